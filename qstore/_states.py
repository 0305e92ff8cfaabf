"""The message state machine: every transition a message makes, as edits to a Txn.

States (``records.READY`` ... ``records.DEAD``) and the one index key each
implies (:meth:`QueueState.index_key`, built by ``keys.index_key``)::

    push ──> ready ──pop──> in_flight ──ack──> (gone)
      │        ^               │  │
      └─> delayed ─(due)─┘     │  └─ nack/expiry, attempts left ──> ready | delayed
                               └──── nack/expiry, attempts used ──> dead ──redrive──> ready

A message pushed on a dedup queue holds a key in the dedup index (``k qid
digest``) while it is live; it gives the key up when it is acked, dropped or
becomes a dead letter (:func:`release_dedup`).

A message with a TTL also has a key in the expiry index (``e qid expires_us
id``) from its push until it leaves: acked, expired (:func:`expire`: dropped,
or moved to the dead letters with the reason "expired"), or dead (dead letters
do not expire). Aging (:func:`age`) moves a ready message to a better level.

Each function adds the keys, records and counter deltas of one transition to
a :class:`~qstore._txn.Txn`; nothing here writes to the database or changes
in-memory state: :meth:`qstore._core.Core.commit` does both.
"""

from __future__ import annotations

from ._aging import aged_priority, level_due_us, levels_gained
from ._txn import BYTES, STATE_COUNTER, QueueState, Txn
from .meta import keys, records
from .payload import PayloadRef

_READY, _DELAYED, _INFLIGHT, _DEAD = records.READY, records.DELAYED, records.INFLIGHT, records.DEAD


def enqueue(txn: Txn, q: QueueState, mid: int, ref: PayloadRef, prio: int | str, delay: float,
            digest: bytes | None, now: float, expires_us: int = 0) -> None:
    """A new message (payload already written at ``ref``): ready, or delayed by ``delay``.

    ``expires_us`` (0: none) is when its TTL runs out.
    """
    qid = q.qid
    if digest is not None:
        txn.put(keys.dedup_key(qid, digest), keys.U64.pack(mid))
    if delay > 0:
        when = keys.to_us(now + delay)
        state = _DELAYED
        txn.put(keys.timed_key(keys.DELAYED, qid, when, mid), b"")
        txn.add_event(q, when)
    else:
        when = 0
        state = _READY
        txn.add_ready(q, keys.ready_key(qid, q.priority_key(prio), mid))
    txn.count(q, STATE_COUNTER[state], 1)
    if expires_us:
        txn.put(keys.expiry_key(qid, expires_us, mid), b"")
        txn.add_event(q, expires_us)
        record = records.encode_message_v2(state, prio, ref.file_id, ref.offset, ref.length, 0,
                                           0, now, when, digest, expires_us, 0, None)
    else:
        record = records.encode_message(state, prio, ref.file_id, ref.offset, ref.length, 0, 0,
                                        now, when, digest)
    if q.rec.aging is not None:
        txn.add_event(q, keys.to_us(now + q.rec.aging))
    txn.put_record(keys.message_key(qid, mid), record)
    txn.count(q, BYTES, ref.length)
    txn.written(ref)


def deliver(txn: Txn, q: QueueState, ready_key: bytes, mid: int, rec: records.MessageRecord,
            deadline_us: int) -> None:
    """ready -> in_flight until ``deadline_us`` (a pop); ``rec`` is updated in place."""
    rec.state = _INFLIGHT
    rec.attempts += 1
    rec.deliveries += 1
    rec.when_us = deadline_us
    txn.delete(ready_key)
    txn.put(keys.timed_key(keys.INFLIGHT, q.qid, deadline_us, mid), b"")
    txn.put_record(keys.message_key(q.qid, mid), rec.encode())


def leave(txn: Txn, q: QueueState, mid: int, rec: records.MessageRecord) -> None:
    """Take a message out of the index of its current state (before requeue)."""
    txn.delete(q.index_key(mid, rec))
    txn.count(q, STATE_COUNTER[rec.state], -1)


def requeue(txn: Txn, q: QueueState, mid: int, rec: records.MessageRecord, now: float,
            delay: float) -> None:
    """Send a message that left its index (see :func:`leave`) to ready, delayed or dead.

    An in-flight message whose attempts reached ``max_attempts`` goes to the
    dead letters; otherwise it is delayed by ``delay`` or ready at its own place.
    """
    if rec.state == _INFLIGHT and rec.attempts >= q.rec.max_attempts:
        rec.state, rec.when_us = _DEAD, 0
        put_dead_key(txn, q, mid)
        release_dedup(txn, q, rec)
        if rec.expires_us:  # dead letters do not expire
            txn.delete(keys.expiry_key(q.qid, rec.expires_us, mid))
            rec.expires_us = 0
    elif delay > 0:
        rec.state, rec.when_us = _DELAYED, keys.to_us(now + delay)
        txn.put(keys.timed_key(keys.DELAYED, q.qid, rec.when_us, mid), b"")
        txn.add_event(q, rec.when_us)
    else:
        rec.state, rec.when_us = _READY, 0
        txn.add_ready(q, keys.ready_key(q.qid, q.priority_key(rec.priority), mid))
        if q.rec.aging is not None:  # it may be due for a level already
            txn.add_event(q, level_due_us(rec.enqueued_at, q.rec.aging, rec.aged + 1))
    txn.count(q, STATE_COUNTER[rec.state], 1)
    txn.put_record(keys.message_key(q.qid, mid), rec.encode())


def extend(txn: Txn, q: QueueState, mid: int, rec: records.MessageRecord,
           deadline_us: int) -> None:
    """Move an in-flight message's lease deadline; its receipt stays valid."""
    txn.delete(keys.timed_key(keys.INFLIGHT, q.qid, rec.when_us, mid))
    rec.when_us = deadline_us
    txn.put(keys.timed_key(keys.INFLIGHT, q.qid, deadline_us, mid), b"")
    txn.put_record(keys.message_key(q.qid, mid), rec.encode())
    txn.add_event(q, deadline_us)


def remove(txn: Txn, q: QueueState, mid: int, rec: records.MessageRecord) -> None:
    """Delete a message for good (ack, or its payload was lost): record, index, dedup."""
    txn.delete(q.index_key(mid, rec))
    if rec.digest is not None and rec.state != _DEAD:  # a dead letter's digest owns no key
        txn.delete(keys.dedup_key(q.qid, rec.digest))
    if rec.expires_us:
        txn.delete(keys.expiry_key(q.qid, rec.expires_us, mid))
    txn.delete_record(keys.message_key(q.qid, mid))
    txn.count(q, STATE_COUNTER[rec.state], -1)
    txn.count(q, BYTES, -rec.length)
    txn.live(PayloadRef(rec.file_id, rec.offset, rec.length), -1)


def lease_ended_it_first(q: QueueState, rec: records.MessageRecord) -> bool:
    """Whether an in-flight message died of its attempts before its TTL ran out: its
    lease, on its last attempt, ended before the TTL did (a tie goes to the TTL)."""
    return (rec.state == _INFLIGHT and rec.when_us < rec.expires_us
            and rec.attempts >= q.rec.max_attempts)


def expire(txn: Txn, q: QueueState, mid: int, rec: records.MessageRecord) -> bool:
    """Its TTL ran out: drop the message, or make it a dead letter (``on_expire="dead"``).

    Either way it leaves its index and the expiry index, and a receipt of it
    stops working (its record is gone, or no longer in flight). Returns
    False, expiring nothing, for a message whose lease on its last attempt
    ended before its TTL (:func:`lease_ended_it_first`): it became a dead
    letter of its attempts then (its TTL dropped), whenever a pass looks.
    """
    if lease_ended_it_first(q, rec):
        leave(txn, q, mid, rec)
        requeue(txn, q, mid, rec, rec.when_us / 1e6, 0.0)
        return False
    if q.rec.on_expire == "dead" and rec.state != _DEAD:
        leave(txn, q, mid, rec)
        _age_before_expiry(q, rec)
        txn.delete(keys.expiry_key(q.qid, rec.expires_us, mid))
        rec.state, rec.when_us, rec.expires_us = _DEAD, 0, 0
        rec.reason = records.EXPIRED_REASON
        put_dead_key(txn, q, mid)
        release_dedup(txn, q, rec)
        txn.count(q, STATE_COUNTER[_DEAD], 1)
        txn.put_record(keys.message_key(q.qid, mid), rec.encode())
    else:
        remove(txn, q, mid, rec)
    return True


def _age_before_expiry(q: QueueState, rec: records.MessageRecord) -> None:
    """Give a message its TTL makes a dead letter the aging levels it gained while
    ready before the TTL ended, as passes looking all along would have.

    It was ready then if it is ready now, or its delay or lease (not its last
    attempt's: that case never gets here) ended before the TTL (a tie goes to
    the TTL, as in the passes). Without this, a level due before the TTL was
    kept only if a pass happened to look in between: the dead letter's
    priority, and the pop order after a redrive with aging off, depended on
    when a pass last looked (a features model audit)."""
    if q.rec.aging is None or not (rec.state == _READY or rec.when_us < rec.expires_us):
        return
    gained = levels_gained(q.rec, rec.enqueued_at, rec.expires_us - 1)
    if gained > rec.aged:
        rec.priority = aged_priority(q.rec, int(rec.priority), rec.aged, gained)
        rec.aged = gained


def bury(txn: Txn, q: QueueState, mid: int, rec: records.MessageRecord, reason: str) -> None:
    """Its payload is damaged: move the message (ready or delayed) to the dead letters.

    ``reason`` is recorded in the record; the payload bytes stay where they
    are (evidence, never deleted on a guess). Like any dead letter it no
    longer expires.
    """
    leave(txn, q, mid, rec)
    if rec.expires_us:
        txn.delete(keys.expiry_key(q.qid, rec.expires_us, mid))
    rec.state, rec.when_us, rec.expires_us = _DEAD, 0, 0
    rec.reason = reason
    put_dead_key(txn, q, mid)
    release_dedup(txn, q, rec)
    txn.count(q, STATE_COUNTER[_DEAD], 1)
    txn.put_record(keys.message_key(q.qid, mid), rec.encode())


def put_dead_key(txn: Txn, q: QueueState, mid: int) -> None:
    """Put the dead-letter index key of ``mid`` (and lower ``q.dead_floor`` to it)."""
    txn.put(keys.dead_key(q.qid, mid), b"")
    if mid < q.dead_floor:
        q.dead_floor = mid


def release_dedup(txn: Txn, q: QueueState, rec: records.MessageRecord) -> None:
    """A message becoming a dead letter gives up its dedup key (the ``k`` key).

    Dead letters do not dedup (contract section 2): a push with the same key
    makes a new message, which then owns the key. The record keeps the
    digest, owning nothing, so that a redrive (:func:`take_back_dedup`) can
    make the message dedup again: a live message holds a digest exactly when
    it owns that ``k`` key; a dead letter's digest owns none.
    """
    if rec.digest is not None:
        txn.delete(keys.dedup_key(q.qid, rec.digest))


def take_back_dedup(txn: Txn, q: QueueState, mid: int, rec: records.MessageRecord,
                    owned: bool) -> None:
    """A dead letter being redriven takes its dedup key back, unless ``owned``
    (another message holds it by now): then it comes back without a digest,
    as a message pushed without dedup."""
    if rec.digest is None:
        return
    if owned:
        rec.digest = None
    else:
        txn.put(keys.dedup_key(q.qid, rec.digest), keys.U64.pack(mid))


def age(txn: Txn, q: QueueState, ready_key: bytes, mid: int, rec: records.MessageRecord,
        priority: int, aged: int) -> bytes:
    """Re-key a ready message at ``priority`` (``aged`` levels gained in all); the new key."""
    txn.delete(ready_key)
    rec.priority, rec.aged = priority, aged
    new_key = keys.ready_key(q.qid, q.priority_key(priority), mid)
    txn.add_ready(q, new_key)
    txn.put_record(keys.message_key(q.qid, mid), rec.encode())
    return new_key


def remove_all(txn: Txn, q: QueueState, per_segment: dict[int, tuple[int, int]],
               every_key: list[bytes] | None = None) -> None:
    """Delete every message of ``q`` (purge, delete_queue); ``per_segment``: the bytes
    (frames included) and number of their payloads in each segment.

    ``every_key``: all the keys of ``q``'s tables (a small queue's), deleted one
    by one; else (None) each table goes with one range deletion. Range
    tombstones stay in the memtable until it is flushed, and every new
    iterator works through all of them: a store that deletes many short-lived
    queues made each iterator, and so each purge, slower (28 us an iterator
    after 8,000 deleted queues against 0.8 us).
    """
    for fid, (nbytes, count) in per_segment.items():
        txn.segment_delta(fid, -nbytes, -count)
    if every_key is not None:
        for key in every_key:
            txn.delete(key)
    else:
        for kind in keys.PER_QUEUE_KINDS:
            p = keys.prefix(kind, q.qid)
            txn.delete_range(p, keys.prefix_end(p))
    txn.forget_records = True
    for i, c in enumerate(q.counts):
        txn.count(q, i, -c)
