"""Priority aging and rate limits (contract section 10), driven by the injected clock."""

from __future__ import annotations

import pytest

import qstore
from qstore import _aging
from tests.conftest import FakeClock

from ._support import assert_consistent


def test_a_waiting_message_gains_one_level_per_period(store: qstore.Store,
                                                      clock: FakeClock) -> None:
    q = store.create_queue("q", aging=10)
    low = q.push(b"low", priority=1)
    clock.advance(9)
    assert q.get(low).priority == 1
    clock.advance(1)
    assert q.peek()[0].priority == 2
    clock.advance(25)
    assert q.get(low).priority == 4  # 35 s: three levels
    q.push(b"new", priority=4)  # pushed later at the same level: pops after
    assert [m.payload for m in q.pop_many(2)] == [b"low", b"new"]
    assert_consistent(store, q)


def test_the_cap_bounds_the_levels_gained_and_min_order_ages_down(store: qstore.Store,
                                                                   clock: FakeClock) -> None:
    q = store.create_queue("q", order="min", aging=1, aging_cap=2)
    mid = q.push(b"x", priority=10)
    clock.advance(100)
    assert q.get(mid).priority == 8
    m = q.pop()
    assert m is not None
    q.nack(m)  # back at its aged place; it keeps the levels it gained
    clock.advance(100)
    assert q.get(mid).priority == 8
    assert_consistent(store, q)


def _starve(store: qstore.Store, clock: FakeClock, aging: float | None) -> int | None:
    """A steady stream of priority-9 pushes, one pop a second; when the old low pops."""
    q = store.create_queue("s", aging=aging)
    q.push(b"old", priority=0)
    for second in range(1, 200):
        q.push(b"high", priority=9)
        clock.advance(1)
        m = q.pop()
        assert m is not None
        q.ack(m)
        if m.payload == b"old":
            return second
    return None


@pytest.mark.parametrize("order", ["max", "min"])
@pytest.mark.parametrize("aging", [1e-300, 5e-324])
def test_a_tiny_aging_period_clamps_at_the_priority_range(store_path: str, order: str,
                                                          aging: float) -> None:
    # 1e-300 s a level: billions of billions of levels in a second. The levels a
    # message can gain stop at the span of int priorities, so its record still
    # encodes (an OverflowError on every pop, peek and stats before, also after
    # a reopen), and the priority stops at the end of the range. 5e-324 s (the
    # smallest float) made the levels an infinite float, which int() refused:
    # every pop, peek, stats and configure_queue of the queue raised
    # OverflowError for good (a configuration audit).
    clock = FakeClock()
    end = 2**63 - 1 if order == "max" else -(2**63)
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.create_queue("q", aging=aging, order=order)
        first, second = q.push(b"a", priority=0), q.push(b"b", priority=5)
        clock.advance(10)
        assert [(m.id, m.priority) for m in q.peek(2)] == [(first, end), (second, end)]
        assert len(q) == 2 and s.stats().queues[0].ready == 2
        # Nothing more to gain: no aging step is due any more, so the pass does
        # not run again on every call.
        assert s.core.queues["q"].next_event_us == 2**64
        assert_consistent(s, q)
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        m = s.queue("q").pop()
        assert m is not None and (m.id, m.priority) == (first, end)
        assert_consistent(s, s.queue("q"))


def test_the_skips_of_capped_levels_go_with_the_levels(store: qstore.Store,
                                                      clock: FakeClock) -> None:
    # Each level whose head held capped messages kept its aging skip after it
    # emptied: with distinct priorities (timestamps, scores), two entries a message
    # drained, 162,000 on an empty queue after 80 rounds (a resource audit).
    q = store.create_queue("q", aging=1, aging_cap=1)
    skip = store.core.queues["q"].heads.aging_skip
    sizes = []
    for r in range(4):
        q.push_many([(b"x", r * 1000 + 2 * i) for i in range(100)])
        clock.advance(5)
        q.stats()  # every message gains its one level: all capped
        clock.advance(5)
        q.stats()  # the next round skips them, and notes where
        assert skip  # the skips are in use
        while got := q.pop_many(100):
            q.ack_many(got)
        sizes.append(len(skip))
    # At most a round's levels and the last round's: not 200 more every round.
    assert max(sizes) <= 200, sizes


def test_aging_ends_starvation_within_the_documented_bound(store: qstore.Store,
                                                           clock: FakeClock) -> None:
    # Documented bound (qstore/_aging.py): it reaches the top level P = 9 at
    # t + (P - p) * a and pops then, ahead of every later push at 9 (nothing older
    # is left at 9: one pop a second keeps up with one push a second).
    popped = _starve(store, clock, aging=5)
    assert popped == 9 * 5
    assert store.queue("s").stats().ready == 1  # the one high pushed in that second


def test_without_aging_the_old_message_starves(store: qstore.Store, clock: FakeClock) -> None:
    assert _starve(store, clock, aging=None) is None


def test_aging_reads_the_heads_of_levels_not_the_backlog(store: qstore.Store,
                                                         clock: FakeClock) -> None:
    q = store.create_queue("q", aging=60)
    old = q.push_many([(b"old", p) for p in range(5)])
    clock.advance(30)
    q.push_many([(b"young", p) for p in range(5) for _ in range(200)])
    clock.advance(30)
    meta = store.core.meta
    read = 0
    scan_keys = meta.scan_keys

    def logged(lo: bytes, hi: bytes, limit: int | None = None) -> list[bytes]:
        nonlocal read
        found = scan_keys(lo, hi, limit)
        read += len(found)
        return found

    meta.scan_keys = logged  # type: ignore[method-assign]
    q.stats()  # runs the aging pass: the five old ones each gain a level
    meta.scan_keys = scan_keys  # type: ignore[method-assign]
    assert read <= 2 * 5 + 5  # per level: its old head and the first young one
    assert [q.get(i).priority for i in old] == [1, 2, 3, 4, 5]
    assert_consistent(store, q)


def test_rounds_do_not_read_again_the_capped_messages_at_a_levels_head(
        store: qstore.Store, clock: FakeClock) -> None:
    # 400 messages reach the cap and wait at the head of their level (no
    # consumer); every later round reads past them, not through them, until a
    # nack puts a key below them, and a message aged into the level after
    # them is still aged on.
    q = store.create_queue("q", aging=1.0, aging_cap=2)
    capped = q.push_many([(b"capped", 0)] * 400)
    clock.advance(3)
    q.stats()  # they gain their two levels
    assert {q.get(i).priority for i in capped} == {2}
    core = store.core
    read = 0
    records_of = core.records_of

    def counted(state: object, index_keys: list[bytes]) -> object:
        nonlocal read
        read += len(index_keys)
        return records_of(state, index_keys)  # type: ignore[arg-type]

    core.records_of = counted  # type: ignore[method-assign,assignment]
    q.push(b"later", 0)
    clock.advance(1.0)
    q.stats()  # the next round reads the level's head once and finds them capped
    assert read >= 400
    for _ in range(20):
        later = q.push(b"later", 0)
        clock.advance(1.0)
        read = 0
        q.stats()
        assert read < 10, read  # not the 400 capped ones
    clock.advance(2.0)
    q.stats()
    assert q.get(later).priority == 2  # aged on, behind the capped run
    m = q.pop(lease=60.0)  # a capped one, given back below the skip: read again
    assert m is not None and m.priority == 2
    q.nack(m)
    read = 0
    clock.advance(1.0)
    q.stats()
    assert read >= 400
    core.records_of = records_of  # type: ignore[method-assign]
    assert_consistent(store, q)


@pytest.mark.parametrize("start", [1_700_000_651.5929728, 1_700_000_000.0, 1_234_567_890.123457])
def test_a_level_is_gained_exactly_k_periods_after_the_push(store_path: str,
                                                          start: float) -> None:
    # The pass compared a clock cut to whole microseconds with the uncut push
    # time: a level came up to 1 us late, and a message pushed at that instant at
    # the level popped before the older one (features audit).
    clock = FakeClock(start)
    with qstore.open(store_path, clock=clock, compactor=False, sweep_interval=3600.0) as s:
        q = s.create_queue("q", aging=10.0)
        old = q.push(b"old", priority=0)
        enqueued = q.get(old).enqueued_at
        clock.now = enqueued + 30.0  # exactly three periods
        new = q.push(b"new", priority=3)
        assert [(m.id, m.priority) for m in q.peek(2)] == [(old, 3), (new, 3)]
        clock.now = enqueued + 39.999  # not yet the fourth
        assert q.get(old).priority == 3
        assert_consistent(s, q)


def test_aging_plan_stops_at_the_first_message_not_old_enough() -> None:
    from qstore.meta import records

    rec_q = records.QueueRecord(1, "max", "int", 5, False, 0.0, aging=10)
    recs = [records.MessageRecord(0, 3, 1, 0, 1, 0, 0, at, 0, None) for at in (0.0, 5.0, 1.0)]
    plan = _aging.plan(rec_q, recs, 12_000_000)
    assert plan.moves == [(0, 4, 1)]  # the third is never looked at
    assert plan.next_us == 15_000_000


@pytest.mark.parametrize(("how", "priority"), [
    ("ready", 1),  # a level at 5 s, the TTL at 6 s
    ("delayed", 1),  # ready at 5.5 s: the level due at 5 s comes at once
    ("delayed past the TTL", 0),  # never ready: no level
    ("lease ran out", 1),  # ready again at 2 s
])
@pytest.mark.parametrize("look", [True, False], ids=["passes look", "no pass"])
def test_a_dead_letter_of_its_ttl_keeps_the_levels_it_gained_before(
        store_path: str, clock: FakeClock, how: str, priority: int, look: bool) -> None:
    # With on_expire="dead", a level that fell due before the TTL was kept only if
    # a pass looked in between: the dead letter's priority (and the pop order
    # after a redrive with aging off) depended on when a pass last looked (a
    # features model audit, the same embedded and through a server).
    with qstore.open(store_path, clock=clock, compactor=False, sweep_interval=3600) as s:
        q = s.create_queue("q", aging=5, ttl=6, on_expire="dead")
        delay = {"delayed": 5.5, "delayed past the TTL": 7.0}.get(how, 0.0)
        mid = q.push(b"m", priority=0, delay=delay)
        if how == "lease ran out":
            assert q.pop(lease=2.0) is not None
        for _ in range(20):
            clock.advance(0.5)
            if look:
                q.stats()  # a pass runs whenever something is due
        [dead] = q.dead_letters()
        assert (dead.id, dead.priority) == (mid, priority)
        s.configure_queue("q", aging=None)
        later = q.push(b"later", priority=1)
        q.redrive()
        order = [m.id for m in q.pop_many(2)]
        assert order == ([mid, later] if priority == 1 else [later, mid])


def test_a_rate_limit_hands_out_tokens_over_time(store: qstore.Store, clock: FakeClock) -> None:
    q = store.create_queue("q", rate=(2, 1.0))
    q.push_many([b"m"] * 10)
    assert len(q.pop_many(5)) == 2  # the bucket starts full: two tokens
    assert q.pop() is None
    clock.advance(0.5)
    assert q.pop() is not None
    assert q.pop() is None
    clock.advance(10)  # at most n tokens pile up
    assert len(q.pop_many(10)) == 2
    store.configure_queue("q", rate=None)
    assert len(q.pop_many(10)) == 5
    assert_consistent(store, q)


def test_a_rate_limited_pop_waits_for_its_token_not_for_the_store(store_path: str) -> None:
    clock = FakeClock(autojump=True)  # jumps to each time the store waits for
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.create_queue("q", rate=(1, 4.0))
        q.push_many([b"a", b"b", b"c"])
        assert q.pop() is not None
        start = clock.now
        m = q.pop(wait=60)
        assert m is not None and m.payload == b"b"
        assert clock.jumps == [4.0] and clock.now == start + 4.0  # one wake-up, on time
        assert q.pop(wait=3.0) is None  # the next token is 4 s away: the deadline first
        assert clock.jumps == [4.0, 3.0]
        assert [x.payload for x in q.pop_many(5, wait=60)] == [b"c"]  # 1 s later
        assert clock.jumps == [4.0, 3.0, 1.0]


def test_rate_bucket_arithmetic() -> None:
    from qstore._rate import TokenBucket

    b = TokenBucket(3, 3.0, 100.0)
    assert b.available(100.0) == 3
    b.take(100.0, 3)
    assert b.wait_time(100.0) == pytest.approx(1.0)
    assert b.available(101.0) == 1
    assert b.available(99.0) == 1  # a clock that went back takes nothing away
