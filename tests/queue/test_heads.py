"""Pops never wade through the tombstones of acked messages (qstore/_heads.py).

Instead of timing pops, these tests record every range the queue reads from
the ready index and check that no range crosses the key of a message that was
already acked: each such key is a RocksDB tombstone a seek would step over.
"""

from __future__ import annotations

import bisect
import copy
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import qstore
from qstore import _heads
from qstore.meta import keys
from tests.conftest import FakeClock


class SeekLog:
    """Wraps MetaDB reads of the ready index and counts dead keys each one crossed."""

    def __init__(self, store: qstore.Store, qid: int, kind: bytes = keys.READY) -> None:
        self.dead: list[bytes] = []  # sorted index keys of acked messages
        self.crossed: list[int] = []
        self.base = keys.prefix(kind, qid)
        meta = store.core.meta
        scan_keys, first_key = meta.scan_keys, meta.first_key

        def logged_scan(lo: bytes, hi: bytes, limit: int | None = None) -> list[bytes]:
            found = scan_keys(lo, hi, limit)
            self._record(lo, found[0] if found else hi)
            return found

        def logged_first(lo: bytes, hi: bytes) -> bytes | None:
            found = first_key(lo, hi)
            self._record(lo, found if found is not None else hi)
            return found

        meta.scan_keys = logged_scan  # type: ignore[method-assign]
        meta.first_key = logged_first  # type: ignore[method-assign]

    def _record(self, lo: bytes, stop: bytes) -> None:
        if lo.startswith(self.base):
            self.crossed.append(bisect.bisect_left(self.dead, stop)
                                - bisect.bisect_left(self.dead, lo))

    def acked(self, key: bytes) -> None:
        bisect.insort(self.dead, key)


def ready_key(q: qstore.Queue, m: qstore.Message) -> bytes:
    pkey = keys.priority_key(q.order, q.priority_type, m.priority)
    return keys.ready_key(q._q.qid, pkey, m.id)


@pytest.fixture
def churn_store(store_path: str, clock: FakeClock) -> Iterator[qstore.Store]:
    s = qstore.open(store_path, clock=clock, compactor=False, sweep_interval=3600)
    yield s
    s.close()


@pytest.mark.parametrize("known_cap", [0, _heads.KNOWN_CAP], ids=["seeking", "known"])
@pytest.mark.parametrize("order", ["max", "min", "fifo"])
def test_push_pop_ack_churn_never_crosses_an_acked_key(churn_store: qstore.Store,
                                                       order: str, known_cap: int,
                                                       monkeypatch: Any) -> None:
    """With no known keys every pop seeks, past no tombstone; with them, none seeks."""
    monkeypatch.setattr(_heads, "KNOWN_CAP", known_cap)
    q = churn_store.create_queue("q", order=order)
    log = SeekLog(churn_store, q._q.qid)
    rng = random.Random(7)
    backlog = 3
    for _ in range(backlog):
        q.push(b"x", priority=rng.randrange(10))
    for _ in range(3000):
        q.push(b"x", priority=rng.randrange(10))
        m = q.pop()
        assert m is not None
        q.ack(m)
        log.acked(ready_key(q, m))
    assert len(log.dead) == 3000
    if known_cap:
        assert log.crossed == [], "a pop of keys this process pushed read the index"
    else:
        assert len(log.crossed) >= 3000
        assert max(log.crossed) == 0, "a pop read across acked messages' tombstones"
    assert q.stats().ready == backlog


@pytest.mark.parametrize("known_cap", [0, _heads.KNOWN_CAP], ids=["seeking", "known"])
def test_returned_messages_are_served_without_crossing_acked_keys(churn_store: qstore.Store,
                                                                  clock: FakeClock,
                                                                  known_cap: int,
                                                                  monkeypatch: Any) -> None:
    monkeypatch.setattr(_heads, "KNOWN_CAP", known_cap)
    q = churn_store.create_queue("q", max_attempts=1000)
    log = SeekLog(churn_store, q._q.qid)
    rng = random.Random(3)
    for _ in range(2000):
        q.push(b"x", priority=rng.randrange(5))
        q.push(b"y", priority=rng.randrange(5))
        a, b = q.pop(), q.pop()
        assert a is not None and b is not None
        q.ack(a)
        log.acked(ready_key(q, a))
        if rng.random() < 0.5:
            q.nack(b)  # back to its own place, behind the level's frontier
        else:
            clock.advance(31.0)  # the lease expires: also back to its own place
    assert max(log.crossed, default=0) == 0
    assert (log.crossed == []) == bool(known_cap)


def test_order_is_exact_with_tiny_caps(churn_store: qstore.Store, clock: FakeClock,
                                       monkeypatch: Any) -> None:
    """Past the caps the heads fall back to seeking; the order never changes."""
    monkeypatch.setattr(_heads, "RETURNS_CAP", 2)
    monkeypatch.setattr(_heads, "LEVEL_CAP", 3)
    monkeypatch.setattr(_heads, "KNOWN_CAP", 3)
    q = churn_store.create_queue("q", max_attempts=1000)
    rng = random.Random(11)
    model: dict[int, int] = {}  # id -> priority of ready messages
    for _ in range(300):
        action = rng.random()
        if action < 0.5 or not model:
            prio = rng.randrange(-20, 20)
            model[q.push(b"p", priority=prio)] = prio
        else:
            got = q.pop_many(rng.randrange(1, 4))
            expected = sorted(model, key=lambda i: (-model[i], i))[: len(got)]
            assert [m.id for m in got] == expected
            for m in got:
                if rng.random() < 0.5:
                    q.nack(m)
                else:
                    q.ack(m)
                    del model[m.id]
        peeked = [m.id for m in q.peek(5)]
        assert peeked == sorted(model, key=lambda i: (-model[i], i))[:5]


@pytest.mark.parametrize("reopened", [False, True])
def test_many_active_levels_cost_no_scan_of_all_of_them_each(
        store_path: str, clock: FakeClock, monkeypatch: Any, reopened: bool) -> None:
    # Past LEVEL_CAP levels, every new level scanned all of them for empty ones
    # to forget; with every level holding messages none went, so each push of a
    # new priority (or a pop learning one after a reopen) cost a scan of all:
    # 8,000 distinct priorities took 0.9 s to push, 32,000 took 30 s (scale audit).
    monkeypatch.setattr(_heads, "LEVEL_CAP", 64)
    visits = []
    real = _heads.ReadyHeads._forget_inactive

    def counted(self: _heads.ReadyHeads) -> None:
        visits.append(len(self.levels))
        real(self)

    monkeypatch.setattr(_heads.ReadyHeads, "_forget_inactive", counted)
    prios = random.Random(5).sample(range(-10**9, 10**9), 2_000)
    with qstore.open(store_path, clock=clock, compactor=False, sweep_interval=3600) as s:
        q = s.create_queue("q")
        for p in prios:
            q.push(b"x", priority=p)
        if reopened:
            s.close()
            visits.clear()
            s = qstore.open(store_path, clock=clock, compactor=False, sweep_interval=3600)
            q = s.queue("q")
        assert [m.priority for m in q.pop_many(2_000)] == sorted(prios, reverse=True)
        s.close()
    # Scans come as the levels double: a handful, visiting about 2x the levels in all.
    assert len(visits) <= 8 and sum(visits) <= 4 * len(prios), visits


@pytest.mark.parametrize("drain", ["pop", "pop_many"])
def test_levels_drained_by_pops_leave_the_active_list(store_path: str, clock: FakeClock,
                                                      drain: str) -> None:
    # A max-order queue whose priorities keep rising (timestamps, scores), drained
    # again and again: the level whose last key a pop took stayed active (maybe
    # set) although empty, and later pops found their keys in the newer levels
    # before it, so none ever looked: one stale active level per drain, kept for
    # the life of the process, and pops grew slower with them (20x after 20,000
    # drains; a resource audit). A pop_many drain left one when it ended on a
    # batch boundary.
    with qstore.open(store_path, clock=clock, compactor=False, sweep_interval=3600) as s:
        q = s.create_queue("q")
        heads = s.core.queues["q"].heads
        prio = 0
        for _ in range(200):
            for _ in range(5):
                prio += 1
                q.push(b"x", priority=prio)
            if drain == "pop":
                got = []
                while (m := q.pop()) is not None:
                    got.append(m)
            else:
                got = q.pop_many(5)
                assert q.pop_many(5) == []
            assert [m.priority for m in got] == list(range(prio, prio - 5, -1))
            q.ack_many(got)
            assert heads.active == []
        assert len(heads.levels) <= _heads.LEVEL_CAP


@pytest.mark.parametrize("last", ["exact", "over"])
def test_returns_past_the_cap_on_a_drained_level_are_found(
        store_path: str, clock: FakeClock, monkeypatch: Any, last: str) -> None:
    # More returns than RETURNS_CAP move the level's frontier back to the first of
    # them and forget them; on a level pops had drained (its maybe flag cleared)
    # nothing said to look there again: pop() returned None with every message
    # ready (a review; 65,537 nacks at the default cap).
    monkeypatch.setattr(_heads, "RETURNS_CAP", 8)
    with qstore.open(store_path, clock=clock, compactor=False, sweep_interval=3600) as s:
        q = s.create_queue("q")
        ids = q.push_many([b"m%d" % i for i in range(9)])
        got = q.pop_many(9 if last == "exact" else 20)
        assert [m.id for m in got] == ids
        for m in got:
            q.nack(m)
        assert q.stats().ready == 9
        assert [m.id for m in q.peek(20)] == ids
        assert [m.id for m in q.pop_many(20)] == ids


def test_reopened_store_learns_levels_and_keeps_order(store_path: str, clock: FakeClock) -> None:
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.create_queue("q", order="min", priority_type="str")
        ids = {q.push(b"x", priority=p): p for p in ["b", "a", "", "c\x00", "c", "a"]}
        m = q.pop()
        assert m is not None and m.priority == ""
        q.ack(m)
        del ids[m.id]
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.queue("q")
        got = q.pop_many(10)
        assert [m.id for m in got] == sorted(ids, key=lambda i: (ids[i].encode(), i))


def test_promotion_reads_each_acked_lease_tombstone_at_most_once(churn_store: qstore.Store,
                                                                 clock: FakeClock) -> None:
    """The in-flight index is read from a time floor, not from its start.

    Without the floor every promotion (the sweeper runs one a second once a
    lease is due) read the tombstones of every lease ever acked.
    """
    q = churn_store.create_queue("q")
    log = SeekLog(churn_store, q._q.qid, keys.INFLIGHT)
    for i in range(2000):
        q.push(b"x", priority=1)
        m = q.pop(lease=5.0)
        assert m is not None
        q.ack(m)
        assert m.lease_deadline is not None
        log.acked(keys.timed_key(keys.INFLIGHT, q._q.qid, keys.to_us(m.lease_deadline), m.id))
        if i % 20 == 0:
            q.push(b"held", priority=0)
            assert q.pop_many(1, lease=5.0)  # a lease left to expire
            clock.advance(10.0)
            q.stats()  # promotes the expired lease
    assert len(log.crossed) >= 100
    assert sum(log.crossed) <= len(log.dead), "promotions re-read old tombstones"


def test_expired_and_aged_keys_leave_the_heads_in_exact_order(churn_store: qstore.Store,
                                                              clock: FakeClock) -> None:
    """Expiry and aging delete ready keys behind the heads' back: ReadyHeads.removed.

    The pops after them return exactly the model's order, and no pop crosses
    the tombstone of a key that expiry or aging deleted.
    """
    q = churn_store.create_queue("q", aging=100)
    log = SeekLog(churn_store, q._q.qid)
    rng = random.Random(11)
    live: dict[int, tuple[int, float]] = {}  # id -> (priority, pushed at)
    for round_ in range(40):
        for _ in range(20):
            p = rng.randrange(4)
            ttl = rng.choice([None, None, 5.0, 50.0])
            mid = q.push(b"x", priority=p, ttl=ttl)
            live[mid] = (p, clock.now)
        clock.advance(rng.choice([1.0, 10.0, 60.0]))
        q.stats()  # expiry and aging passes
        for mid in list(live):
            try:
                m = q.get(mid)
            except qstore.MessageNotFound:  # expired: its key is a tombstone now
                log.acked(keys.ready_key(q._q.qid, keys.priority_key("max", "int",
                                                                       live[mid][0]), mid))
                del live[mid]
                continue
            key = ready_key(q, m)
            if m.priority != live[mid][0]:  # aged: its old key is a tombstone now
                log.acked(keys.ready_key(q._q.qid, keys.priority_key("max", "int",
                                                                       live[mid][0]), mid))
                live[mid] = (int(m.priority), live[mid][1])
            assert key
        want = sorted(live, key=lambda i: (-live[i][0], i))[:5]
        got = q.pop_many(5)
        assert [m.id for m in got] == want, f"round {round_}"
        for m in got:
            q.ack(m)
            log.acked(ready_key(q, m))
            del live[m.id]
    assert max(log.crossed, default=0) == 0, "a read crossed a deleted key"
    assert q.stats().expired > 0


def _level_state(heads: _heads.ReadyHeads) -> Any:
    return (heads.known_upto, heads.known_total, list(heads.active),
            {s: (lv.frontier, list(lv.returns), lv.maybe, lv.known[lv.k0:], lv.exact)
             for s, lv in heads.levels.items()})


def _churn(store: qstore.Store, seed: int, steps: int,
           push: Callable[[qstore.Queue, random.Random], object],
           pop: Callable[[qstore.Queue, random.Random], list[qstore.Message]]) -> None:
    """A random workload: pushes, pops (through ``pop``), nacks and acks."""
    rnd = random.Random(seed)
    q = store.create_queue("q")
    leased: list[qstore.Message] = []
    for _ in range(steps):
        op = rnd.random()
        if op < 0.45:
            push(q, rnd)
        elif op < 0.88:
            leased.extend(pop(q, rnd))
        elif leased:
            m = leased.pop(rnd.randrange(len(leased)))
            q.nack(m) if rnd.random() < 0.5 else q.ack(m)


@pytest.mark.parametrize("seed", range(3))
def test_the_single_pop_fast_path_matches_plan_and_taken(churn_store: qstore.Store,
                                                          clock: FakeClock, seed: int) -> None:
    # Before every single pop, the fast path (known_head/took_head) and the
    # general one (plan/taken) are run on copies of the heads: wherever the fast
    # path answers, it must pick the same key and leave the same knowledge.
    fast = 0

    def pop(q: qstore.Queue, rnd: random.Random) -> list[qstore.Message]:
        nonlocal fast
        a, b = copy.deepcopy(q._q.heads), copy.deepcopy(q._q.heads)
        head = a.known_head()
        plan = b.plan(churn_store.core.meta, 1)
        if head is not None:
            fast += 1
            assert plan.keys == [head]
            a.took_head(head)
            b.taken(plan)
            assert _level_state(a) == _level_state(b)
        m = q.pop()
        return [] if m is None else [m]

    _churn(churn_store, seed, 3000, lambda q, rnd: q.push(b"x", priority=rnd.randrange(4)), pop)
    assert fast > 500  # the fast path is the common one


@pytest.mark.parametrize("seed", range(3))
def test_taking_runs_of_known_keys_matches_taking_them_one_by_one(
        churn_store: qstore.Store, clock: FakeClock, seed: int) -> None:
    # taken() moves past a plan made only of known keys one level at a time;
    # the same plan taken key by key (as a plan with returns or seeks is) must
    # leave the same knowledge. Checked before every batch pop of a random
    # workload whose nacks put returns in the plans now and then.
    bulk = 0

    def pop(q: qstore.Queue, rnd: random.Random) -> list[qstore.Message]:
        nonlocal bulk
        n = rnd.randrange(1, 40)
        a, b = copy.deepcopy(q._q.heads), copy.deepcopy(q._q.heads)
        plan_a = a.plan(churn_store.core.meta, n)
        plan_b = b.plan(churn_store.core.meta, n)
        assert plan_a.keys == plan_b.keys
        bulk += not plan_a.mixed
        a.taken(plan_a)
        plan_b.mixed = True  # the key-by-key way
        b.taken(plan_b)
        assert _level_state(a) == _level_state(b)
        return q.pop_many(n, lease=60.0)

    _churn(churn_store, seed, 1500,
           lambda q, rnd: q.push_many([(b"x", rnd.randrange(4))
                                       for _ in range(rnd.randrange(1, 30))]), pop)
    assert bulk > 100


def test_pops_of_a_backlog_this_process_did_not_push_read_ahead(store_path: str,
                                                                 clock: FakeClock) -> None:
    # After a reopen no key is known: the first pop of a level seeks and reads
    # the next READ_AHEAD keys too, so the pops after it need no seek.
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.create_queue("q")
        ids = q.push_many([(b"m%d" % i, i % 3) for i in range(2000)])
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.queue("q")
        meta = s.core.meta
        reads: list[bytes] = []
        scan_keys, first_key = meta.scan_keys, meta.first_key

        def logged_scan(lo: bytes, hi: bytes, limit: int | None = None) -> list[bytes]:
            reads.append(lo)
            return scan_keys(lo, hi, limit)

        def logged_first(lo: bytes, hi: bytes) -> bytes | None:
            reads.append(lo)
            return first_key(lo, hi)

        meta.scan_keys = logged_scan  # type: ignore[method-assign]
        meta.first_key = logged_first  # type: ignore[method-assign]
        popped = [q.pop(lease=60.0) for _ in range(1000)]
        popped += q.pop_many(1000, lease=60.0)
        assert q.pop(lease=60.0) is None
        got = [m.id for m in popped if m is not None]
        # max order: priority 2 first, then 1, then 0, each level in push order
        assert got == sorted(ids, key=lambda i: (-(ids.index(i) % 3), i))
        levels = 3
        assert len(reads) <= 2000 // _heads.READ_AHEAD + 4 * levels  # not one seek a pop
        assert s.check().ok
