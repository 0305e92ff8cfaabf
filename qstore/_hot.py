"""The hot paths of the core and its record cache (a mixin of :class:`qstore._core.Core`).

Single and batch push, pop and ack build their one WriteBatch directly: the
same keys, records and counters the state machine (``_states``) plus
``Core.commit`` would write, which ``tests/queue/test_hot_paths.py`` checks
byte for byte, without a ``Txn`` or per-message calls. Id allocation lives
here too (``alloc_id``; ``push_one`` and ``push_ready`` move the high-water
mark the same way), and the record cache: the last records this process
committed, so that a pop or an ack of a recent message reads no record from
RocksDB.

Everything here runs with the writer lock held, and changes in-memory state
only after the batch it reflects was written (docs/architecture.md).

A batch's keys go in key order, one table after the other (all its message
keys by id, then all its ready keys, ...), not message by message. RocksDB's
memtable (a skip list) remembers where its last insert went and starts the
next one there when the new key falls right after it: new keys in order
(a push's, a pop's in-flight keys) then cost a few comparisons each, where
keys that jump between tables cost a search from the top each. Measured with
rocksdict alone, batches of 300 new keys: 0.18-0.28 us a key in order
against 0.57-0.92 us interleaved; in the store, the RocksDB write of a
push_many(100) went from 1.7 to 0.75 us a message and that of a
pop_many+ack_many from 5.0-5.3 to 3.6-3.9 (docs/benchmarks.md). The order
changes nothing else: a batch is applied as a whole, and no hot-path batch
names a key twice.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any

from ._durability import Syncer
from ._errors import StorageError
from ._reserve import RESERVE_BYTES, SpaceReserve, free_bytes
from ._seg_accounts import DEFER_MAX
from ._txn import QueueState, Txn
from .meta import Batch, MetaDB, keys, new_batch, records, space_to_open
from .payload import FRAME_SIZE, HEADER_SIZE, PayloadRef, SegmentSet

log = logging.getLogger("qstore")

_READY, _INFLIGHT = records.READY, records.INFLIGHT
_U64 = keys.U64.pack

ID_BLOCK = 4096  # ids reserved per M"id_hwm" write; a crash skips the unused rest
# Message records this process wrote last, kept encoded (or decoded, by a pop,
# for its ack; or as the fields a push gave, see Pushed) so that a pop or an
# ack of a recent message reads no record from RocksDB. Bounded: about 150
# bytes each.
RECORD_CACHE = 65_536

# A plain push's record in the cache: (priority, file_id, offset, length,
# enqueued_at), the fields it was encoded from. A pop builds its MessageRecord
# from them: cheaper than decoding the bytes.
Pushed = tuple["int | str", int, int, int, float]

# durability="always": a batch with at most this many bytes of bodies carries
# them as journal keys (one sync instead of two, see _durability.py); a larger
# one has its segment fdatasynced by the sync it waits for, as before.
JOURNAL_MAX_BYTES = 1024 * 1024
# Once this many bytes were journaled since the last flush of the memtable, the
# checkpoint runs at once rather than at the end of the sync interval: it deletes
# the journal keys (a second copy of each body, in the metadata) and its journal
# policy flushes the memtable. With sync_interval=600, 150 MB of bodies sat in the
# journal for ten minutes (a configuration audit).
JOURNAL_FLUSH_BYTES = 32 * 1024 * 1024
_MR = records.MessageRecord


def _from_push(p: Pushed) -> records.MessageRecord:
    """The record a plain push wrote (ready, no attempts, delay, digest or TTL)."""
    return _MR(_READY, p[0], p[1], p[2], p[3], 0, 0, p[4], 0, None)


class HotPaths:
    """The hot paths, id allocation and the record cache of :class:`~qstore._core.Core`."""

    # Set by Core.__init__ (declared here for the type checker).
    path: str
    reserve: SpaceReserve
    # True from the moment the disk had less free than the metadata database
    # needs to reopen (the space reserve was released for it), or an open found
    # no room to make the reserve, until there is (space_ok): pushes are refused
    # meanwhile (check_push_space).
    space_low: bool
    payload: SegmentSet
    meta: MetaDB
    syncer: Syncer
    clock: Callable[[], float]
    segments: dict[int, list[int]]
    waiters: int
    ready: Any  # the core's ReadySignal (a threading.Condition)
    _next_id: int
    _id_hwm: int
    _synced_mark: tuple[int, int] | None
    always: bool  # durability="always"
    journaling: bool
    _awaiting_sync: list[tuple[int, int, bytes]]
    _journal_bytes: int
    # The segment whose S record single pushes leave alone (_seg_accounts.py),
    # and how many have since it was last written.
    _deferred: int | None
    _deferred_n: int
    # message key -> its record as last committed by this process (see commit):
    # encoded, or decoded (a pop leaves the record it delivered, for the ack);
    # message_record() hands a decoded one over rather than share it.
    _records: dict[bytes, bytes | records.MessageRecord | Pushed]

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

    def push_one(self, q: QueueState, body: bytes, prio: int | str) -> int:
        """Append one ready message: the hot path of ``Queue.push`` (lock held).

        The same keys, records and counters as :func:`states.enqueue` plus
        :meth:`commit` would write (a test compares the two byte for byte),
        built straight into one batch: no Txn, no per-call dictionaries.
        """
        if self.space_low:
            self.check_push_space()
        now = self.clock()  # before the append: a clock that fails leaves nothing behind
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
        record = records.encode_message(_READY, prio, fid, offset, length, 0, 0, now, 0, None)
        batch.put(mkey, record)
        journal = self.journal_into(batch, (ref,), (body,)) if self.always else None
        c = q.counts
        counts = [c[0] + 1, c[1], c[2], c[3], c[4] + length]
        batch.put(q.counts_key, records.encode_counts(counts))
        frame = FRAME_SIZE + length
        end = offset + frame
        old = self.segments.get(fid)
        seg = ([frame, 1, end] if old is None
               else [old[0] + frame, old[1] + 1, end if end > old[2] else old[2]])
        defer = fid == self._deferred and self._deferred_n < DEFER_MAX
        if not defer:  # the segment's first push, or the record's turn to catch up
            self._defer_into(batch, fid, seg)
        self._write_hot(batch)
        if defer:
            self._deferred_n += 1
        else:
            self._deferred, self._deferred_n = fid, 0
        if journal:
            self._awaiting_sync.extend(journal)
        cache = self._records
        cache[mkey] = (prio, fid, offset, length, now)
        if len(cache) > RECORD_CACHE:
            self._trim_records()
        q.counts = counts
        self.segments[fid] = seg
        if hwm is not None:
            self._id_hwm = hwm
        q.heads.added_one(rkey)
        if self.waiters:
            self.ready.notify_all(q.name)
        return mid

    def check_push_space(self, what: str = "pushes") -> None:
        """Refuse a push while the disk is nearly full (:attr:`space_low`; lock held).
        ``what`` names what is refused in the error (a backfill's load too).

        Once the reserve was released so that the metadata database could
        reopen, its room is for the acks and the compaction that free space.
        Pushes took it: a server's producers, pushing on, used the last bytes,
        and from then on every ack, pop and compaction failed until a file was
        deleted by hand (a fault audit). Pushes now wait for the reserve to be
        made again (or for room for it twice over), then go on by themselves.
        """
        if self.space_ok():
            self.space_low = False
            log.warning("free space is back: pushes are taken again")
            return
        err = StorageError(f"the disk of {self.path} is nearly full: {what} are refused "
                           "until space is back (ack, delete or compact to free it)")
        err.errno = errno.ENOSPC
        raise err

    def space_ok(self) -> bool:
        """The space reserve is whole (made again here if there is room), or the disk
        has room for it twice over (a filesystem that cannot make one)."""
        return self.reserve.restore() or free_bytes(self.path) >= (
            space_to_open(os.path.join(self.path, "meta")) + 2 * RESERVE_BYTES)

    def push_ready(self, q: QueueState, bodies: Sequence[bytes],
                   prios: Sequence[int | str]) -> list[int]:
        """Append ready messages, no delay, TTL or dedup: the hot path of
        ``Queue.push_many`` (lock held; bodies checked with ``check_size``).

        What :func:`states.enqueue` for each plus :meth:`commit` would write (a
        test compares the two byte for byte), built straight into one batch.
        """
        if not bodies:
            return []
        now = self.clock()  # before the append: a clock that fails leaves nothing behind
        with self.appending_batch() as started:
            refs = self.payload.append_many(bodies, started)
            return self._commit_ready(q, refs, prios, now, bodies)

    @contextlib.contextmanager
    def appending_batch(self) -> Iterator[list[int]]:
        """Around a batch's ``payload.append_many(bodies, started)`` and its commit (lock held).

        A batch larger than the room left rotates the active segment, once or
        more. If it then fails (a file call, the metadata write), the segments
        it sealed may hold nothing but its uncommitted records, with no ``S``
        record: orphans to the check, kept until a pass or the next open. Those
        are removed here at once: the segments the batch started, and the one
        active before it if the batch's records were its first. Any other is
        kept: one with an ``S`` record counts the batch's records as garbage (as
        for a failed single push), and a payload is never deleted unless it is
        known to hold only records no commit referred to.
        """
        if self.space_low:
            self.check_push_space()
        before = self.payload.active_id
        ours = [] if before is None or self.payload.segment_size(before) > HEADER_SIZE \
            else [before]
        started: list[int] = []
        try:
            yield started
        except BaseException:
            active = self.payload.active_id
            dead = [fid for fid in (*ours, *started)
                    if fid != active and fid not in self.segments
                    and not self._recorded(fid)]
            if dead:
                try:
                    self.payload.delete(dead)
                except StorageError as exc:  # the batch's error is the one to report
                    log.error("could not remove segments %s, which hold only the records "
                              "of a failed batch: %s (the next compaction pass does)",
                              dead, exc)
                else:
                    log.warning("removed segments %s: they held only the records of a "
                                "failed batch", dead)
            raise

    def _recorded(self, fid: int) -> bool:
        """Whether the database holds segment ``fid``'s S record (or cannot tell):
        then a commit refers to it, and it is no failed batch's to remove. The
        batch may have committed before the exception: an interrupt (Ctrl-C) as
        its write returned reached the cleanup before memory knew of the segments,
        which then deleted the payloads of messages it had just added (an
        interrupt audit)."""
        try:
            return self.meta.get(keys.segment_key(fid)) is not None
        except StorageError:
            return True

    def journal_into(self, batch: Batch, refs: Sequence[PayloadRef], bodies: Sequence[bytes]
                     ) -> list[tuple[int, int, bytes]] | None:
        """Put the payload journal's keys for the records at ``refs`` into ``batch``
        (durability ``always``); returns their entries, for ``_awaiting_sync`` once the
        batch is written. Bodies over ``JOURNAL_MAX_BYTES`` in all, or any while
        journaling is off (a nearly full disk, see Core._journal_policy), are not
        journaled: the next sync fdatasyncs the segment instead."""
        total = sum(map(len, bodies))
        if total > JOURNAL_MAX_BYTES or not self.journaling:
            self.syncer.payload_needed = True
            return None
        self._journal_bytes += total
        if self._journal_bytes >= JOURNAL_FLUSH_BYTES:
            self.syncer.kick()
        out = []
        put = batch.put
        for (fid, offset, length), body in zip(refs, bodies, strict=True):
            key = keys.journal_key(fid, offset)
            put(key, body)
            out.append((fid, offset + FRAME_SIZE + length, key))
        return out

    def pending_batch(self, put: Callable[[bytes, bytes], None], qid: int, first: int,
                      n: int, last: PayloadRef) -> list[tuple[int, int, bytes]] | None:
        """Put the pending batch key of a batch push of ``n`` messages with ids from
        ``first``, whose last record is at ``last``, not carried by the journal;
        returns its entry, for ``_awaiting_sync`` once the batch is written.

        Until a sync covers the batch's last record, a power loss may keep its
        metadata (the log synced by another write, a memtable flush) and lose
        some of its records: recovery then drops every message of the batch,
        not only those (meta/_keys.py). None in ``durability="none"``, which
        syncs nothing that would delete the key: a batch there is not atomic
        across a power loss (docs/faults.md).
        """
        if self.syncer.mode == "none":
            return None
        end = last.offset + FRAME_SIZE + last.length
        key = keys.pending_batch_key(qid, first)
        put(key, records.pack([records.RECORD_VERSION, first + n - 1, last.file_id, end]))
        return [(last.file_id, end, key)]

    def _commit_ready(self, q: QueueState, refs: list[PayloadRef],
                      prios: Sequence[int | str], now: float,
                      bodies: Sequence[bytes]) -> list[int]:
        """push_ready's batch for the records at ``refs``, written, and memory in line."""
        batch = new_batch()
        put = batch.put
        n = len(refs)
        first = self._next_id
        self._next_id = first + n
        hwm = self._id_hwm
        if first + n > hwm:  # what alloc_id does, id by id
            for mid in range(first, first + n):
                if mid + 1 > hwm:
                    hwm = max(hwm, mid) + ID_BLOCK
            put(keys.ID_HWM_KEY, records.pack([records.RECORD_VERSION, hwm]))
        ready_prefix, message_prefix, pkeys = q.ready_prefix, q.message_prefix, q.pkeys
        encode = records.encode_message
        rkeys = []
        written: list[tuple[bytes, Pushed]] = []
        total = 0
        mid = first
        # Keys in key order, one table after the other (module docstring): the
        # message keys as the ids grow, then the ready keys sorted.
        for (fid, offset, length), prio in zip(refs, prios, strict=True):
            id_bytes = _U64(mid)
            mid += 1
            pkey = pkeys.get(prio)
            rkeys.append(ready_prefix + (q.priority_key(prio) if pkey is None else pkey)
                         + id_bytes)
            mkey = message_prefix + id_bytes
            put(mkey, encode(_READY, prio, fid, offset, length, 0, 0, now, 0, None))
            written.append((mkey, (prio, fid, offset, length, now)))
            total += length
        for rkey in sorted(rkeys):
            put(rkey, b"")
        # Records are appended in order: each segment's last one is its end.
        segs: dict[int, list[int]] = {}
        if refs[0].file_id == refs[-1].file_id:  # the usual batch: one segment
            last = refs[-1]
            segs[last.file_id] = [total + FRAME_SIZE * n, n, last.offset + FRAME_SIZE + last.length]
        else:
            for fid, offset, length in refs:
                frame = FRAME_SIZE + length
                seg = segs.get(fid)
                if seg is None:
                    segs[fid] = [frame, 1, offset + frame]
                else:
                    seg[0] += frame
                    seg[1] += 1
                    seg[2] = offset + frame
        c = q.counts
        counts = [c[0] + n, c[1], c[2], c[3], c[4] + total]
        put(q.counts_key, records.encode_counts(counts))
        segments = self.segments
        new_segs = []
        self.release_deferred(batch)
        for fid, (dbytes, dcount, end) in segs.items():
            old = segments.get(fid)
            seg = ([dbytes, dcount, end] if old is None
                   else [old[0] + dbytes, old[1] + dcount, max(old[2], end)])
            put(keys.segment_key(fid), self.segment_record(fid, seg))
            new_segs.append((fid, seg))
        journal = self.journal_into(batch, refs, bodies) if self.always else None
        if journal is None and n > 1:
            journal = self.pending_batch(batch.put, q.qid, first, n, refs[-1])
        self._write_hot(batch)
        if journal:
            self._awaiting_sync.extend(journal)
        cache = self._records
        cache.update(written)
        if len(cache) > RECORD_CACHE:
            self._trim_records()
        q.counts = counts
        for fid, seg in new_segs:
            segments[fid] = seg
        self._id_hwm = hwm
        q.heads.added(rkeys)
        if self.waiters:
            self.ready.notify_all(q.name)
        return list(range(first, first + n))

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
        self._cache_record(mkey, rec)  # decoded: the ack needs no decode
        q.counts = counts
        if deadline_us < q.next_event_us:
            q.next_event_us = deadline_us
        if deadline_us < q.time_floor_us:
            q.time_floor_us = deadline_us

    def deliver_many(self, q: QueueState, ready_keys: Sequence[bytes],
                     recs: Sequence[records.MessageRecord], deadline_us: int) -> list[int]:
        """ready -> in_flight for several messages: the hot path of ``Queue.pop_many``
        (lock held). What :func:`states.deliver` for each plus :meth:`commit`
        would write (a test compares the two byte for byte). The records stay
        decoded in the record cache, for the acks. Returns the messages' ids,
        in order (read from the keys in one call: a call per key cost more).
        """
        batch = new_batch()
        put = batch.put
        inflight = q.inflight_prefix + _U64(deadline_us)
        message_prefix = q.message_prefix
        delete = batch.delete
        # In key order, one table after the other (module docstring): the ready
        # keys as popped (the index's order), then the new in-flight keys and
        # the records by id.
        ids = [rkey[-8:] for rkey in ready_keys]  # every index key ends with the id
        for rkey, rec in zip(ready_keys, recs, strict=True):
            rec.state = _INFLIGHT
            rec.attempts += 1
            rec.deliveries += 1
            rec.when_us = deadline_us
            delete(rkey)
        # By id: the ids are distinct, no record is compared.
        delivered = sorted(zip(ids, recs, strict=True))
        mkeys = []
        for id_bytes, _ in delivered:
            put(inflight + id_bytes, b"")
            mkeys.append(message_prefix + id_bytes)
        by_id = [rec for _, rec in delivered]
        for mkey, record in zip(mkeys, records.encode_records(by_id), strict=True):
            put(mkey, record)
        k = len(by_id)
        c = q.counts
        counts = [c[0] - k, c[1], c[2] + k, c[3], c[4]]
        put(q.counts_key, records.encode_counts(counts))
        self._write_hot(batch)
        cache = self._records
        cache.update(zip(mkeys, by_id, strict=True))
        if len(cache) > RECORD_CACHE:
            self._trim_records()
        q.counts = counts
        if deadline_us < q.next_event_us:
            q.next_event_us = deadline_us
        if deadline_us < q.time_floor_us:
            q.time_floor_us = deadline_us
        return list(struct.unpack(f">{len(ids)}Q", b"".join(ids)))

    def remove_many(self, q: QueueState, mids: Sequence[int],
                    recs: Sequence[records.MessageRecord]) -> None:
        """Delete several in-flight messages: the hot path of ``Queue.ack_many`` (lock
        held). What :func:`states.remove` for each plus :meth:`commit` would
        write (a test compares the two byte for byte).
        """
        batch = new_batch()
        delete = batch.delete
        inflight, message_prefix = q.inflight_prefix, q.message_prefix
        qid = q.qid
        cache = self._records
        total = 0
        segs: dict[int, list[int]] = {}
        # In key order, one table after the other (module docstring); the rare
        # dedup and expiry keys as they come.
        inflight_keys = []
        message_keys = []
        when_us, by_when = -1, b""  # a batch pop's leases share one deadline: packed once
        for mid, rec in zip(mids, recs, strict=True):
            id_bytes = _U64(mid)
            if rec.when_us != when_us:
                when_us = rec.when_us
                by_when = inflight + _U64(when_us)
            inflight_keys.append(by_when + id_bytes)
            if rec.digest is not None:
                delete(keys.dedup_key(qid, rec.digest))
            if rec.expires_us:
                delete(keys.expiry_key(qid, rec.expires_us, mid))
            mkey = message_prefix + id_bytes
            message_keys.append(mkey)
            cache.pop(mkey, None)  # before the write: a failed one only costs a read
            length = rec.length
            total += length
            seg = segs.get(rec.file_id)
            if seg is None:
                segs[rec.file_id] = [FRAME_SIZE + length, 1]
            else:
                seg[0] += FRAME_SIZE + length
                seg[1] += 1
        inflight_keys.sort()
        for key in inflight_keys:
            delete(key)
        message_keys.sort()
        for key in message_keys:
            delete(key)
        k = len(recs)
        c = q.counts
        counts = [c[0], c[1], c[2] - k, c[3], c[4] - total]
        batch.put(q.counts_key, records.encode_counts(counts))
        segments = self.segments
        new_segs = []
        for fid, (dbytes, dcount) in segs.items():
            old = segments.get(fid)
            seg = [-dbytes, -dcount, 0] if old is None else [old[0] - dbytes, old[1] - dcount,
                                                             old[2]]
            batch.put(keys.segment_key(fid), self.segment_record(fid, seg))
            new_segs.append((fid, seg))
        self._write_hot(batch)
        q.counts = counts
        for fid, seg in new_segs:
            segments[fid] = seg

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
        batch.put(keys.segment_key(fid), self.segment_record(fid, seg))
        self._write_hot(batch)
        self._records.pop(mkey, None)
        q.counts = counts
        self.segments[fid] = seg

    def live_leases(self, q: QueueState, leases: Sequence[tuple[int, int, int] | None],
                    now_us: int) -> list[records.MessageRecord | None]:
        """For each parsed receipt (qid, id, delivery) of ``q``: the record of a lease
        that is plainly live, handed over from the record cache (as
        :meth:`message_record` hands one over), else None.

        Plainly live: a decoded record in the cache (one this process popped),
        in flight, of that delivery, its deadline after ``now_us``, no TTL.
        None says nothing but "not here": the caller reads and checks that one
        the long way (``Queue._leased``), which raises what it should.
        """
        cache = self._records
        prefix, qid, pack = q.message_prefix, q.qid, _U64
        out: list[records.MessageRecord | None] = []
        for lease in leases:
            rec = None
            if lease is not None and lease[0] == qid:
                mkey = prefix + pack(lease[1])
                got = cache.get(mkey)
                if (type(got) is _MR and got.state == _INFLIGHT and got.deliveries == lease[2]
                        and got.when_us > now_us and not got.expires_us):
                    del cache[mkey]
                    rec = got
            out.append(rec)
        return out

    def _cache_record(self, key: bytes, value: bytes | records.MessageRecord | Pushed) -> None:
        cache = self._records
        cache[key] = value
        if len(cache) > RECORD_CACHE:
            self._trim_records()

    def _trim_records(self) -> None:
        # Keep the newer half. (Deleting the oldest key one at a time would
        # cost O(n) each: a dict's iterator skips every slot deleted before.)
        cache = self._records
        newer = list(islice(cache.items(), RECORD_CACHE // 2, None))
        cache.clear()
        cache.update(newer)

    def message_record(self, key: bytes) -> records.MessageRecord | None:
        """The message record at ``key`` (the record cache, else RocksDB), the caller's to change.

        A decoded record in the cache is handed over (removed), never shared:
        the caller changes it in place and commits it, or drops it.
        """
        value = self._records.get(key)
        if value is None:
            raw = self.meta.get(key)
            return None if raw is None else records.MessageRecord.decode(raw)
        if type(value) is tuple:
            return _from_push(value)
        if type(value) is bytes:
            return records.MessageRecord.decode(value)
        del self._records[key]
        return value  # type: ignore[return-value]

    def segment_record(self, fid: int, seg: Sequence[int]) -> bytes:
        """The S record of segment ``fid`` holding ``seg`` (every message of it this
        process committed, once the batch is written): with ``covered``, the next
        id, if single pushes defer it (see _seg_accounts.py)."""
        return records.encode_segment(seg[0], seg[1], seg[2],
                                      self._next_id if fid == self._deferred else None)

    def _defer_into(self, batch: Batch, fid: int, seg: Sequence[int]) -> None:
        """Put into a single push's ``batch`` the S record of its segment ``fid``
        (``seg`` after the push), from which the next pushes defer theirs."""
        self.release_deferred(batch)
        batch.put(keys.segment_key(fid), records.encode_segment(seg[0], seg[1], seg[2],
                                                                self._next_id))

    def release_deferred(self, batch: Batch) -> None:
        """Once pushes append to another segment than the one they defer: put its
        whole record (no ``covered`` id) into ``batch`` and defer no more, so an
        open never scans the messages pushed since. Call before the batch's own
        S records (a later put of a key wins). If the batch then fails, the
        store's reopen (Core.resume) reads the records back as they are."""
        before = self._deferred
        if before is not None and before != self.payload.active_id:
            self._deferred = None
            old = self.segments.get(before)
            if old is not None:  # else its segment was compacted away
                batch.put(keys.segment_key(before), records.encode_segment(*old))

    def _write_hot(self, batch: Batch) -> None:
        """The tail every hot-path batch shares with :meth:`commit`: the synced mark."""
        synced = self.payload.synced_position()
        if synced is not self._synced_mark:
            batch.put(keys.SYNCED_KEY, records.pack([records.RECORD_VERSION, *synced]))
        self.meta.write(batch)
        self._synced_mark = synced
        self.syncer.wrote()

    def records_of(self, q: QueueState, index_keys: list[bytes]) -> list[records.MessageRecord]:
        """The message records the index keys of ``q`` name, in order."""
        if len(index_keys) == 1:  # a multi-get costs several times a get
            key = index_keys[0]  # it ends with the id, as a message key does
            rec = self.message_record(q.message_prefix + key[-8:])
            if rec is None:
                raise missing_record(q, keys.trailing_id(key))
            return [rec]
        # From the record cache where it has them (a decoded one is handed over),
        # the rest from one multi-get.
        prefix = q.message_prefix
        cache = self._records
        decode = records.MessageRecord.decode
        out: list[Any] = []
        missing: list[int] = []  # positions in out still to read
        for key in index_keys:
            mkey = prefix + key[-8:]
            value = cache.get(mkey)
            if value is None:
                missing.append(len(out))
                out.append(mkey)
            elif type(value) is tuple:  # _from_push, inline: a call each cost more
                prio, fid, offset, length, enqueued_at = value
                out.append(_MR(_READY, prio, fid, offset, length, 0, 0, enqueued_at, 0, None))
            elif type(value) is bytes:
                out.append(decode(value))
            else:
                del cache[mkey]
                out.append(value)
        if missing:
            raws = (self.meta.multi_get([out[i] for i in missing]) if len(missing) > 1
                    else [self.meta.get(out[missing[0]])])
            for i, raw in zip(missing, raws, strict=True):
                if raw is None:
                    raise missing_record(q, keys.trailing_id(index_keys[i]))
                out[i] = decode(raw)
        return out


def missing_record(q: QueueState, mid: int) -> StorageError:
    return StorageError(f"index of queue {q.name!r} names message {mid} but its record is "
                        "missing; run `qstore check`")
