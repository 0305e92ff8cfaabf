"""RocksDB key encodings. Plain byte order of the keys is the order qstore needs.

Every prefix byte and layout here is written to disk: NEVER CHANGE one; add a
new prefix instead. See docs/meta-schema.md for the table and a worked example.

Per-queue keys start with a one-byte kind and the queue's fixed-width 4-byte
id (not its name), so queue ``a`` can never scan into queue ``ab``. Integers
are big-endian so byte order equals numeric order.
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import numpy as np
else:
    from .._lazy import np  # imported on first use (_lazy.py)

# Singletons (value: msgpack).
META = b"M"
FORMAT_KEY = META + b"format"
ID_HWM_KEY = META + b"id_hwm"  # message ids below this may have been handed out
QID_NEXT_KEY = META + b"qid_next"
COMPACTION_KEY = META + b"compaction"
# [file_id, offset]: the active segment's bytes below offset were on stable
# storage when the batch holding this value was written (power-loss recovery).
SYNCED_KEY = META + b"synced"
# M backfill/<job id>: a bulk load whose rows are in (written by its ingestion,
# with them). Deleted by the job itself once its rejects directory has _SUCCESS;
# one a crash left is settled by the next backfill and kept until a rerun of that
# job given `again` deletes it (reruns without it are refused; docs/backfill.md).
BACKFILL_JOB = META + b"backfill/"
# M batch/ qid:u32 first_id:u64 -> [1, last_id, end_file_id, end_offset]: a batch
# push of several messages whose payload no sync has covered yet (interval mode,
# or an always-mode batch the payload journal does not carry). Written with the
# batch, deleted with the durable mark of the sync that covers its last record;
# one left at an open after a power loss makes recovery drop the whole batch if
# any of its messages lost its bytes (a batch is atomic; Core._drop_lost_tails).
PENDING_BATCH = META + b"batch/"


def backfill_job_key(job_id: str) -> bytes:
    return BACKFILL_JOB + job_id.encode("ascii")

# Queues by name and their counters.
QUEUE = b"Q"  # Q name(utf-8)                       -> QueueRecord
COUNTS = b"C"  # C qid:u32                           -> counters
SEGMENT = b"S"  # S file_id:u64                      -> SegmentRecord
# durability="always": the body of a payload record whose segment bytes may not
# be synced yet (redone into the segment on open, deleted once it is synced).
JOURNAL = b"J"  # J file_id:u64 offset:u64            -> body
# Per-queue message keys.
MESSAGE = b"m"  # m qid:u32 id:u64                   -> MessageRecord
READY = b"r"  # r qid:u32 priority-key id:u64       -> b""
DELAYED = b"d"  # d qid:u32 due_us:u64 id:u64         -> b""
INFLIGHT = b"i"  # i qid:u32 deadline_us:u64 id:u64    -> b""
DEAD = b"x"  # x qid:u32 id:u64                   -> b""
DEDUP = b"k"  # k qid:u32 digest[16]               -> id:u64
EXPIRY = b"e"  # e qid:u32 expires_us:u64 id:u64     -> b"" (messages with a TTL)
PER_QUEUE_KINDS = (MESSAGE, READY, DELAYED, INFLIGHT, DEAD, DEDUP, EXPIRY)
# Per-queue totals that outlive the messages they count (not cleared by a purge).
TOTALS = b"E"  # E qid:u32                           -> [1, expired]

U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
U64x2 = struct.Struct(">QQ")
TIMED_KEY_SIZE = 1 + 4 + 8 + 8  # a delayed, in-flight or expiry key: kind qid when_us id
QID_ID = struct.Struct(">IQ")

INT_MIN = -(2**63)
INT_MAX = 2**63 - 1
MAX_STR_PRIORITY_BYTES = 1024
_FLIP = bytes(range(255, -1, -1))  # byte complement: reverses the order of prefix-free keys


def pending_batch_key(qid: int, first_id: int) -> bytes:
    return PENDING_BATCH + QID_ID.pack(qid, first_id)


def pending_batch_parts(key: bytes) -> tuple[int, int]:
    """(qid, first id) of a pending batch key."""
    qid, first = QID_ID.unpack_from(key, len(PENDING_BATCH))
    return qid, first


def queue_key(name: str) -> bytes:
    return QUEUE + name.encode("utf-8")


def counts_key(qid: int) -> bytes:
    return COUNTS + U32.pack(qid)


def totals_key(qid: int) -> bytes:
    return TOTALS + U32.pack(qid)


def expiry_key(qid: int, expires_us: int, mid: int) -> bytes:
    """The expiry index key of a message that expires at ``expires_us``."""
    return EXPIRY + U32.pack(qid) + U64x2.pack(expires_us, mid)


def segment_key(file_id: int) -> bytes:
    return SEGMENT + U64.pack(file_id)


def segment_id(key: bytes) -> int:
    return int(U64.unpack_from(key, 1)[0])


def journal_key(file_id: int, offset: int) -> bytes:
    return JOURNAL + U64x2.pack(file_id, offset)


def journal_parts(key: bytes) -> tuple[int, int]:
    """(file_id, offset) of a journal key."""
    fid, offset = U64x2.unpack_from(key, 1)
    return int(fid), int(offset)


def prefix(kind: bytes, qid: int) -> bytes:
    return kind + U32.pack(qid)


def prefix_end(p: bytes) -> bytes:
    """The smallest key greater than every key starting with ``p``."""
    stripped = p.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1])


def message_key(qid: int, mid: int) -> bytes:
    return MESSAGE + QID_ID.pack(qid, mid)


def dead_key(qid: int, mid: int) -> bytes:
    return DEAD + QID_ID.pack(qid, mid)


def timed_key(kind: bytes, qid: int, when_us: int, mid: int) -> bytes:
    """A delayed (due time) or in-flight (lease deadline) index key."""
    return kind + U32.pack(qid) + U64x2.pack(when_us, mid)


def timed_parts(key: bytes) -> tuple[int, int]:
    """(when_us, id) of a delayed or in-flight key."""
    when, mid = U64x2.unpack_from(key, 5)
    return int(when), int(mid)


def trailing_id(key: bytes) -> int:
    """The message id every per-queue index key ends with."""
    return int(U64.unpack_from(key, len(key) - 8)[0])


def dedup_key(qid: int, digest: bytes) -> bytes:
    return DEDUP + U32.pack(qid) + digest


# The two dedup namespaces (store format 2; docs/meta-schema.md). NEVER CHANGE either.
# A payload hash is BLAKE2b personalised with PAYLOAD_PERSON, an explicit key is
# hashed as b"k" + key without personalisation: different functions, so no
# payload can hash to the digest of a key (format 1 hashed the bare payload, and
# push(b"kfoo") collided with dedup_key="foo").
PAYLOAD_PERSON = b"qstore.payload"


def payload_digest(body: bytes) -> bytes:
    """The dedup digest of a push without a dedup key (a hash of its payload)."""
    return hashlib.blake2b(body, digest_size=16, person=PAYLOAD_PERSON).digest()


def explicit_digest(dedup_key: bytes) -> bytes:
    """The dedup digest of a push with an explicit ``dedup_key`` (UTF-8 bytes of a str)."""
    return hashlib.blake2b(b"k" + dedup_key, digest_size=16).digest()


def legacy_payload_digest(body: bytes) -> bytes:
    """Format 1's payload digest (the bare payload's hash): read only by the migration."""
    return hashlib.blake2b(body, digest_size=16).digest()


def priority_key(order: str, ptype: str, priority: int | str) -> bytes:
    """Encode a priority so that ascending key order is pop order.

    int: offset binary (sign bit flipped) big-endian, complemented for "max".
    str: UTF-8 with 0x00 escaped as 0x00 0xFF and terminated by 0x00 0x00, a
    prefix-free encoding that keeps byte order; complemented for "max".
    fifo: empty, so the id alone orders the queue.
    """
    if order == "fifo":
        return b""
    if ptype == "int":
        u = int(priority) + 2**63
        return U64.pack(u if order == "min" else 2**64 - 1 - u)
    raw = str(priority).encode("utf-8").replace(b"\x00", b"\x00\xff") + b"\x00\x00"
    return raw if order == "min" else raw.translate(_FLIP)


def ready_key(qid: int, pkey: bytes, mid: int) -> bytes:
    return READY + U32.pack(qid) + pkey + U64.pack(mid)


# The index each message state lives in (states as in _records: never change).
_STATE_INDEX = (READY, DELAYED, INFLIGHT, DEAD)
# The same as a map: state code -> its index's key prefix byte (what the audit
# and the Spark scan iterate over).
STATE_INDEX = dict(enumerate(_STATE_INDEX))


def index_key(state: int, qid: int, mid: int, pkey: bytes, when_us: int) -> bytes:
    """The one index key a message in ``state`` has; the only place that says which.

    ``pkey`` is the message's priority key (used by ready), ``when_us`` its
    due time (delayed) or lease deadline (in flight).
    """
    kind = _STATE_INDEX[state]
    if kind is READY:
        return READY + U32.pack(qid) + pkey + U64.pack(mid)
    if kind is DEAD:
        return DEAD + QID_ID.pack(qid, mid)
    return kind + U32.pack(qid) + U64x2.pack(when_us, mid)


# -- bulk forms (numpy): the same bytes as the builders above, a whole array at once --

def int_priority_keys(priorities: np.ndarray, order: str) -> np.ndarray:
    """:func:`priority_key` of int priorities (int64 array) as uint64 values.

    Written big-endian (:func:`key_rows`) each is the 8-byte key of an "int"
    queue of ``order`` "min" or "max"; a "fifo" queue has no priority key.
    """
    u = priorities.astype(np.int64).view(np.uint64) ^ np.uint64(1 << 63)  # offset binary
    return u if order == "min" else ~u


def key_rows(kind: bytes, qid: int, *parts: np.ndarray) -> np.ndarray:
    """The (n, width) uint8 matrix of keys ``kind qid:u32 part...``, one key a row.

    A 1-d part is an integer array written as big-endian u64 (ids, due times,
    :func:`int_priority_keys`); a 2-d part is an (n, k) uint8 matrix copied as
    is (dedup digests). So ``key_rows(MESSAGE, q, ids)`` holds
    ``message_key(q, id)`` of each id, and ``key_rows(READY, q,
    int_priority_keys(p, order), ids)`` the ready keys of an int queue.
    """
    n = len(parts[0])
    fields: list[tuple[str, object] | tuple[str, object, tuple[int]]] = [("k", "S1"), ("q", ">u4")]
    for i, part in enumerate(parts):
        fields.append((f"f{i}", ">u8") if part.ndim == 1 else (f"f{i}", np.uint8, (part.shape[1],)))
    rec = np.empty(n, np.dtype(fields))
    rec["k"] = kind
    rec["q"] = qid
    for i, part in enumerate(parts):
        rec[f"f{i}"] = part
    return rec.view(np.uint8).reshape(n, rec.dtype.itemsize)


def split_rows(rows: np.ndarray) -> list[bytes]:
    """The rows of a :func:`key_rows` matrix as separate byte strings."""
    width = rows.shape[1] if rows.ndim == 2 else 0
    if not width or not len(rows):
        return []
    # A row as one opaque (void) item: tolist() makes its bytes, trailing zeros kept
    # (an "S" dtype would strip them), about 2.5x faster than slicing one buffer.
    return cast(list[bytes],
                np.ascontiguousarray(rows).view(np.dtype(("V", width))).ravel().tolist())


def to_us(seconds: float) -> int:
    """Seconds since the epoch as non-negative integer microseconds."""
    return max(0, int(seconds * 1_000_000))


def index_key_problem(kind: bytes, key: bytes, value: bytes) -> str | None:
    """Why ``key`` (with ``value``) of index ``kind`` is not laid out as that index's keys
    are, or None. Such a key names no message (the id at its end would be whatever
    its last 8 bytes are); the check and the Spark audit report it so."""
    if kind == DEDUP:
        return None if len(key) == 21 and len(value) == 8 else \
            "not k qid:u32 digest[16] -> id:u64"
    if len(key) < 13 or (kind != READY and len(key) != (13 if kind == DEAD else 21)):
        return "malformed key"
    return None
