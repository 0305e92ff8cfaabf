"""One atomic change to the store, and the in-memory queue state it changes.

A :class:`Txn` is a WriteBatch plus the counter deltas it carries. Counters
(per queue and per payload segment) reach the database only in
:meth:`qstore._core.Core.commit`, in the same batch as the change they
count, so ``stats()`` always equals a recount. This module sits at the bottom
of the core: it knows keys and records, nothing above it.
"""

from __future__ import annotations

import operator

from ._heads import ReadyHeads
from ._rate import TokenBucket
from .meta import Batch, keys, new_batch, records
from .payload import FRAME_SIZE, PayloadRef

# Indexes into a queue's counter list: [ready, delayed, in_flight, dead, bytes].
READY, DELAYED, INFLIGHT, DEAD, BYTES = range(5)
STATE_COUNTER = {records.READY: READY, records.DELAYED: DELAYED,
                 records.INFLIGHT: INFLIGHT, records.DEAD: DEAD}
NO_EVENT_US = 2**64  # "no due time or deadline pending"
_first = operator.itemgetter(0)


def plain_push(rec: records.QueueRecord) -> bool:
    """Whether a push with default arguments takes the hot path (no dedup, TTL or aging)."""
    return not rec.dedup and rec.ttl is None and rec.aging is None


class QueueState:
    """What the store keeps in memory per queue (shared by all its handles).

    Changed only with the writer lock held, and what reflects a batch only
    after that batch was written: by the core (its commit, the hot paths, the
    queue registry) and, in the core's writer sections they run as part of,
    by the time-driven passes (``_timers.py``: resume points, time floor,
    next event and aging times, ``expired``, the heads) and the queue facade
    (``_queue.py``: the heads after a pop or a burial of damaged messages,
    the rate tokens). docs/architecture.md says who changes what.
    """

    __slots__ = ("name", "rec", "qid", "counts", "counts_key", "heads", "next_event_us",
                 "time_floor_us", "deleted", "pkeys", "ready_prefix", "message_prefix",
                 "inflight_prefix", "int_prio", "expired", "bucket", "aging_next_us", "plain",
                 "hot_paths", "cursors", "pass_mark_us", "aging_round", "dead_floor")

    def __init__(self, name: str, rec: records.QueueRecord, counts: list[int]) -> None:
        self.name = name
        self.rec = rec
        self.plain = plain_push(rec)
        # False: batches go through the state machine (_states + Core.commit), as
        # a test does to compare the two; the hot paths write the same bytes.
        self.hot_paths = True
        self.qid = rec.qid
        self.counts = counts
        # Where each priority level's ready messages start (see _heads.py):
        # pops never wade through the tombstones acked messages leave behind.
        self.heads = ReadyHeads(rec.qid)
        self.counts_key = keys.counts_key(rec.qid)
        self.pkeys: dict[int | str, bytes] = {}  # priority -> priority key, a small cache
        self.int_prio = rec.priority_type == "int"
        # Key prefixes of the queue's own keys, for the hot paths (see meta.keys).
        self.ready_prefix = keys.prefix(keys.READY, rec.qid)
        self.message_prefix = keys.prefix(keys.MESSAGE, rec.qid)
        self.inflight_prefix = keys.prefix(keys.INFLIGHT, rec.qid)
        # Earliest lease deadline or due time that may need promotion (us).
        self.next_event_us = 0
        # No delayed or in-flight key of the queue has a time below this (us):
        # their indexes are read from here, past the tombstones of earlier ones.
        self.time_floor_us = 0
        # No dead letter of the queue has an id below this: its index (by id) is
        # read from here, past the tombstones of those redriven or purged before.
        # Lowered by every dead letter made (_states, before the commit: a floor
        # too low only costs a longer read), raised by a redrive after its commit.
        self.dead_floor = 0
        self.deleted = False
        self.expired = 0  # messages expired by their TTL, ever (the E totals key)
        self.bucket: TokenBucket | None = None  # the rate limit's tokens (set by the core)
        # When the next ready message may gain a level by aging (us); NO_EVENT_US: none.
        self.aging_next_us = NO_EVENT_US
        # Where an unfinished pass goes on in each time index (_timers.py), and the
        # aging round in progress (an _aging.Round), so a pass can span lock holds.
        self.cursors: dict[bytes, bytes] = {}
        self.pass_mark_us = 0  # the time of the call that left the cursors
        self.aging_round: object = None  # an _aging.Round (this module sits below it)

    def priority_key(self, priority: int | str) -> bytes:
        pkey = self.pkeys.get(priority)
        if pkey is None:
            if len(self.pkeys) >= 1024:
                self.pkeys.clear()
            rec = self.rec
            pkey = self.pkeys[priority] = keys.priority_key(rec.order, rec.priority_type,
                                                            priority)
        return pkey

    def index_key(self, mid: int, rec: records.MessageRecord) -> bytes:
        """The index key ``rec`` implies (see :func:`qstore.meta.keys.index_key`)."""
        return keys.index_key(rec.state, self.qid, mid, self.priority_key(rec.priority),
                              rec.when_us)


class Txn:
    """Built and committed under the writer lock; never shared between threads.

    ``ordered``: for a batch of many messages. Its keys are held back and go into
    the WriteBatch sorted by key, at :meth:`seal` (or before a range delete), so
    that RocksDB's memtable inserts the new keys of each table one after the
    other rather than searching for each (see qstore/_hot.py). The sort is
    stable: two operations on one key keep their order. Write through the
    methods: ``batch`` itself only takes keys no held operation names (the
    payload journal's), since they go in ahead of the held ones.
    """

    __slots__ = ("batch", "queues", "segments", "ready_keys", "events", "id_hwm", "records",
                 "forget_records", "cache_records", "journal", "_held")

    def __init__(self, ordered: bool = False) -> None:
        self.batch: Batch = new_batch()
        # ordered: (key, value) puts and (key, None) deletes not in the batch yet
        self._held: list[tuple[bytes, bytes | None]] | None = [] if ordered else None
        self.queues: dict[QueueState, list[int]] = {}  # counter deltas per queue
        # file_id -> [live bytes delta, live count delta, highest record end written]
        self.segments: dict[int, list[int]] = {}
        self.ready_keys: dict[QueueState, list[bytes]] | None = None  # ready keys written
        self.events: dict[QueueState, int] | None = None  # earliest due time/deadline (us)
        self.id_hwm: int | None = None
        # Message records written (None: deleted), for the core's record cache.
        self.records: list[tuple[bytes, bytes | None]] = []
        self.forget_records = False  # a range of records was deleted: drop the cache
        # False: update cached records but cache no new ones (compaction's repoints
        # must not push the records of hot messages out of the cache).
        self.cache_records = True
        # The payload journal's keys this batch carries (Core.journal_into).
        self.journal: list[tuple[int, int, bytes]] | None = None

    def put_record(self, key: bytes, value: bytes) -> None:
        """Write a message record (always through here: the core caches records)."""
        self.put(key, value)
        self.records.append((key, value))

    def put_records(self, keys: list[bytes], values: list[bytes]) -> None:
        """:meth:`put_record` of each pair (compaction's repoints): one call for a chunk."""
        if self._held is None:
            put = self.batch.put
            for key, value in zip(keys, values, strict=True):
                put(key, value)
        else:
            self._held.extend(zip(keys, values, strict=True))
        self.records.extend(zip(keys, values, strict=True))

    def delete_record(self, key: bytes) -> None:
        self.delete(key)
        self.records.append((key, None))

    def put(self, key: bytes, value: bytes) -> None:
        if self._held is None:
            self.batch.put(key, value)
        else:
            self._held.append((key, value))

    def delete(self, key: bytes) -> None:
        if self._held is None:
            self.batch.delete(key)
        else:
            self._held.append((key, None))

    def delete_range(self, start: bytes, end: bytes) -> None:
        """Delete every key in ``[start, end)``: after what came before, before what follows."""
        self.seal()
        self.batch.delete_range(start, end)

    def seal(self) -> Batch:
        """The WriteBatch, with every held operation in it (sorted by key)."""
        held = self._held
        if held:
            held.sort(key=_first)
            batch = self.batch
            for key, value in held:
                if value is None:
                    batch.delete(key)
                else:
                    batch.put(key, value)
            held.clear()
        return self.batch

    def count(self, q: QueueState, index: int, n: int) -> None:
        delta = self.queues.get(q)
        if delta is None:
            delta = self.queues[q] = [0, 0, 0, 0, 0]
        delta[index] += n

    def add_ready(self, q: QueueState, key: bytes) -> None:
        self.put(key, b"")
        if self.ready_keys is None:
            self.ready_keys = {q: [key]}
        elif q in self.ready_keys:
            self.ready_keys[q].append(key)
        else:
            self.ready_keys[q] = [key]

    def add_event(self, q: QueueState, when_us: int) -> None:
        if self.events is None:
            self.events = {q: when_us}
        elif when_us < self.events.get(q, when_us + 1):
            self.events[q] = when_us

    def _segment(self, file_id: int) -> list[int]:
        entry = self.segments.get(file_id)
        if entry is None:
            entry = self.segments[file_id] = [0, 0, 0]
        return entry

    def live(self, ref: PayloadRef, sign: int) -> None:
        """Count one record as referenced (+1) or released (-1) in its segment."""
        entry = self._segment(ref.file_id)
        entry[0] += sign * (FRAME_SIZE + ref.length)
        entry[1] += sign

    def segment_delta(self, file_id: int, nbytes: int, count: int) -> None:
        """Many records at once (compaction): live bytes and count change by these."""
        entry = self._segment(file_id)
        entry[0] += nbytes
        entry[1] += count

    def set_end(self, file_id: int, end: int) -> None:
        """Records up to ``end`` of the segment may now be referenced."""
        entry = self._segment(file_id)
        entry[2] = max(entry[2], end)

    def written(self, ref: PayloadRef) -> None:
        """A new record: counts it live and moves the segment's committed end."""
        entry = self._segment(ref.file_id)
        frame = FRAME_SIZE + ref.length
        entry[0] += frame
        entry[1] += 1
        end = ref.offset + frame
        if end > entry[2]:
            entry[2] = end


def apply_counts(old: list[int], delta: list[int]) -> list[int]:
    return [old[0] + delta[0], old[1] + delta[1], old[2] + delta[2], old[3] + delta[3],
            old[4] + delta[4]]
