"""The immutable values the API hands out: messages and statistics."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass
from typing import Any

from .payload import HEADER_SIZE

_FIELDS = ("id", "queue", "priority", "payload", "attempts", "enqueued_at", "lease_deadline",
           "receipt", "state", "expires_at", "dead_reason")


class Message:
    """One delivered (``pop``) or inspected (``peek``, ``get``) message.

    ``receipt`` identifies this delivery; it is None when the message was not
    leased to you. ``lease_deadline`` is set while the message is in flight;
    ``state`` is one of ``ready``, ``delayed``, ``in_flight``, ``dead``.
    ``expires_at`` is when its TTL runs out (None: no TTL); ``dead_reason`` is
    ``"expired"`` for a dead letter its TTL made. Times are seconds of the
    store's clock, ``lease_deadline`` and ``expires_at`` to the microsecond
    the store keeps.

    Immutable, compared and hashed by its fields. It keeps them in one tuple
    (built with one store per pop instead of one per field: pops are the hot
    path) and reads them through properties. A pop leaves the receipt string
    out of the tuple until something reads it (:meth:`_fields`): an
    embedded ack uses the parsed receipt pop keeps, and formatting the string
    cost a tenth of a batch pop+ack (docs/benchmarks.md).
    """

    __slots__ = ("_v", "_lease")
    _v: tuple[Any, ...]
    _lease: tuple[int, int, int] | None

    id: int
    queue: str
    priority: int | str
    payload: bytes
    attempts: int
    enqueued_at: float
    lease_deadline: float | None
    receipt: str | None
    state: str
    expires_at: float | None
    dead_reason: str | None

    def __init__(self, id: int, queue: str, priority: int | str, payload: bytes, attempts: int,
                 enqueued_at: float, lease_deadline: float | None, receipt: str | None,
                 state: str = "in_flight", *, expires_at: float | None = None,
                 dead_reason: str | None = None) -> None:
        fields: tuple[Any, ...] = (id, queue, priority, payload, attempts, enqueued_at,
                                   lease_deadline, receipt, state)
        if expires_at is not None or dead_reason is not None:
            fields += (expires_at, dead_reason)
        _set(self, "_v", fields)
        _set(self, "_lease", None)

    @classmethod
    def _leased(cls, fields: tuple[Any, ...], lease: tuple[int, int, int]) -> Message:
        """A popped message; ``lease`` is its receipt parsed (qid, id, delivery).

        ``fields`` holds None where the receipt goes: :meth:`_fields` writes it
        from ``lease`` when first asked.
        """
        msg = cls.__new__(cls)
        _set_v(msg, fields)
        _set_lease(msg, lease)
        return msg

    def _fields(self) -> tuple[Any, ...]:
        """The nine fields in order, then ``expires_at`` and ``dead_reason`` when either
        is set: the layout of a message on the wire (docs/protocol.md)."""
        v = self._v
        lease = self._lease
        if lease is not None and v[7] is None:  # a pop's receipt, not written yet
            v = v[:7] + (make_receipt(*lease),) + v[8:]
            _set(self, "_v", v)
        return v

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if type(other) is not Message:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __reduce__(self) -> tuple[Any, ...]:
        v = self._fields()
        if len(v) > 9:
            return (_rebuild, v)
        return (Message, v)

    def __repr__(self) -> str:
        body = self.payload[:32]
        more = "..." if len(self.payload) > 32 else ""
        return (
            f"Message(id={self.id}, queue={self.queue!r}, priority={self.priority!r}, "
            f"attempts={self.attempts}, state={self.state!r}, payload={body!r}{more})"
        )


def make_receipt(qid: int, mid: int, deliveries: int) -> str:
    """The receipt of delivery ``deliveries`` of message ``mid`` of queue ``qid``."""
    return f"{qid:x}-{mid:x}-{deliveries:x}"


def _field(i: int) -> property:
    if i == 7:  # the receipt: a pop writes it only when it is read
        return property(lambda self: self._fields()[7], doc="The message's receipt.")
    if i >= 9:  # kept only when set (a pop builds the first nine alone)
        return property(lambda self: self._v[i] if len(self._v) > i else None,
                        doc=f"The message's {_FIELDS[i]}.")
    return property(lambda self: self._v[i], doc=f"The message's {_FIELDS[i]}.")


def _rebuild(*v: Any) -> Message:
    return Message(*v[:9], expires_at=v[9], dead_reason=v[10])


for _i, _name in enumerate(_FIELDS):
    setattr(Message, _name, _field(_i))
_set = object.__setattr__
# The slots' own setters: a pop's Message._leased sets both in two thirds of
# the time object.__setattr__ takes (no lookup by name).
_set_v = Message.__dict__["_v"].__set__
_set_lease = Message.__dict__["_lease"].__set__


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Message counts of one queue; ``bytes`` is the payload bytes of all its messages."""

    queue: str
    ready: int
    delayed: int
    in_flight: int
    dead: int
    bytes: int
    expired: int = 0  # messages expired by their TTL, ever (a purge keeps this count)
    ttl: float | None = None  # the queue's options (contract section 10)
    on_expire: str = "drop"
    aging: float | None = None
    aging_cap: int | None = None
    rate: tuple[int, float] | None = None

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

        body = sum(max(0, s.size - HEADER_SIZE) for s in self.segments)
        return 0.0 if body == 0 else max(0.0, (body - self.live_bytes) / body)


@dataclass(frozen=True)
class CompactionResult:
    """What one pass did.

    ``bytes_copied`` counts the records rewritten (8-byte frames included).
    ``bytes_freed`` is how much less disk the payload takes: the size of the
    segment files the pass deleted minus the size of the output it wrote, and
    never negative. A pass that copies its sources but cannot delete them yet
    (a read-only view was opening; or it failed once its repoint began) has
    freed nothing: it reports 0, and the pass that deletes those sources also
    subtracts that output. So, once no output is owed, the sum over a store's
    passes is the disk they gave back, and a running total never decreases
    (the server's ``qstore_compaction_bytes_freed_total`` is a Prometheus
    counter). What is owed is kept by the open store: after a reopen, the pass
    that deletes such sources counts their whole size. Neither the new active
    segment a seal starts nor dead segments a failed pass deleted are counted.
    """

    sealed: int | None
    segments_read: tuple[int, ...]
    segments_deleted: tuple[int, ...]
    output: int | None
    messages_moved: int
    bytes_copied: int
    bytes_freed: int
    seconds: float
