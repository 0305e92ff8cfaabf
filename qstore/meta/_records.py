"""Value encodings (msgpack arrays whose first element is a format version).

NEVER CHANGE the meaning of a field of an existing version; add a version.
See docs/meta-schema.md.
"""

from __future__ import annotations

import functools
import itertools
import operator
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import msgpack

from .._errors import StorageError

if TYPE_CHECKING:
    import numpy as np
else:
    from .._lazy import np  # imported on first use (_lazy.py)

RECORD_VERSION = 1  # never change the meaning of 1
# Version 2 of a message record: version 1's fields plus [expires_us, aged, reason]
# (written only for a message with a TTL, an aged priority or a dead-letter reason);
# version 2 of a queue record: version 1's fields plus a map of queue options.
RECORD_VERSION_2 = 2
_V1 = (RECORD_VERSION,)
_V12 = (RECORD_VERSION, RECORD_VERSION_2)
ON_EXPIRE = ("drop", "dead")  # what expiry does to a message (queue option on_expire)
EXPIRED_REASON = "expired"  # the reason of a message moved to the dead letters by its TTL
# The reason of a message moved to the dead letters because its payload bytes
# are damaged: this prefix, then what is wrong ("damaged payload: bad CRC").
DAMAGED_REASON = "damaged payload"


def set_aside(state: object, reason: object) -> bool:
    """Whether a message in ``state`` with dead-letter ``reason`` was moved to the dead
    letters because its payload is damaged (its damage is then a note, not a finding)."""
    return state == DEAD and isinstance(reason, str) and reason.startswith(DAMAGED_REASON)
# Value of the M"format" key. 2: the dedup namespaces and dead letters without a
# dedup key; 3: a dead letter's record may keep its digest (qstore/_migrate.py). A
# read-write open migrates 1 and 2 to 3; a read-only open reads all three; any
# other value is refused (also by the check and the Spark audit).
STORE_FORMAT = 3
READABLE_FORMATS = (1, 2, 3)

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


def unpack(data: bytes, what: str, versions: tuple[int, ...] = _V1) -> list[Any]:
    try:
        value = msgpack.unpackb(data, use_list=True, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        # A bare msgpack FormatError (no message) reached the user as a traceback
        # from an open, and as an empty detail in the check (a differential).
        raise StorageError(f"{what} record does not decode: {type(exc).__name__}"
                           + (f": {exc}" if str(exc) else "")) from None
    if not isinstance(value, list) or not value or value[0] not in versions:
        raise StorageError(f"unsupported {what} record version: {value!r:.80}")
    return value


def record_version(data: bytes) -> object:
    """The version a record says it is (its first field), or None if it does not
    decode as a record: for errors about records this build cannot read."""
    try:
        value = msgpack.unpackb(data, use_list=True, raw=False)
    except Exception:  # msgpack raises several unrelated types for bad input
        return None
    return value[0] if isinstance(value, list) and value else None


def store_format(raw: bytes | None) -> int:
    """The store format the ``M"format"`` record ``raw`` names (:data:`STORE_FORMAT`
    when there is none, or it does not decode: the checks judge the rest)."""
    try:
        return int(unpack(raw, "format")[1]) if raw else STORE_FORMAT
    except (StorageError, ValueError, TypeError, IndexError):
        return STORE_FORMAT


def readable_store_format(raw: bytes | None, where: str) -> int:
    """:func:`store_format`, refusing one this version does not read, as an open
    does: the check and the audit read a format 9 snapshot as if it were theirs
    and called it clean (a review)."""
    fmt = store_format(raw)
    if fmt not in READABLE_FORMATS:
        raise StorageError(f"unsupported store format {fmt!r} in {where} "
                           f"(this version reads {READABLE_FORMATS})")
    return fmt


def dead_letters_own_dedup_keys(store_format: int) -> bool:
    """Format 1: a dead letter kept its ``k`` key. From format 2 it holds none; from
    format 3 its record may keep the digest, which a redrive takes the key back with."""
    return store_format == 1


def encode_message(state: int, priority: int | str, file_id: int, offset: int, length: int,
                   attempts: int, deliveries: int, enqueued_at: float, when_us: int,
                   digest: bytes | None) -> bytes:
    """A message record, without building a MessageRecord first (the push path)."""
    data: bytes = _pack([RECORD_VERSION, state, priority, file_id, offset, length, attempts,
                         deliveries, enqueued_at, when_us, digest])
    return data


def encode_records(recs: Iterable[MessageRecord]) -> list[bytes]:
    """:meth:`MessageRecord.encode` of each record: the batch form (a batch pop's).

    A record that needs no version 2 field is packed here, in
    :func:`encode_message`'s layout, without the two calls per record.
    """
    pack, version = _pack, RECORD_VERSION
    out: list[bytes] = []
    for r in recs:
        if r.expires_us or r.aged or r.reason is not None:
            out.append(r.encode())
        else:
            out.append(pack([version, r.state, r.priority, r.file_id, r.offset, r.length,
                             r.attempts, r.deliveries, r.enqueued_at, r.when_us, r.digest]))
    return out


def encode_message_v2(state: int, priority: int | str, file_id: int, offset: int, length: int,
                      attempts: int, deliveries: int, enqueued_at: float, when_us: int,
                      digest: bytes | None, expires_us: int, aged: int,
                      reason: str | None) -> bytes:
    """A version 2 message record: ``expires_us`` (0: no TTL), the priority levels
    ``aged`` gained by aging (``priority`` is the aged one), the dead-letter ``reason``."""
    data: bytes = _pack([RECORD_VERSION_2, state, priority, file_id, offset, length, attempts,
                         deliveries, enqueued_at, when_us, digest, expires_us, aged, reason])
    return data


# Where a message record keeps its payload reference (file_id, offset, length).
# Only this module knows field positions; the compactor scans and repoints
# millions of records through message_ref / repoint without building objects.

def message_ref(data: bytes) -> tuple[int, int, int]:
    """(file_id, offset, length) of an encoded message record."""
    v = unpack(data, "message", _V12)
    return v[3], v[4], v[5]


def message_refs(ks: list[bytes], vs: list[bytes]) -> np.ndarray:
    """:func:`message_ref` of each record ``vs`` (of message keys ``ks``), as an
    ``(n, 3)`` int64 array, read in bulk (see :func:`_fields`).

    A record that is not laid out as this module writes them is decoded by
    msgpack instead, so that a damaged one raises an error naming its key.
    """
    flat, starts = _joined(vs)
    at = _fields(flat, starts)
    refs = None if at is None else [_uints(flat, at[k]) for k in (3, 4, 5)]
    if refs is None or any(r is None for r in refs):
        rows = decode_messages(ks, vs)
        ref = operator.itemgetter(3, 4, 5)
        return np.fromiter(itertools.chain.from_iterable(map(ref, rows)), np.int64,
                           3 * len(rows)).reshape(len(rows), 3)
    return np.stack(cast(list[np.ndarray], refs), axis=1)


def repoint_many(vs: list[bytes], file_id: int, offsets: list[int]) -> list[bytes]:
    """:func:`repoint` of each record ``vs`` to ``(file_id, offsets[i])``: the same bytes.

    The two fields are replaced in place in the encoded record (found in bulk,
    see :func:`_fields`); the fields around them are not decoded. A record
    laid out otherwise goes through :func:`repoint`.
    """
    flat, starts = _joined(vs)
    at = _fields(flat, starts)
    if at is None:
        return [repoint(v, file_id, o) for v, o in zip(vs, offsets, strict=True)]
    head = (at[3] - starts).tolist()  # the record up to file_id
    tail = (at[5] - starts).tolist()  # from length on
    fid = _pack(file_id)
    return [v[:a] + fid + _pack(o) + v[b:]
            for v, a, o, b in zip(vs, head, offsets, tail, strict=True)]


# -- reading fields of many encoded records at once (numpy) --


@functools.cache
def _widths() -> np.ndarray:
    """The width of a msgpack object from its first byte, for the kinds a message
    record holds: ints, nil, floats, str (priorities, reasons) and bin (digests).
    0: a kind records never hold; str 8/16 and bin 8/16 are read from their length.
    (Built on first use: nothing touches numpy at import, see _lazy.py.)"""
    width = np.zeros(256, np.int64)
    width[0x00:0x80] = 1  # positive fixint
    width[0xE0:0x100] = 1  # negative fixint
    width[0xA0:0xC0] = np.arange(1, 33)  # fixstr of 0..31 bytes
    width[0xC0] = 1  # nil
    for tag, w in ((0xCA, 5), (0xCB, 9), (0xCC, 2), (0xCD, 3), (0xCE, 5), (0xCF, 9),
                   (0xD0, 2), (0xD1, 3), (0xD2, 5), (0xD3, 9)):
        width[tag] = w
    return width


_LEN8 = (0xC4, 0xD9)  # bin 8, str 8: a one-byte length follows the tag
_LEN16 = (0xC5, 0xDA)  # bin 16, str 16: a two-byte length
_UINT_BYTES = ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8))


def _joined(vs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The records back to back as one byte array, and where each starts."""
    flat = np.frombuffer(b"".join(vs), np.uint8)
    lens = np.fromiter(map(len, vs), np.int64, len(vs))
    return flat, np.cumsum(lens) - lens


def _fields(flat: np.ndarray, starts: np.ndarray) -> list[np.ndarray] | None:
    """Where each field of each message record starts (``[k][i]``: field ``k`` of record ``i``).

    The records are walked a field at a time, all together. None unless every
    record is a version 1 array of 11 fields or a version 2 array of 14 whose
    fields are of the kinds above and end exactly where the record does (so a
    damaged or unknown record is left to msgpack).
    """
    size = len(flat)
    if not len(starts) or size == 0:
        return None
    ends = np.r_[starts[1:], size]
    if int((ends - starts).min()) < 2:
        return None
    head, version = flat[starts], flat[starts + 1]
    v2 = head == 0x9E
    if not np.all(((head == 0x9B) & (version == RECORD_VERSION))
                  | (v2 & (version == RECORD_VERSION_2))):
        return None
    fields = []
    widths = _widths()
    pos = starts + 1
    last = size - 1
    for k in range(14 if v2.any() else 11):
        has = v2 if k >= 11 else None  # rows that hold field k
        tag = flat[np.minimum(pos, last)]
        width = widths[tag]
        for tags, extra in ((_LEN8, 1), (_LEN16, 2)):
            var = np.isin(tag, tags)
            if var.any():
                at = np.minimum(pos + 1, last)
                n = flat[at].astype(np.int64)
                if extra == 2:
                    n = n * 256 + flat[np.minimum(pos + 2, last)]
                width = np.where(var, 1 + extra + n, width)
        if has is not None:
            width = np.where(has, width, 0)
            if np.any(has & ((width == 0) | (pos >= ends))):
                return None
        elif np.any((width == 0) | (pos >= ends)):
            return None
        fields.append(pos)
        pos = pos + width
    if not np.array_equal(pos, ends):
        return None
    return fields


def _uints(flat: np.ndarray, pos: np.ndarray) -> np.ndarray | None:
    """The non-negative ints that start at ``pos``; None if one is another kind."""
    tag = flat[pos].astype(np.int64)
    out = np.where(tag < 0x80, tag, -1)
    for t, n in _UINT_BYTES:
        rows = np.flatnonzero(tag == t)
        if len(rows):
            at = pos[rows] + 1
            value = np.zeros(len(rows), np.int64)
            for i in range(n):
                value = (value << 8) | flat[at + i]
            out[rows] = value
    if (out < 0).any():  # another kind, or past int64 (never a file id, offset or length)
        return None
    return out


def repoint(data: bytes, file_id: int, offset: int) -> bytes:
    """The encoded message record ``data`` with its payload moved to (file_id, offset)."""
    v = unpack(data, "message", _V12)
    v[3], v[4] = file_id, offset
    return pack(v)


# -- the bulk form of encode_message (numpy): the same bytes, a batch of new messages --

# msgpack's encodings of an int, as its packer picks them (the smallest that fits):
# class 0 is the one-byte fixint (-32..127); then uint 8/16/32/64, then int 8/16/32/64.
_INT_TAGS = (0, 0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3)
_INT_SIZES = (1, 1, 2, 4, 8, 1, 2, 4, 8)  # value bytes after the tag (class 0: no tag)
_INT_WIDTHS = (1, 2, 3, 5, 9, 2, 3, 5, 9)  # tag and value bytes of each class
_RECORD_HEAD = (0x9B, RECORD_VERSION)  # fixarray of 11, the version (a fixint)
_RECORD_HEAD_2 = (0x9E, RECORD_VERSION_2)  # fixarray of 14, version 2
_V2_TAIL = (0x00, 0xC0)  # after expires_us: aged 0 (a fixint), reason nil


def _int_classes(x: np.ndarray) -> np.ndarray:
    """The msgpack encoding class (an index into ``_INT_TAGS``) of each int64 in ``x``."""
    c = np.zeros(len(x), np.int64)
    for bound, cls in ((128, 1), (256, 2), (1 << 16, 3), (1 << 32, 4)):
        c[x >= bound] = cls
    for bound, cls in ((-32, 5), (-128, 6), (-(1 << 15), 7), (-(1 << 31), 8)):
        c[x < bound] = cls
    return c


def _put_int(out: np.ndarray, at: int, vals: np.ndarray, cls: int) -> int:
    """Write ints of msgpack encoding class ``cls`` at column ``at`` of ``out``;
    returns the column after them."""
    if cls == 0:
        out[:, at] = (vals & 0xFF).astype(np.uint8)
        return at + 1
    size = _INT_SIZES[cls]
    out[:, at] = _INT_TAGS[cls]
    out[:, at + 1: at + 1 + size] = vals.astype(">i8").view(np.uint8).reshape(
        len(vals), 8)[:, 8 - size:]
    return at + 1 + size


def encode_messages(states: np.ndarray, priorities: np.ndarray, file_ids: int | Sequence[int],
                    offsets: Sequence[int] | np.ndarray, lengths: np.ndarray,
                    when_us: np.ndarray, digests: Sequence[bytes | None],
                    enqueued_at: float, expires_us: np.ndarray | None = None) -> list[bytes]:
    """:func:`encode_message` of each row of a batch of new messages, built as arrays.

    Every message has ``attempts`` and ``deliveries`` 0 and the same
    ``enqueued_at``; ``file_ids`` is one id for all or one per row;
    ``states`` are small ints (READY .. DEAD); a digest is None or 16 bytes.
    A row whose ``expires_us`` is not 0 (a TTL) is :func:`encode_message_v2`
    with ``aged`` 0 and no reason, as ``push`` writes it.
    The bytes are exactly those functions' (a test compares them):
    rows are grouped by the msgpack encodings their ints need, and each group
    is one 2-D byte array filled a column at a time. An ``object`` array of
    priorities (str queues) is encoded a row at a time.
    """
    k = len(states)
    if k == 0:
        return []
    exp = np.zeros(k, np.int64) if expires_us is None else np.asarray(expires_us, np.int64)
    if priorities.dtype == object or not isinstance(enqueued_at, float):
        fid_list = [file_ids] * k if isinstance(file_ids, int) else file_ids
        at_list = offsets.tolist() if isinstance(offsets, np.ndarray) else offsets
        return [encode_message_v2(st, p, f, a, n, 0, 0, enqueued_at, w, dg, e, 0, None) if e
                else encode_message(st, p, f, a, n, 0, 0, enqueued_at, w, dg)
                for st, p, f, a, n, w, dg, e in zip(
                    states.tolist(), priorities.tolist(), fid_list, at_list, lengths.tolist(),
                    when_us.tolist(), digests, exp.tolist(), strict=True)]
    ints = [np.asarray(priorities, np.int64),
            np.full(k, file_ids, np.int64) if isinstance(file_ids, int)
            else np.asarray(file_ids, np.int64),
            np.asarray(offsets, np.int64), np.asarray(lengths, np.int64),
            np.asarray(when_us, np.int64), exp]
    classes = [_int_classes(x) for x in ints]
    has_dg = np.zeros(k, bool) if list(digests).count(None) == k else np.array(
        [d is not None for d in digests], bool)
    has_exp = exp != 0
    sig = has_dg.astype(np.int64) * 2 + has_exp
    for c in classes:
        sig = sig * 9 + c
    # Record lengths: head 2 + state 1 + the 5 ints + two zeros 2 + float 9 + digest 1 or
    # 18; version 2 adds expires_us and two bytes (aged 0, reason nil).
    widths = np.array(_INT_WIDTHS, np.int64)
    sizes = (15 + sum(widths[c] for c in classes[:5]) + 17 * has_dg
             + has_exp * (widths[classes[5]] + 2))
    ends = np.cumsum(sizes)
    starts = ends - sizes
    groups, inverse = np.unique(sig, return_inverse=True)
    flat = None if len(groups) == 1 else np.empty(int(ends[-1]), np.uint8)
    now_bytes = np.frombuffer(b"\xcb" + struct.pack(">d", enqueued_at), np.uint8)
    for g in range(len(groups)):
        rows = np.flatnonzero(inverse == g) if flat is not None else np.arange(k)
        first = int(rows[0])
        width = int(sizes[first])
        v2 = bool(has_exp[first])
        out = np.empty((len(rows), width), np.uint8)
        out[:, 0], out[:, 1] = _RECORD_HEAD_2 if v2 else _RECORD_HEAD
        out[:, 2] = states[rows]
        at = 3

        for j in range(5):
            if j == 4:  # attempts, deliveries and enqueued_at come before when_us
                out[:, at: at + 2] = 0
                out[:, at + 2: at + 11] = now_bytes
                at += 11
            at = _put_int(out, at, ints[j][rows], int(classes[j][first]))
        if has_dg[first]:
            out[:, at], out[:, at + 1] = 0xC4, 16  # bin 8 of 16 bytes
            out[:, at + 2: at + 18] = np.frombuffer(
                b"".join([cast(bytes, digests[i]) for i in rows.tolist()]),
                np.uint8).reshape(len(rows), 16)
            at += 18
        else:
            out[:, at] = 0xC0  # nil
            at += 1
        if v2:
            at = _put_int(out, at, ints[5][rows], int(classes[5][first]))
            out[:, at], out[:, at + 1] = _V2_TAIL
            at += 2
        assert at == width
        if flat is None:  # one layout for all: the rows as bytes (see keys.split_rows)
            return cast(list[bytes], out.view(np.dtype(("V", width))).ravel().tolist())
        flat[starts[rows][:, None] + np.arange(width)] = out
    assert flat is not None  # set before the loop whenever widths differ
    raw = flat.tobytes()
    return [raw[a: b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]


class MessageRecord:
    """A message's metadata; ``when_us`` is its due time (delayed) or lease deadline."""

    __slots__ = (
        "state", "priority", "file_id", "offset", "length", "attempts",
        "deliveries", "enqueued_at", "when_us", "digest", "expires_us", "aged", "reason",
    )

    def __init__(
        self, state: int, priority: int | str, file_id: int, offset: int, length: int,
        attempts: int, deliveries: int, enqueued_at: float, when_us: int, digest: bytes | None,
        expires_us: int = 0, aged: int = 0, reason: str | None = None,
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
        self.expires_us = expires_us  # 0: no TTL
        self.aged = aged  # priority levels gained by aging
        self.reason = reason  # why it is a dead letter, when not its attempts

    def encode(self) -> bytes:
        if self.expires_us or self.aged or self.reason is not None:
            return encode_message_v2(self.state, self.priority, self.file_id, self.offset,
                                     self.length, self.attempts, self.deliveries,
                                     self.enqueued_at, self.when_us, self.digest,
                                     self.expires_us, self.aged, self.reason)
        return encode_message(self.state, self.priority, self.file_id, self.offset, self.length,
                              self.attempts, self.deliveries, self.enqueued_at, self.when_us,
                              self.digest)

    @classmethod
    def decode(cls, data: bytes) -> MessageRecord:
        v = unpack(data, "message", _V12)
        if v[0] == RECORD_VERSION_2:
            return cls(v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11],
                       v[12], v[13])
        return cls(v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10])


@dataclass(frozen=True)
class QueueRecord:
    """A queue's settings. The options after ``created_at`` (section 10 of the
    contract) are written as a version 2 record, and only when one is set."""

    qid: int
    order: str
    priority_type: str
    max_attempts: int
    dedup: bool
    created_at: float
    ttl: float | None = None  # default TTL of its messages (seconds)
    on_expire: str = "drop"  # "drop" or "dead"
    aging: float | None = None  # seconds a ready message waits per priority level gained
    aging_cap: int | None = None  # most levels aging may add
    rate: tuple[int, float] | None = None  # at most n pops per `per` seconds

    def options(self) -> dict[str, Any]:
        """The options that differ from their defaults (the version 2 map)."""
        out: dict[str, Any] = {}
        if self.ttl is not None:
            out["ttl"] = self.ttl
        if self.on_expire != "drop":
            out["on_expire"] = self.on_expire
        if self.aging is not None:
            out["aging"] = self.aging
        if self.aging_cap is not None:
            out["aging_cap"] = self.aging_cap
        if self.rate is not None:
            out["rate"] = list(self.rate)
        return out

    def encode(self) -> bytes:
        head = [self.qid, self.order, self.priority_type, self.max_attempts, self.dedup,
                self.created_at]
        options = self.options()
        if options:
            return pack([RECORD_VERSION_2, *head, options])
        return pack([RECORD_VERSION, *head])

    @classmethod
    def decode(cls, data: bytes) -> QueueRecord:
        v = unpack(data, "queue", _V12)
        if v[0] == RECORD_VERSION_2:
            o = v[7]
            if not isinstance(o, dict):
                raise StorageError(f"queue options are not a map: {o!r:.80}")
            rate = o.get("rate")
            return cls(v[1], v[2], v[3], v[4], v[5], v[6], o.get("ttl"),
                       o.get("on_expire", "drop"), o.get("aging"), o.get("aging_cap"),
                       None if rate is None else (rate[0], rate[1]))
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


def encode_totals(expired: int) -> bytes:
    """A queue's lifetime totals (key E): [expired]."""
    return pack([RECORD_VERSION, expired])


def decode_totals(data: bytes) -> int:
    return int(unpack(data, "totals")[1])


def encode_segment(live_bytes: int, live_count: int, end: int,
                   covered: int | None = None) -> bytes:
    """Live record bytes (frames included), live record count, and data end offset.

    ``covered`` (the segment pushes append to, docs/meta-schema.md): the record
    counts exactly the messages of this segment with ids below it; those with
    higher ids were pushed after it was written and are counted by whoever reads
    it (``qstore._seg_accounts``). Without it the record counts every message.
    """
    data: bytes = _pack([RECORD_VERSION, live_bytes, live_count, end] if covered is None
                        else [RECORD_VERSION, live_bytes, live_count, end, covered])
    return data


def decode_segment(data: bytes) -> tuple[int, int, int]:
    v = unpack(data, "segment")
    return v[1], v[2], v[3]


def segment_covered(data: bytes) -> int | None:
    """An S record's ``covered`` id (see encode_segment), or None if it counts everything."""
    v = unpack(data, "segment")
    if len(v) < 5:
        return None
    covered = v[4]
    if type(covered) is not int or covered < 0:
        raise StorageError(f"segment record's covered id {covered!r:.40} is not an unsigned int")
    return covered


def decode_messages(ks: list[bytes], vs: list[bytes]) -> list[tuple[Any, ...]]:
    """The records ``vs`` of message keys ``ks`` as tuples, in the layout of encode_message.

A version 2 record's tuple has 14 fields: the 11 of version 1, then
expires_us, aged and reason (encode_message_v2); the first 11 mean the same.

One streaming unpack: about 3x faster than one call each. When a record is
damaged, they are decoded one by one so that the error names its key.
"""
    unpacker = msgpack.Unpacker(raw=False, use_list=False, strict_map_key=False)
    unpacker.feed(b"".join(vs))
    try:
        rows: list[tuple[Any, ...]] = list(unpacker)
    except Exception:  # msgpack's errors have no common base; the slow path names the key
        rows = []
    if (len(rows) == len(vs) and set(map(type, rows)) <= {tuple}
            and {(len(row), row[0]) for row in rows} <= {(11, RECORD_VERSION),
                                                         (14, RECORD_VERSION_2)}):
        return rows
    # A record is damaged: decode one by one so that the error names its message.
    out = []
    for k, v in zip(ks, vs, strict=True):
        try:
            rec = MessageRecord.decode(v)
        except Exception as exc:
            raise StorageError(f"message key {k.hex()}: undecodable record ({exc})") from None
        row: tuple[Any, ...] = (RECORD_VERSION, rec.state, rec.priority, rec.file_id, rec.offset,
               rec.length, rec.attempts, rec.deliveries, rec.enqueued_at, rec.when_us,
               rec.digest)
        if v[:1] == b"\x9e":  # a fixarray of 14: version 2 (its extra fields follow)
            row = (RECORD_VERSION_2, *row[1:], rec.expires_us, rec.aged, rec.reason)
        out.append(row)
    return out
