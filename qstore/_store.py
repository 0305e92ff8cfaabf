"""The store: one directory holding RocksDB metadata (meta/) and payload segments (payload/).

Concurrency: one writer lock serialises every change in this process; one
process may open a store read-write (RocksDB's LOCK file enforces it), any
number read-only. Every change is one :class:`~qstore._txn.Txn` (one
WriteBatch); payload bytes are written before the batch that refers to them.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from ._check import run_check
from ._check_report import CheckReport
from ._config import Config
from ._durability import Syncer
from ._errors import (
    InvalidArgument,
    QueueExists,
    QueueNotFound,
    ReadOnlyStore,
    StorageError,
    StoreClosed,
    StoreLocked,
)
from ._heads import ReadyHeads
from ._message import SegmentStats, StoreStats
from ._txn import Txn, apply_counts
from .meta import MetaDB, keys, new_batch, records
from .payload import PayloadRef, SegmentSet
from .payload._format import FRAME_SIZE

if TYPE_CHECKING:
    from ._compact import CompactionResult, Compactor
    from ._queue import Queue

log = logging.getLogger("qstore")

ID_BLOCK = 4096  # ids reserved per M"id_hwm" write; a restart skips the unused rest
MAX_QUEUE_NAME_BYTES = 255

# Store directories open read-write in this process, by (st_dev, st_ino). RocksDB's
# LOCK file stops other processes, but within one process it only compares path
# strings: a symlink, "./" or a relative spelling would open a second writer.
_writers: set[tuple[int, int]] = set()
_writers_lock = threading.Lock()


def _claim_writer(path: str) -> tuple[int, int]:
    st = os.stat(path)
    key = (st.st_dev, st.st_ino)
    with _writers_lock:
        if key in _writers:
            raise StoreLocked(path)
        _writers.add(key)
    return key


def _release_writer(key: tuple[int, int] | None) -> None:
    if key is not None:
        with _writers_lock:
            _writers.discard(key)


class _Writing:
    """The writer-lock context of one store (a class: cheaper than a generator per call)."""

    __slots__ = ("_store",)

    def __init__(self, store: Store) -> None:
        self._store = store

    def __enter__(self) -> None:
        store = self._store
        store._lock.acquire()
        if store._closed or store.readonly:
            store._lock.release()
            store._check_writable()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        store = self._store
        ticket = store.syncer.ticket()
        store._lock.release()
        if ticket is not None and exc_type is None:
            store.syncer.wait(ticket)


class QueueState:
    """What the store keeps in memory per queue (shared by all its handles)."""

    __slots__ = ("name", "rec", "qid", "counts", "counts_key", "heads", "next_event_us",
                 "time_floor_us", "deleted", "pkeys")

    def __init__(self, name: str, rec: records.QueueRecord, counts: list[int]) -> None:
        self.name = name
        self.rec = rec
        self.qid = rec.qid
        self.counts = counts
        # Where each priority level's ready messages start (see _heads.py):
        # pops never wade through the tombstones acked messages leave behind.
        self.heads = ReadyHeads(rec.qid)
        self.counts_key = keys.counts_key(rec.qid)
        self.pkeys: dict[int | str, bytes] = {}  # priority -> priority key, a small cache
        # Earliest lease deadline or due time that may need promotion (us).
        self.next_event_us = 0
        # No delayed or in-flight key of the queue has a time below this (us):
        # their indexes are read from here, past the tombstones of earlier ones.
        self.time_floor_us = 0
        self.deleted = False


class Store:
    """An open qstore directory. Use :func:`qstore.open`."""

    def __init__(self, path: str, config: Config) -> None:
        self.path = path
        self.config = config
        self.clock = config.clock
        self.readonly = config.readonly
        self._lock = threading.RLock()
        self._ready = threading.Condition(self._lock)
        self._writing = _Writing(self)
        self._closed = False
        self._writer_key: tuple[int, int] | None = None
        if not config.readonly:
            os.makedirs(path, exist_ok=True)
            self._writer_key = _claim_writer(path)
        elif not os.path.isdir(os.path.join(path, "meta")):
            raise StorageError(f"{path!r} is not a qstore directory (no meta/)")
        try:
            self.meta = MetaDB(os.path.join(path, "meta"), readonly=config.readonly,
                               store_path=path)
        except BaseException:
            _release_writer(self._writer_key)
            raise
        self.syncer = Syncer(self)
        try:
            self._load()
        except BaseException:
            self.meta.close()
            _release_writer(self._writer_key)
            raise
        self.compactor: Compactor | None = None
        if not self.readonly:
            from ._compact import Compactor

            self.compactor = Compactor(self)
            self.compactor.recover()
            self.syncer.start()
            self._sweeper = threading.Thread(target=self._sweep_loop, name="qstore-sweeper",
                                             daemon=True)
            self._stop = threading.Event()
            self._sweeper.start()
            if config.compactor:
                self.compactor.start()

    # -- opening --------------------------------------------------------------

    def _load(self) -> None:
        fmt = self.meta.get(keys.FORMAT_KEY)
        if fmt is None and not self.readonly:
            txn = Txn()
            txn.put(keys.FORMAT_KEY, records.pack([records.RECORD_VERSION, records.STORE_FORMAT]))
            self.meta.write(txn.batch, sync=True)
        elif fmt is not None and records.unpack(fmt, "format")[1] != records.STORE_FORMAT:
            raise StorageError(f"unsupported store format in {self.path}")
        hwm = self.meta.get(keys.ID_HWM_KEY)
        self._next_id = records.unpack(hwm, "id")[1] if hwm else 1
        self._id_hwm = self._next_id
        qnext = self.meta.get(keys.QID_NEXT_KEY)
        self._next_qid = records.unpack(qnext, "qid")[1] if qnext else 1
        self.queue_states: dict[str, QueueState] = {}
        for key, value in self.meta.scan(keys.QUEUE, keys.prefix_end(keys.QUEUE)):
            rec = records.QueueRecord.decode(value)
            raw = self.meta.get(keys.counts_key(rec.qid))
            counts = records.decode_counts(raw) if raw else [0, 0, 0, 0, 0]
            state = QueueState(key[1:].decode("utf-8"), rec, counts)
            self.queue_states[state.name] = state
            self._refresh_next_event(state)
        self.seg_live: dict[int, list[int]] = {}  # file_id -> [live bytes, live count, end]
        for key, value in self.meta.scan(keys.SEGMENT, keys.prefix_end(keys.SEGMENT)):
            self.seg_live[keys.segment_id(key)] = list(records.decode_segment(value))
        hints = {fid: v[2] for fid, v in self.seg_live.items()}
        synced = self.meta.get(keys.SYNCED_KEY)
        if synced is not None:
            # Recovery scans the segment that was active from the last offset known
            # to be durable, not from the end the metadata refers to: after a power
            # loss the metadata may refer to bytes that never reached the disk.
            _, sfid, soff = records.unpack(synced, "synced")
            hints[sfid] = min(soff, hints.get(sfid, soff))
        self._synced_mark: tuple[int, int] | None = None
        compaction = self.meta.get(keys.COMPACTION_KEY)
        discard: list[int] = []
        if compaction is not None and compaction_unfinished(compaction):
            discard.append(records.unpack(compaction, "compaction")[2])
        self.payload = SegmentSet(
            os.path.join(self.path, "payload"),
            segment_max_bytes=self.config.segment_max_bytes,
            max_payload_bytes=self.config.max_payload_bytes,
            readonly=self.readonly,
            tail_hints=hints,
            discard=discard,
            next_file_id_floor=max(self.seg_live, default=0) + 1,
        )
        if not self.readonly:
            self._drop_lost_tails()

    def _drop_lost_tails(self) -> None:
        """Forget messages whose payload bytes did not survive a power loss.

        Only possible for bytes past the last durable offset, which belong to
        operations that had not returned in ``durability="always"`` (an
        operation returns only after the sync that covers its bytes); in the
        other modes a power loss may also take operations that had returned.
        Without this, those messages would fail every read with Corruption.
        """
        files = set(self.payload.file_ids())
        for fid, (_, _, end) in list(self.seg_live.items()):
            if fid not in files:
                continue  # a missing segment is damage: reads raise, the audit reports it
            valid = self.payload.segment_size(fid)
            if valid >= end:
                continue
            txn = Txn()
            lost = 0
            for key, value in self.meta.scan(keys.MESSAGE, keys.prefix_end(keys.MESSAGE)):
                rec = records.MessageRecord.decode(value)
                if rec.file_id != fid or rec.offset + FRAME_SIZE + rec.length <= valid:
                    continue
                q = self._state_for_key(key)
                self._forget_message(txn, q, keys.trailing_id(key), rec)
                lost += 1
            self.seg_live[fid][2] = valid
            txn.set_end(fid, valid)
            self._commit(txn)
            self.syncer.sync_now()
            log.error("segment %s ends at %d but the metadata referred up to %d (a power loss "
                      "before those bytes were synced): %d message(s) dropped", fid, valid,
                      end, lost)

    def _state_for_key(self, key: bytes) -> QueueState:
        qid = keys.U32.unpack_from(key, 1)[0]
        return next(q for q in self.queue_states.values() if q.qid == qid)

    def _forget_message(self, txn: Txn, q: QueueState, mid: int,
                        rec: records.MessageRecord) -> None:
        """Add the removal of one message and its index keys to ``txn``."""
        from ._txn import BYTES, STATE_COUNTER

        if rec.state == records.READY:
            pkey = keys.priority_key(q.rec.order, q.rec.priority_type, rec.priority)
            txn.delete(keys.ready_key(q.qid, pkey, mid))
        elif rec.state == records.DELAYED:
            txn.delete(keys.timed_key(keys.DELAYED, q.qid, rec.when_us, mid))
        elif rec.state == records.INFLIGHT:
            txn.delete(keys.timed_key(keys.INFLIGHT, q.qid, rec.when_us, mid))
        else:
            txn.delete(keys.dead_key(q.qid, mid))
        if rec.digest is not None:
            txn.delete(keys.dedup_key(q.qid, rec.digest))
        txn.delete(keys.message_key(q.qid, mid))
        txn.count(q, STATE_COUNTER[rec.state], -1)
        txn.count(q, BYTES, -rec.length)
        txn.live(PayloadRef(rec.file_id, rec.offset, rec.length), -1)

    def _refresh_next_event(self, q: QueueState) -> None:
        """Recompute the earliest due time or lease deadline from the indexes."""
        earliest = 2**64
        floor = keys.U64.pack(q.time_floor_us)
        for kind in (keys.DELAYED, keys.INFLIGHT):
            base = keys.prefix(kind, q.qid)
            first = self.meta.first_key(base + floor, keys.prefix_end(base))
            if first is not None:
                earliest = min(earliest, keys.timed_parts(first)[0])
        q.next_event_us = earliest

    # -- the commit path ------------------------------------------------------

    def _check_writable(self) -> None:
        if self._closed:
            raise StoreClosed(f"store {self.path!r} is closed")
        if self.readonly:
            raise ReadOnlyStore(f"store {self.path!r} was opened with readonly=True")

    def alloc_id(self, txn: Txn) -> int:
        mid = self._next_id
        self._next_id += 1
        reserved = self._id_hwm if txn.id_hwm is None else txn.id_hwm
        if self._next_id > reserved:
            hwm = max(reserved, mid) + ID_BLOCK
            txn.put(keys.ID_HWM_KEY, records.pack([records.RECORD_VERSION, hwm]))
            txn.id_hwm = hwm
        return mid

    def _commit(self, txn: Txn) -> None:
        """Write ``txn`` as one batch, then apply its counters in memory (lock held).

        The one place counters reach the database: each batch carries the new
        counts of every queue and segment it changes.
        """
        batch = txn.batch
        new_counts = []
        for q, delta in txn.queues.items():
            counts = apply_counts(q.counts, delta)
            batch.put(q.counts_key, records.encode_counts(counts))
            new_counts.append((q, counts))
        new_segs = []
        seg_live = self.seg_live
        for fid, (dbytes, dcount, end) in txn.segments.items():
            old = seg_live.get(fid)
            seg = ([dbytes, dcount, end] if old is None
                   else [old[0] + dbytes, old[1] + dcount, max(old[2], end)])
            batch.put(keys.segment_key(fid), records.encode_segment(seg[0], seg[1], seg[2]))
            new_segs.append((fid, seg))
        synced = self.payload.synced_position()
        if synced != self._synced_mark:
            batch.put(keys.SYNCED_KEY, records.pack([records.RECORD_VERSION, *synced]))
        self.meta.write(batch)
        self._synced_mark = synced
        for q, counts in new_counts:
            q.counts = counts
        for fid, seg in new_segs:
            seg_live[fid] = seg
        if txn.id_hwm is not None:
            self._id_hwm = txn.id_hwm
        if txn.ready_keys is not None:
            for q, added in txn.ready_keys.items():
                q.heads.added(added)
            self._ready.notify_all()
        if txn.events is not None:
            for q, when in txn.events.items():
                if when < q.next_event_us:
                    q.next_event_us = when
                if when < q.time_floor_us:
                    q.time_floor_us = when
        self.syncer.wrote()

    def writing(self) -> _Writing:
        """Hold the writer lock for a change; in "always" mode wait for it to be durable."""
        return self._writing

    # -- queues ---------------------------------------------------------------

    def create_queue(
        self,
        name: str,
        *,
        order: str = "max",
        priority_type: str = "int",
        max_attempts: int = 5,
        dedup: bool = False,
        exist_ok: bool = False,
    ) -> Queue:
        from ._queue import Queue

        _check_queue_name(name)
        if order not in ("max", "min", "fifo"):
            raise InvalidArgument(f"order must be 'max', 'min' or 'fifo', not {order!r}")
        if priority_type not in ("int", "str"):
            raise InvalidArgument(f"priority_type must be 'int' or 'str', not {priority_type!r}")
        if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
            raise InvalidArgument(f"max_attempts must be an int >= 1, not {max_attempts!r}")
        if not isinstance(dedup, bool):
            raise InvalidArgument("dedup must be a bool")
        with self.writing():
            existing = self.queue_states.get(name)
            if existing is not None:
                want = (order, priority_type, max_attempts, dedup)
                have = (existing.rec.order, existing.rec.priority_type,
                        existing.rec.max_attempts, existing.rec.dedup)
                if not exist_ok:
                    raise QueueExists(name)
                if want != have:
                    raise InvalidArgument(
                        f"queue {name!r} exists with order, priority_type, max_attempts, "
                        f"dedup = {have}, not {want}"
                    )
                return Queue(self, existing)
            rec = records.QueueRecord(self._next_qid, order, priority_type, max_attempts, dedup,
                                      self.clock())
            txn = Txn()
            txn.put(keys.queue_key(name), rec.encode())
            txn.put(keys.QID_NEXT_KEY, records.pack([records.RECORD_VERSION, rec.qid + 1]))
            state = QueueState(name, rec, [0, 0, 0, 0, 0])
            state.next_event_us = 2**64
            txn.count(state, 0, 0)
            self.queue_states[name] = state
            try:
                self._commit(txn)
            except BaseException:
                del self.queue_states[name]
                raise
            self._next_qid += 1
        return Queue(self, state)

    def queue(self, name: str) -> Queue:
        from ._queue import Queue

        self._check_open()
        state = self.queue_states.get(name)
        if state is None:
            raise QueueNotFound(name)
        return Queue(self, state)

    def queues(self) -> list[str]:
        self._check_open()
        return sorted(self.queue_states)

    def delete_queue(self, name: str) -> None:
        """Delete a queue with every message in it, in one batch."""
        with self.writing():
            state = self.queue_states.get(name)
            if state is None:
                raise QueueNotFound(name)
            txn = Txn()
            self.release_all(state, txn)
            txn.delete(keys.queue_key(name))
            txn.delete(keys.counts_key(state.qid))
            self._commit(txn)
            state.deleted = True
            del self.queue_states[name]

    def release_all(self, q: QueueState, txn: Txn) -> int:
        """Add to ``txn`` the removal of every message of ``q``; returns how many."""
        lo = keys.prefix(keys.MESSAGE, q.qid)
        n = 0
        for _, value in self.meta.scan(lo, keys.prefix_end(lo)):
            rec = records.MessageRecord.decode(value)
            txn.live(PayloadRef(rec.file_id, rec.offset, rec.length), -1)
            n += 1
        for kind in keys.PER_QUEUE_KINDS:
            p = keys.prefix(kind, q.qid)
            txn.batch.delete_range(p, keys.prefix_end(p))
        for i, c in enumerate(q.counts):
            txn.count(q, i, -c)
        return n

    # -- maintenance ----------------------------------------------------------

    def _sweep_loop(self) -> None:
        from ._queue import promote

        while not self._stop.wait(self.config.sweep_interval):
            try:
                with self._lock:
                    if self._closed:
                        return
                    now_us = keys.to_us(self.clock())
                    for q in list(self.queue_states.values()):
                        if q.next_event_us <= now_us:
                            promote(self, q, now_us)
            except Exception:
                log.exception("lease/delay sweep failed; it will be retried")

    def compact(self, **options: Any) -> CompactionResult:
        """Run one seal-then-compact pass now (see docs/compaction.md)."""
        self._check_writable()
        assert self.compactor is not None
        return self.compactor.run_pass(**options)

    def snapshot(self, dest: str) -> str:
        """A consistent, self-contained copy of the store at ``dest`` (see docs/spark.md)."""
        from ._snapshot import take_snapshot

        self._check_open()
        return take_snapshot(self, dest)

    def stats(self) -> StoreStats:
        from ._queue import Queue

        self._check_open()
        with self._lock:
            queues = tuple(Queue(self, q).stats() for q in
                           sorted(self.queue_states.values(), key=lambda s: s.name))
            active = self.payload.active_id
            segs = []
            for fid in self.payload.file_ids():
                live = self.seg_live.get(fid, [0, 0, 0])
                size = self.payload.segment_size(fid) if fid == active or not self.readonly \
                    else os.path.getsize(self.payload.path_of(fid))
                segs.append(SegmentStats(fid, size, live[0], live[1], fid == active))
        return StoreStats(queues, tuple(segs))

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"store {self.path!r} is closed")

    def close(self) -> None:
        """Stop background work, make everything durable, and release the lock."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ready.notify_all()
        if not self.readonly:
            self._stop.set()
            if self.compactor is not None:
                self.compactor.stop()
            self._sweeper.join()
            self.syncer.stop()
        with self._lock:
            if self.readonly:
                self.payload.close()
            else:
                active = (self.payload.active_id, self.payload.active_end)
                self.payload.close()  # cuts the preallocated tail and fsyncs the segment
                # Record that all of it is durable, so the next open scans nothing
                # (in durability="none" nothing else ever records it).
                batch = new_batch()
                batch.put(keys.SYNCED_KEY, records.pack([records.RECORD_VERSION, *active]))
                self.meta.write(batch)
                # Flushing the memtable now means the next open replays no WAL:
                # it opens faster and without that memory.
                self.meta.flush()
                self.meta.sync_wal()
            self.meta.close()
            _release_writer(self._writer_key)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "readonly" if self.readonly else self.config.durability
        state = "closed" if self._closed else "open"
        return f"<qstore.Store {self.path!r} {mode} {state}>"

    def check(self) -> CheckReport:
        """Check the whole store's integrity (docs/check.md); returns a :class:`CheckReport`.

        Holds the writer lock for the whole check, so nothing changes meanwhile:
        every push, pop and ack of this store waits until it returns (about 15 s
        per million small messages). Reads every message record and payload.
        """
        self._check_open()
        with self._lock:
            return run_check(self.meta, os.path.join(self.path, "payload"),
                             active_id=self.payload.active_id)


def compaction_unfinished(raw: bytes) -> bool:
    """True if the compaction record says its output was never committed."""
    return bool(records.unpack(raw, "compaction")[1] == "copying")


def _check_queue_name(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"queue name must be a non-empty str, not {name!r}")
    if len(name.encode("utf-8")) > MAX_QUEUE_NAME_BYTES:
        raise InvalidArgument(f"queue name is over {MAX_QUEUE_NAME_BYTES} UTF-8 bytes")


def open_store(path: str | os.PathLike[str], **options: Any) -> Store:
    """Open (creating if needed) the store in directory ``path``.

    Options are those of :class:`qstore.Config`; an unknown one is an error.
    """
    config = Config.from_options(options)
    return Store(os.fspath(path), config)
