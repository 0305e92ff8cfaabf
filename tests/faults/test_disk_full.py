"""A real full disk: a small tmpfs mounted by the test, filled until writes fail.

In every durability mode, with the payload running out first and with RocksDB
running out first (issue 11 case 10): the failing call raises StorageError
with errno ENOSPC, every push that returned reads back, the check is clean,
the in-memory counters match the database, and once space is freed pushes
work again in the same process; close releases the store and a reopen finds
everything. A store on a disk with no byte free opens (its space reserve is
released) so that acks and compaction can free space.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from typing import TypeVar

import pytest

import qstore
from qstore import _core
from qstore._reserve import RESERVE_BYTES, RESERVE_NAME, free_bytes
from qstore.meta import MetaDB, keys
from qstore.meta._db import OPEN_MARGIN, SMALL_WRITE_BUFFER_BYTES, space_to_open
from tests.conftest import fill_disk

T = TypeVar("T")
MODES = ["always", "interval", "none"]
SEGMENT = 1024 * 1024


def _push_until_full(q: qstore.Queue, body: bytes, kept: dict[int, bytes]) -> qstore.StorageError:
    """Push until a push fails; ``kept`` gets what each push put (``q`` holds only
    what is in ``kept``, all ready)."""
    for i in range(1_000_000):
        b = body + b"%d" % i
        try:
            kept[q.push(b)] = b
        except qstore.StorageError as exc:
            return exc
    raise AssertionError("the disk never filled up")


def _filled(small_disk: str, mode: str,
            body: bytes) -> tuple[str, qstore.Store, qstore.Queue, dict[int, bytes]]:
    """A store on ``small_disk`` filled by pushes of ``body`` until one failed with
    ENOSPC: its path, the store, its queue and what every push that returned put."""
    path = os.path.join(small_disk, "s")
    store = qstore.open(path, durability=mode, compactor=False, segment_max_bytes=SEGMENT)
    q = store.create_queue("q")
    kept: dict[int, bytes] = {}
    exc = _push_until_full(q, body, kept)
    assert exc.errno == errno.ENOSPC
    return path, store, q, kept


def _pushes_work_then_reopen(store: qstore.Store, path: str, mode: str,
                             kept: dict[int, bytes]) -> None:
    """Space is back: pushes work, everything is there, and after close and reopen."""
    q = store.queue("q")
    for i in range(100):
        kept[q.push(b"after %d" % i)] = b"after %d" % i
    _assert_intact(store, kept)
    store.close()
    with qstore.open(path, durability=mode, compactor=False) as again:
        _assert_intact(again, kept)


def _pushed(small_disk: str, batches: int,
            size: int) -> tuple[str, qstore.Store, qstore.Queue, dict[int, bytes]]:
    """A store on ``small_disk`` given ``batches`` push_many of 100 bodies of about
    ``size`` bytes: its path, the store, its queue, and id -> body of each."""
    path = os.path.join(small_disk, "s")
    store = qstore.open(path, compactor=False, segment_max_bytes=SEGMENT)
    q = store.create_queue("q")
    kept: dict[int, bytes] = {}
    for i in range(batches):
        bodies = [b"%d-%d-" % (i, j) + b"x" * size for j in range(100)]
        kept.update(zip(q.push_many(bodies), bodies, strict=True))
    return path, store, q, kept


def _twice(op: Callable[[], T]) -> T:
    """``op()``; once more if it found the disk full. The first metadata write that
    fails stops RocksDB; the next one reopens it with the space reserve's room."""
    try:
        return op()
    except qstore.StorageError as exc:
        assert exc.errno == errno.ENOSPC
        return op()


def _assert_intact(store: qstore.Store, kept: dict[int, bytes]) -> None:
    q = store.queue("q")
    for mid, body in kept.items():
        assert q.get(mid).payload == body
    # the in-memory counters never ran ahead of what was written
    assert q.stats().ready == len(kept)
    report = store.check()
    assert report.ok, report.summary()


@pytest.mark.parametrize("mode", MODES)
def test_metadata_full_then_space_freed_writes_work_again(small_disk: str, mode: str) -> None:
    path = os.path.join(small_disk, "s")
    store = qstore.open(path, durability=mode, compactor=False, segment_max_bytes=4 * SEGMENT)
    q = store.create_queue("q")
    kept: dict[int, bytes] = {}
    for i in range(50):
        kept[q.push(b"before %d" % i)] = b"before %d" % i
    filler = os.path.join(small_disk, "filler")
    # The reserve would be handed to RocksDB: take it away first so that this
    # test sees the plain error path (the next test covers the reserve).
    os.unlink(os.path.join(path, RESERVE_NAME))
    fill_disk(filler)
    # The active segment's preallocated blocks take small payloads: RocksDB fails first.
    exc = _push_until_full(q, b"small ", kept)
    assert exc.errno == errno.ENOSPC
    assert isinstance(exc, qstore.StorageError)
    with pytest.raises(qstore.StorageError) as again:
        q.push(b"still full")
    assert again.value.errno == errno.ENOSPC
    _assert_intact(store, kept)  # reads and the check work while writes fail

    os.unlink(filler)  # space is back: the same process writes again
    for i in range(20):
        kept[q.push(b"after %d" % i)] = b"after %d" % i
    m = q.pop()
    assert m is not None
    q.ack(m)
    del kept[m.id]
    _assert_intact(store, kept)
    store.close()
    with qstore.open(path, durability=mode, compactor=False) as again_store:
        _assert_intact(again_store, kept)


@pytest.mark.parametrize("mode", MODES)
def test_payload_full_then_ack_and_compact_frees_space(small_disk: str, mode: str) -> None:
    path, store, q, kept = _filled(small_disk, mode, b"x" * 3000)
    assert len(kept) > 1000
    _assert_intact(store, kept)

    # Ack the oldest two thirds (on a full disk: RocksDB may need the reserve),
    # then compact: whole segments die and are deleted.
    for m in _twice(lambda: q.pop_many(len(kept) * 2 // 3)):
        q.ack(m)
        del kept[m.id]
    result = store.compact()
    assert result.bytes_freed > SEGMENT
    assert free_bytes(small_disk) > SEGMENT
    _pushes_work_then_reopen(store, path, mode, kept)


@pytest.mark.parametrize("mode", MODES)
def test_a_disk_filled_by_small_messages_drains_compacts_and_closes(
        small_disk: str, mode: str) -> None:
    # Small messages grow RocksDB's log more than the segments. Its memtable was
    # flushed (and the log dropped) only at 64 MiB: the log reached 15 MB on a
    # 32 MiB disk, and once a write failed the database could not be reopened
    # (that needs about the log's size free, and the reserve gives back 1 MiB):
    # no ack, pop, compaction or close went through until a file was deleted by
    # hand. Below 256 MiB free the log is now kept small, in every mode.
    path, store, q, kept = _filled(small_disk, mode, b"s" * 40)
    assert len(kept) > 50_000
    assert space_to_open(os.path.join(path, "meta")) < 2 * RESERVE_BYTES
    _assert_intact(store, kept)

    # Drain it all, compacting as the background compactor would.
    rounds = freed = 0
    while kept:
        msgs = _twice(lambda: q.pop_many(2000))
        assert msgs
        _twice(lambda: q.ack_many(msgs))  # noqa: B023 (called at once)
        for m in msgs:
            assert kept.pop(m.id) == m.payload
        rounds += 1
        if rounds % 10 == 0 or not kept:
            freed += _twice(store.compact).bytes_freed
    assert freed > 4 * SEGMENT
    _pushes_work_then_reopen(store, path, mode, kept)


def test_the_log_is_kept_small_below_the_threshold_and_grows_again_above(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.path.join(str(tmp_path), "s")
    meta_dir = os.path.join(path, "meta")

    def log_bytes() -> int:
        return space_to_open(meta_dir) - OPEN_MARGIN

    def push(n: int) -> None:
        q.push_many([b"%d" % i for i in range(n)])

    with qstore.open(path, compactor=False, sync_interval=3600) as store:
        core = store.core
        q = store.create_queue("q")
        monkeypatch.setattr(_core, "LOG_TIGHT_FREE", 0)
        core.watch_space()
        assert not core.meta.small_log
        push(20_000)
        grown = log_bytes()
        assert grown > 4 * SMALL_WRITE_BUFFER_BYTES
        # Less free than the threshold: the log grown so far is flushed at once,
        # and from then on the memtable is flushed every 256 KiB.
        monkeypatch.setattr(_core, "LOG_TIGHT_FREE", 1 << 62)
        monkeypatch.setattr(_core, "LOG_ROOMY_FREE", 1 << 62)
        core.watch_space()
        assert core.meta.small_log
        assert log_bytes() < SMALL_WRITE_BUFFER_BYTES
        for _ in range(10):
            push(2_000)
            assert log_bytes() < 4 * SMALL_WRITE_BUFFER_BYTES
        for i in range(2_000):
            q.push(b"one %d" % i)
        # A table file per 256 KiB or so of metadata, not one per write.
        assert len([f for f in os.listdir(meta_dir) if f.endswith(".sst")]) < 100
        # Between the two thresholds nothing changes; above the second the log
        # may grow again.
        monkeypatch.setattr(_core, "LOG_TIGHT_FREE", 0)
        core.watch_space()
        assert core.meta.small_log
        monkeypatch.setattr(_core, "LOG_ROOMY_FREE", 0)
        core.watch_space()
        assert not core.meta.small_log
        push(20_000)
        assert log_bytes() > 4 * SMALL_WRITE_BUFFER_BYTES
        assert len(q) == 62_000


def test_the_switch_and_the_flush_wait_for_what_they_need(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # A review: the flag was set before SetOptions worked (a failure was never
    # tried again, and the next tick logged "works again"); and the flush ran
    # whatever the room, and one that failed on a full disk left RocksDB
    # refusing every write, acks included.
    path = os.path.join(str(tmp_path), "s")
    with qstore.open(path, compactor=False, sync_interval=3600) as store:
        core, meta = store.core, store.core.meta
        q = store.create_queue("q")
        q.push_many([b"%d" % i for i in range(5000)])
        monkeypatch.setattr(_core, "LOG_TIGHT_FREE", 1 << 62)
        monkeypatch.setattr(_core, "LOG_ROOMY_FREE", 1 << 62)
        real_db = meta._db

        class Full:
            def __getattr__(self, name: str) -> object:
                return getattr(real_db, name)

            def set_options(self, options: dict[str, str]) -> None:
                raise OSError("IO error: Unable to persist options.: IO error: "
                              "No space left on device")

        monkeypatch.setattr(meta, "_db", Full())
        caplog.set_level(logging.INFO, logger="qstore")
        core.space_tick()
        assert not meta.small_log  # not switched: tried again at the next tick
        core.space_tick()
        assert not meta.small_log
        monkeypatch.setattr(meta, "_db", real_db)
        # Switched now, but no room for the flush (the memtables look larger
        # than the free space): the log stays until there is.
        monkeypatch.setattr(meta, "memtable_bytes", lambda: 1 << 62)
        flushes: list[int] = []
        real_flush = meta.flush
        monkeypatch.setattr(meta, "flush", lambda: (flushes.append(1), real_flush()))
        core.space_tick()
        assert meta.small_log and flushes == []
        q.push(b"still taken")
        monkeypatch.setattr(meta, "memtable_bytes", lambda: 0)
        core.space_tick()
        assert flushes == [1]
        core.space_tick()
        assert flushes == [1]  # once
    lines = [r.getMessage() for r in caplog.records]
    failed = [m for m in lines if "keeping the metadata log small" in m]
    assert len(failed) == 2 and "failed" in failed[0] and "works again after 2" in failed[1]
    assert sum("the metadata log is kept small" in m for m in lines) == 1


def test_a_reopen_waits_for_a_call_in_progress_on_the_old_handle(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    # rocksdict refuses to close a handle another thread is inside ("Already
    # borrowed": always mode's checkpoint flushes outside the writer lock); the
    # handle kept the store's LOCK and the reopen raised StoreLocked, not a
    # StorageError (a review). The reopen now keeps the handle and says so.
    path = os.path.join(str(tmp_path), "s")
    with qstore.open(path, compactor=False) as store:
        q = store.create_queue("q")
        q.push(b"kept")
        meta = store.core.meta
        real_db = meta._db

        class Busy:
            def __getattr__(self, name: str) -> object:
                return getattr(real_db, name)

            def close(self) -> None:
                raise RuntimeError("Already borrowed")

        meta._failure("metadata write failed", OSError("IO error: No space left on device"))
        monkeypatch.setattr(meta, "_db", Busy())
        with pytest.raises(qstore.StorageError, match="must wait for a call in progress") as e:
            q.push(b"refused")
        assert e.value.errno == errno.ENOSPC
        assert meta.failed is not None and meta._db is not real_db  # kept as it was
        monkeypatch.setattr(meta, "_db", real_db)  # the call ended
        kept = q.push(b"after")
        assert [m.payload for m in q.pop_many(5)] == [b"kept", b"after"] and kept


def test_a_reopen_waits_for_a_scan_in_progress_and_reads_go_on(tmp_path: object) -> None:
    # An iterator keeps RocksDB's LOCK past close(): a write that reopened the
    # database after a failed one, while the compactor walked every message
    # outside the writer lock, raised StoreLocked ("locked by another writer")
    # from its own process, and left no handle, so stats() raised it too, for
    # as long as the scan ran (a race audit).
    path = os.path.join(str(tmp_path), "s")
    with qstore.open(path, compactor=False) as store:
        q = store.create_queue("q")
        q.push_many([b"a", b"b", b"c"])
        meta = store.core.meta
        scan = meta.scan(keys.MESSAGE, keys.prefix_end(keys.MESSAGE))  # as _compact does
        assert next(scan)[0].startswith(keys.MESSAGE)
        meta._failure("metadata write failed", OSError("IO error: No space left on device"))
        with pytest.raises(qstore.StorageError, match=r"must wait for 1 scan\(s\) in progress"
                           ) as e:
            q.push(b"refused")
        assert not isinstance(e.value, qstore.StoreLocked) and e.value.errno == errno.ENOSPC
        assert q.stats().ready == 3  # reads go on, on the handle kept
        assert len(list(scan)) == 2  # the scan itself goes on too, to its end
        del scan
        kept = q.push(b"after")  # this write reopens
        assert [m.payload for m in q.pop_many(5)] == [b"a", b"b", b"c", b"after"] and kept
    with qstore.open(path, compactor=False) as again:
        assert again.check().ok


def test_store_on_a_disk_with_no_byte_free_opens_to_ack_and_compact(small_disk: str) -> None:
    # Half the disk, then a filler takes the rest: pushing until full, the
    # reserve went or stayed by which write failed first (the payload's, or
    # RocksDB's log, which below 256 MiB free starts a new file every 256 KiB).
    path, store, q, kept = _pushed(small_disk, 25, 3000)
    store.close()
    fill_disk(os.path.join(small_disk, "filler"))
    assert free_bytes(small_disk) == 0
    assert os.path.exists(os.path.join(path, RESERVE_NAME))

    with qstore.open(path, compactor=False, segment_max_bytes=SEGMENT) as store:
        assert not os.path.exists(os.path.join(path, RESERVE_NAME))  # given to RocksDB
        _assert_intact(store, kept)
        q = store.queue("q")
        for m in _twice(lambda: q.pop_many(len(kept))):
            q.ack(m)
            del kept[m.id]
        assert store.compact().bytes_freed > SEGMENT
        assert os.path.exists(os.path.join(path, RESERVE_NAME))  # space is back: made again
        kept[q.push(b"after")] = b"after"
        _assert_intact(store, kept)
    with qstore.open(path, readonly=True) as view:
        assert view.queue("q").get(next(iter(kept))).payload == b"after"


def _churn(q: qstore.Queue, kept: dict[int, bytes], tag: bytes) -> tuple[int, int]:
    """A push, then a pop and its ack, over and over, until pushes were refused
    many times and many acks went through; (refused pushes, acks)."""
    acked = refused = 0
    for i in range(20_000):
        body = tag + b"%d-" % i + b"y" * 512
        try:
            kept[q.push(body)] = body
        except qstore.StorageError as exc:
            assert exc.errno == errno.ENOSPC
            refused += 1
        try:
            m = q.pop()
            assert m is not None
            q.ack(m)
        except qstore.StorageError as exc:  # the first write to find the disk full
            assert exc.errno == errno.ENOSPC
            continue
        del kept[m.id]
        acked += 1
        if refused > 50 and acked > 500:
            break
    return refused, acked


def test_pushes_on_a_full_disk_leave_the_reserve_to_acks_and_compaction(small_disk: str) -> None:
    # A producer that pushes on while the disk is full (a server's, always)
    # took the room the released reserve gave the metadata database: from
    # then on every ack, pop and compaction failed until a file was deleted
    # by hand (a fault audit). Pushes are now refused until the reserve is back.
    path, store, q, kept = _pushed(small_disk, 20, 2000)
    filler = os.path.join(small_disk, "filler")
    fill_disk(filler)
    refused, acked = _churn(q, kept, b"a")
    # Once pushes were refused, acks kept going: the reserve's room was theirs.
    assert refused > 50 and acked > 500, (refused, acked)
    # A restart before space is back, then the same: pushes make the reserve
    # again before they take any room (its flag lived in memory only, and after
    # a restart pushes took the room back; a review).
    store.close()
    store = qstore.open(path, compactor=False, segment_max_bytes=SEGMENT)
    q = store.queue("q")
    refused, acked = _churn(q, kept, b"b")
    assert refused > 50 and acked > 500, (refused, acked)
    assert store.compact().bytes_freed > SEGMENT
    _assert_intact(store, kept)
    os.unlink(filler)  # space is back: pushes are taken again, in the same process
    kept[q.push(b"after")] = b"after"
    assert os.path.exists(os.path.join(path, RESERVE_NAME))
    _assert_intact(store, kept)
    store.close()
    with qstore.open(path, compactor=False) as again:
        _assert_intact(again, kept)


def _full_without_reserve(small_disk: str) -> tuple[str, qstore.Store, dict[int, bytes]]:
    """A store on a disk filled until a push failed, its space reserve gone."""
    path = os.path.join(small_disk, "s")
    store = qstore.open(path, compactor=False, segment_max_bytes=4 * SEGMENT)
    q = store.create_queue("q")
    kept: dict[int, bytes] = {q.push(b"first"): b"first"}
    os.unlink(os.path.join(path, RESERVE_NAME))
    fill_disk(os.path.join(small_disk, "filler"))
    _push_until_full(q, b"small ", kept)
    return path, store, kept


def test_a_half_made_reserve_left_by_a_kill_is_released_too(small_disk: str) -> None:
    # A process killed between making reserve.tmp and renaming it left 1 MiB that
    # no release gave back: on the next full disk the store could not open, so
    # nothing could be acked (a crash-point audit).
    path, store, q, kept = _pushed(small_disk, 5, 2000)
    store.close()
    os.unlink(os.path.join(path, RESERVE_NAME))
    tmp = os.path.join(path, RESERVE_NAME + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, RESERVE_BYTES)  # what _reserve makes before its rename
    finally:
        os.close(fd)
    fill_disk(os.path.join(small_disk, "filler"))
    with qstore.open(path, compactor=False, segment_max_bytes=SEGMENT) as store:
        assert not os.path.exists(tmp)  # given to RocksDB with the rest
        _assert_intact(store, kept)
        for m in _twice(lambda: store.queue("q").pop_many(10)):
            store.queue("q").ack(m)
            del kept[m.id]
        _assert_intact(store, kept)


def test_close_after_a_metadata_failure_releases_the_store(small_disk: str) -> None:
    path, store, kept = _full_without_reserve(small_disk)
    # Closing cuts the active segment's preallocated tail, which gives RocksDB
    # the room to reopen and make everything durable: nothing to report.
    store.close()
    with qstore.open(path, compactor=False) as again:  # same process: not locked
        _assert_intact(again, kept)


def test_close_that_cannot_reopen_the_metadata_raises_but_unlocks(
        small_disk: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path, store, kept = _full_without_reserve(small_disk)
    with monkeypatch.context() as mp:
        def refuse(self: MetaDB, *, create: bool) -> None:
            raise qstore.StorageError("cannot open metadata (test)")

        mp.setattr(MetaDB, "_open", refuse)
        with pytest.raises(qstore.StorageError, match="cannot open metadata"):
            store.close()
    with qstore.open(path, compactor=False) as again:  # released: the same process opens it
        _assert_intact(again, kept)


def test_background_sync_logs_one_line_per_failure_episode(
        small_disk: str, caplog: pytest.LogCaptureFixture) -> None:
    path = os.path.join(small_disk, "s")
    store = qstore.open(path, compactor=False, sync_interval=3600.0,
                        segment_max_bytes=4 * SEGMENT)
    q = store.create_queue("q")
    kept: dict[int, bytes] = {}
    os.unlink(os.path.join(path, RESERVE_NAME))
    filler = os.path.join(small_disk, "filler")
    fill_disk(filler)
    _push_until_full(q, b"small ", kept)
    syncer = store.core.syncer
    with caplog.at_level(logging.WARNING, logger="qstore"):
        for _ in range(5):  # what the thread does at each interval
            syncer.background_sync()
        failed = [r for r in caplog.records if "background sync failed" in r.getMessage()]
        assert len(failed) == 1
        assert failed[0].exc_info is None  # one clear line, no traceback
        os.unlink(filler)
        kept[q.push(b"resumed")] = b"resumed"  # reopens the database
        syncer.background_sync()
        assert any("background sync works again" in r.getMessage() for r in caplog.records)
    _assert_intact(store, kept)
    store.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def test_reads_work_while_full_even_when_something_fell_due(small_disk: str) -> None:
    """A read that would promote a due lease or delay first (a metadata write)
    shows what the database holds while writes fail; once space is back, reads,
    snapshots and the promotion they skipped work again without a write first."""
    path = os.path.join(small_disk, "s")
    clock = _Clock()
    store = qstore.open(path, compactor=False, clock=clock, segment_max_bytes=4 * SEGMENT)
    q = store.create_queue("q")
    kept: dict[int, bytes] = {}
    for i in range(10):
        kept[q.push(b"body %d" % i)] = b"body %d" % i
    leased = q.pop(lease=10)
    assert leased is not None
    delayed = q.push(b"later", delay=5)
    kept[delayed] = b"later"
    os.unlink(os.path.join(path, RESERVE_NAME))
    filler = os.path.join(small_disk, "filler")
    fill_disk(filler)
    _push_until_full(q, b"small ", kept)
    with pytest.raises(qstore.StorageError):
        q.push(b"still full")  # the database now refuses every write

    clock.now += 20  # the lease and the delay fall due: a read would promote them
    before = q.stats()
    assert (before.ready, before.delayed, before.in_flight) == (len(kept) - 2, 1, 1)
    assert q.get(delayed).payload == b"later"
    assert q.get(leased.id).state == "in_flight"  # as written: its expiry is not
    assert [m.id for m in q.peek(1)] == [leased.id + 1]  # the oldest ready one
    assert q.dead_letters() == []
    assert store.stats().queues[0].in_flight == 1
    with pytest.raises(qstore.StorageError):
        store.snapshot(os.path.join(small_disk, "snap-full"))

    os.unlink(filler)  # space is back: no write comes first
    after = q.stats()  # the read reopens the database and promotes what fell due
    assert (after.ready, after.delayed, after.in_flight) == (len(kept), 0, 0)
    assert q.get(leased.id).state == "ready"
    snap = os.path.join(small_disk, "snap")
    store.snapshot(snap)
    store.close()
    with qstore.open(snap, readonly=True) as view:
        assert view.queue("q").stats().ready == len(kept)
    with qstore.open(path, compactor=False, clock=clock) as again:
        _assert_intact(again, kept)
