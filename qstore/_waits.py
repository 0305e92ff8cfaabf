"""Blocking by the store's clock: how long a waiting pop blocks, and what wakes it.

A ``pop(wait=...)`` decides everything by the store's clock (``qstore.open(...,
clock=...)``): its deadline is ``clock() + wait``, a rate-limit token and a due
message (delay, lease, TTL) are due at times of that clock, and it gives up once
that clock reads the deadline. Only the length of each real block on
``Core.ready`` is not a time of that clock, and an injected clock may decide it
through two optional methods:

- ``clock.deadline_to_sleep_time(deadline) -> float`` (the name and meaning of
  trio's ``Clock`` method): how many real seconds to block for the clock to
  reach ``deadline``. Without it, ``deadline - clock()``: the clock is taken to
  run at the speed of real time. A clock that moves only when a test moves it
  returns ``math.inf`` (block until woken); one that jumps ("autojump") moves
  itself to ``deadline`` and returns 0, so the wait's outcome is decided at once,
  without any real sleep.
- ``clock.subscribe(callback)`` and ``clock.unsubscribe(callback)``: the store
  subscribes when it opens and unsubscribes when it closes. A clock that calls
  its subscribers after it moves (from any thread, holding no lock that its
  reads take) wakes the blocked pops, which read it again.

The default clock, ``time.time``, has neither: a blocked pop wakes when ready
keys are added (push, nack, redrive, a promotion), when the store closes, or
when its next due time comes; its deadline is measured by ``time.monotonic``
(``Core.wait_clock``), so that a step of the wall clock neither stretches nor
cuts a wait.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from ._errors import InvalidArgument

# The shortest real block: a due time a retry could not clear (a bounded pass
# that goes on in the next call) is retried after this, never in a busy loop.
MIN_BLOCK = 0.001


def sleep_time_of(clock: Any, read: Callable[[], float]) -> Callable[[float], float | None]:
    """``f(until)``: real seconds to block for the store's clock to read ``until``
    (None: until woken; 0 or less: do not block, the clock is there already).

    ``clock`` is the object given to ``qstore.open``; ``read`` reads it checked.
    """
    hook = getattr(clock, "deadline_to_sleep_time", None)

    def sleep_time(until: float) -> float | None:
        now = read()
        if until <= now:  # due already: a retry did not clear it (see MIN_BLOCK)
            return MIN_BLOCK
        if hook is None:
            return until - now
        seconds = hook(until)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                or math.isnan(seconds):
            raise InvalidArgument(f"the store's clock's deadline_to_sleep_time returned "
                                  f"{seconds!r:.60}, not a number of seconds")
        return None if seconds > threading.TIMEOUT_MAX else float(seconds)

    return sleep_time


def watch(clock: Any, callback: Callable[[], None]) -> Callable[[], None]:
    """Subscribe ``callback`` to the moves of ``clock`` if it tells of them; returns
    the call that unsubscribes it (nothing to do for a clock that does not)."""
    subscribe = getattr(clock, "subscribe", None)
    unsubscribe = getattr(clock, "unsubscribe", None)
    if subscribe is None or unsubscribe is None:
        return _nothing
    subscribe(callback)
    subscribed = [True]

    def unwatch() -> None:  # once, however often the store is closed
        if subscribed:
            subscribed.clear()
            unsubscribe(callback)

    return unwatch


def _nothing() -> None:
    pass
