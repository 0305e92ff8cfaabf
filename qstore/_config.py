"""The store's configuration: a frozen, keyword-only, validated object."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Literal

from ._errors import InvalidArgument

Durability = Literal["always", "interval", "none"]
Clock = Callable[[], float]

MiB = 1024 * 1024


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
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive number of seconds, not {value!r}")
        for name in ("segment_max_bytes", "max_payload_bytes", "compact_max_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive int, not {value!r}")
        if not 0.0 < self.compact_threshold <= 1.0:
            raise InvalidArgument(
                f"compact_threshold must be in (0, 1], not {self.compact_threshold!r}"
            )
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
