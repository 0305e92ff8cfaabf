"""Value encodings (msgpack arrays whose first element is a format version).

NEVER CHANGE the meaning of a field of an existing version; add a version.
See docs/meta-schema.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from .._errors import StorageError

RECORD_VERSION = 1  # never change the meaning of 1
STORE_FORMAT = 1  # value of the M"format" key

# Message states (never change).
READY = 0
DELAYED = 1
INFLIGHT = 2
DEAD = 3
STATE_NAMES = ("ready", "delayed", "in_flight", "dead")

_pack = msgpack.Packer(use_bin_type=True).pack


def pack(value: Any) -> bytes:
    data: bytes = _pack(value)
    return data


def unpack(data: bytes, what: str) -> list[Any]:
    value = msgpack.unpackb(data, use_list=True, raw=False)
    if not isinstance(value, list) or not value or value[0] != RECORD_VERSION:
        raise StorageError(f"unsupported {what} record version: {value!r:.80}")
    return value


def encode_message(state: int, priority: int | str, file_id: int, offset: int, length: int,
                   attempts: int, deliveries: int, enqueued_at: float, when_us: int,
                   digest: bytes | None) -> bytes:
    """A message record, without building a MessageRecord first (the push path)."""
    data: bytes = _pack([RECORD_VERSION, state, priority, file_id, offset, length, attempts,
                         deliveries, enqueued_at, when_us, digest])
    return data


# Where a message record keeps its payload reference (file_id, offset, length).
# Only this module knows field positions; the compactor scans and repoints
# millions of records through message_ref / repoint without building objects.

def message_ref(data: bytes) -> tuple[int, int, int]:
    """(file_id, offset, length) of an encoded message record."""
    v = unpack(data, "message")
    return v[3], v[4], v[5]


def repoint(data: bytes, file_id: int, offset: int) -> bytes:
    """The encoded message record ``data`` with its payload moved to (file_id, offset)."""
    v = unpack(data, "message")
    v[3], v[4] = file_id, offset
    return pack(v)


class MessageRecord:
    """A message's metadata; ``when_us`` is its due time (delayed) or lease deadline."""

    __slots__ = (
        "state", "priority", "file_id", "offset", "length", "attempts",
        "deliveries", "enqueued_at", "when_us", "digest",
    )

    def __init__(
        self, state: int, priority: int | str, file_id: int, offset: int, length: int,
        attempts: int, deliveries: int, enqueued_at: float, when_us: int, digest: bytes | None,
    ) -> None:
        self.state = state
        self.priority = priority
        self.file_id = file_id
        self.offset = offset
        self.length = length
        self.attempts = attempts
        self.deliveries = deliveries
        self.enqueued_at = enqueued_at
        self.when_us = when_us
        self.digest = digest

    def encode(self) -> bytes:
        return encode_message(self.state, self.priority, self.file_id, self.offset, self.length,
                              self.attempts, self.deliveries, self.enqueued_at, self.when_us,
                              self.digest)

    @classmethod
    def decode(cls, data: bytes) -> MessageRecord:
        v = unpack(data, "message")
        return cls(v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10])


@dataclass(frozen=True)
class QueueRecord:
    qid: int
    order: str
    priority_type: str
    max_attempts: int
    dedup: bool
    created_at: float

    def encode(self) -> bytes:
        return pack([RECORD_VERSION, self.qid, self.order, self.priority_type,
                     self.max_attempts, self.dedup, self.created_at])

    @classmethod
    def decode(cls, data: bytes) -> QueueRecord:
        v = unpack(data, "queue")
        return cls(v[1], v[2], v[3], v[4], v[5], v[6])


# Phases of the compaction record M"compaction" (written to disk: never change).
COPYING = "copying"  # the output may be incomplete and nothing refers to it: discard it
REPOINTING = "repointing"  # some messages may refer to the output: keep it
DELETING = "deleting"  # every message refers to the output: the sources are garbage


def encode_compaction(phase: str, output: int, sources: list[int]) -> bytes:
    return pack([RECORD_VERSION, phase, output, sources])


def decode_compaction(data: bytes) -> tuple[str, int, list[int]]:
    """(phase, output file id, source file ids) of a compaction record."""
    v = unpack(data, "compaction")
    return v[1], v[2], v[3]


def encode_counts(counts: list[int]) -> bytes:
    """[ready, delayed, in_flight, dead, bytes]."""
    data: bytes = _pack([RECORD_VERSION, *counts])
    return data


def decode_counts(data: bytes) -> list[int]:
    return unpack(data, "counters")[1:6]


def encode_segment(live_bytes: int, live_count: int, end: int) -> bytes:
    """Live record bytes (frames included), live record count, and data end offset."""
    data: bytes = _pack([RECORD_VERSION, live_bytes, live_count, end])
    return data


def decode_segment(data: bytes) -> tuple[int, int, int]:
    v = unpack(data, "segment")
    return v[1], v[2], v[3]
