"""The wire protocol shared by the server and both clients (docs/protocol.md).

A frame is a 4-byte big-endian length followed by that many bytes of one
msgpack value. The first frame each way is the handshake (a map); after it,
a request is ``[id, op, args]`` and its response ``[id, 0, result]`` or
``[id, 1, [class_name, message, fields]]``. Values that cross the wire
(messages, stats, errors) are encoded and decoded here and nowhere else, so
the server and the clients cannot disagree.

msgpack because it is already a dependency, carries bytes without escaping
(payloads are bytes), and packs a small request in about a microsecond.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import msgpack

from . import _errors as errors
from . import _net_errors as net_errors
from ._check_report import CheckReport, Finding
from ._message import CompactionResult, Message, QueueStats, SegmentStats, StoreStats

PROTOCOL_VERSION = 1  # never reuse a number; a server refuses versions it does not speak
LENGTH = struct.Struct(">I")
OK, ERR = 0, 1
DEFAULT_MAX_FRAME = 80 * 1024 * 1024  # above the default max_payload_bytes (64 MiB)
SERVER_ERROR_ID = 0  # id of an error about the connection itself, not one request

# Operations on a queue take the queue name as args["queue"].
QUEUE_OPS = frozenset({
    "push", "push_many", "pop", "pop_many", "ack", "ack_many", "nack", "extend", "peek",
    "get", "dead_letters", "redrive", "purge", "stats", "queue",
})
STORE_OPS = frozenset({
    "create_queue", "configure_queue", "queues", "delete_queue", "store_stats", "compact",
    "snapshot", "ping", "check", "backfill",
})

_packer = msgpack.Packer(use_bin_type=True)

MAX_BODY = 2**32 - 1  # what the frame's uint32 length can say
# A Packer keeps its buffer at the size of the largest value it packed: after a
# body past this size, the next frames get a fresh one, so a process that sent
# one 64 MiB payload does not hold 64 MiB more for the rest of its life.
BIG_BODY = 1024 * 1024  # below MAX_BODY: past it only is MAX_BODY checked


class FrameTooLarge(ValueError):
    """A value whose frame body would be over :data:`MAX_BODY` bytes."""

    def __init__(self, size: int) -> None:
        super().__init__(f"a frame of {size} bytes is over the {MAX_BODY}-byte limit of the "
                         "protocol's uint32 length")
        self.size = size


def pack(value: Any) -> bytes:
    """One frame: length prefix and msgpack body (FrameTooLarge past MAX_BODY)."""
    body: bytes = _packer.pack(value)
    if len(body) > BIG_BODY:
        _big(body)
    return LENGTH.pack(len(body)) + body


def pack_parts(value: Any) -> list[bytes]:
    """:func:`pack` for a writer that takes several buffers (``writelines``): a big
    frame as its prefix and its body, so the body is not copied once more to
    join them (a 64 MiB pop answer peaked at five times its size in the server)."""
    body: bytes = _packer.pack(value)
    if len(body) > BIG_BODY:
        _big(body)
        return [LENGTH.pack(len(body)), body]
    return [LENGTH.pack(len(body)) + body]


def _big(body: bytes) -> None:
    """After a big body: a fresh packer (see BIG_BODY); FrameTooLarge past MAX_BODY."""
    global _packer
    _packer = msgpack.Packer(use_bin_type=True)
    if len(body) > MAX_BODY:
        raise FrameTooLarge(len(body))


def unpack(body: bytes | memoryview) -> Any:
    """The value of a frame body; raises ProtocolError on anything malformed."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise net_errors.ProtocolError(f"malformed frame: {exc}") from None


# -- values -------------------------------------------------------------------


def encode_message(m: Message) -> tuple[Any, ...]:
    """Nine fields; eleven when the message has an expiry or a dead reason (TTL).

    The message's own field tuple, which msgpack packs as an array: no copy.
    """
    return m._fields()


# A newer server may add fields within one protocol version: map keys and
# trailing array fields this client does not know are ignored (docs/protocol.md,
# "Versioning"). A client that built its values from every field it got broke
# on the first one added (a cross-version audit: stats() and a TTL message's pop
# raised TypeError in a client of the first weeks).
_FIELD_NAMES: dict[Any, frozenset[str]] = {}  # a dataclass -> its field names


def _known(cls: Any, v: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``v`` that are fields of dataclass ``cls``."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    return v if v.keys() <= names else {k: x for k, x in v.items() if k in names}


def decode_message(v: list[Any]) -> Message:
    if len(v) > 9:
        return Message(*v[:9], expires_at=v[9], dead_reason=v[10])
    return Message(*v)


def encode_stats(s: QueueStats) -> dict[str, Any]:
    return dataclasses.asdict(s)


def decode_stats(v: dict[str, Any]) -> QueueStats:
    rate = v.get("rate")
    if isinstance(rate, list):  # msgpack has no tuple
        v = {**v, "rate": tuple(rate)}
    return QueueStats(**_known(QueueStats, v))


def encode_store_stats(s: StoreStats) -> dict[str, Any]:
    return {"queues": [encode_stats(q) for q in s.queues],
            "segments": [dataclasses.asdict(g) for g in s.segments]}


def decode_store_stats(v: dict[str, Any]) -> StoreStats:
    return StoreStats(tuple(decode_stats(q) for q in v["queues"]),
                      tuple(SegmentStats(**_known(SegmentStats, g)) for g in v["segments"]))


def encode_compaction(r: CompactionResult) -> dict[str, Any]:
    return dataclasses.asdict(r)


def decode_compaction(v: dict[str, Any]) -> CompactionResult:
    fields: dict[str, Any] = {k: tuple(x) if isinstance(x, list) else x for k, x in v.items()}
    return CompactionResult(**_known(CompactionResult, fields))


def _findings(fs: tuple[Finding, ...]) -> list[list[Any]]:
    return [[f.kind, f.queue, f.message_id, f.file_id, f.offset, f.detail] for f in fs]


def encode_check(r: CheckReport) -> dict[str, Any]:
    return {"findings": _findings(r.findings), "notes": _findings(r.notes),
            "repairs": _findings(r.repairs), "queues": r.queues, "messages": r.messages,
            "segments": r.segments, "payload_bytes": r.payload_bytes}


def decode_check(v: dict[str, Any]) -> CheckReport:
    def findings(rows: list[list[Any]]) -> tuple[Finding, ...]:
        return tuple(Finding(*row[:6]) for row in rows)
    return CheckReport(findings(v["findings"]), findings(v["notes"]), v["queues"],
                       v["messages"], v["segments"], v["payload_bytes"], findings(v["repairs"]))


# -- errors -------------------------------------------------------------------

ERROR_CLASSES: dict[str, type[errors.QStoreError]] = {
    cls.__name__: cls
    for module in (errors, net_errors) for cls in vars(module).values()
    if isinstance(cls, type) and issubclass(cls, errors.QStoreError)
}


def encode_error(exc: BaseException) -> list[Any]:
    """[class name, message, fields] of a qstore error (fields: the attributes it carries)."""
    if not isinstance(exc, errors.QStoreError):
        return ["StorageError", f"server error: {type(exc).__name__}: {exc}", {}]
    fields = {k: v for k, v in vars(exc).items()
              if not k.startswith("_") and isinstance(v, (str, int, float, bool, type(None)))}
    return [type(exc).__name__, str(exc), fields]


def decode_error(v: Any) -> errors.QStoreError:
    """The same class with the same message and fields the server raised."""
    if not (isinstance(v, list) and len(v) == 3 and isinstance(v[0], str)
            and isinstance(v[1], str) and isinstance(v[2], dict)):
        return net_errors.ProtocolError(f"malformed error value {v!r:.80}")
    cls = ERROR_CLASSES.get(v[0], errors.QStoreError)
    exc = cls.__new__(cls)
    Exception.__init__(exc, v[1])
    for key, value in v[2].items():
        if isinstance(key, str):
            setattr(exc, key, value)
    return exc
