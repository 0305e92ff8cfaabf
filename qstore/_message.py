"""The immutable values the API hands out: messages and statistics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Message:
    """One delivered (``pop``) or inspected (``peek``, ``get``) message.

    ``receipt`` identifies this delivery; it is None when the message was not
    leased to you. ``lease_deadline`` is set while the message is in flight;
    ``state`` is one of ``ready``, ``delayed``, ``in_flight``, ``dead``.
    """

    id: int
    queue: str
    priority: int | str
    payload: bytes
    attempts: int
    enqueued_at: float
    lease_deadline: float | None
    receipt: str | None
    state: str = "in_flight"

    def __repr__(self) -> str:
        body = self.payload[:32]
        more = "..." if len(self.payload) > 32 else ""
        return (
            f"Message(id={self.id}, queue={self.queue!r}, priority={self.priority!r}, "
            f"attempts={self.attempts}, state={self.state!r}, payload={body!r}{more})"
        )


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Message counts of one queue; ``bytes`` is the payload bytes of all its messages."""

    queue: str
    ready: int
    delayed: int
    in_flight: int
    dead: int
    bytes: int

    @property
    def total(self) -> int:
        return self.ready + self.delayed + self.in_flight + self.dead


@dataclass(frozen=True, slots=True)
class SegmentStats:
    """One payload segment: its size, the bytes still referenced, and the rest."""

    file_id: int
    size: int
    live_bytes: int
    live_count: int
    active: bool

    @property
    def garbage_ratio(self) -> float:
        from .payload._format import HEADER_SIZE

        body = self.size - HEADER_SIZE
        return 0.0 if body <= 0 else max(0.0, (body - self.live_bytes) / body)


@dataclass(frozen=True, slots=True)
class StoreStats:
    queues: tuple[QueueStats, ...]
    segments: tuple[SegmentStats, ...]

    @property
    def disk_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    @property
    def live_bytes(self) -> int:
        return sum(s.live_bytes for s in self.segments)

    @property
    def garbage_ratio(self) -> float:
        """Dead record bytes over all record bytes (segment headers are not garbage)."""
        from .payload._format import HEADER_SIZE

        body = sum(max(0, s.size - HEADER_SIZE) for s in self.segments)
        return 0.0 if body == 0 else max(0.0, (body - self.live_bytes) / body)
