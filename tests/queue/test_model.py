"""The real store against a plain in-memory model of the queue semantics (CONTRACT section 2).

A hypothesis state machine drives one store with two queues, ``a`` and
``ab`` (prefix neighbours), through random pushes, pops, acks, nacks,
extends, clock moves, redrives, purges and reopens, and compares every
result, every error and every counter with the model after each step. An
invariant also recounts each queue straight from its RocksDB indexes.

Each queue also draws the options of contract section 10, and the model
follows them with the same injected clock: a TTL (per push, per batch, per
item or the queue's default; ``on_expire`` drop or dead) expires a message in
any state but dead, before a lease or delay that runs out at the same time
is promoted; an aging queue's ready messages sit at their pushed priority
plus one level per ``aging`` seconds since their push (up to ``aging_cap``),
so every pop is compared with the model's aged priorities; a rate-limited
queue's pops take tokens from a bucket refilled by the clock (full again
after a reopen). ``stats().expired`` and the options are compared too, and
``configure`` changes the TTL, ``on_expire``, rate (or removes it) and aging
(period and cap) of a live queue: levels already gained are kept, and a
message gains more only once the new period gives it more than it has.

``pop(wait=w)`` runs on the store's clock (qstore/_waits.py), here an
autojump clock: each time the store waits it jumps to the time waited for. The
model predicts the whole wait: the time the pop returns at (a token falls due
within ``w``, then a message becomes ready: it returns one; else ``None`` at
the deadline) and what it returns, settling the queue at each time the store
wakes (the next token while the bucket is empty, else the queue's next event).

Times are multiples of 1/8 s (rates whose tokens fall due at such times too),
so that ``clock() + lease`` and its microsecond key round-trip exactly and the
model can compare deadlines and token times with ``==``.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import qstore
from tests.conftest import FakeClock

from ._support import Counts, assert_consistent

INT_MIN, INT_MAX = -(2**63), 2**63 - 1
NAMES = ("a", "ab")

int_priorities = st.one_of(
    st.none(),
    st.integers(-2, 2),
    st.sampled_from([INT_MIN, INT_MIN + 1, INT_MAX - 1, INT_MAX]),
    st.integers(INT_MIN, INT_MAX),
)
str_priorities = st.one_of(
    st.none(),
    st.sampled_from(["", "\x00", "\x00\x00", "\x01", "a", "a\x00", "a\x00b", "ab", "b",
                     "\x7f", "é", "\uffff", "\U0001d11e"]),
    st.text(max_size=4),
)
payloads = st.one_of(
    st.sampled_from([b"", b"dup", b"\x00"]),
    st.binary(max_size=400),
    # Over segment_max_bytes: such a record gets a segment of its own.
    st.integers(4097, 5000).map(lambda n: bytes([n % 251]) * n),
)
delays = st.sampled_from([0, 0, 0.0, 1, 2.5, 7])
leases = st.sampled_from([1, 2, 5, 10, 20.5, 100])
dedup_keys = st.sampled_from([None, None, None, "k1", b"k1", "k2"])
advances = st.sampled_from([0.5, 1, 2, 5, 10, 20, 30])
ttls = st.sampled_from([None] * 5 + [1, 2.5, 6, 20])
on_expires = st.sampled_from(["drop", "dead"])
agings = st.sampled_from([None, None, 1, 2.5, 4])
aging_caps = st.sampled_from([None, None, 1, 3])
# Token intervals (per / n) of 2, 0.5, 2 and 1/8 s: token times stay exact floats.
RATES = [(1, 2.0), (2, 1.0), (3, 6.0), (4, 0.5)]
rates = st.sampled_from([None, None, None, *RATES])
waits = st.sampled_from([0.5, 1, 2, 3.5, 10, 40])
# A clock move at the start of an operation, before any stats() call promotes what
# became due: the operation itself must see expired leases and due delays.
ticks = st.sampled_from([None] * 7 + ["event", "before", 1])


@dataclass
class Rec:
    """The model of one message."""

    id: int
    priority: int | str
    payload: bytes
    enqueued_at: float
    digest: tuple[str, bytes] | None
    state: str = "ready"
    when: float = 0.0  # due time (delayed) or lease deadline (in_flight)
    attempts: int = 0
    receipt: str | None = None  # the live delivery, while in_flight
    expires: float | None = None  # when its TTL runs out (None: no TTL, or dead)
    reason: str | None = None  # "expired": a dead letter made by its TTL
    base: int | str = 0  # the pushed priority (``priority`` is the aged one)
    aged: int = 0  # levels gained so far (kept when the aging options change)
    kept: tuple[str, bytes] | None = None  # a dead letter's digest, for a redrive


@dataclass
class Options:
    """The options of contract section 10 as the model holds them."""

    ttl: float | None = None
    on_expire: str = "drop"
    aging: float | None = None
    aging_cap: int | None = None
    rate: tuple[int, float] | None = None


class ModelQueue:
    def __init__(self, name: str, order: str, ptype: str, max_attempts: int, dedup: bool,
                 opts: Options, now: float) -> None:
        self.name = name
        self.order = order
        self.ptype = ptype
        self.max_attempts = max_attempts
        self.dedup = dedup
        self.opts = opts
        self.msgs: dict[int, Rec] = {}
        self.expired = 0
        self.tokens = Fraction(0)
        self.tokens_at = Fraction(now)
        self.fill_bucket(now)

    # -- rate limit: a token bucket, in exact fractions ------------------------

    def fill_bucket(self, now: float) -> None:
        """A new bucket (create, reopen, a changed rate) starts full."""
        if self.opts.rate is not None:
            self.tokens, self.tokens_at = Fraction(self.opts.rate[0]), Fraction(now)

    def tokens_available(self, now: float) -> int:
        if self.opts.rate is None:
            return 2**31
        n, per = self.opts.rate
        t = Fraction(now)
        if t > self.tokens_at:
            self.tokens = min(Fraction(n), self.tokens + (t - self.tokens_at) * n / Fraction(per))
            self.tokens_at = t
        return math.floor(self.tokens)

    def take_tokens(self, k: int) -> None:
        if self.opts.rate is not None:
            self.tokens -= k

    # -- aging -----------------------------------------------------------------

    def gain(self, rec: Rec, now: float) -> int:
        """Levels a message pushed at ``rec.enqueued_at`` has gained by ``now``."""
        a = self.opts.aging
        assert a is not None
        k = math.floor((Fraction(now) - Fraction(rec.enqueued_at)) / Fraction(a))
        k = max(k, 0)
        return k if self.opts.aging_cap is None else min(k, self.opts.aging_cap)

    def gain_before(self, rec: Rec, t: float) -> int:
        """Levels gained strictly before ``t`` (one due at ``t`` loses to a TTL there)."""
        a = self.opts.aging
        assert a is not None
        k = max(math.ceil((Fraction(t) - Fraction(rec.enqueued_at)) / Fraction(a)) - 1, 0)
        return k if self.opts.aging_cap is None else min(k, self.opts.aging_cap)

    def aged(self, rec: Rec, now: float) -> int:
        """A ready message's priority at ``now``: levels are gained, never given back
        (a longer period, a lower cap or no aging keep what was gained)."""
        return self.aged_to(rec, self.gain(rec, now))

    def aged_to(self, rec: Rec, gained: int) -> int:
        """The priority with ``gained`` levels, or those already gained if more."""
        assert isinstance(rec.base, int)
        k = rec.aged = max(rec.aged, gained)
        return max(INT_MIN, rec.base - k) if self.order == "min" else min(INT_MAX, rec.base + k)

    def next_gain(self, rec: Rec, now: float) -> float | None:
        """When a ready message next gains a level (None: it reached its cap)."""
        a = self.opts.aging
        assert a is not None
        k = max(rec.aged, self.gain(rec, now))
        if self.opts.aging_cap is not None and k >= self.opts.aging_cap:
            return None
        return rec.enqueued_at + (k + 1) * a

    def next_token(self, now: float) -> float:
        """When the empty bucket (just refilled to ``now``) next holds a whole token."""
        assert self.opts.rate is not None and self.tokens < 1 and self.tokens_at == now
        n, per = self.opts.rate
        return float(self.tokens_at + (1 - self.tokens) * Fraction(per) / n)

    def priority(self, given: int | str | None) -> int | str:
        if given is None:
            return 0 if self.ptype == "int" else ""
        return given

    def digest(self, payload: bytes, key: str | bytes | None) -> tuple[str, bytes] | None:
        if not self.dedup:
            return None
        if key is None:
            return ("payload", payload)
        return ("key", key.encode("utf-8") if isinstance(key, str) else key)

    def live_with(self, digest: tuple[str, bytes] | None) -> Rec | None:
        if digest is None:
            return None
        return next((m for m in self.msgs.values() if m.digest == digest), None)

    def ready(self) -> list[Rec]:
        """Ready messages in pop order: priority (per order), then id."""
        by_id = sorted((m for m in self.msgs.values() if m.state == "ready"), key=lambda m: m.id)
        if self.order == "fifo":
            return by_id

        def prio(m: Rec) -> Any:
            return m.priority.encode("utf-8") if isinstance(m.priority, str) else m.priority

        # sorted() is stable, also with reverse=True: equal priorities keep id order.
        return sorted(by_id, key=prio, reverse=self.order == "max")

    def dead(self) -> list[Rec]:
        return sorted((m for m in self.msgs.values() if m.state == "dead"), key=lambda m: m.id)

    def give_back(self, m: Rec, now: float, delay: float) -> None:
        """A lease ends without an ack (nack or expiry)."""
        m.receipt = None
        if m.attempts >= self.max_attempts:
            m.state, m.when, m.expires = "dead", 0.0, None  # dead letters do not expire
            m.digest, m.kept = None, m.digest  # nor dedup: until a redrive takes it back
        elif delay > 0:
            m.state, m.when = "delayed", now + delay
        else:
            m.state, m.when = "ready", 0.0

    def settle(self, now: float) -> None:
        """What the store's pass does at ``now``, in its order: expire the TTLs that ran
        out (clock() >= expires; a message whose last lease ended first is a dead
        letter of its attempts instead), then expire leases and release delays
        whose time has come (clock() >= when), then age the ready messages."""
        for m in list(self.msgs.values()):
            if m.expires is not None and now >= m.expires:
                if m.state == "in_flight" and m.when < m.expires \
                        and m.attempts >= self.max_attempts:
                    # Its last lease ended before its TTL: it died of its attempts
                    # then, whenever the pass runs (a tie goes to the TTL).
                    self.give_back(m, m.when, 0.0)
                    continue
                self.expired += 1
                if self.opts.on_expire == "dead":
                    if self.opts.aging is not None and m.when < m.expires:
                        # Ready before its TTL (ready now: when is 0; or its delay or
                        # lease ended first): it keeps the levels it gained then.
                        m.priority = self.aged_to(m, self.gain_before(m, m.expires))
                    m.state, m.when, m.receipt = "dead", 0.0, None
                    m.expires, m.reason = None, "expired"
                    m.digest, m.kept = None, m.digest
                else:
                    del self.msgs[m.id]
        for m in self.msgs.values():
            if m.state == "in_flight" and now >= m.when:
                self.give_back(m, now, 0.0)
            elif m.state == "delayed" and now >= m.when:
                m.state, m.when = "ready", 0.0
        if self.opts.aging is not None:
            for m in self.msgs.values():
                if m.state == "ready":
                    m.priority = self.aged(m, now)

    def events(self, now: float) -> list[float]:
        out = [m.when for m in self.msgs.values() if m.state in ("in_flight", "delayed")]
        out += [m.expires for m in self.msgs.values() if m.expires is not None]
        if self.opts.aging is not None:
            out += [t for m in self.msgs.values() if m.state == "ready"
                    for t in [self.next_gain(m, now)] if t is not None]
        return out

    def counts(self) -> Counts:
        n = {s: 0 for s in ("ready", "delayed", "in_flight", "dead")}
        for m in self.msgs.values():
            n[m.state] += 1
        return Counts(n["ready"], n["delayed"], n["in_flight"], n["dead"],
                      sum(len(m.payload) for m in self.msgs.values()))


def outcome(fn: Callable[[], Any]) -> tuple[Any, type[Exception] | None]:
    try:
        return fn(), None
    except qstore.QStoreError as exc:
        return None, type(exc)


class QueueMachine(RuleBasedStateMachine):
    ORDER = "max"  # of queue "a"; "ab" draws its own

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="qstore-model-")
        self.path = os.path.join(self.tmp, "store")
        self.clock = FakeClock(autojump=True)  # only pop(wait=...) ever waits on it
        self.options: dict[str, Any] = {}
        self.store: qstore.Store | None = None
        self.model: dict[str, ModelQueue] = {}
        self.handles: dict[str, qstore.Queue] = {}
        self.delivered: list[qstore.Message] = []  # every Message pop or extend returned
        self.receipts: set[str] = set()
        self.ids: list[int] = []
        self.last_id = 0
        self._token_first = False  # the last waiting pop began with an empty bucket

    # -- set-up ---------------------------------------------------------------

    @initialize(
        durability=st.sampled_from(["none", "none", "none", "interval", "always"]),
        a_type=st.sampled_from(["int", "str"]),
        a_attempts=st.sampled_from([1, 2, 3, 3]),
        a_dedup=st.booleans(),
        b_order=st.sampled_from(["max", "min", "fifo"]),
        b_type=st.sampled_from(["int", "str"]),
        b_attempts=st.sampled_from([1, 2, 3, 3]),
        b_dedup=st.booleans(),
        opts=st.lists(st.tuples(ttls, on_expires, agings, aging_caps, rates), min_size=2,
                      max_size=2),
    )
    def open_store(self, durability: str, a_type: str, a_attempts: int, a_dedup: bool,
                   b_order: str, b_type: str, b_attempts: int, b_dedup: bool,
                   opts: list[tuple[Any, ...]]) -> None:
        self.options = {"clock": self.clock, "compactor": False, "segment_max_bytes": 4096,
                        "sweep_interval": 3600.0, "durability": durability}
        self.store = qstore.open(self.path, **self.options)
        configs = {"a": (self.ORDER, a_type, a_attempts, a_dedup),
                   "ab": (b_order, b_type, b_attempts, b_dedup)}
        for (name, (order, ptype, attempts, dedup)), drawn in zip(configs.items(), opts,
                                                                  strict=True):
            o = Options(*drawn)
            if ptype != "int" or order == "fifo":
                o.aging = o.aging_cap = None  # aging needs int priorities and an order
            elif o.aging is None:
                o.aging_cap = None
            self.handles[name] = self.store.create_queue(
                name, order=order, priority_type=ptype, max_attempts=attempts, dedup=dedup,
                ttl=o.ttl, on_expire=o.on_expire, aging=o.aging, aging_cap=o.aging_cap,
                rate=o.rate)
            self.model[name] = ModelQueue(name, order, ptype, attempts, dedup, o, self.now)

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- helpers --------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.clock.now

    def _record_push(self, mq: ModelQueue, rows: list[tuple[bytes, Any, float, Any, Any]],
                     ids: list[int]) -> None:
        assert len(ids) == len(rows)
        for (payload, prio, delay, key, ttl), mid in zip(rows, ids, strict=True):
            digest = mq.digest(payload, key)
            existing = mq.live_with(digest)
            if existing is not None:
                assert mid == existing.id, "a dedup hit must return the live message's id"
                continue
            assert mid > self.last_id, "message ids must grow with every push"
            self.last_id = mid
            self.ids.append(mid)
            rec = Rec(mid, mq.priority(prio), payload, self.now, digest)
            rec.base = rec.priority
            if ttl is None:
                ttl = mq.opts.ttl
            if ttl is not None:
                rec.expires = self.now + ttl
            if delay > 0:
                rec.state, rec.when = "delayed", self.now + delay
            mq.msgs[mid] = rec

    def _check_delivery(self, mq: ModelQueue, msg: qstore.Message, rec: Rec,
                        lease: float) -> None:
        rec.attempts += 1
        rec.state, rec.when, rec.receipt = "in_flight", self.now + lease, msg.receipt
        assert (msg.id, msg.queue, msg.payload) == (rec.id, mq.name, rec.payload)
        assert msg.priority == rec.priority and type(msg.priority) is type(rec.priority)
        assert msg.attempts == rec.attempts
        assert msg.enqueued_at == rec.enqueued_at
        assert msg.lease_deadline == rec.when
        assert msg.state == "in_flight"
        assert isinstance(msg.receipt, str) and msg.receipt not in self.receipts
        self.receipts.add(msg.receipt)
        self.delivered.append(msg)

    def _check_seen(self, msg: qstore.Message, rec: Rec, name: str) -> None:
        """A Message from peek, get or dead_letters matches the model and holds no lease."""
        assert (msg.id, msg.queue, msg.payload) == (rec.id, name, rec.payload)
        assert msg.priority == rec.priority and type(msg.priority) is type(rec.priority)
        assert (msg.state, msg.attempts, msg.enqueued_at) == (rec.state, rec.attempts,
                                                             rec.enqueued_at)
        assert msg.receipt is None
        assert msg.lease_deadline == (rec.when if rec.state == "in_flight" else None)
        assert (msg.expires_at, msg.dead_reason) == (rec.expires, rec.reason)

    def _pick(self, data: st.DataObject, *, edge_ok: bool = True) -> qstore.Message:
        """A delivery: mostly one whose lease is live, else any (likely stale) one.

        Then, now and then, the clock lands exactly on its deadline (too late) or
        half a second before it (just in time), with nothing promoted in between.
        """
        live = [m for m in self.delivered if self._lease_error(m.queue, m) is None]
        if live and data.draw(st.integers(0, 2)):
            msg = data.draw(st.sampled_from(live))
        else:
            msg = data.draw(st.sampled_from(self.delivered))
        edge = data.draw(st.sampled_from([None] * 6 + [0.0, 0.5])) if edge_ok else None
        rec = self.model[msg.queue].msgs.get(msg.id)
        if (edge is not None and rec is not None and rec.state == "in_flight"
                and rec.when - edge > self.now):
            # The model settled at the step's tick; the store must too, or it would
            # settle what fell due then only at the edge, in one pass whose order
            # (TTLs first, then leases) may differ from two passes.
            for q in self.handles.values():
                q.stats()
            self.clock.now = rec.when - edge
            self._settle()
        return msg

    def _lease_error(self, name: str, msg: qstore.Message) -> type[Exception] | None:
        """The error ack/nack/extend of ``msg`` through queue ``name`` must raise, if any."""
        if msg.queue != name:
            return qstore.InvalidArgument
        rec = self.model[name].msgs.get(msg.id)
        if rec is None:
            return qstore.MessageNotFound
        if rec.state != "in_flight" or rec.receipt != msg.receipt:
            return qstore.LeaseExpired
        return None

    def _via(self, msg: qstore.Message, other: int) -> str:
        """Usually the message's own queue; sometimes the other one (a foreign receipt)."""
        if other == 0:
            return "ab" if msg.queue == "a" else "a"
        return msg.queue

    # -- pushing --------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), payload=payloads, pi=int_priorities, ps=str_priorities,
          delay=delays, key=dedup_keys, ttl=ttls, tick=ticks)
    def push(self, name: str, payload: bytes, pi: int | None, ps: str | None, delay: float,
             key: str | bytes | None, ttl: float | None, tick: Any) -> None:
        self._tick(tick)
        mq = self.model[name]
        prio = pi if mq.ptype == "int" else ps
        key = key if mq.dedup else None
        mid = self.handles[name].push(payload, priority=prio, delay=delay, dedup_key=key,
                                      ttl=ttl)
        self._record_push(mq, [(payload, prio, delay, key, ttl)], [mid])

    @rule(name=st.sampled_from(NAMES), batch_delay=delays, batch_ttl=ttls,
          items=st.lists(st.tuples(payloads, int_priorities, str_priorities, delays, dedup_keys,
                                   ttls, st.sampled_from(["bytes", 1, 2, 3, 4, 5])),
                         max_size=5))
    def push_many(self, name: str, batch_delay: float, batch_ttl: float | None,
                  items: list[tuple[bytes, Any, Any, float, Any, Any, Any]]) -> None:
        mq = self.model[name]
        args: list[Any] = []
        rows = []
        for payload, pi, ps, delay, key, ttl, shape in items:
            prio = pi if mq.ptype == "int" else ps
            key = key if mq.dedup else None
            if shape == "bytes":
                args.append(payload)
                rows.append((payload, None, batch_delay, None, batch_ttl))
            else:
                full = (payload, prio, delay, key, ttl)
                args.append(full[:shape])
                rows.append(full[:shape] + (None, None, batch_delay, None, batch_ttl)[shape:])
        ids = self.handles[name].push_many(args, delay=batch_delay, ttl=batch_ttl)
        self._record_push(mq, rows, ids)

    # -- leasing --------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), lease=leases, tick=ticks)
    def pop(self, name: str, lease: float, tick: Any) -> None:
        self._tick(tick)
        mq = self.model[name]
        mq.settle(self.now)
        head = mq.ready()[:min(1, mq.tokens_available(self.now))]
        got = self.handles[name].pop(lease=lease)
        if not head:
            assert got is None
            return
        assert got is not None, f"pop returned nothing; the model has {head[0].id} ready"
        mq.take_tokens(1)
        self._check_delivery(mq, got, head[0], lease)

    @rule(name=st.sampled_from(NAMES), n=st.integers(1, 5), lease=leases, tick=ticks)
    def pop_many(self, name: str, n: int, lease: float, tick: Any) -> None:
        self._tick(tick)
        mq = self.model[name]
        mq.settle(self.now)
        head = mq.ready()[:min(n, mq.tokens_available(self.now))]
        got = self.handles[name].pop_many(n, lease=lease)
        assert [m.id for m in got] == [r.id for r in head]
        mq.take_tokens(len(got))
        for msg, rec in zip(got, head, strict=True):
            self._check_delivery(mq, msg, rec, lease)

    @rule(name=st.sampled_from(NAMES), n=st.integers(1, 4), single=st.booleans(),
          lease=leases, wait=waits, tick=ticks, drain=st.integers(0, 2))
    def pop_wait(self, name: str, n: int, single: bool, lease: float, wait: float,
                 tick: Any, drain: int) -> None:
        """pop(wait=...) / pop_many(wait=...): what it returns and when, by the clock.

        Now and then a pop_many first takes every token it can, so that the wait
        often begins with an empty bucket and messages ready behind it."""
        self._tick(tick)
        if not drain:
            self.pop_many(name, 5, lease, None)
        mq = self.model[name]
        n = 1 if single else n
        at, head = self._predict_wait(mq, n, wait)
        q = self.handles[name]
        if single:
            one = q.pop(lease=lease, wait=wait)
            got = [] if one is None else [one]
        else:
            got = q.pop_many(n, lease=lease, wait=wait)
        assert self.now == at, f"the wait returned at {self.now}, the model says {at}"
        event(f"pop_wait: {'messages' if got else 'nothing'} after {len(self.clock.jumps)} "
              f"wake-up(s){', first for a token' if self._token_first else ''}")
        self.clock.jumps.clear()
        assert [m.id for m in got] == [r.id for r in head]
        mq.take_tokens(len(got))
        for msg, rec in zip(got, head, strict=True):
            self._check_delivery(mq, msg, rec, lease)

    def _predict_wait(self, mq: ModelQueue, n: int, wait: float) -> tuple[float, list[Rec]]:
        """Where the clock stands when a waiting pop returns, and the records it returns.

        The store tries to pop, and while it gets nothing and the deadline has not
        come, waits for the next token if the bucket is empty (nothing can go before
        it), else for the queue's next event (a delay or lease that runs out, a TTL),
        and tries again then. The model settles the queue at each of those times.
        """
        t, deadline = self.now, self.now + wait
        self._token_first = False
        while True:
            mq.settle(t)
            tokens = mq.tokens_available(t)
            head = mq.ready()[:min(n, tokens)]
            if head or t >= deadline:
                return t, head
            if tokens == 0:
                self._token_first |= t == self.now
                nxt = mq.next_token(t)
            else:
                nxt = min((e for e in mq.events(t) if e > t), default=deadline)
            t = min(deadline, nxt)

    @precondition(lambda self: self.delivered)
    @rule(data=st.data(), by_message=st.booleans(), other=st.integers(0, 7), tick=ticks)
    def ack(self, data: st.DataObject, by_message: bool, other: int, tick: Any) -> None:
        self._tick(tick)
        msg = self._pick(data)
        name = self._via(msg, other)
        expected = self._lease_error(name, msg)
        _, err = outcome(lambda: self.handles[name].ack(msg if by_message else msg.receipt))
        assert err is expected
        if expected is None:
            del self.model[name].msgs[msg.id]

    @precondition(lambda self: self.delivered)
    @rule(data=st.data(), k=st.integers(0, 3), other=st.integers(0, 7), tick=ticks)
    def ack_many(self, data: st.DataObject, k: int, other: int, tick: Any) -> None:
        self._tick(tick)
        picked = [self._pick(data, edge_ok=i == 0) for i in range(k)]
        name = self._via(picked[0], other) if picked else data.draw(st.sampled_from(NAMES))
        items = [m if i % 2 else m.receipt for i, m in enumerate(picked)]
        expected: type[Exception] | None = None
        seen: set[int] = set()
        for msg in picked:
            expected = self._lease_error(name, msg)
            if expected is None and msg.id in seen:
                expected = qstore.InvalidArgument
            if expected is not None:
                break
            seen.add(msg.id)
        n, err = outcome(lambda: self.handles[name].ack_many(items))
        assert err is expected, "ack_many acks all or raises the first item's error"
        if expected is None:
            assert n == k
            for mid in seen:
                del self.model[name].msgs[mid]

    @precondition(lambda self: self.delivered)
    @rule(data=st.data(), delay=delays, by_message=st.booleans(), other=st.integers(0, 7),
          tick=ticks)
    def nack(self, data: st.DataObject, delay: float, by_message: bool, other: int,
             tick: Any) -> None:
        self._tick(tick)
        msg = self._pick(data)
        name = self._via(msg, other)
        expected = self._lease_error(name, msg)
        _, err = outcome(lambda: self.handles[name].nack(msg if by_message else msg.receipt,
                                                         delay=delay))
        assert err is expected
        if expected is None:
            mq = self.model[name]
            mq.give_back(mq.msgs[msg.id], self.now, delay)

    @precondition(lambda self: self.delivered)
    @rule(data=st.data(), lease=leases, other=st.integers(0, 7), tick=ticks)
    def extend(self, data: st.DataObject, lease: float, other: int, tick: Any) -> None:
        self._tick(tick)
        msg = self._pick(data)
        name = self._via(msg, other)
        expected = self._lease_error(name, msg)
        got, err = outcome(lambda: self.handles[name].extend(msg, lease=lease))
        assert err is expected
        if expected is None:
            rec = self.model[name].msgs[msg.id]
            rec.when = self.now + lease
            assert got.receipt == msg.receipt, "extend keeps the receipt"
            assert (got.id, got.payload, got.attempts) == (rec.id, rec.payload, rec.attempts)
            assert got.lease_deadline == rec.when
            self.delivered.append(got)

    # -- time -----------------------------------------------------------------

    def _settle(self) -> None:
        for mq in self.model.values():
            mq.settle(self.now)

    @rule(seconds=advances)
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self._settle()

    def _tick(self, tick: Any) -> None:
        """Move the clock: to the next deadline or due time exactly ("event"), half a
        second before it ("before"), or by ``tick`` seconds."""
        if tick is None:
            return
        if tick in ("event", "before"):
            events = [w for mq in self.model.values() for w in mq.events(self.now)]
            if not events:
                return
            target = min(events) - (0.5 if tick == "before" else 0.0)
            if target > self.now:
                self.clock.now = target
        else:
            self.clock.advance(tick)
        self._settle()
        # The model settles every queue at this time, so the store must run the
        # passes of every queue now too: what a pass left (the levels a message
        # had gained when its TTL made it a dead letter) depends on when it ran.
        for handle in self.handles.values():
            handle.stats()

    @rule(tick=st.sampled_from(["event", "before"]))
    def advance_to_next_event(self, tick: str) -> None:
        self._tick(tick)

    # -- inspection -----------------------------------------------------------

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), name=st.sampled_from(NAMES), tick=ticks)
    def get(self, data: st.DataObject, name: str, tick: Any) -> None:
        self._tick(tick)
        mid = data.draw(st.sampled_from(self.ids))
        self.model[name].settle(self.now)
        rec = self.model[name].msgs.get(mid)
        got, err = outcome(lambda: self.handles[name].get(mid))
        if rec is None:
            assert err is qstore.MessageNotFound
        else:
            assert err is None
            self._check_seen(got, rec, name)

    @rule(name=st.sampled_from(NAMES), n=st.integers(1, 3),
          tick=st.sampled_from([None, "event", "event", 1]))
    def redrive(self, name: str, n: int, tick: Any) -> None:
        self._tick(tick)
        mq = self.model[name]
        mq.settle(self.now)
        want = mq.dead()[:n]
        assert self.handles[name].redrive(n) == len(want)
        for rec in want:  # ready again, without its reason (and without a TTL)
            rec.state, rec.attempts, rec.reason = "ready", 0, None
            # It dedups again, unless a live message (or an earlier letter of
            # this redrive) holds its key by now.
            if rec.kept is not None and mq.live_with(rec.kept) is None:
                rec.digest = rec.kept
            rec.kept = None

    @rule(name=st.sampled_from(NAMES), go=st.integers(0, 3))
    def purge(self, name: str, go: int) -> None:
        if go:  # purge only now and then, or queues would rarely grow
            return
        mq = self.model[name]
        assert self.handles[name].purge() == len(mq.msgs)
        mq.msgs.clear()

    @rule(go=st.integers(0, 3))
    def reopen(self, go: int) -> None:
        if go:  # reopening costs tens of ms: now and then is enough
            return
        assert self.store is not None
        self.store.close()
        self.store = qstore.open(self.path, **self.options)
        assert self.store.queues() == list(NAMES)
        for name, mq in self.model.items():
            q = self.handles[name] = self.store.queue(name)
            assert (q.order, q.priority_type, q.max_attempts, q.dedup) == (
                mq.order, mq.ptype, mq.max_attempts, mq.dedup)
            mq.fill_bucket(self.now)  # the bucket lives in memory: full again

    @rule(name=st.sampled_from(NAMES), what=st.sampled_from(["ttl", "on_expire", "rate"]),
          ttl=ttls, on_expire=on_expires, rate=rates, go=st.integers(0, 2))
    def configure(self, name: str, what: str, ttl: float | None, on_expire: str,
                  rate: tuple[int, float] | None, go: int) -> None:
        """Change one option of a live queue; messages keep the TTL they were given."""
        if go:
            return
        assert self.store is not None
        value = {"ttl": ttl, "on_expire": on_expire, "rate": rate}[what]
        self.handles[name] = self.store.configure_queue(name, **{what: value})
        mq = self.model[name]
        old_rate = mq.opts.rate
        setattr(mq.opts, what, value)
        if what == "rate" and value != old_rate:
            mq.fill_bucket(self.now)

    @rule(name=st.sampled_from(NAMES), rate=st.sampled_from([None, *RATES]),
          go=st.integers(0, 1))
    def configure_rate(self, name: str, rate: tuple[int, float] | None, go: int) -> None:
        """A new rate starts a full bucket; the same rate keeps the bucket; None lifts it."""
        if go:
            return
        assert self.store is not None
        self.handles[name] = self.store.configure_queue(name, rate=rate)
        mq = self.model[name]
        old, mq.opts.rate = mq.opts.rate, rate
        if rate != old:
            mq.fill_bucket(self.now)

    @rule(name=st.sampled_from(NAMES), aging=st.sampled_from([None, 0.5, 1, 2.5, 4, 8]),
          cap=aging_caps, keep_cap=st.booleans(), go=st.integers(0, 1))
    def configure_aging(self, name: str, aging: float | None, cap: int | None,
                        keep_cap: bool, go: int) -> None:
        """Change or remove the aging period (and maybe the cap) of a live queue; on a
        queue that cannot age (str priorities, fifo) setting a period or a cap is
        refused."""
        if go:
            return
        assert self.store is not None
        mq = self.model[name]
        args: dict[str, Any] = {"aging": aging} if keep_cap else {"aging": aging,
                                                                  "aging_cap": cap}
        can_age = mq.ptype == "int" and mq.order != "fifo"
        store = self.store
        got, err = outcome(lambda: store.configure_queue(name, **args))
        if not can_age and (aging is not None or (not keep_cap and cap is not None)):
            assert err is qstore.InvalidArgument
            return
        assert err is None
        self.handles[name] = got
        mq.settle(self.now)  # what was gained by now under the old options stays
        mq.opts.aging = aging
        if not keep_cap:
            mq.opts.aging_cap = cap
        event(f"configure_aging: {'removed' if aging is None else 'set'}, "
              f"{'with' if mq.ready() else 'without'} ready messages")

    # -- invariants -----------------------------------------------------------

    @invariant()
    def counters_equal_model_and_recount(self) -> None:
        if self.store is None:
            return
        for name, mq in self.model.items():
            mq.settle(self.now)
            assert assert_consistent(self.store, self.handles[name]) == mq.counts()
            st_ = self.handles[name].stats()
            o = mq.opts
            assert (st_.expired, st_.ttl, st_.on_expire, st_.aging, st_.aging_cap, st_.rate) == (
                mq.expired, o.ttl, o.on_expire, o.aging, o.aging_cap, o.rate)

    @invariant()
    def peek_and_dead_letters_equal_model(self) -> None:
        """peek(n) is the ready set in pop order; dead_letters(n) the dead set by id."""
        if self.store is None:
            return
        for name, mq in self.model.items():
            mq.settle(self.now)
            q = self.handles[name]
            for got, want in ((q.peek(len(mq.msgs) + 1), mq.ready()),
                              (q.dead_letters(len(mq.msgs) + 1), mq.dead())):
                assert [m.id for m in got] == [r.id for r in want]
                for msg, rec in zip(got, want, strict=True):
                    self._check_seen(msg, rec, name)
            ready = mq.ready()
            if len(ready) > 1:  # a short peek is the head of the long one
                assert [m.id for m in q.peek(2)] == [r.id for r in ready[:2]]


MODEL_SETTINGS = settings(
    max_examples=int(os.environ.get("QSTORE_MODEL_EXAMPLES", "30")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize("order", ["max", "min", "fifo"])
def test_store_behaves_like_the_model(order: str) -> None:
    machine = type(f"QueueMachine_{order}", (QueueMachine,), {"ORDER": order})
    run_state_machine_as_test(machine, settings=MODEL_SETTINGS)
