"""Queue operations: push, pop, ack, nack, extend and friends.

Each public operation is one :class:`~qstore._txn.Txn` committed under the
store's writer lock. Pop order is plain key order of the ready index
(``r qid priority-key id``); delayed and in-flight messages sit in indexes
ordered by time and are promoted back to ready lazily (on pop, peek, stats)
and by the store's sweeper thread.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ._errors import (
    InvalidArgument,
    LeaseExpired,
    MessageNotFound,
    QueueNotFound,
)
from ._heads import ReadyHeads
from ._message import Message, QueueStats
from ._txn import BYTES, DEAD, DELAYED, INFLIGHT, READY, STATE_COUNTER, Txn
from .meta import keys, records
from .payload import PayloadRef

if TYPE_CHECKING:
    from ._store import QueueState, Store

Receipted = Message | str
PROMOTE_BATCH = 1000  # promotions per batch, to bound the time the writer lock is held

_ST = records
_INF_US = 2**64


def _payload(body: object) -> bytes:
    if type(body) is bytes:
        return body
    if isinstance(body, (bytearray, memoryview)):
        return bytes(body)
    raise InvalidArgument(f"payload must be bytes, not {type(body).__name__}")


# Longest delay, lease or wait accepted: a century. Beyond it, due times overflow
# their microsecond keys and waits the platform's timeout limit.
MAX_SECONDS = 100 * 366 * 86400


def _seconds(value: object, what: str, *, positive: bool = False) -> float:
    if type(value) is float and (0.0 < value <= MAX_SECONDS or value == 0.0 and not positive):
        return value  # the common case, cheaply
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(f"{what} must be a finite number of seconds, not {value!r}")
    if value < 0 or (positive and value == 0):
        raise InvalidArgument(f"{what} must be {'> 0' if positive else '>= 0'}, not {value!r}")
    if value > MAX_SECONDS:
        raise InvalidArgument(f"{what} must be at most {MAX_SECONDS} seconds, not {value!r}")
    return float(value)


# qid (u32), message id (u64), delivery count, in the lowercase hex make_receipt writes.
_RECEIPT = re.compile(r"([0-9a-f]{1,8})-([0-9a-f]{1,16})-([0-9a-f]{1,16})")


def _receipt_parts(item: object) -> tuple[int, int, int]:
    receipt = item.receipt if isinstance(item, Message) else item
    if not isinstance(receipt, str):
        raise InvalidArgument(f"expected a Message from pop() or its receipt, not {item!r:.60}")
    # Strict: int(x, 16) alone would take "0x1", " 1", "+1" or "1_0", and an id
    # over 64 bits would reach the key encoder and fail there.
    match = _RECEIPT.fullmatch(receipt)
    if match is None:
        raise InvalidArgument(f"malformed receipt {receipt!r:.80}")
    qid, mid, delivery = (int(p, 16) for p in match.groups())
    return qid, mid, delivery


def _iterate(items: object, what: str) -> Iterator[Any]:
    try:
        return iter(items)  # type: ignore[call-overload, no-any-return]
    except TypeError:
        raise InvalidArgument(f"{what} takes an iterable, not {type(items).__name__}") from None


def make_receipt(qid: int, mid: int, deliveries: int) -> str:
    return f"{qid:x}-{mid:x}-{deliveries:x}"


class Queue:
    """A handle on one queue of a store. Get it from ``store.queue(name)``."""

    __slots__ = ("_store", "_q")

    def __init__(self, store: Store, state: QueueState) -> None:
        self._store = store
        self._q = state

    @property
    def name(self) -> str:
        return self._q.name

    @property
    def order(self) -> str:
        return self._q.rec.order

    @property
    def priority_type(self) -> str:
        return self._q.rec.priority_type

    @property
    def max_attempts(self) -> int:
        return self._q.rec.max_attempts

    @property
    def dedup(self) -> bool:
        return self._q.rec.dedup

    def __repr__(self) -> str:
        return f"<qstore.Queue {self.name!r} order={self.order} type={self.priority_type}>"

    def _state(self) -> QueueState:
        q = self._q
        if q.deleted:
            raise QueueNotFound(q.name)
        return q

    # -- validation -----------------------------------------------------------

    def _priority(self, priority: object) -> int | str:
        rec = self._q.rec
        if rec.priority_type == "int":
            if type(priority) is int and keys.INT_MIN <= priority <= keys.INT_MAX:
                return priority  # the common case, cheaply
            if priority is None:
                return 0
            if type(priority) is not int and not (isinstance(priority, int)
                                                  and not isinstance(priority, bool)):
                raise InvalidArgument(f"priority must be an int on queue {self.name!r}, "
                                      f"not {type(priority).__name__}")
            if not keys.INT_MIN <= priority <= keys.INT_MAX:
                raise InvalidArgument(f"priority {priority} is outside signed 64-bit range")
            return int(priority)
        if priority is None:
            return ""
        if not isinstance(priority, str):
            raise InvalidArgument(f"priority must be a str on queue {self.name!r}, "
                                  f"not {type(priority).__name__}")
        try:
            size = len(priority.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidArgument("priority is not encodable as UTF-8") from None
        if size > keys.MAX_STR_PRIORITY_BYTES:
            raise InvalidArgument(f"priority is over {keys.MAX_STR_PRIORITY_BYTES} UTF-8 bytes")
        return priority

    def _digest(self, body: bytes, dedup_key: object) -> bytes | None:
        if dedup_key is None:
            return hashlib.blake2b(body, digest_size=16).digest() if self._q.rec.dedup else None
        if isinstance(dedup_key, str):
            dedup_key = dedup_key.encode("utf-8")
        if not isinstance(dedup_key, bytes):
            raise InvalidArgument(f"dedup_key must be str or bytes, not {type(dedup_key).__name__}")
        if not self._q.rec.dedup:
            raise InvalidArgument(f"queue {self.name!r} was not created with dedup=True")
        return hashlib.blake2b(b"k" + dedup_key, digest_size=16).digest()

    # -- push -----------------------------------------------------------------

    def push(self, payload: bytes, priority: int | str | None = None, delay: float = 0.0,
             dedup_key: str | bytes | None = None) -> int:
        """Enqueue one message; returns its id (the existing id for a dedup hit)."""
        if (dedup_key is not None or self._q.rec.dedup or type(payload) is not bytes
                or delay != 0 or type(delay) not in (int, float)):
            return self._push([(payload, priority, delay, dedup_key)])[0]
        # The common case, without the batch machinery: same checks, same keys.
        prio = self._priority(priority)
        store = self._store
        store.payload.check_size(payload)
        with store.writing():
            q = self._state()
            ref = store.payload.append_one(payload)
            txn = Txn()
            mid = _enqueue(store, txn, q, ref, prio, 0.0, None, store.clock())
            store._commit(txn)
        return mid

    def push_many(self, items: Iterable[bytes | Sequence[Any]], *, delay: float = 0.0) -> list[int]:
        """Enqueue many messages in one atomic batch; returns their ids in order.

        Each item is a payload, or a ``(payload, priority)`` or
        ``(payload, priority, delay)`` or ``(payload, priority, delay, dedup_key)`` tuple.
        """
        defaults = (None, None, delay, None)
        rows = []
        for item in _iterate(items, "push_many"):
            if isinstance(item, (bytes, bytearray, memoryview)):
                rows.append((item, None, delay, None))
            elif isinstance(item, (tuple, list)) and 1 <= len(item) <= 4:
                rows.append(tuple(item) + defaults[len(item):])
            else:
                raise InvalidArgument(f"push_many item must be bytes or a tuple, not {item!r:.60}")
        return self._push(rows) if rows else []

    def _push(self, rows: list[tuple[Any, Any, Any, Any]]) -> list[int]:
        store = self._store
        bodies = []
        prepared = []
        for body, priority, delay, dedup_key in rows:
            body = _payload(body)
            store.payload.check_size(body)
            prio = self._priority(priority)
            d = _seconds(delay, "delay")
            bodies.append(body)
            prepared.append((prio, d, self._digest(body, dedup_key)))
        ids = [0] * len(rows)
        with store.writing():
            q = self._state()
            qid = q.qid
            txn = Txn()
            fresh: list[int] = []  # rows really enqueued
            first_of: dict[bytes, int] = {}  # dedup digest -> first row in this batch
            dup_of: dict[int, int] = {}  # row -> earlier row with the same digest
            for i, (_, _, digest) in enumerate(prepared):
                if digest is not None:
                    if digest in first_of:
                        dup_of[i] = first_of[digest]
                        continue
                    raw = store.meta.get(keys.dedup_key(qid, digest))
                    if raw is not None:
                        ids[i] = keys.U64.unpack(raw)[0]
                        continue
                    first_of[digest] = i
                fresh.append(i)
            if fresh:
                refs = store.payload.append_many([bodies[i] for i in fresh])
                now = store.clock()
                for i, ref in zip(fresh, refs, strict=True):
                    prio, delay, digest = prepared[i]
                    ids[i] = _enqueue(store, txn, q, ref, prio, delay, digest, now)
                txn.commit(store)
            for i, j in dup_of.items():
                ids[i] = ids[j]
        return ids

    # -- pop ------------------------------------------------------------------

    def pop(self, lease: float = 30.0, wait: float = 0.0) -> Message | None:
        """Lease the head of the queue for ``lease`` seconds; None if nothing is ready.

        With ``wait`` > 0, block up to that many seconds for a message; a push
        in this process wakes the waiter at once.
        """
        got = self.pop_many(1, lease=lease, wait=wait)
        return got[0] if got else None

    def pop_many(self, n: int, lease: float = 30.0, wait: float = 0.0) -> list[Message]:
        """Lease up to ``n`` messages from the head of the queue, in pop order."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"n must be an int >= 1, not {n!r}")
        lease = _seconds(lease, "lease", positive=True)
        wait = _seconds(wait, "wait")
        store = self._store
        with store.writing():
            got = self._pop_locked(n, lease)
            if got or not wait:
                return got
            deadline = time.monotonic() + wait
            while True:
                remaining = deadline - time.monotonic()
                if got or remaining <= 0 or store._closed:
                    return got
                q = self._q
                until_event = (q.next_event_us / 1e6) - store.clock()
                store._ready.wait(max(0.001, min(remaining, until_event)))
                if store._closed:  # close() woke us; the database may be gone already
                    return []
                got = self._pop_locked(n, lease)

    def _pop_locked(self, n: int, lease: float) -> list[Message]:
        store = self._store
        q = self._state()
        now = store.clock()
        now_us = keys.to_us(now)
        if q.next_event_us <= now_us:
            promote(store, q, now_us)
        qid = q.qid
        plan = q.heads.plan(store.meta, n)
        ready_keys = plan.keys
        if not ready_keys:
            return []
        mids = [keys.trailing_id(k) for k in ready_keys]
        raws = (store.meta.multi_get([keys.message_key(qid, mid) for mid in mids])
                if len(mids) > 1 else [store.meta.get(keys.message_key(qid, mids[0]))])
        deadline = now + lease
        when = keys.to_us(deadline)
        txn = Txn()
        out = []
        name = q.name
        read = store.payload.read
        for rkey, mid, raw in zip(ready_keys, mids, raws, strict=True):
            if raw is None:
                raise _missing_record(q, mid)
            rec = records.MessageRecord.decode(raw)
            payload = read(PayloadRef(rec.file_id, rec.offset, rec.length))
            rec.state = _ST.INFLIGHT
            rec.attempts += 1
            rec.deliveries += 1
            rec.when_us = when
            txn.delete(rkey)
            txn.put(keys.timed_key(keys.INFLIGHT, qid, when, mid), b"")
            txn.put(keys.message_key(qid, mid), rec.encode())
            out.append(Message(mid, name, rec.priority, payload, rec.attempts, rec.enqueued_at,
                               deadline, make_receipt(qid, mid, rec.deliveries)))
        txn.count(q, READY, -len(out))
        txn.count(q, INFLIGHT, len(out))
        txn.add_event(q, when)
        txn.commit(store)
        q.heads.taken(plan)
        return out

    # -- ack / nack / extend --------------------------------------------------

    def _leased(
        self, item: Receipted, now_us: int
    ) -> tuple[QueueState, int, records.MessageRecord]:
        """The in-flight record ``item`` holds a live lease on (writer lock held)."""
        q = self._state()
        qid, mid, delivery = _receipt_parts(item)
        if qid != q.qid:
            raise InvalidArgument(f"receipt belongs to another queue, not {q.name!r}")
        raw = self._store.meta.get(keys.message_key(qid, mid))
        if raw is None:
            raise MessageNotFound(q.name, mid)
        rec = records.MessageRecord.decode(raw)
        if rec.state != _ST.INFLIGHT or rec.deliveries != delivery or rec.when_us <= now_us:
            raise LeaseExpired(f"the lease of message {mid} in {q.name!r} expired or was "
                               "superseded by a later delivery; nothing was changed")
        return q, mid, rec

    def ack(self, item: Receipted) -> None:
        """Delete a leased message for good."""
        self._ack((item,))

    def ack_many(self, items: Iterable[Receipted]) -> int:
        """Ack every item in one batch; if any lease is not live, nothing is acked."""
        return self._ack(list(_iterate(items, "ack_many")))

    def _ack(self, items: Sequence[Receipted]) -> int:
        store = self._store
        with store.writing():
            now_us = keys.to_us(store.clock())
            txn = Txn()
            seen = set()
            for item in items:
                q, mid, rec = self._leased(item, now_us)
                if mid in seen:
                    raise InvalidArgument(f"message {mid} appears twice in one ack_many")
                seen.add(mid)
                txn.delete(keys.message_key(q.qid, mid))
                txn.delete(keys.timed_key(keys.INFLIGHT, q.qid, rec.when_us, mid))
                if rec.digest is not None:
                    txn.delete(keys.dedup_key(q.qid, rec.digest))
                txn.live(PayloadRef(rec.file_id, rec.offset, rec.length), -1)
                txn.count(q, INFLIGHT, -1)
                txn.count(q, BYTES, -rec.length)
            if items:
                txn.commit(store)
        return len(items)

    def nack(self, item: Receipted, delay: float = 0.0) -> None:
        """Give a leased message back: ready again at its own place, or after ``delay``.

        A message that has used up ``max_attempts`` goes to the dead letters.
        """
        delay = _seconds(delay, "delay")
        store = self._store
        with store.writing():
            now = store.clock()
            q, mid, rec = self._leased(item, keys.to_us(now))
            txn = Txn()
            txn.delete(keys.timed_key(keys.INFLIGHT, q.qid, rec.when_us, mid))
            txn.count(q, INFLIGHT, -1)
            _requeue(txn, q, mid, rec, now, delay)
            txn.commit(store)

    def extend(self, item: Receipted, lease: float = 30.0) -> Message:
        """Move a live lease's deadline to now + ``lease``; the receipt stays valid."""
        lease = _seconds(lease, "lease", positive=True)
        store = self._store
        with store.writing():
            now = store.clock()
            q, mid, rec = self._leased(item, keys.to_us(now))
            txn = Txn()
            txn.delete(keys.timed_key(keys.INFLIGHT, q.qid, rec.when_us, mid))
            rec.when_us = keys.to_us(now + lease)
            txn.put(keys.timed_key(keys.INFLIGHT, q.qid, rec.when_us, mid), b"")
            txn.put(keys.message_key(q.qid, mid), rec.encode())
            txn.add_event(q, rec.when_us)
            txn.commit(store)
            payload = store.payload.read(PayloadRef(rec.file_id, rec.offset, rec.length))
            return Message(mid, q.name, rec.priority, payload, rec.attempts, rec.enqueued_at,
                           now + lease, make_receipt(q.qid, mid, rec.deliveries))

    # -- inspection -----------------------------------------------------------

    def _maybe_promote(self) -> QueueState:
        store = self._store
        store._check_open()  # reads of a closed store must not reach rocksdict
        q = self._state()
        if not store.readonly:
            now_us = keys.to_us(store.clock())
            if q.next_event_us <= now_us:
                promote(store, q, now_us)
        return q

    def _messages(self, q: QueueState, index_keys: list[bytes]) -> list[Message]:
        store = self._store
        mids = [keys.trailing_id(k) for k in index_keys]
        raws = store.meta.multi_get([keys.message_key(q.qid, m) for m in mids])
        out = []
        for mid, raw in zip(mids, raws, strict=True):
            if raw is None:
                raise _missing_record(q, mid)
            out.append(self._message(q, mid, records.MessageRecord.decode(raw)))
        return out

    def _message(self, q: QueueState, mid: int, rec: records.MessageRecord) -> Message:
        payload = self._store.payload.read(PayloadRef(rec.file_id, rec.offset, rec.length))
        deadline = rec.when_us / 1e6 if rec.state == _ST.INFLIGHT else None
        return Message(mid, q.name, rec.priority, payload, rec.attempts, rec.enqueued_at,
                       deadline, None, _ST.STATE_NAMES[rec.state])

    def peek(self, n: int = 1) -> list[Message]:
        """The first ``n`` ready messages in pop order, without leasing them."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"n must be an int >= 1, not {n!r}")
        with self._store._lock:
            q = self._maybe_promote()
            return self._messages(q, q.heads.plan(self._store.meta, n).keys)

    def get(self, message_id: int) -> Message:
        """One message by id, in any state (MessageNotFound once acked or purged)."""
        if (isinstance(message_id, bool) or not isinstance(message_id, int)
                or not 0 <= message_id < 2**64):
            raise InvalidArgument(f"message id must be an int in [0, 2**64), not {message_id!r}")
        with self._store._lock:
            q = self._maybe_promote()
            raw = self._store.meta.get(keys.message_key(q.qid, message_id))
            if raw is None:
                raise MessageNotFound(q.name, message_id)
            return self._message(q, message_id, records.MessageRecord.decode(raw))

    def dead_letters(self, n: int = 10) -> list[Message]:
        """Up to ``n`` dead letters, oldest id first."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"n must be an int >= 1, not {n!r}")
        with self._store._lock:
            q = self._maybe_promote()
            lo = keys.prefix(keys.DEAD, q.qid)
            return self._messages(q, self._store.meta.scan_keys(lo, keys.prefix_end(lo), n))

    def redrive(self, n: int = 100) -> int:
        """Move up to ``n`` dead letters back to ready with attempts reset to 0."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"n must be an int >= 1, not {n!r}")
        store = self._store
        with store.writing():
            q = self._state()
            now = store.clock()
            now_us = keys.to_us(now)
            if q.next_event_us <= now_us:
                # A lease that ran out on its last attempt is dead already.
                promote(store, q, now_us)
            lo = keys.prefix(keys.DEAD, q.qid)
            dead = store.meta.scan_keys(lo, keys.prefix_end(lo), n)
            if not dead:
                return 0
            mids = [keys.trailing_id(k) for k in dead]
            raws = store.meta.multi_get([keys.message_key(q.qid, m) for m in mids])
            txn = Txn()
            for dkey, mid, raw in zip(dead, mids, raws, strict=True):
                if raw is None:
                    raise _missing_record(q, mid)
                rec = records.MessageRecord.decode(raw)
                rec.attempts = 0
                txn.delete(dkey)
                txn.count(q, DEAD, -1)
                _requeue(txn, q, mid, rec, now, 0.0)
            txn.commit(store)
            return len(dead)

    def purge(self) -> int:
        """Delete every message of the queue (all states) in one batch; returns how many."""
        store = self._store
        with store.writing():
            q = self._state()
            txn = Txn()
            n = store.release_all(q, txn)
            txn.commit(store)
            q.heads = ReadyHeads(q.qid)
            q.next_event_us = _INF_US
            return n

    def stats(self) -> QueueStats:
        """Counts by state; expired leases and due delays are promoted first."""
        with self._store._lock:
            q = self._maybe_promote()
            c = q.counts
            return QueueStats(q.name, c[READY], c[DELAYED], c[INFLIGHT], c[DEAD], c[BYTES])

    def __len__(self) -> int:
        return self.stats().total


def _enqueue(store: Store, txn: Txn, q: QueueState, ref: PayloadRef, prio: int | str,
             delay: float, digest: bytes | None, now: float) -> int:
    """Add one new message (payload already written at ``ref``) to ``txn``; returns its id."""
    mid = store.alloc_id(txn)
    qid = q.qid
    if digest is not None:
        txn.put(keys.dedup_key(qid, digest), keys.U64.pack(mid))
    if delay > 0:
        when = keys.to_us(now + delay)
        state = _ST.DELAYED
        txn.put(keys.timed_key(keys.DELAYED, qid, when, mid), b"")
        txn.add_event(q, when)
        txn.count(q, DELAYED, 1)
    else:
        when = 0
        state = _ST.READY
        pkey = q.pkeys.get(prio)
        if pkey is None:
            if len(q.pkeys) >= 1024:
                q.pkeys.clear()
            pkey = q.pkeys[prio] = keys.priority_key(q.rec.order, q.rec.priority_type, prio)
        txn.add_ready(q, keys.ready_key(qid, pkey, mid))
        txn.count(q, READY, 1)
    txn.put(keys.message_key(qid, mid), records.encode_message(
        state, prio, ref.file_id, ref.offset, ref.length, 0, 0, now, when, digest))
    txn.count(q, BYTES, ref.length)
    txn.written(ref)
    return mid


def _requeue(txn: Txn, q: QueueState, mid: int, rec: records.MessageRecord, now: float,
             delay: float) -> None:
    """Send a message that left the in-flight or dead set to ready, delayed or dead."""
    if rec.state == _ST.INFLIGHT and rec.attempts >= q.rec.max_attempts:
        rec.state, rec.when_us = _ST.DEAD, 0
        txn.put(keys.dead_key(q.qid, mid), b"")
    elif delay > 0:
        rec.state, rec.when_us = _ST.DELAYED, keys.to_us(now + delay)
        txn.put(keys.timed_key(keys.DELAYED, q.qid, rec.when_us, mid), b"")
        txn.add_event(q, rec.when_us)
    else:
        rec.state, rec.when_us = _ST.READY, 0
        pkey = keys.priority_key(q.rec.order, q.rec.priority_type, rec.priority)
        txn.add_ready(q, keys.ready_key(q.qid, pkey, mid))
    txn.count(q, STATE_COUNTER[rec.state], 1)
    txn.put(keys.message_key(q.qid, mid), rec.encode())


def promote(store: Store, q: QueueState, now_us: int) -> int:
    """Move due delayed messages and expired leases of ``q`` (writer lock held).

    The scan and the batch happen under the writer lock, so nothing can ack or
    extend a message between the look and the action.
    """
    moved = 0
    for kind in (keys.INFLIGHT, keys.DELAYED):
        base = keys.prefix(kind, q.qid)
        # Start at the time floor, not at the prefix: everything before it was
        # promoted, acked or extended away, and its tombstones are not read again.
        lo = base + keys.U64.pack(q.time_floor_us)
        hi = base + keys.U64.pack(now_us + 1)
        while True:
            due = store.meta.scan_keys(lo, hi, PROMOTE_BATCH)
            if not due:
                break
            mids = [keys.trailing_id(k) for k in due]
            raws = store.meta.multi_get([keys.message_key(q.qid, m) for m in mids])
            txn = Txn()
            for key, mid, raw in zip(due, mids, raws, strict=True):
                if raw is None:
                    raise _missing_record(q, mid)
                rec = records.MessageRecord.decode(raw)
                txn.delete(key)
                txn.count(q, STATE_COUNTER[rec.state], -1)
                _requeue(txn, q, mid, rec, now_us / 1e6, 0.0)
            txn.commit(store)
            moved += len(due)
            if len(due) < PROMOTE_BATCH:
                break
            lo = due[-1] + b"\x00"
    # Nothing due at or before now is left in either index; a later write of an
    # earlier time (a clock that went back) lowers the floor in Store._commit.
    q.time_floor_us = max(q.time_floor_us, now_us + 1)
    store._refresh_next_event(q)
    return moved


def _missing_record(q: QueueState, mid: int) -> Exception:
    from ._errors import StorageError

    return StorageError(f"index of queue {q.name!r} names message {mid} but its record is "
                        "missing; run `qstore audit`")
