"""The core of an open store: the writer lock, the one commit path, ids, per-queue state.

Layers point one way::

    Store, Queue (facade: validation, the public API), _timers (time-driven passes)
      └─> Core (this module): writer lock, commit, ids, queue registry
            ├─> _states (the message state machine, as edits to a Txn)
            ├─> _txn (Txn, QueueState), _durability (Syncer)
            └─> meta/ (RocksDB), payload/ (segments)

The compactor, snapshots and the Spark ingest call the core's methods; only
:meth:`Core.commit` writes counters, segment accounting and heads. One
process may open a store read-write (RocksDB's LOCK file enforces it), any
number read-only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any

from . import _states as states
from ._config import Config
from ._durability import Syncer
from ._errors import Corruption, ReadOnlyStore, StorageError, StoreClosed, StoreLocked
from ._heads import ReadyHeads
from ._rate import TokenBucket
from ._txn import NO_EVENT_US, QueueState, Txn, apply_counts
from .meta import Batch, MetaDB, keys, new_batch, records, write_sst
from .payload import FRAME_SIZE, PayloadRef, SegmentSet, parse_segment_name

log = logging.getLogger("qstore")

_READY, _INFLIGHT = records.READY, records.INFLIGHT
_U64 = keys.U64.pack

ID_BLOCK = 4096  # ids reserved per M"id_hwm" write; a restart skips the unused rest
# Message records this process wrote last, kept encoded so that a pop or an ack
# of a recent message reads no record from RocksDB. Bounded: about 150 bytes each.
RECORD_CACHE = 65_536

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


LOST_METADATA = "metadata is missing or empty next to existing payload segments"


def _segment_files(payload_dir: str) -> list[str]:
    try:
        names = os.listdir(payload_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [n for n in names if parse_segment_name(n) is not None]


def _refuse_lost_metadata(path: str) -> None:
    """Raise Corruption if ``path`` holds payload segments but no metadata database.

    Opening it as a new store would let the compactor delete every segment as
    an orphan: the store refuses, creating and deleting nothing (docs/faults.md).
    """
    meta = os.path.join(path, "meta")
    if os.path.exists(os.path.join(meta, "CURRENT")):
        return
    found = _segment_files(os.path.join(path, "payload"))
    if found:
        raise Corruption(meta, 0, f"{LOST_METADATA} ({len(found)} segment file(s), "
                                  "no meta/CURRENT)")


class Writing:
    """The writer-lock context of one core (a class: cheaper than a generator per call).

    In ``durability="always"`` leaving it waits until the changes made inside
    are on stable storage (group commit, see _durability.py).
    """

    __slots__ = ("_core",)

    def __init__(self, core: Core) -> None:
        self._core = core

    def __enter__(self) -> None:
        core = self._core
        core.lock.acquire()
        if core.closed or core.readonly:
            core.lock.release()
            core.check_writable()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        core = self._core
        ticket = core.syncer.ticket()
        core.lock.release()
        if ticket is not None and exc_type is None:
            core.syncer.wait(ticket)


class ReadySignal(threading.Condition):
    """The condition blocked pops wait on, with one optional listener.

    The server (qstore/server) parks waiting pops without a thread: while it
    has any, it counts itself in ``Core.waiters`` and sets ``listener``, which
    is then called (writer lock held, so it must only schedule work) each time
    ready keys are added.
    """

    listener: Callable[[], None] | None = None

    def notify_all(self) -> None:
        super().notify_all()
        if self.listener is not None:
            self.listener()


class Core:
    """Everything an open store holds, and the only code that commits changes."""

    def __init__(self, path: str, config: Config) -> None:
        self.path = path
        self.config = config
        self.clock = config.clock
        self.readonly = config.readonly
        self.max_payload_bytes = config.max_payload_bytes
        self.lock = threading.RLock()
        self.ready = ReadySignal(self.lock)  # notified when ready keys are added
        self.waiters = 0  # pops blocked in ready.wait (lock held to change it)
        self.writing = Writing(self)
        self.closed = False
        # message key -> its record as last committed by this process (see commit)
        self._records: dict[bytes, bytes] = {}
        self._writer_key: tuple[int, int] | None = None
        _refuse_lost_metadata(path)
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
        try:
            self._load()
        except BaseException:
            self.meta.close()
            _release_writer(self._writer_key)
            raise
        self.syncer = Syncer(config.durability, config.sync_interval, self.payload, self.meta)
        if not self.readonly:
            self._drop_lost_tails()
            self.syncer.start()

    # -- opening --------------------------------------------------------------

    def _load(self) -> None:
        fmt = self.meta.get(keys.FORMAT_KEY)
        if fmt is None and _segment_files(os.path.join(self.path, "payload")):
            # A metadata database without the format key next to payload: not a
            # new store but one whose metadata was lost (never "recovered" as empty).
            raise Corruption(self.meta.path, 0, LOST_METADATA)
        if fmt is None and not self.readonly:
            batch = new_batch()
            batch.put(keys.FORMAT_KEY, records.pack([records.RECORD_VERSION,
                                                     records.STORE_FORMAT]))
            self.meta.write(batch, sync=True)
        elif fmt is not None and records.unpack(fmt, "format")[1] != records.STORE_FORMAT:
            raise StorageError(f"unsupported store format in {self.path}")
        hwm = self.meta.get(keys.ID_HWM_KEY)
        self._next_id = records.unpack(hwm, "id")[1] if hwm else 1
        self._id_hwm = self._next_id
        qnext = self.meta.get(keys.QID_NEXT_KEY)
        self._next_qid = records.unpack(qnext, "qid")[1] if qnext else 1
        self.queues: dict[str, QueueState] = {}
        for key, value in self.meta.scan(keys.QUEUE, keys.prefix_end(keys.QUEUE)):
            rec = records.QueueRecord.decode(value)
            raw = self.meta.get(keys.counts_key(rec.qid))
            counts = records.decode_counts(raw) if raw else [0, 0, 0, 0, 0]
            state = QueueState(key[1:].decode("utf-8"), rec, counts)
            totals = self.meta.get(keys.totals_key(rec.qid))
            state.expired = records.decode_totals(totals) if totals else 0
            self.set_options(state, rec)
            self.queues[state.name] = state
            self.refresh_next_event(state)
        # file_id -> [live bytes, live count, end]: what the S records say.
        self.segments: dict[int, list[int]] = {}
        for key, value in self.meta.scan(keys.SEGMENT, keys.prefix_end(keys.SEGMENT)):
            self.segments[keys.segment_id(key)] = list(records.decode_segment(value))
        hints = {fid: v[2] for fid, v in self.segments.items()}
        synced = self.meta.get(keys.SYNCED_KEY)
        if synced is not None:
            # Recovery scans the segment that was active from the last offset known
            # to be durable, not from the end the metadata refers to: after a power
            # loss the metadata may refer to bytes that never reached the disk.
            _, sfid, soff = records.unpack(synced, "synced")
            hints[sfid] = min(soff, hints.get(sfid, soff))
        # Only the segment that was active may have lost unsynced bytes; any other
        # one was fsynced when sealed, and bytes missing from it are damage.
        self._active_at_crash = None if synced is None else sfid
        self._synced_mark: tuple[int, int] | None = None
        compaction = self.meta.get(keys.COMPACTION_KEY)
        discard: list[int] = []
        if compaction is not None and records.decode_compaction(compaction)[0] == records.COPYING:
            discard.append(records.decode_compaction(compaction)[1])
        self.payload = SegmentSet(
            os.path.join(self.path, "payload"),
            segment_max_bytes=self.config.segment_max_bytes,
            max_payload_bytes=self.config.max_payload_bytes,
            readonly=self.readonly,
            tail_hints=hints,
            discard=discard,
            next_file_id_floor=max(self.segments, default=0) + 1,
            hints_are_durable_marks=True,
        )

    def _drop_lost_tails(self) -> None:
        """Forget messages whose payload bytes did not survive a power loss.

        Only possible for bytes past the last durable offset, which belong to
        operations that had not returned in ``durability="always"`` (an
        operation returns only after the sync that covers its bytes); in the
        other modes a power loss may also take operations that had returned.
        Without this, those messages would fail every read with Corruption.
        """
        files = set(self.payload.file_ids())
        for fid, (_, _, end) in list(self.segments.items()):
            if fid not in files:
                continue  # a missing segment is damage: reads raise, the audit reports it
            valid = self.payload.segment_size(fid)
            if valid >= end:
                continue
            if fid != self._active_at_crash and self._active_at_crash is not None:
                # A sealed segment cut short: damage, not a torn tail. Its messages
                # stay; a read of one in the missing bytes raises Corruption, and
                # `qstore check` names them.
                log.error("sealed segment %s ends at %d but its records reach %d: the file "
                          "was damaged (cut); its messages are kept, reads of the lost ones "
                          "raise Corruption; run `qstore check`", fid, valid, end)
                continue
            txn = Txn()
            lost = 0
            for key, value in self.meta.scan(keys.MESSAGE, keys.prefix_end(keys.MESSAGE)):
                rec = records.MessageRecord.decode(value)
                if rec.file_id != fid or rec.offset + FRAME_SIZE + rec.length <= valid:
                    continue
                states.remove(txn, self._state_of_key(key), keys.trailing_id(key), rec)
                lost += 1
            self.segments[fid][2] = valid
            txn.set_end(fid, valid)
            self.commit(txn)
            self.syncer.sync_now()
            log.error("segment %s ends at %d but the metadata referred up to %d (a power loss "
                      "before those bytes were synced): %d message(s) dropped", fid, valid,
                      end, lost)

    def _state_of_key(self, key: bytes) -> QueueState:
        qid = keys.U32.unpack_from(key, 1)[0]
        return next(q for q in self.queues.values() if q.qid == qid)

    # -- checks ---------------------------------------------------------------

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosed(f"store {self.path!r} is closed")

    def check_writable(self) -> None:
        self.check_open()
        if self.readonly:
            raise ReadOnlyStore(f"store {self.path!r} was opened with readonly=True")

    # -- the commit path ------------------------------------------------------

    def alloc_id(self, txn: Txn) -> int:
        """A new message id; ``txn`` carries the id high-water mark when it moves."""
        mid = self._next_id
        self._next_id += 1
        reserved = self._id_hwm if txn.id_hwm is None else txn.id_hwm
        if self._next_id > reserved:
            hwm = max(reserved, mid) + ID_BLOCK
            txn.put(keys.ID_HWM_KEY, records.pack([records.RECORD_VERSION, hwm]))
            txn.id_hwm = hwm
        return mid

    def commit(self, txn: Txn) -> None:
        """Write ``txn`` as one batch, then bring the in-memory state in line (lock held).

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
        segments = self.segments
        for fid, (dbytes, dcount, end) in txn.segments.items():
            old = segments.get(fid)
            seg = ([dbytes, dcount, end] if old is None
                   else [old[0] + dbytes, old[1] + dcount, max(old[2], end)])
            batch.put(keys.segment_key(fid), records.encode_segment(seg[0], seg[1], seg[2]))
            new_segs.append((fid, seg))
        synced = self.payload.synced_position()
        if synced != self._synced_mark:
            batch.put(keys.SYNCED_KEY, records.pack([records.RECORD_VERSION, *synced]))
        self.meta.write(batch)
        self._synced_mark = synced
        if txn.forget_records:
            self._records.clear()
        cache = self._records
        for key, value in txn.records:
            if value is None:
                cache.pop(key, None)
            elif txn.cache_records:
                self._cache_record(key, value)
            elif key in cache:
                cache[key] = value
        for q, counts in new_counts:
            q.counts = counts
        for fid, seg in new_segs:
            segments[fid] = seg
        if txn.id_hwm is not None:
            self._id_hwm = txn.id_hwm
        if txn.ready_keys is not None:
            for q, added in txn.ready_keys.items():
                q.heads.added(added)
            if self.waiters:
                self.ready.notify_all()
        if txn.events is not None:
            for q, when in txn.events.items():
                if when < q.next_event_us:
                    q.next_event_us = when
                if when < q.time_floor_us:
                    q.time_floor_us = when
        self.syncer.wrote()

    def push_one(self, q: QueueState, body: bytes, prio: int | str) -> int:
        """Append one ready message: the hot path of ``Queue.push`` (lock held).

        The same keys, records and counters as :func:`states.enqueue` plus
        :meth:`commit` would write (a test compares the two byte for byte),
        built straight into one batch: no Txn, no per-call dictionaries.
        """
        ref = self.payload.append_one(body)
        fid, offset, length = ref
        batch = new_batch()
        mid = self._next_id
        self._next_id = mid + 1
        hwm = None
        if mid >= self._id_hwm:
            hwm = mid + ID_BLOCK
            batch.put(keys.ID_HWM_KEY, records.pack([records.RECORD_VERSION, hwm]))
        id_bytes = _U64(mid)
        pkey = q.pkeys.get(prio)
        rkey = q.ready_prefix + (q.priority_key(prio) if pkey is None else pkey) + id_bytes
        batch.put(rkey, b"")
        mkey = q.message_prefix + id_bytes
        record = records.encode_message(_READY, prio, fid, offset, length, 0, 0, self.clock(), 0,
                                        None)
        batch.put(mkey, record)
        c = q.counts
        counts = [c[0] + 1, c[1], c[2], c[3], c[4] + length]
        batch.put(q.counts_key, records.encode_counts(counts))
        frame = FRAME_SIZE + length
        end = offset + frame
        old = self.segments.get(fid)
        seg = [frame, 1, end] if old is None else [old[0] + frame, old[1] + 1, max(old[2], end)]
        batch.put(keys.segment_key(fid), records.encode_segment(seg[0], seg[1], seg[2]))
        self._write_hot(batch)
        self._cache_record(mkey, record)
        q.counts = counts
        self.segments[fid] = seg
        if hwm is not None:
            self._id_hwm = hwm
        q.heads.added((rkey,))
        if self.waiters:
            self.ready.notify_all()
        return mid

    def deliver_one(self, q: QueueState, ready_key: bytes, mid: int,
                    rec: records.MessageRecord, deadline_us: int) -> None:
        """ready -> in_flight for one message: the hot path of ``Queue.pop`` (lock held).

        The batch :func:`states.deliver` plus :meth:`commit` would write, built
        directly (a test compares the two byte for byte).
        """
        rec.state = _INFLIGHT
        rec.attempts += 1
        rec.deliveries += 1
        rec.when_us = deadline_us
        batch = new_batch()
        batch.delete(ready_key)
        id_bytes = _U64(mid)
        batch.put(q.inflight_prefix + _U64(deadline_us) + id_bytes, b"")
        mkey = q.message_prefix + id_bytes
        record = rec.encode()
        batch.put(mkey, record)
        c = q.counts
        counts = [c[0] - 1, c[1], c[2] + 1, c[3], c[4]]
        batch.put(q.counts_key, records.encode_counts(counts))
        self._write_hot(batch)
        self._cache_record(mkey, record)
        q.counts = counts
        if deadline_us < q.next_event_us:
            q.next_event_us = deadline_us
        if deadline_us < q.time_floor_us:
            q.time_floor_us = deadline_us

    def remove_one(self, q: QueueState, mid: int, rec: records.MessageRecord) -> None:
        """Delete one in-flight message: the hot path of ``Queue.ack`` (lock held).

        The batch :func:`states.remove` plus :meth:`commit` would write, built
        directly (a test compares the two byte for byte).
        """
        batch = new_batch()
        id_bytes = _U64(mid)
        batch.delete(q.inflight_prefix + _U64(rec.when_us) + id_bytes)
        if rec.digest is not None:
            batch.delete(keys.dedup_key(q.qid, rec.digest))
        if rec.expires_us:
            batch.delete(keys.expiry_key(q.qid, rec.expires_us, mid))
        mkey = q.message_prefix + id_bytes
        batch.delete(mkey)
        length = rec.length
        c = q.counts
        counts = [c[0], c[1], c[2] - 1, c[3], c[4] - length]
        batch.put(q.counts_key, records.encode_counts(counts))
        fid = rec.file_id
        frame = FRAME_SIZE + length
        old = self.segments.get(fid)
        seg = [-frame, -1, 0] if old is None else [old[0] - frame, old[1] - 1, old[2]]
        batch.put(keys.segment_key(fid), records.encode_segment(seg[0], seg[1], seg[2]))
        self._write_hot(batch)
        self._records.pop(mkey, None)
        q.counts = counts
        self.segments[fid] = seg

    def _cache_record(self, key: bytes, value: bytes) -> None:
        cache = self._records
        cache[key] = value
        if len(cache) > RECORD_CACHE:
            # Keep the newer half. (Deleting the oldest key one at a time would
            # cost O(n) each: a dict's iterator skips every slot deleted before.)
            newer = list(islice(cache.items(), RECORD_CACHE // 2, None))
            cache.clear()
            cache.update(newer)

    def record(self, key: bytes) -> bytes | None:
        """The message record at ``key`` (the record cache, else RocksDB)."""
        value = self._records.get(key)
        return value if value is not None else self.meta.get(key)

    def _write_hot(self, batch: Batch) -> None:
        """The tail every hot-path batch shares with :meth:`commit`: the synced mark."""
        synced = self.payload.synced_position()
        if synced is not self._synced_mark:
            batch.put(keys.SYNCED_KEY, records.pack([records.RECORD_VERSION, *synced]))
        self.meta.write(batch)
        self._synced_mark = synced
        self.syncer.wrote()

    def write_synced(self, puts: Sequence[tuple[bytes, bytes]] = (),
                     deletes: Sequence[bytes] = ()) -> None:
        """A synced batch of bookkeeping keys that carry no counters (compaction records)."""
        batch = new_batch()
        for key, value in puts:
            batch.put(key, value)
        for key in deletes:
            batch.delete(key)
        self.meta.write(batch, sync=True)

    # -- ids for bulk loads ---------------------------------------------------

    def reserve_ids(self, n: int) -> int:
        """Reserve ``n`` consecutive message ids, durably; returns the first."""
        with self.lock:
            self.check_writable()
            first = self._next_id
            end = first + n
            hwm = max(self._id_hwm, end)
            self.write_synced([(keys.ID_HWM_KEY, records.pack([records.RECORD_VERSION, hwm]))])
            self._next_id = end
            self._id_hwm = hwm
        return first

    def ids_reserved_below(self) -> int:
        """Every id below this was handed out or reserved."""
        return self._id_hwm

    def reserve_file_ids(self, n: int) -> list[int]:
        """``n`` segment file ids above every segment of the store (held in memory only)."""
        with self.lock:
            self.check_writable()
            return [self.payload.reserve_file_id() for _ in range(n)]

    def ingest(self, q: QueueState, paths: list[str], counts_delta: list[int],
               new_segments: dict[int, tuple[int, int, int]], end_id: int,
               min_due_us: int | None) -> None:
        """Ingest sorted SST files holding new messages of ``q`` (a bulk load), atomically.

        The counters, segment records and id high-water mark go in one more
        file of the same ingestion, so all of it lands or none. Lock held.
        """
        counts = apply_counts(q.counts, counts_delta)
        hwm = max(self._id_hwm, end_id)
        entries = [
            (q.counts_key, records.encode_counts(counts)),
            (keys.ID_HWM_KEY, records.pack([records.RECORD_VERSION, hwm])),
        ]
        for fid, (live_bytes, live_count, end) in new_segments.items():
            entries.append((keys.segment_key(fid),
                            records.encode_segment(live_bytes, live_count, end)))
        meta_sst = os.path.join(os.path.dirname(paths[0]) if paths else self.path,
                                "meta.sst")
        write_sst(meta_sst, entries)
        self.meta.ingest([*paths, meta_sst])
        q.counts = counts
        for fid, seg in new_segments.items():
            self.segments[fid] = list(seg)
        self._id_hwm = hwm
        self._next_id = max(self._next_id, end_id)
        q.heads = ReadyHeads(q.qid)  # loaded keys may sort anywhere: learn the levels again
        if min_due_us is not None:  # the earliest due time or expiry of the loaded messages
            q.next_event_us = min(q.next_event_us, min_due_us)
            q.time_floor_us = min(q.time_floor_us, min_due_us)
        if q.rec.aging is not None:  # plan aging again: the new ready messages are waiting too
            q.aging_next_us = 0
            q.next_event_us = 0
        if counts_delta[0] and self.waiters:
            self.ready.notify_all()

    # -- queues ---------------------------------------------------------------

    def add_queue(self, name: str, order: str, priority_type: str, max_attempts: int,
                  dedup: bool, **options: Any) -> QueueState:
        """Create queue ``name`` (writer lock held; the caller checked it is new and
        validated ``options``, the QueueRecord fields of contract section 10)."""
        rec = records.QueueRecord(self._next_qid, order, priority_type, max_attempts, dedup,
                                  self.clock(), **options)
        txn = Txn()
        txn.put(keys.queue_key(name), rec.encode())
        txn.put(keys.QID_NEXT_KEY, records.pack([records.RECORD_VERSION, rec.qid + 1]))
        state = QueueState(name, rec, [0, 0, 0, 0, 0])
        state.next_event_us = NO_EVENT_US
        state.heads = ReadyHeads.of_empty_queue(rec.qid)
        self.set_options(state, rec)
        txn.count(state, 0, 0)
        self.queues[name] = state
        try:
            self.commit(txn)
        except BaseException:
            del self.queues[name]
            raise
        self._next_qid += 1
        return state

    def set_options(self, q: QueueState, rec: records.QueueRecord) -> None:
        """Bring the in-memory state of ``q`` in line with its (new) record."""
        old = q.rec
        q.rec = rec
        if rec.rate is None:
            q.bucket = None
        elif q.bucket is None or old.rate != rec.rate:
            q.bucket = TokenBucket(rec.rate[0], rec.rate[1], self.clock())
        q.aging_next_us = 0 if rec.aging is not None else NO_EVENT_US
        q.next_event_us = min(q.next_event_us, q.aging_next_us)

    def configure_queue(self, q: QueueState, options: dict[str, Any]) -> None:
        """Change the options of ``q`` (validated by the caller; writer lock held)."""
        rec = dataclasses.replace(q.rec, **options)
        txn = Txn()
        txn.put(keys.queue_key(q.name), rec.encode())
        self.commit(txn)
        self.set_options(q, rec)

    def drop_queue(self, q: QueueState) -> None:
        """Delete a queue with every message in it, in one batch (writer lock held)."""
        txn = Txn()
        states.remove_all(txn, q, list(self.payload_refs(q)))
        txn.delete(keys.queue_key(q.name))
        # The counters put that commit() adds for q would bring the key back:
        # drop q's deltas, the key goes with the queue.
        del txn.queues[q]
        txn.delete(q.counts_key)
        txn.delete(keys.totals_key(q.qid))
        self.commit(txn)
        q.deleted = True
        del self.queues[q.name]

    def purge(self, q: QueueState) -> int:
        """Delete every message of ``q`` in one batch; returns how many (lock held)."""
        refs = list(self.payload_refs(q))
        txn = Txn()
        states.remove_all(txn, q, refs)
        self.commit(txn)
        q.heads = ReadyHeads.of_empty_queue(q.qid)
        q.next_event_us = NO_EVENT_US
        return len(refs)

    def payload_refs(self, q: QueueState) -> Iterator[PayloadRef]:
        lo = keys.prefix(keys.MESSAGE, q.qid)
        for _, value in self.meta.scan(lo, keys.prefix_end(lo)):
            rec = records.MessageRecord.decode(value)
            yield PayloadRef(rec.file_id, rec.offset, rec.length)

    def records_of(self, q: QueueState, index_keys: list[bytes]) -> list[records.MessageRecord]:
        """The message records the index keys of ``q`` name, in order."""
        mids = [keys.trailing_id(k) for k in index_keys]
        if len(mids) == 1:  # a multi-get costs several times a get
            raws = [self.record(keys.message_key(q.qid, mids[0]))]
        else:
            raws = self.meta.multi_get([keys.message_key(q.qid, m) for m in mids])
        out = []
        for mid, raw in zip(mids, raws, strict=True):
            if raw is None:
                raise missing_record(q, mid)
            out.append(records.MessageRecord.decode(raw))
        return out

    # -- time (the passes themselves are in _timers.py) ------------------------

    def refresh_next_event(self, q: QueueState) -> None:
        """Recompute the earliest due time or lease deadline from the indexes."""
        earliest = q.aging_next_us
        floor = keys.U64.pack(q.time_floor_us)
        for kind in (keys.DELAYED, keys.INFLIGHT, keys.EXPIRY):
            base = keys.prefix(kind, q.qid)
            first = self.meta.first_key(base + floor, keys.prefix_end(base))
            if first is not None:
                earliest = min(earliest, keys.timed_parts(first)[0])
        q.next_event_us = earliest

    # -- closing --------------------------------------------------------------

    def close(self) -> None:
        """Make everything durable and release the database (background work stopped)."""
        self.syncer.stop()
        with self.lock:
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


def missing_record(q: QueueState, mid: int) -> StorageError:
    return StorageError(f"index of queue {q.name!r} names message {mid} but its record is "
                        "missing; run `qstore check`")
