"""pop(wait=...) measured by the store's clock (qstore/_waits.py).

With an injected clock the deadline, the rate-limit tokens and the due
messages are all times of that clock: a test decides a wait's outcome by
moving the clock (from another thread, which wakes the waiter) or with an
autojump clock, and nothing sleeps.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qstore
from qstore._rate import TokenBucket
from tests.conftest import FakeClock, wait_blocks


def _waiter(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.update(got=fn()))
    t.start()
    return t, result


def test_a_wait_ends_when_the_injected_clock_reaches_its_deadline(store_path: str) -> None:
    clock = FakeClock()
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.create_queue("q")
        t, result = _waiter(lambda: q.pop(wait=30.0))
        wait_blocks(clock, 1)
        clock.advance(29.5)  # wakes the waiter: half a second left, it blocks again
        wait_blocks(clock, 2)
        assert t.is_alive()
        clock.advance(0.5)
        t.join(30.0)
        assert not t.is_alive() and result == {"got": None}


def test_a_rate_limited_waiter_gets_its_message_when_the_clock_reaches_the_token(
        store_path: str) -> None:
    clock = FakeClock()
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.create_queue("q", rate=(1, 4.0))
        q.push_many([b"a", b"b"])
        assert q.pop() is not None  # the only token
        t, result = _waiter(lambda: q.pop(wait=60.0))
        wait_blocks(clock, 1)
        clock.advance(3.5)  # no token yet: blocks again
        wait_blocks(clock, 2)
        assert t.is_alive()
        clock.advance(0.5)
        t.join(30.0)
        assert not t.is_alive() and result["got"].payload == b"b"


@pytest.mark.parametrize("new_rate", [None, (1000, 1.0)])
def test_lifting_a_rate_limit_wakes_a_pop_waiting_for_a_token(store_path: str,
                                                              new_rate: Any) -> None:
    # The waiter slept until the old bucket's next token or its own deadline, with
    # the message ready and no longer limited (a configuration audit): here an
    # hour, with the clock never moved.
    clock = FakeClock()
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.create_queue("q", rate=(1, 3600.0))
        q.push_many([b"a", b"b"])
        assert q.pop() is not None  # the only token for an hour
        t, result = _waiter(lambda: q.pop(wait=7200.0))
        wait_blocks(clock, 1)
        s.configure_queue("q", rate=new_rate)
        t.join(30.0)
        assert not t.is_alive() and result["got"].payload == b"b"


def test_an_autojump_clock_decides_waits_at_once(store_path: str) -> None:
    clock = FakeClock(autojump=True)
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.create_queue("q")
        q.push(b"later", delay=5.0)
        assert q.pop(wait=2.0) is None  # due after the deadline
        assert clock.jumps == [2.0]
        got = q.pop_many(3, wait=10.0)  # due 3 s later: the wait wakes then
        assert [m.payload for m in got] == [b"later"] and clock.jumps == [2.0, 3.0]
        # Its lease runs out in 30 s: that is when the next waiter gets it back.
        again = q.pop(lease=1.0, wait=100.0)
        assert again is not None and again.attempts == 2 and clock.jumps[-1] == 30.0
        assert not s.core.waiters


def test_a_clock_that_tells_of_its_moves_is_let_go_at_close(store_path: str) -> None:
    clock = FakeClock()
    s = qstore.open(store_path, clock=clock, compactor=False)
    assert len(clock._subscribers) == 1
    s.close()
    s.close()
    assert clock._subscribers == []


class _BadSleepClock(FakeClock):
    def deadline_to_sleep_time(self, deadline: float) -> float:
        return math.nan


def test_a_clock_giving_a_bad_sleep_time_is_an_error_not_a_hang(store_path: str) -> None:
    with qstore.open(store_path, clock=_BadSleepClock(), compactor=False) as s:
        q = s.create_queue("q")
        with pytest.raises(qstore.InvalidArgument, match="deadline_to_sleep_time"):
            q.pop(wait=1.0)
        assert not s.core.waiters


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 7), per=st.sampled_from([10.0, 3.0, 0.7, 1e-3, 86400.0, 1 / 3]),
       start=st.floats(0.0, 2e9), gap=st.floats(0.0, 50.0), k=st.integers(1, 7))
def test_the_next_token_time_finds_a_token_despite_rounding(n: int, per: float, start: float,
                                                           gap: float, k: int) -> None:
    """A waiter woken at next_token_at(now) finds a token there (a rounding shortfall
    would have it wait again for a time that rounds to now: a spin)."""
    b = TokenBucket(n, per, start)
    b.take(start, min(k, n))
    now = start + gap
    t = b.next_token_at(now)
    assert t >= now
    assert t <= now + b.wait_time(now) + 1e-6 * max(1.0, per)
    if b.available(now) == 0:
        assert b.available(t) >= 1


def test_deleting_the_queue_ends_a_wait_on_it_at_once(store_path: str) -> None:
    # The waiter slept out the rest of its wait, then raised QueueNotFound (an API
    # audit: 4.8 s after the delete); a server's parked pop the same.
    clock = FakeClock()
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.create_queue("q")
        result: dict[str, Any] = {}

        def pop() -> None:
            try:
                result["got"] = q.pop(wait=30.0)
            except qstore.QueueNotFound as exc:
                result["error"] = exc

        t = threading.Thread(target=pop, daemon=True)
        t.start()
        wait_blocks(clock, 1)
        s.delete_queue("q")
        t.join(30.0)  # the clock never moves: only the delete can end the wait
        assert not t.is_alive() and isinstance(result.get("error"), qstore.QueueNotFound)
