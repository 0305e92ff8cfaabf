"""The options ``qstore.open`` and ``configure_queue`` take, as types.

Only for type checkers: ``**options: Unpack[QueueOptions]`` lets mypy flag a
misspelled option (``tll=5``) or a value of the wrong type, which ``**options:
Any`` let through to run time (an API audit); ``StoreOptions`` does the same
for ``qstore.open(path, **options)``. The store still checks every option at
run time (:class:`qstore.Config`), for callers without a type checker; a test
keeps ``StoreOptions`` and ``Config``'s fields the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypedDict


class QueueOptions(TypedDict, total=False):
    ttl: float | None
    on_expire: str
    aging: float | None
    aging_cap: int | None
    rate: tuple[int, float] | None


class StoreOptions(TypedDict, total=False):
    """The keyword options of ``qstore.open``: the fields of :class:`qstore.Config`."""

    readonly: bool
    durability: Literal["always", "interval", "none"]
    sync_interval: float
    segment_max_bytes: int
    max_payload_bytes: int
    compactor: bool
    compact_interval: float
    compact_threshold: float
    compact_max_bytes: int
    sweep_interval: float
    clock: Callable[[], float] | None
