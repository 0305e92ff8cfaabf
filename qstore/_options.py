"""The queue options ``configure_queue`` takes, as a type (contract section 10).

Only for type checkers: ``**options: Unpack[QueueOptions]`` lets mypy flag a
misspelled option (``tll=5``) or a value of the wrong type, which ``**options:
Any`` let through to run time (an API audit). The store still checks every
option at run time, for callers without a type checker.
"""

from __future__ import annotations

from typing import TypedDict


class QueueOptions(TypedDict, total=False):
    ttl: float | None
    on_expire: str
    aging: float | None
    aging_cap: int | None
    rate: tuple[int, float] | None
