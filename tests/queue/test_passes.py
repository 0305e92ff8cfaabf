"""The time-driven passes over a large due backlog: bounded batches, the writer lock let
go between them, no expired message delivered meanwhile, progress on a stopped clock."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import qstore
from qstore import _aging
from qstore import _timers as timers
from tests.conftest import FakeClock

from ._support import assert_consistent

N = 12_000  # over two promote() budgets


@pytest.fixture
def store(store_path: str, clock: FakeClock) -> Iterator[qstore.Store]:
    """No sweeper pass during a test: the calls under test are the only ones."""
    with qstore.open(store_path, clock=clock, compactor=False, sweep_interval=3600.0) as s:
        yield s


@pytest.fixture
def small_budget(monkeypatch: pytest.MonkeyPatch) -> int:
    """A smaller budget and batch, so that a few thousand messages span many calls."""
    monkeypatch.setattr(timers, "BUDGET", 2_000)
    monkeypatch.setattr(timers, "PROMOTE_BATCH", 500)
    return 2_000


def _spy_promote(monkeypatch: pytest.MonkeyPatch, store: qstore.Store,
                 q: qstore.Queue) -> list[tuple[int, int]]:
    """Record (lock recursion count at entry, messages expired) of each promote() call."""
    calls: list[tuple[int, int]] = []
    real = timers.promote
    state = store.core.queues[q.name]

    def spy(core: Any, qs: Any, now_us: int, budget: int | None = None) -> bool:
        held = core.lock._recursion_count()
        before = state.expired
        done = real(core, qs, now_us) if budget is None else real(core, qs, now_us, budget)
        calls.append((held, state.expired - before))
        return done

    monkeypatch.setattr(timers, "promote", spy)
    return calls


def test_expiry_of_a_large_backlog_runs_in_bounded_calls_letting_go_of_the_lock(
        store: qstore.Store, clock: FakeClock, monkeypatch: pytest.MonkeyPatch,
        small_budget: int) -> None:
    q = store.create_queue("q")
    for _ in range(0, N, 4_000):
        q.push_many([(b"x", 1)] * 4_000, ttl=10)
    keep = q.push(b"keep", priority=0)
    clock.advance(11)
    calls = _spy_promote(monkeypatch, store, q)
    stats = q.stats()
    assert stats.expired == N and stats.ready == 1
    # Each call took the writer lock afresh (held once: by catch_up itself, not by
    # a caller across calls) and did at most one budget of work.
    assert len(calls) >= N // small_budget
    assert all(held == 1 for held, _ in calls[:-1])
    assert all(0 <= n <= small_budget for _, n in calls)
    assert sum(n for _, n in calls) == N
    m = q.pop()
    assert m is not None and m.id == keep
    assert_consistent(store, q)


@pytest.mark.parametrize("call", ["store_stats", "configure_queue"])
def test_store_wide_calls_run_a_large_expiry_letting_go_of_the_lock(
        store: qstore.Store, clock: FakeClock, monkeypatch: pytest.MonkeyPatch,
        small_budget: int, call: str) -> None:
    """store.stats() (`qstore stats`) and configure_queue also run the passes one
    call per hold of the writer lock, not all of them under one hold."""
    q = store.create_queue("q")
    for _ in range(0, N, 4_000):
        q.push_many([(b"x", 1)] * 4_000, ttl=10)
    clock.advance(11)
    calls = _spy_promote(monkeypatch, store, q)
    if call == "store_stats":
        assert store.stats().queues[0].expired == N
    else:
        store.configure_queue("q", ttl=60)
        assert q.stats().expired == N
    assert len(calls) >= N // small_budget
    assert all(held == 1 for held, _ in calls[:-1])
    assert sum(n for _, n in calls) == N


def test_a_pop_behind_a_large_expiry_never_delivers_an_expired_message(
        store: qstore.Store, clock: FakeClock, small_budget: int) -> None:
    q = store.create_queue("q")
    # Expired messages ahead of the live one in pop order (higher priority), whose
    # expiry times come after those of a lower, earlier-expiring group: the
    # expiry pass (in expiry-time order) does not reach them first.
    q.push_many([(b"low", 0)] * 5_000, ttl=5)
    q.push_many([(b"high", 9)] * 3_000, ttl=10)
    live = q.push(b"live", priority=5)
    clock.advance(11)
    m = q.pop()
    assert m is not None and m.id == live and m.payload == b"live"
    state = store.core.queues["q"]
    assert state.expired < 8_000  # the pass is not over: the pop did not wait for it
    q.ack(m)
    assert q.stats().expired == 8_000 and q.stats().total == 0
    assert_consistent(store, q)


def test_expiry_makes_progress_on_a_stopped_clock(store: qstore.Store, clock: FakeClock,
                                                  small_budget: int) -> None:
    q = store.create_queue("q")
    live = q.push_many([(b"live", 9)] * 5)
    q.push_many([(b"x", 0)] * 7_000, ttl=1)
    clock.advance(2)  # and never again
    state = store.core.queues["q"]
    seen = []
    for mid in live:
        m = q.pop()  # each pop goes on with the pass where the last one stopped
        assert m is not None and m.id == mid
        seen.append(state.expired)
    assert seen == [2_000, 4_000, 6_000, 7_000, 7_000]
    assert q.stats().expired == 7_000 and q.stats().in_flight == 5
    assert_consistent(store, q)


def test_aging_past_a_level_head_of_capped_messages_on_a_stopped_clock(
        store: qstore.Store, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_aging, "SCAN", 100)
    q = store.create_queue("q", aging=10, aging_cap=1)
    capped = q.push_many([(b"old", 0)] * 250)
    clock.advance(10)
    assert q.stats().ready == 250
    assert {q.get(i).priority for i in capped} == {1}  # capped at one level
    young = q.push_many([(b"young", 1)] * 5)  # behind 250 capped messages in level 1
    clock.advance(10)  # and never again: the young ones are due
    state = store.core.queues["q"]
    for _ in range(10):
        q.peek(1)
    assert [q.get(i).priority for i in young] == [2] * 5
    assert {q.get(i).priority for i in capped} == {1}
    assert state.aging_round is None  # the round is over
    popped = q.pop_many(5)
    assert [m.id for m in popped] == young
    assert_consistent(store, q)


def test_aging_a_backlog_larger_than_one_call_on_a_stopped_clock(
        store: qstore.Store, clock: FakeClock, small_budget: int) -> None:
    q = store.create_queue("q", aging=10)
    ids = []
    for _ in range(3):
        ids += q.push_many([(b"m", 0)] * 2_000)
    clock.advance(10)  # and never again
    state = store.core.queues["q"]
    # Each pop goes on with the round where the last one stopped.
    for _ in range(5):
        q.pop_many(1)
        if state.aging_round is None:
            break
    assert state.aging_round is None
    assert {q.get(i).priority for i in ids[5:]} == {1}
    assert_consistent(store, q)


def test_a_key_written_behind_the_resume_point_by_a_clock_that_went_back_is_not_skipped(
        store: qstore.Store, clock: FakeClock, small_budget: int) -> None:
    q = store.create_queue("q")
    live = q.push(b"live", priority=9)
    q.push_many([(b"x", 0)] * 5_000, ttl=10)
    start = clock.now
    clock.advance(11)
    m = q.pop()  # one call of the pass: it stops part way, with a resume point
    assert m is not None and m.id == live
    state = store.core.queues["q"]
    assert 0 < state.expired < 5_000 and state.cursors
    clock.now = start - 5  # the clock goes back; a TTL runs out before the resume point
    early = q.push(b"early", ttl=1)
    clock.now = start + 11
    stats = q.stats()
    assert stats.expired == 5_001 and stats.ready == 0
    with pytest.raises(qstore.MessageNotFound):
        q.get(early)
    assert_consistent(store, q)
