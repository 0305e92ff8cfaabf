"""The queue facade: push, pop, ack, nack, extend and friends.

This module validates arguments and turns each public operation into one
metadata batch under the writer lock: plain push, pop and ack (single and
batch) through the core's hot paths (``_hot.py``, which build the batch
directly), every other operation as one :class:`~qstore._txn.Txn` built from
the transitions of :mod:`qstore._states` and committed by the core
(:meth:`qstore._core.Core.commit`). Pop order is plain key order of the
ready index (``r qid priority-key id``); delayed and in-flight messages sit
in indexes ordered by time and are promoted back to ready lazily (on pop,
peek, stats) and by the store's sweeper thread.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from . import _states as states
from . import _timers as timers
from ._batch import no_receipt, refuse_single_item
from ._core import Core
from ._errors import (
    Corruption,
    InvalidArgument,
    LeaseExpired,
    MessageNotFound,
    QueueNotFound,
)
from ._message import Message, QueueStats, make_receipt
from ._txn import BYTES, DEAD, DELAYED, INFLIGHT, READY, QueueState, Txn
from .meta import keys, records

Receipted = Message | str
log = logging.getLogger("qstore")

_ST = records
INT_MIN, INT_MAX = keys.INT_MIN, keys.INT_MAX


def _payload(body: object) -> bytes:
    if type(body) is bytes:
        return body
    if isinstance(body, (bytes, bytearray, memoryview)):  # a subclass (np.bytes_), a view
        return bytes(body)
    raise InvalidArgument(f"payload must be bytes, not {type(body).__name__}")


# Longest delay, lease or wait accepted: a century. Beyond it, due times overflow
# their microsecond keys and waits the platform's timeout limit.
MAX_SECONDS = 100 * 366 * 86400


def _seconds(value: object, what: str, *, positive: bool = False) -> float:
    if type(value) is float and (0.0 < value <= MAX_SECONDS or value == 0.0 and not positive):
        return value  # the common case, cheaply
    # An int is compared as it is: math.isfinite(10**400) would raise OverflowError.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise InvalidArgument(f"{what} must be a finite number of seconds, not {value!r:.60}")
    if value < 0 or (positive and value == 0):
        raise InvalidArgument(f"{what} must be {'> 0' if positive else '>= 0'}, not {value!r:.60}")
    if value > MAX_SECONDS:
        raise InvalidArgument(f"{what} must be at most {MAX_SECONDS} seconds, not {value!r:.60}")
    return float(value)


# qid (u32), message id (u64), delivery count, in the lowercase hex make_receipt writes.
_RECEIPT = re.compile(r"([0-9a-f]{1,8})-([0-9a-f]{1,16})-([0-9a-f]{1,16})")


def _receipt_parts(item: object) -> tuple[int, int, int]:
    if type(item) is Message:
        lease = item._lease  # set by pop: the receipt it made, already parsed
        if lease is not None:
            return lease
    receipt = item.receipt if isinstance(item, Message) else item
    if not isinstance(receipt, str):
        if isinstance(item, Message):  # from peek, get or dead_letters: not leased to you
            raise no_receipt(item.id)
        raise InvalidArgument(f"expected a Message from pop() or its receipt, not {item!r:.60}")
    # Strict: int(x, 16) alone would take "0x1", " 1", "+1" or "1_0", and an id
    # over 64 bits would reach the key encoder and fail there.
    match = _RECEIPT.fullmatch(receipt)
    if match is None:
        raise InvalidArgument(f"malformed receipt {receipt!r:.80}")
    qid, mid, delivery = match.groups()
    return int(qid, 16), int(mid, 16), int(delivery, 16)


def _refuse_receiptless(item: object) -> None:
    """A Message from peek, get or dead_letters is refused before anything else is
    looked at, as the clients refuse it before sending."""
    if isinstance(item, Message) and item._lease is None and item.receipt is None:
        raise no_receipt(item.id)


class _Buried:
    """The damaged messages one pop or peek moved to the dead letters, logged once
    per segment and reason when the call ends (:meth:`report`).

    One line a message made a lost segment file of the default size about
    250,000 identical lines; each message is still logged at DEBUG, and its
    dead-letter record keeps its own reason.
    """

    def __init__(self, queue: str) -> None:
        self._queue = queue
        # (file id, reason) -> [count, lowest id, highest id, the lowest id's error]
        self._runs: dict[tuple[int, str], list[Any]] = {}

    def add(self, mid: int, file_id: int, reason: str, exc: Corruption) -> None:
        log.debug("queue %r: message %d moved to the dead letters: %s (%s)",
                  self._queue, mid, reason, exc)
        run = self._runs.get((file_id, reason))
        if run is None:
            self._runs[(file_id, reason)] = [1, mid, mid, exc]
            return
        run[0] += 1
        if mid < run[1]:
            run[1], run[3] = mid, exc
        run[2] = max(run[2], mid)

    def report(self) -> None:
        for (fid, reason), (count, low, high, exc) in sorted(self._runs.items()):
            if count == 1:
                log.error("queue %r: message %d moved to the dead letters: %s (%s)",
                          self._queue, low, reason, exc)
            else:
                log.error("queue %r: %d messages of segment %d moved to the dead letters: "
                          "%s (ids %d to %d; the first: %s)", self._queue, count, fid,
                          reason, low, high, exc)
        self._runs.clear()


def _iterate(items: object, what: str) -> Iterator[Any]:
    refuse_single_item(items, what)
    try:
        return iter(items)  # type: ignore[call-overload, no-any-return]
    except TypeError:
        raise InvalidArgument(f"{what} takes an iterable, not {type(items).__name__}") from None


def _popped(qid: int, mid: int, name: str, rec: records.MessageRecord, payload: bytes,
            deadline: float) -> Message:
    """The Message a pop returns, its receipt kept parsed (for ack) and written when read."""
    fields: tuple[Any, ...] = (mid, name, rec.priority, payload, rec.attempts,
                               rec.enqueued_at, deadline, None, "in_flight")
    if rec.expires_us:  # a worker can see how long it has (None meant "no TTL" to it)
        fields += (rec.expires_us / 1e6, None)
    return Message._leased(fields, (qid, mid, rec.deliveries))


def _popped_many(qid: int, mids: Sequence[int], name: str,
                 recs: Sequence[records.MessageRecord], payloads: Sequence[bytes],
                 deadline: float) -> list[Message]:
    """:func:`_popped` of each message of a batch pop, in one loop (a call per
    message cost about 3% of a batch pop+ack)."""
    leased = Message._leased
    out = []
    for mid, rec, payload in zip(mids, recs, payloads, strict=True):
        fields: tuple[Any, ...] = (mid, name, rec.priority, payload, rec.attempts,
                                   rec.enqueued_at, deadline, None, "in_flight")
        if rec.expires_us:  # as in _popped
            fields += (rec.expires_us / 1e6, None)
        out.append(leased(fields, (qid, mid, rec.deliveries)))
    return out


class Queue:
    """A handle on one queue of a store. Get it from ``store.queue(name)``."""

    __slots__ = ("_core", "_q")

    def __init__(self, core: Core, state: QueueState) -> None:
        self._core = core
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
            return keys.payload_digest(body) if self._q.rec.dedup else None
        if isinstance(dedup_key, str):
            try:
                dedup_key = dedup_key.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate
                raise InvalidArgument("dedup_key is not encodable as UTF-8") from None
        if isinstance(dedup_key, (bytearray, memoryview)):  # as a client sends them
            dedup_key = bytes(dedup_key)
        if not isinstance(dedup_key, bytes):
            raise InvalidArgument(f"dedup_key must be str or bytes, not {type(dedup_key).__name__}")
        if not self._q.rec.dedup:
            raise InvalidArgument(f"queue {self.name!r} was not created with dedup=True")
        return keys.explicit_digest(dedup_key)

    # -- push -----------------------------------------------------------------

    def push(self, payload: bytes | bytearray | memoryview,
             priority: int | str | None = None, delay: float = 0.0,
             dedup_key: str | bytes | None = None, ttl: float | None = None) -> int:
        """Enqueue one message; returns its id (the existing id for a dedup hit).

        ``ttl``: seconds after which the message expires if not acked (default:
        the queue's ``ttl``, if any).
        """
        q = self._q
        if q.deleted:  # first, as through a server (which looks the queue up first)
            raise QueueNotFound(q.name)
        if (dedup_key is not None or not q.plain or type(payload) is not bytes
                or delay != 0 or type(delay) not in (int, float) or ttl is not None):
            return self._push([(payload, priority, delay, dedup_key, ttl)])[0]
        # The common case, without the batch machinery: same checks, same keys.
        if not (type(priority) is int and q.int_prio and INT_MIN <= priority <= INT_MAX):
            priority = self._priority(priority)
        core = self._core
        if len(payload) > core.max_payload_bytes:
            core.payload.check_size(payload)  # raises PayloadTooLarge
        with core.writing:
            if q.deleted:
                raise QueueNotFound(q.name)
            return core.push_one(q, payload, priority)

    def push_many(self, items: Iterable[bytes | Sequence[Any]], *, delay: float = 0.0,
                  ttl: float | None = None) -> list[int]:
        """Enqueue many messages in one atomic batch; returns their ids in order.

        Each item is a payload, or a ``(payload, priority)`` or
        ``(payload, priority, delay)`` or ``(payload, priority, delay, dedup_key)``
        or ``(payload, priority, delay, dedup_key, ttl)`` tuple; ``delay`` and
        ``ttl`` are the defaults of items that do not give theirs.
        """
        q = self._q
        listed = _iterate(items, "push_many")
        if q.deleted:  # after what a client checks before sending, as through a server
            raise QueueNotFound(q.name)
        # The batch defaults are checked even when every item gives its own.
        delay = _seconds(delay, "delay")
        if ttl is not None:
            ttl = _seconds(ttl, "ttl", positive=True)
        # The usual batch (bodies, or (body, priority) pairs, no delay, TTL or
        # dedup) is collected as two lists for the core's hot path; the first
        # item that needs more turns the batch into rows for the general path.
        plain = q.plain and q.hot_paths and ttl is None and delay == 0
        bodies: list[bytes] = []
        prios: list[int | str] = []
        default = 0 if q.int_prio else ""
        defaults = (None, None, delay, None, ttl)
        rows: list[tuple[Any, ...]] = []
        for item in listed:
            if plain:
                kind = type(item)
                if kind is bytes:
                    bodies.append(item)
                    prios.append(default)
                    continue
                if (kind is tuple or kind is list) and len(item) == 2 \
                        and type(item[0]) is bytes:
                    body, priority = item
                    bodies.append(body)
                    prios.append(priority if type(priority) is int and q.int_prio
                                 and INT_MIN <= priority <= INT_MAX
                                 else self._priority(priority))
                    continue
                plain = False
                rows = [(b, p, delay, None, ttl) for b, p in zip(bodies, prios, strict=True)]
            if isinstance(item, (bytes, bytearray, memoryview)):
                rows.append((item, None, delay, None, ttl))
            elif isinstance(item, (tuple, list)) and 1 <= len(item) <= 5:
                rows.append(tuple(item) + defaults[len(item):])
            elif isinstance(item, (tuple, list)):
                raise InvalidArgument(
                    f"push_many item has {len(item)} fields, not 1 to 5 (payload, priority, "
                    f"delay, dedup_key, ttl): {item!r:.60}")
            else:
                raise InvalidArgument(f"push_many item must be bytes or a tuple, not {item!r:.60}")
        if plain:
            if not bodies:
                return []
            core = self._core
            limit = core.max_payload_bytes
            for body in bodies:
                if len(body) > limit:
                    core.payload.check_size(body)  # raises PayloadTooLarge
            with core.writing:
                if q.deleted:
                    raise QueueNotFound(q.name)
                return core.push_ready(q, bodies, prios)
        if not rows:  # nothing to push
            return []
        return self._push(rows)

    def _push(self, rows: list[tuple[Any, ...]]) -> list[int]:
        core = self._core
        bodies = []
        prepared = []
        for body, priority, delay, dedup_key, ttl in rows:
            body = _payload(body)
            core.payload.check_size(body)
            prio = self._priority(priority)
            d = _seconds(delay, "delay")
            t = None if ttl is None else _seconds(ttl, "ttl", positive=True)
            bodies.append(body)
            prepared.append((prio, d, self._digest(body, dedup_key), t))
        ids = [0] * len(rows)
        if self._q.rec.dedup:
            timers.catch_up(core, self._q)
        with core.writing:
            q = self._state()
            qid = q.qid
            if q.rec.dedup:
                # A message whose TTL ran out is gone even before a pass removed it:
                # finish the pass (catch_up above did the bulk), so that its dedup
                # key matches no push.
                now_us = keys.to_us(core.clock())
                if q.next_event_us <= now_us:
                    timers.promote_all(core, q, now_us)
            fresh: list[int] = []  # rows really enqueued
            first_of: dict[bytes, int] = {}  # dedup digest -> first row in this batch
            dup_of: dict[int, int] = {}  # row -> earlier row with the same digest
            for i, (_, _, digest, _) in enumerate(prepared):
                if digest is not None:
                    if digest in first_of:
                        dup_of[i] = first_of[digest]
                        continue
                    raw = core.meta.get(keys.dedup_key(qid, digest))
                    if raw is not None:
                        ids[i] = keys.U64.unpack(raw)[0]
                        continue
                    first_of[digest] = i
                fresh.append(i)
            if fresh:
                now = core.clock()  # before the append: a bad time leaves nothing behind
                with core.appending_batch() as started:
                    refs = core.payload.append_many([bodies[i] for i in fresh], started)
                    txn = Txn(ordered=len(fresh) > 1)
                    default_ttl = q.rec.ttl
                    for i, ref in zip(fresh, refs, strict=True):
                        prio, delay, digest, ttl = prepared[i]
                        ids[i] = mid = core.alloc_id(txn)
                        if ttl is None:
                            ttl = default_ttl
                        expires_us = 0 if ttl is None else keys.to_us(now + ttl)
                        states.enqueue(txn, q, mid, ref, prio, delay, digest, now, expires_us)
                    if core.always:
                        txn.journal = core.journal_into(txn.batch, refs,
                                                        [bodies[i] for i in fresh])
                    if txn.journal is None and len(fresh) > 1:
                        txn.journal = core.pending_batch(txn.put, qid, ids[fresh[0]],
                                                         len(fresh), refs[-1])
                    core.commit(txn)
            for i, j in dup_of.items():
                ids[i] = ids[j]
        return ids

    # -- pop ------------------------------------------------------------------

    def pop(self, lease: float = 30.0, wait: float = 0.0) -> Message | None:
        """Lease the head of the queue for ``lease`` seconds; None if nothing is ready.

        With ``wait`` > 0, block up to that many seconds for a message; a push
        in this process wakes the waiter at once.
        """
        if self._q.deleted:  # first, as through a server (which looks the queue up first)
            raise QueueNotFound(self.name)
        if (type(wait) is float or type(wait) is int) and wait == 0 and type(lease) is float \
                and 0.0 < lease <= MAX_SECONDS:
            core = self._core  # the common case, without pop_many's argument checks
            with core.writing:
                got = self._pop_locked(1, lease)
        else:
            got = self.pop_many(1, lease=lease, wait=wait)
        return got[0] if got else None

    def pop_many(self, n: int, lease: float = 30.0, wait: float = 0.0) -> list[Message]:
        """Lease up to ``n`` messages from the head of the queue, in pop order."""
        self._state()  # first, as through a server (which looks the queue up first)
        _check_count(n)
        lease = _seconds(lease, "lease", positive=True)
        wait = _seconds(wait, "wait")
        core = self._core
        with core.writing:
            got = self._pop_locked(n, lease)
            if got or not wait:
                return got
            # Measured by core.wait_clock: an injected clock decides the outcome, as
            # it does for tokens and due times (_waits.py).
            wait_clock = core.wait_clock
            deadline = wait_clock() + wait
            while True:
                left = deadline - wait_clock()
                if got or left <= 0:
                    return got
                core.check_open()  # close() woke us: StoreClosed, as any later call
                now = core.clock()
                end = deadline if wait_clock is core.clock else now + left  # store clock
                bucket = self._q.bucket
                if bucket is not None and bucket.available(now) == 0:
                    # Nothing goes before a token: wake when one is due (on time, not
                    # by polling the store), whatever else falls due before.
                    until = min(end, bucket.next_token_at(now))
                else:
                    until = min(end, self._q.next_event_us / 1e6)
                core.wait_until(until)
                # close() woke us (the database may be gone already): StoreClosed,
                # as through a client, not an empty answer (an API audit).
                core.check_open()
                got = self._pop_locked(n, lease)

    def _pop_locked(self, n: int, lease: float) -> list[Message]:
        buried: _Buried | None = None  # what damaged heads were moved aside, if any
        try:
            # A loop, not recursion: each round that meets damaged heads moves them
            # aside (at least one) and pops again; a long run of them must not overflow.
            while True:
                core = self._core
                q = self._q
                if q.deleted:
                    raise QueueNotFound(q.name)
                now = core.clock()
                now_us = keys.to_us(now)
                if q.next_event_us <= now_us and not timers.promote(core, q, now_us):
                    # A large due backlog: the pass goes on in later calls; meanwhile no
                    # expired message at the head may be delivered.
                    timers.expire_head(core, q, now_us, n)
                bucket = q.bucket
                if bucket is not None:
                    n = min(n, bucket.available(now))
                    if n == 0:
                        return []
                heads = q.heads
                head = heads.known_head() if n == 1 else None
                if head is not None:  # the usual single pop: no plan, no seek
                    plan = None
                    ready_keys = [head]
                else:
                    plan = heads.plan(core.meta, n)
                    ready_keys = plan.keys
                    if not ready_keys:
                        return []
                when = keys.to_us(now + lease)
                deadline = when / 1e6  # the deadline the store keeps, to the microsecond
                name, qid = q.name, q.qid
                read = core.payload.read
                recs = core.records_of(q, ready_keys)
                try:  # costs nothing unless raised (Python 3.11): damage is the cold path
                    if len(recs) == 1:
                        rkey, rec = ready_keys[0], recs[0]
                        mid = keys.trailing_id(rkey)
                        payload = read(rec)
                        core.deliver_one(q, rkey, mid, rec, when)
                        out = [_popped(qid, mid, name, rec, payload, deadline)]
                    elif q.hot_paths:
                        payloads = core.payload.read_many(recs)  # all read before anything changes
                        mids = core.deliver_many(q, ready_keys, recs, when)
                        out = _popped_many(qid, mids, name, recs, payloads, deadline)
                    else:
                        txn = Txn()
                        out = []
                        for rkey, rec in zip(ready_keys, recs, strict=True):
                            mid = keys.trailing_id(rkey)
                            payload = read(rec)
                            states.deliver(txn, q, rkey, mid, rec, when)
                            out.append(_popped(qid, mid, name, rec, payload, deadline))
                        txn.count(q, READY, -len(out))
                        txn.count(q, INFLIGHT, len(out))
                        txn.add_event(q, when)
                        core.commit(txn)
                except Corruption:
                    # Nothing was written: move the damaged ones aside and pop again
                    # (each round removes at least one, so this ends).
                    if buried is None:  # the cold path: a _Buried only when needed
                        buried = _Buried(q.name)
                    if not self._bury_damaged(q, ready_keys, core.records_of(q, ready_keys),
                                              buried):
                        raise
                    continue
                if plan is None:
                    heads.took_head(ready_keys[0])
                else:
                    heads.taken(plan)
                if bucket is not None:
                    bucket.take(now, len(out))
                return out
        finally:
            if buried is not None:
                buried.report()  # what was moved aside is committed, even if a round raised

    def _bury_damaged(self, q: QueueState, ready_keys: list[bytes],
                      recs: list[records.MessageRecord], buried: _Buried) -> list[bytes]:
        """Move the ready messages among ``ready_keys`` whose payload is damaged to
        the dead letters, with the reason recorded (writer lock held); their keys.

        A damaged message at the head must never block its queue (contract
        section 9). Its payload bytes stay where they are. Each one is added to
        ``buried``, which the calling pop or peek logs once it ends.
        """
        core = self._core
        read = core.payload.read
        txn = Txn()
        gone = []
        for rkey, rec in zip(ready_keys, recs, strict=True):
            try:
                read(rec)
            except Corruption as exc:
                mid = keys.trailing_id(rkey)
                reason = f"{records.DAMAGED_REASON}: {exc.reason}"
                states.bury(txn, q, mid, rec, reason)
                gone.append((rkey, mid, rec.file_id, reason, exc))
        if gone:
            core.commit(txn)
            q.heads.removed([rkey for rkey, *_ in gone])
            for _, mid, fid, reason, error in gone:  # committed: in the dead letters now
                buried.add(mid, fid, reason, error)
        return [rkey for rkey, *_ in gone]

    # -- ack / nack / extend --------------------------------------------------

    def _leased(self, item: Receipted, now_us: int) -> tuple[int, records.MessageRecord]:
        """The in-flight record ``item`` holds a live lease on (writer lock held)."""
        _refuse_receiptless(item)
        q = self._q
        if q.deleted:
            raise QueueNotFound(q.name)
        qid, mid, delivery = _receipt_parts(item)
        if qid != q.qid:
            raise InvalidArgument(f"receipt belongs to another queue, not {q.name!r}")
        rec = self._core.message_record(q.message_prefix + keys.U64.pack(mid))
        if rec is None:
            raise MessageNotFound(q.name, mid)
        if (0 < rec.expires_us <= now_us and q.rec.on_expire == "drop"
                and not states.lease_ended_it_first(q, rec)):
            raise MessageNotFound(q.name, mid)  # expired: as good as gone already
        if (rec.state != _ST.INFLIGHT or rec.deliveries != delivery or rec.when_us <= now_us
                or 0 < rec.expires_us <= now_us):
            raise LeaseExpired(f"the lease of message {mid} in {q.name!r} expired or was "
                               "superseded by a later delivery; nothing was changed")
        return mid, rec

    def ack(self, item: Receipted) -> None:
        """Delete a leased message for good."""
        core = self._core
        with core.writing:
            mid, rec = self._leased(item, keys.to_us(core.clock()))
            core.remove_one(self._q, mid, rec)

    def ack_many(self, items: Iterable[Receipted]) -> int:
        """Ack every item in one batch; if any lease is not live, nothing is acked."""
        return self._ack(list(_iterate(items, "ack_many")))

    def _leased_many(self, items: Sequence[Receipted], now_us: int
                     ) -> tuple[list[int], list[records.MessageRecord]]:
        """:meth:`_leased` of each item (writer lock held), no message twice.

        The core hands over at once the records of messages this process
        popped whose leases are plainly live (``Core.live_leases``); every
        other item, and any doubt, goes through :meth:`_leased`, which raises
        what it should.
        """
        q = self._q
        leases = [item._lease if type(item) is Message else None for item in items]
        if None in leases:  # not all popped here: refused before all else, as by the clients
            for item, lease in zip(items, leases, strict=True):
                if lease is None:
                    _refuse_receiptless(item)
        if q.deleted:
            raise QueueNotFound(q.name)
        live = self._core.live_leases(q, leases, now_us)
        if None not in live:  # all plainly live, so none named twice (a record is handed over once)
            return [lease[1] for lease in leases], live  # type: ignore[index, return-value]
        mids: list[int] = []
        recs: list[records.MessageRecord] = []
        seen: set[int] = set()
        # In item order: the first item that is wrong (a lease not live, or a
        # message named again) raises, whatever comes after it.
        for item, lease, rec in zip(items, leases, live, strict=True):
            if rec is None:
                mid, rec = self._leased(item, now_us)
            else:
                mid = lease[1]  # type: ignore[index]
            if mid in seen:
                raise InvalidArgument(f"message {mid} appears twice in one ack_many")
            seen.add(mid)
            mids.append(mid)
            recs.append(rec)
        return mids, recs

    def _ack(self, items: Sequence[Receipted]) -> int:
        core = self._core
        with core.writing:
            q = self._q
            mids, recs = self._leased_many(items, keys.to_us(core.clock()))
            if not items:
                pass
            elif q.hot_paths:
                core.remove_many(q, mids, recs)
            else:
                txn = Txn()
                for mid, rec in zip(mids, recs, strict=True):
                    states.remove(txn, q, mid, rec)
                core.commit(txn)
        return len(items)

    def nack(self, item: Receipted, delay: float = 0.0) -> None:
        """Give a leased message back: ready again at its own place, or after ``delay``.

        A message that has used up ``max_attempts`` goes to the dead letters.
        """
        _refuse_receiptless(item)
        self._state()
        delay = _seconds(delay, "delay")
        core = self._core
        with core.writing:
            now = core.clock()
            mid, rec = self._leased(item, keys.to_us(now))
            q = self._q
            txn = Txn()
            states.leave(txn, q, mid, rec)
            states.requeue(txn, q, mid, rec, now, delay)
            core.commit(txn)

    def extend(self, item: Receipted, lease: float = 30.0) -> Message:
        """Move a live lease's deadline to now + ``lease``; the receipt stays valid."""
        _refuse_receiptless(item)
        self._state()
        lease = _seconds(lease, "lease", positive=True)
        core = self._core
        with core.writing:
            now = core.clock()
            mid, rec = self._leased(item, keys.to_us(now))
            q = self._q
            txn = Txn()
            when = keys.to_us(now + lease)
            states.extend(txn, q, mid, rec, when)
            core.commit(txn)
            payload = core.payload.read(rec)
            return Message(mid, q.name, rec.priority, payload, rec.attempts, rec.enqueued_at,
                           when / 1e6, make_receipt(q.qid, mid, rec.deliveries),
                           expires_at=rec.expires_us / 1e6 if rec.expires_us else None)

    # -- inspection -----------------------------------------------------------

    def _catch_up(self) -> None:
        """Run the due passes in batches, letting go of the writer lock between them
        (before an inspection takes the lock for itself; see
        :func:`timers.catch_up_to_read` for a full disk)."""
        timers.catch_up_to_read(self._core, self._q)

    def _maybe_promote(self) -> QueueState:
        core = self._core
        core.check_open()  # reads of a closed store must not reach rocksdict
        q = self._state()
        if not core.readonly:
            now_us = keys.to_us(core.clock())
            if q.next_event_us <= now_us:
                timers.promote_all_to_read(core, q, now_us)  # what fell due since _catch_up
        return q

    def _messages(self, q: QueueState, index_keys: list[bytes]) -> list[Message]:
        recs = self._core.records_of(q, index_keys)
        return [self._message(q, keys.trailing_id(k), rec)
                for k, rec in zip(index_keys, recs, strict=True)]

    def _message(self, q: QueueState, mid: int, rec: records.MessageRecord) -> Message:
        payload = self._core.payload.read(rec)
        deadline = rec.when_us / 1e6 if rec.state == _ST.INFLIGHT else None
        return Message(mid, q.name, rec.priority, payload, rec.attempts, rec.enqueued_at,
                       deadline, None, _ST.STATE_NAMES[rec.state],
                       expires_at=rec.expires_us / 1e6 if rec.expires_us else None,
                       dead_reason=rec.reason)

    def peek(self, n: int = 1) -> list[Message]:
        """The first ``n`` ready messages in pop order, without leasing them."""
        self._state()
        _check_count(n)
        self._catch_up()
        with self._core.settling:
            q = self._maybe_promote()
            buried = _Buried(q.name)
            try:
                return self._peek_rounds(q, n, buried)
            finally:
                buried.report()

    def _peek_rounds(self, q: QueueState, n: int, buried: _Buried) -> list[Message]:
        want = n
        while True:
            ready_keys = q.heads.plan(self._core.meta, want).keys
            try:
                return self._messages(q, ready_keys[:n])
            except Corruption:
                recs = self._core.records_of(q, ready_keys)
                if not self._core.readonly:
                    if not self._bury_damaged(q, ready_keys, recs, buried):
                        raise
                    continue
                # A view cannot move them: it leaves them out, and looks further
                # until it has n intact messages or the queue ends.
                intact = [(k, rec) for k, rec in zip(ready_keys, recs, strict=True)
                          if self._damage_of(rec) is None]
                if len(intact) >= n or len(ready_keys) < want:
                    return [self._message(q, keys.trailing_id(k), rec)
                            for k, rec in intact[:n]]
                want += n - len(intact)

    def _damage_of(self, rec: records.MessageRecord) -> str | None:
        """What is wrong with ``rec``'s payload bytes, or None when they read back."""
        try:
            self._core.payload.read(rec)
        except Corruption as exc:
            return exc.reason
        return None

    def get(self, message_id: int) -> Message:
        """One message by id, in any state (MessageNotFound once acked or purged)."""
        self._state()
        if (isinstance(message_id, bool) or not isinstance(message_id, int)
                or not 0 <= message_id < 2**64):
            raise InvalidArgument(f"message id must be an int in [0, 2**64), not {message_id!r}")
        self._catch_up()
        with self._core.settling:
            q = self._maybe_promote()
            raw = self._core.meta.get(keys.message_key(q.qid, message_id))
            if raw is None:
                raise MessageNotFound(q.name, message_id)
            return self._message(q, message_id, records.MessageRecord.decode(raw))

    def dead_letters(self, n: int = 10) -> list[Message]:
        """Up to ``n`` dead letters, oldest id first."""
        self._state()
        _check_count(n)
        self._catch_up()
        with self._core.settling:
            q = self._maybe_promote()
            lo = keys.prefix(keys.DEAD, q.qid)
            dead = self._core.meta.scan_keys(keys.dead_key(q.qid, q.dead_floor),
                                             keys.prefix_end(lo), n)
            try:
                return self._messages(q, dead)
            except Corruption:
                # A dead letter whose payload is damaged is listed with an empty
                # payload and a reason that says so (the one recorded when it was
                # moved aside for it; else what is wrong now); get() raises.
                out = []
                for k, rec in zip(dead, self._core.records_of(q, dead), strict=True):
                    problem = self._damage_of(rec)
                    if problem is None:
                        out.append(self._message(q, keys.trailing_id(k), rec))
                        continue
                    reason = rec.reason
                    if not (reason or "").startswith(records.DAMAGED_REASON):
                        reason = f"{records.DAMAGED_REASON}: {problem}"
                    out.append(Message(keys.trailing_id(k), q.name, rec.priority, b"",
                                       rec.attempts, rec.enqueued_at, None, None,
                                       _ST.STATE_NAMES[rec.state], dead_reason=reason))
                return out

    def redrive(self, n: int = 100) -> int:
        """Move up to ``n`` dead letters back to ready with attempts reset to 0."""
        self._state()
        _check_count(n)
        core = self._core
        self._catch_up()
        with core.writing:
            q = self._state()
            now = core.clock()
            now_us = keys.to_us(now)
            if q.next_event_us <= now_us:
                # A lease that ran out on its last attempt is dead already.
                timers.promote_all(core, q, now_us)
            lo = keys.prefix(keys.DEAD, q.qid)
            dead = core.meta.scan_keys(keys.dead_key(q.qid, q.dead_floor),
                                       keys.prefix_end(lo), n)
            if not dead:
                return 0
            txn = Txn()
            recs = core.records_of(q, dead)
            # Dedup keys free now, that the letters' digests may take back (the
            # first letter of a digest gets it; a live message may own it).
            digests = sorted({r.digest for r in recs if r.digest is not None})
            owners = core.meta.multi_get([keys.dedup_key(q.qid, d) for d in digests]) \
                if digests else []
            taken = {d for d, raw in zip(digests, owners, strict=True) if raw is not None}
            for dkey, rec in zip(dead, recs, strict=True):
                mid = keys.trailing_id(dkey)
                states.leave(txn, q, mid, rec)
                rec.attempts = 0
                rec.reason = None
                owned = rec.digest in taken
                states.take_back_dedup(txn, q, mid, rec, owned)
                if rec.digest is not None:
                    taken.add(rec.digest)
                states.requeue(txn, q, mid, rec, now, 0.0)
            core.commit(txn)
            # Every dead letter from the floor to the last one redriven was read and
            # moved (none made meanwhile: the writer lock is held): none is below.
            q.dead_floor = max(q.dead_floor, keys.trailing_id(dead[-1]) + 1)
            return len(dead)

    def purge(self) -> int:
        """Delete every message of the queue (all states) in one batch; returns how many.

        The due passes run first, as for stats: a message whose TTL had run
        out was expired (counted in ``stats().expired``), not purged, however
        long ago any pass last looked.
        """
        core = self._core
        self._catch_up()
        with core.writing:
            q = self._state()
            now_us = keys.to_us(core.clock())
            if q.next_event_us <= now_us:
                timers.promote_all(core, q, now_us)
            return core.purge(q)

    def stats(self) -> QueueStats:
        """Counts by state; expired leases and due delays are promoted first."""
        self._catch_up()
        with self._core.settling:
            q = self._maybe_promote()
            c = q.counts
            r = q.rec
            return QueueStats(q.name, c[READY], c[DELAYED], c[INFLIGHT], c[DEAD], c[BYTES],
                              expired=q.expired, ttl=r.ttl, on_expire=r.on_expire,
                              aging=r.aging, aging_cap=r.aging_cap, rate=r.rate)

    def __len__(self) -> int:
        return self.stats().total


def _check_count(n: object) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgument(f"n must be an int >= 1, not {n!r}")
