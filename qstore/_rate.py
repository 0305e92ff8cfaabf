"""The token bucket of a rate-limited queue (``create_queue(..., rate=(n, per))``).

A bucket holds at most ``n`` tokens and gains ``n / per`` tokens a second; a
pop takes one token per message it returns. The bucket lives in memory only
(a restart starts it full); its configuration persists in the queue record.
Time is whatever clock the store was given: the bucket never reads the wall
clock itself, so tests drive it with a fake clock.
"""

from __future__ import annotations

import math


class TokenBucket:
    __slots__ = ("capacity", "per", "tokens", "at")

    def __init__(self, n: int, per: float, now: float) -> None:
        self.capacity = n
        self.per = per
        self.tokens = float(n)  # starts full
        self.at = now

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.tokens = min(float(self.capacity),
                              self.tokens + (now - self.at) * self.capacity / self.per)
        self.at = now  # a clock that went back refills nothing and loses nothing

    def available(self, now: float) -> int:
        """Whole tokens there are at ``now``."""
        self._refill(now)
        return int(self.tokens + 1e-9)

    def take(self, now: float, n: int) -> None:
        """Take ``n`` tokens (no more than :meth:`available` said)."""
        self._refill(now)
        self.tokens = max(0.0, self.tokens - n)

    def wait_time(self, now: float) -> float:
        """Seconds from ``now`` until a whole token is there (0 if one is)."""
        self._refill(now)
        missing = 1.0 - self.tokens
        return 0.0 if missing <= 1e-9 else missing * self.per / self.capacity

    def next_token_at(self, now: float) -> float:
        """When a whole token is there: ``now + wait_time(now)``, or the few floats
        after it needed for :meth:`available` to say 1 there.

        ``now + wait_time(now)`` may fall a rounding error short of a whole token
        (times near 1.7e9 s are spaced 2.4e-7 s apart): a pop woken then would
        find none and wait again for a time that rounds to ``now``. Stepping to
        the next float until the refill reaches the token makes the wake-up exact.
        """
        self._refill(now)
        if self.tokens + 1e-9 >= 1.0:
            return now
        t = now + self.wait_time(now)
        for _ in range(64):  # a few steps at most; the bound only guards the loop
            # the very sum _refill will make at t
            if int(self.tokens + (t - self.at) * self.capacity / self.per + 1e-9) >= 1:
                break
            t = math.nextafter(t, math.inf)
        return t
