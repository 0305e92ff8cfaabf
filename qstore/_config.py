"""The store's configuration: a frozen, keyword-only, validated object."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, Literal

from ._errors import InvalidArgument

Durability = Literal["always", "interval", "none"]
Clock = Callable[[], float]

MiB = 1024 * 1024
MAX_INTERVAL = 100 * 366 * 86400  # seconds: a century, as for delays and leases
MAX_RECORD_LENGTH = 0xFFFF_FFFF  # a payload frame's u32 length field (docs/payload-format.md)


# The latest time a clock may return: far past any real date, and far enough below
# 2**64 microseconds that a time plus a century still fits a u64 key.
MAX_CLOCK = 1e13


def checked_clock(clock: Clock) -> Clock:
    """``clock``, refusing what it returns unless that is a finite time in [0, MAX_CLOCK].

    A NaN or infinite time would be stored in records and keys (NaN compares
    false with everything, so leases would never expire): the operation that
    read it raises InvalidArgument instead, before anything is written. The
    default ``time.time`` is trusted and not wrapped (the hot paths call it).
    """
    if clock is time.time:
        return clock

    def checked() -> float:
        now = clock()
        if type(now) is float and 0.0 <= now <= MAX_CLOCK:  # also false for nan
            return now
        if (isinstance(now, bool) or not isinstance(now, (int, float))
                or not 0 <= now <= MAX_CLOCK):
            raise InvalidArgument(f"the store's clock returned {now!r:.60}, not a finite "
                                  f"number of seconds since the epoch in [0, {MAX_CLOCK:.0e}]")
        return float(now)

    return checked


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Options of :func:`qstore.open`. Unknown options are an error."""

    readonly: bool = False
    durability: Durability = "interval"
    sync_interval: float = 0.05
    segment_max_bytes: int = 256 * MiB
    max_payload_bytes: int = 64 * MiB
    compactor: bool = True
    compact_interval: float = 30.0
    compact_threshold: float = 0.5
    compact_max_bytes: int = 1024 * MiB
    sweep_interval: float = 1.0
    clock: Clock = time.time

    def __post_init__(self) -> None:
        if self.durability not in ("always", "interval", "none"):
            raise InvalidArgument(
                f"durability must be 'always', 'interval' or 'none', not {self.durability!r}"
            )
        for name in ("sync_interval", "compact_interval", "sweep_interval"):
            value = getattr(self, name)
            # nan made the sync thread spin, inf killed the sweeper (issue 11 case 13).
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not 0 < value <= MAX_INTERVAL):
                raise InvalidArgument(f"{name} must be a positive number of seconds "
                                      f"up to {MAX_INTERVAL}, not {value!r}")
        for name in ("segment_max_bytes", "max_payload_bytes", "compact_max_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2**63:
                raise InvalidArgument(f"{name} must be a positive int below 2**63, "
                                      f"not {value!r:.60}")
        if self.max_payload_bytes > MAX_RECORD_LENGTH:
            raise InvalidArgument(f"max_payload_bytes must be at most {MAX_RECORD_LENGTH} "
                                  f"(a frame's length field), not {self.max_payload_bytes!r}")
        t = self.compact_threshold
        if (not isinstance(t, (int, float)) or isinstance(t, bool)
                or (isinstance(t, float) and not math.isfinite(t)) or not 0.0 < t <= 1.0):
            raise InvalidArgument(f"compact_threshold must be a number in (0, 1], not {t!r}")
        if self.clock is None:  # None means the default clock
            object.__setattr__(self, "clock", time.time)
        if not callable(self.clock):
            raise InvalidArgument("clock must be a zero-argument callable returning seconds")
        for name in ("readonly", "compactor"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be a bool")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Config:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidArgument(f"unknown option(s) {unknown}; known options: {sorted(known)}")
        return cls(**options)
