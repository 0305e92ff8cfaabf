"""Contract section 9: faults that used to lose data silently or brick the store.

Each test makes the fault for real (files removed or cut, a file call failed
by tests/faults/_inject.py) and asserts what was raised, what is on disk and
that every message whose operation returned is intact.
"""

from __future__ import annotations

import os
import shutil

import pytest

import qstore
from qstore.meta import keys
from qstore.payload import HEADER_SIZE

from ._inject import FaultyCalls, creates

BODY = b"x" * 100


def _listing(path: str) -> dict[str, int]:
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = os.path.getsize(full)
    return out


def _filled_store(path: str, n: int = 40) -> dict[int, bytes]:
    """A closed store with ``n`` messages over several sealed segments."""
    pushed = {}
    with qstore.open(path, compactor=False, segment_max_bytes=1024) as store:
        q = store.create_queue("q")
        for i in range(n):
            body = BODY + b"%03d" % i
            pushed[q.push(body, priority=i)] = body
    return pushed


def _assert_intact(path: str, pushed: dict[int, bytes], readonly: bool = False) -> None:
    with qstore.open(path, compactor=False, readonly=readonly) as store:
        q = store.queue("q")
        for mid, body in pushed.items():
            assert q.get(mid).payload == body
        assert q.stats().ready == len(pushed)
        if not readonly:
            assert store.check().ok


@pytest.mark.parametrize("lost", ["meta", "CURRENT"])
@pytest.mark.parametrize("readonly", [False, True])
def test_open_refuses_payload_without_metadata_and_touches_nothing(
        store_path: str, lost: str, readonly: bool) -> None:
    _filled_store(store_path)
    if lost == "meta":
        shutil.rmtree(os.path.join(store_path, "meta"))
    else:
        os.unlink(os.path.join(store_path, "meta", "CURRENT"))
    before = _listing(store_path)
    assert sum(name.endswith(".seg") for name in before) > 3
    for _ in range(2):  # the second open used to find the "new" store the first made
        with pytest.raises(qstore.Corruption, match="metadata is missing"):
            qstore.open(store_path, readonly=readonly)
        assert _listing(store_path) == before


def test_a_directory_without_payload_segments_is_still_a_new_store(store_path: str) -> None:
    os.makedirs(os.path.join(store_path, "payload"))
    with qstore.open(store_path, compactor=False) as store:
        assert store.queues() == []


@pytest.mark.parametrize("persistent", [False, True])
def test_a_full_disk_at_rotation_raises_storage_error_and_leaves_no_short_segment(
        store_path: str, monkeypatch: pytest.MonkeyPatch, persistent: bool) -> None:
    faults = FaultyCalls(monkeypatch, only=creates)
    pushed: dict[int, bytes] = {}
    store = qstore.open(store_path, compactor=False, segment_max_bytes=1024)
    try:
        q = store.create_queue("q")
        faults.arm(1, persistent=persistent)
        failures = 0
        for i in range(30):  # crosses two rotations
            body = BODY + b"%03d" % i
            try:
                pushed[q.push(body)] = body
            except qstore.StorageError as exc:
                assert exc.errno == 28  # ENOSPC
                failures += 1
        assert failures >= 1 and faults.failed
        assert not [n for n, size in _listing(store_path).items()
                    if n.endswith(".seg") and size < HEADER_SIZE]
        faults.heal()
        for i in range(30, 45):  # the disk has room again: no restart needed
            body = BODY + b"%03d" % i
            pushed[q.push(body)] = body
        assert store.check().ok
    finally:
        store.close()
    _assert_intact(store_path, pushed)
    _assert_intact(store_path, pushed, readonly=True)


@pytest.mark.parametrize("how", ["compact", "seal"])
def test_a_failed_seal_leaves_the_writer_open(
        store_path: str, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    faults = FaultyCalls(monkeypatch, only=creates)
    store = qstore.open(store_path, compactor=False)
    try:
        q = store.create_queue("q")
        gone = [q.push(BODY) for _ in range(10)]
        for _ in gone:
            m = q.pop()
            assert m is not None
            q.ack(m)
        kept = {q.push(BODY + b"k"): BODY + b"k"}
        faults.arm(1, persistent=True)
        with pytest.raises(qstore.StorageError):
            if how == "compact":
                store.compact(threshold=0.1)
            else:
                store.core.payload.seal()
        # The next pushes go to the old segment, as before the failed seal.
        for i in range(5):
            kept[q.push(b"after %d" % i)] = b"after %d" % i
        faults.heal()
        store.compact(threshold=0.1)
        kept[q.push(b"after heal")] = b"after heal"
        assert store.check().ok
    finally:
        store.close()
    _assert_intact(store_path, kept)


def test_open_removes_a_short_segment_nothing_names(store_path: str) -> None:
    pushed = _filled_store(store_path, n=5)
    # What a rotation leaves when the disk is full and even its unlink fails.
    with open(os.path.join(store_path, "payload", "0000000000.seg"), "wb"):
        pass
    _assert_intact(store_path, pushed)
    assert "0000000000.seg" not in os.listdir(os.path.join(store_path, "payload"))


def test_delete_queue_leaves_no_counters_key_and_the_check_stays_clean(store_path: str) -> None:
    with qstore.open(store_path, compactor=False) as store:
        q = store.create_queue("gone")
        qid = store.core.queues["gone"].qid
        q.push_many([(b"a", 1), (b"b", 2)])
        store.delete_queue("gone")
        assert store.core.meta.get(keys.counts_key(qid)) is None
        assert store.check().ok
    with qstore.open(store_path, compactor=False) as store:
        assert store.queues() == [] and store.check().ok
