"""Order-independent fingerprints of sets of index entries, computed with numpy.

The audit proves that each index holds exactly the entries its messages call
for without looking each one up: the message pass fingerprints the entries
the messages imply, the index pass fingerprints the entries it finds, and
the two must agree. A fingerprint is the count and the sum (mod 2**64) of a
64-bit hash of each entry (key bytes followed by value bytes), so it does not
depend on order and partial fingerprints of separate tasks add up. Only when
they differ does the audit look entry by entry, to name the culprits.

Entries the message pass builds with numpy (fixed-width keys from
``qstore.meta.keys.key_rows``: every index but the ready index of
str-priority queues) never exist as Python bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MASK = (1 << 64) - 1
_C0 = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S1, _S2, _S3 = np.uint64(30), np.uint64(27), np.uint64(31)


def fingerprint(entries: Sequence[bytes]) -> tuple[int, int]:
    """(count, hash sum) of byte strings of any lengths."""
    by_len: dict[int, list[bytes]] = {}
    for e in entries:
        by_len.setdefault(len(e), []).append(e)
    total = 0
    for width, group in by_len.items():
        rows = np.frombuffer(b"".join(group), np.uint8).reshape(len(group), width)
        total += hash_rows(rows)
    return len(entries), total & MASK


def hash_rows(rows: np.ndarray) -> int:
    """Sum (mod 2**64) of the hashes of each row of an (n, width) uint8 matrix."""
    n, width = rows.shape
    if n == 0:
        return 0
    words = (width + 7) // 8
    padded = np.zeros((n, words * 8), np.uint8)
    padded[:, :width] = rows
    w = padded.view(">u8").astype(np.uint64)
    h = np.full(n, (width * int(_C0)) & MASK, np.uint64)  # Python ints: no overflow warning
    for j in range(words):
        h = _mix(h ^ w[:, j])
    return int(h.sum(dtype=np.uint64))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (a bijection with good avalanche), elementwise."""
    x = (x ^ (x >> _S1)) * _C1
    x = (x ^ (x >> _S2)) * _C2
    out: np.ndarray = x ^ (x >> _S3)
    return out


def to_signed(h: int) -> int:
    """A 64-bit hash sum as the int64 Spark can carry."""
    return h - (1 << 64) if h >= (1 << 63) else h
