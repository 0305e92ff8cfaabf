"""The token bucket of a rate-limited queue (``create_queue(..., rate=(n, per))``).

A bucket holds at most ``n`` tokens and gains ``n / per`` tokens a second; a
pop takes one token per message it returns. The bucket lives in memory only
(a restart starts it full); its configuration persists in the queue record.
Time is whatever clock the store was given: the bucket never reads the wall
clock itself, so tests drive it with a fake clock.
"""

from __future__ import annotations


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
