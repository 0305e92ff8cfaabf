"""The building blocks of the scan and the audit that need no SparkSession."""

from __future__ import annotations

import numpy as np
import pytest

from qstore.meta import keys
from qstore.spark import _index_hash as ih
from qstore.spark._audit_source import bucket_top, size_buckets

pytestmark = pytest.mark.spark


@pytest.mark.parametrize("order", ["max", "min", "fifo"])
def test_numpy_index_entries_are_the_keys_the_store_writes(order: str) -> None:
    prios = [-(2**63), -5, 0, 7, 2**63 - 1]
    mids = [1, 2, 3, 10**12, 2**63 + 5]
    um = np.array(mids, np.uint64)
    expected = [keys.ready_key(9, keys.priority_key(order, "int", p), m)
                for p, m in zip(prios, mids, strict=True)]
    parts = [um] if order == "fifo" else [keys.int_priority_keys(np.array(prios), order), um]
    ready = keys.key_rows(keys.READY, 9, *parts)
    assert [bytes(r) for r in ready] == expected
    timed = keys.key_rows(keys.INFLIGHT, 9, np.array([5, 6], np.uint64), um[:2])
    assert [bytes(r) for r in timed] == [keys.timed_key(keys.INFLIGHT, 9, w, m)
                                         for w, m in ((5, 1), (6, 2))]
    digests = np.frombuffer(bytes(range(32)), np.uint8).reshape(2, 16)
    dedup = keys.key_rows(keys.DEDUP, 9, digests, um[:2])
    assert bytes(dedup[1]) == keys.dedup_key(9, bytes(range(16, 32))) + keys.U64.pack(2)
    assert ih.fingerprint(expected) == (5, ih.hash_rows(ready))


def test_fingerprints_ignore_order_and_see_one_changed_entry() -> None:
    entries = [b"r\x00\x00\x00\x01" + bytes([i]) * 16 for i in range(50)] + [b"short", b""]
    n, h = ih.fingerprint(entries)
    assert ih.fingerprint(list(reversed(entries))) == (n, h)
    changed = [*entries[:-3], entries[-3][:-1] + b"\x00", *entries[-2:]]
    assert ih.fingerprint(changed)[1] != h
    halves = ih.fingerprint(entries[:20])[1] + ih.fingerprint(entries[20:])[1]
    assert halves & ih.MASK == h


def test_size_buckets_are_at_most_a_32nd_wide() -> None:
    lengths = np.array([0, 1, 63, 64, 65, 127, 128, 1000, 1024, 65_535, 2**31 - 1])
    buckets = size_buckets(lengths)
    for n, b in zip(lengths.tolist(), buckets.tolist(), strict=True):
        assert b <= n <= bucket_top(b)
        assert bucket_top(b) - b <= max(b // 32, 0)
    assert buckets[:3].tolist() == [0, 1, 63]
