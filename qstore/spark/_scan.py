"""Reading a snapshot's messages as Arrow record batches.

This is the one place that turns a snapshot's metadata and payload segments
into rows. The ``qstore`` Spark data source calls :func:`scan_range` once per
partition on the executors; :func:`scan_snapshot` runs the same code over
every range in one process (the plain-Python baseline of the benchmarks, and
handy without Spark). Formats are parsed only by ``qstore.meta`` and
``qstore.payload``.

Partitions are ranges of the ``m`` (message) prefix (see
:mod:`._snapshot_view`); messages of a queue id with no ``Q`` record have a
null ``queue`` column.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .._check import message_problem
from .._errors import Corruption, StorageError
from ..meta import keys, records
from ..payload import PayloadRef
from ._snapshot_view import ScanRange, Snapshot, plan_ranges

BATCH_ROWS = 8192  # message records decoded per Arrow batch
BATCH_PAYLOAD_BYTES = 32 * 1024 * 1024  # a batch with payloads is cut at about this size

_STATE_BY_CODE = dict(enumerate(records.STATE_NAMES))

# The message table. Every column is nullable, as Spark's are by default, so
# that batches match the schema Spark derives from the data source's schema.
BASE_FIELDS = (
    pa.field("queue", pa.string()),  # null: the queue id has no Q record
    pa.field("id", pa.int64()),
    pa.field("priority_int", pa.int64()),  # int queues; null on str queues
    pa.field("priority_str", pa.string()),  # str queues; null on int queues
    pa.field("state", pa.string()),  # ready, delayed, in_flight, dead
    pa.field("attempts", pa.int64()),
    pa.field("deliveries", pa.int64()),
    pa.field("enqueued_at", pa.float64()),  # seconds since the epoch
    pa.field("due_or_deadline", pa.float64()),  # due time (delayed), lease deadline (in_flight)
    pa.field("file_id", pa.int64()),
    pa.field("offset", pa.int64()),
    pa.field("length", pa.int64()),  # payload bytes, without the 8-byte frame
    pa.field("dedup_digest", pa.binary()),  # 16 bytes; null unless pushed on a dedup queue
    pa.field("expires_at", pa.float64()),  # when the TTL runs out; null: no TTL
    pa.field("aged", pa.int64()),  # priority levels gained by aging
    pa.field("dead_reason", pa.string()),  # why a dead letter is one, when not its attempts
)
PAYLOAD_FIELD = pa.field("payload", pa.binary())
PROBLEM_FIELD = pa.field("problem", pa.string())  # null: the reference resolves to an intact record
INDEX_OK_FIELD = pa.field("index_ok", pa.bool_())


def message_schema(*, payload: bool = False, verify: bool = False,
                   check_index: bool = False) -> pa.Schema:
    """The Arrow schema of the message table with the optional columns asked for."""
    fields = list(BASE_FIELDS)
    if payload:
        fields.append(PAYLOAD_FIELD)
    if verify:
        fields.append(PROBLEM_FIELD)
    if check_index:
        fields.append(INDEX_OK_FIELD)
    return pa.schema(fields)


def scan_range(snap: Snapshot, rng: ScanRange, *, payload: bool = False, verify: bool = False,
               check_index: bool = False, states: Iterable[str] | None = None,
               batch_rows: int = BATCH_ROWS, skip_bad: bool = False
               ) -> Iterator[pa.RecordBatch]:
    """Yield the messages of ``rng`` as record batches of :func:`message_schema`.

    ``payload`` adds the bodies (a damaged record raises Corruption, unless
    ``verify`` is also set: then its payload is null and ``problem`` says why).
    ``verify`` checks every reference (segment listed and present, bounds
    within the manifest length, frame length, CRC). ``check_index`` checks
    that each message's key in the index of its state, and its dedup key,
    exist. ``states`` keeps only messages in those states. A record that
    cannot be used (see :func:`checked_records`) raises StorageError naming
    its key, or is left out if ``skip_bad``.
    """
    schema = message_schema(payload=payload, verify=verify, check_index=check_index)
    codes = None if states is None else {c for c, n in _STATE_BY_CODE.items() if n in set(states)}
    builder = _BatchBuilder(snap, rng.qid, schema, payload=payload, verify=verify,
                            check_index=check_index, codes=codes, skip_bad=skip_bad)
    lo, hi = rng.bounds()
    ks: list[bytes] = []
    vs: list[bytes] = []
    items = snap.meta.items(lo, hi)
    try:
        for k, v in items:
            ks.append(k)
            vs.append(v)
            if len(ks) >= batch_rows:
                yield from builder.build(ks, vs)
                ks, vs = [], []
    finally:
        del items
    if ks:
        yield from builder.build(ks, vs)


def scan_snapshot(path: str | os.PathLike[str], *, payload: bool = False, verify: bool = False,
                  check_index: bool = False, queues: Iterable[str] | None = None,
                  states: Iterable[str] | None = None) -> pa.Table:
    """Every message of a snapshot in one process, as one Arrow table.

    The same rows, columns and checks as ``spark.read.format("qstore")`` with
    the same options, ordered by queue id, then message id.
    """
    schema = message_schema(payload=payload, verify=verify, check_index=check_index)
    with Snapshot(path) as snap:
        batches = [
            batch
            for rng in plan_ranges(snap, partitions=1, queues=queues)
            for batch in scan_range(snap, rng, payload=payload, verify=verify,
                                    check_index=check_index, states=states)
        ]
    return pa.Table.from_batches(batches, schema=schema)


class _BatchBuilder:
    """Turns raw message keys and values of one queue into Arrow batches."""

    def __init__(self, snap: Snapshot, qid: int, schema: pa.Schema, *, payload: bool,
                 verify: bool, check_index: bool, codes: set[int] | None,
                 skip_bad: bool = False) -> None:
        self.snap = snap
        self.skip_bad = skip_bad
        self.qid = qid
        self.info = snap.queues.get(qid)
        self.schema = schema
        self.payload = payload
        self.verify = verify
        self.check_index = check_index
        self.codes = codes

    def build(self, ks: list[bytes], vs: list[bytes]) -> Iterator[pa.RecordBatch]:
        ids, rows, bad = checked_records(
            ks, vs, self.info.rec.priority_type if self.info is not None else None)
        if bad and not self.skip_bad:
            raise StorageError(f"{self.snap.path}: {bad[0].reason}")
        if self.codes is not None:
            keep = [i for i, r in enumerate(rows) if r[1] in self.codes]
            rows = [rows[i] for i in keep]
            ids = [ids[i] for i in keep]
        if not rows:
            return
        if not self.payload:
            yield self._batch(ids, rows)
            return
        start = size = 0
        for i, r in enumerate(rows):  # cut batches so that payloads stay about bounded
            size += r[5]
            if size >= BATCH_PAYLOAD_BYTES:
                yield self._batch(ids[start:i + 1], rows[start:i + 1])
                start, size = i + 1, 0
        if start < len(rows):
            yield self._batch(ids[start:], rows[start:])

    def _batch(self, ids: list[int], rows: list[tuple[Any, ...]]) -> pa.RecordBatch:
        n = len(rows)
        cols = [list(c) for c in zip(*rows, strict=True)]
        (_, state, prio, file_id, offset, length, attempts, deliveries, enqueued, when,
         digest) = cols[:11]
        expires = cols[11] if len(cols) > 11 else None  # version 2 fields, when any row has them
        try:
            state_names = [_STATE_BY_CODE[s] for s in state]
        except (KeyError, TypeError):
            bad = next(i for i, s in enumerate(state) if s not in _STATE_BY_CODE)
            raise self._bad_record(ids[bad], f"unknown state {state[bad]!r}") from None
        prio_int, prio_str = self._priorities(prio, ids)
        timed = pa.array([s in (records.DELAYED, records.INFLIGHT) for s in state], pa.bool_())
        due = pc.if_else(timed, pc.divide(pa.array(when, pa.float64()), 1e6),
                         pa.nulls(n, pa.float64()))
        name = self.info.name if self.info is not None else None
        columns: list[pa.Array] = [
            pa.array([name] * n, pa.string()),
            pa.array(ids, pa.int64()),
            prio_int,
            prio_str,
            pa.array(state_names, pa.string()),
            pa.array(attempts, pa.int64()),
            pa.array(deliveries, pa.int64()),
            pa.array(enqueued, pa.float64()),
            due,
            pa.array(file_id, pa.int64()),
            pa.array(offset, pa.int64()),
            pa.array(length, pa.int64()),
            pa.array(digest, pa.binary()),
            *self._version_2(n, cols),
        ]
        if self.payload:
            bodies, problems = self._payloads(file_id, offset, length)
            columns.append(pa.array(bodies, pa.binary()))
        elif self.verify:
            problems = self.snap.check_refs(file_id, offset, length)
        if self.verify:
            columns.append(pa.array(problems, pa.string()))
        if self.check_index:
            columns.append(pa.array(self._index_ok(ids, state, prio, when, digest, expires),
                                    pa.bool_()))
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)

    @staticmethod
    def _version_2(n: int, cols: list[list[Any]]) -> list[pa.Array]:
        """The expires_at, aged and dead_reason columns (null, 0, null for version 1 rows)."""
        if len(cols) == 11:
            return [pa.nulls(n, pa.float64()), pa.array([0] * n, pa.int64()),
                    pa.nulls(n, pa.string())]
        expires, aged, reason = cols[11], cols[12], cols[13]
        return [pa.array([e / 1e6 if e else None for e in expires], pa.float64()),
                pa.array(aged, pa.int64()),
                pa.array(reason, pa.string())]

    def _priorities(self, prio: list[Any], ids: list[int]) -> tuple[pa.Array, pa.Array]:
        n = len(prio)
        want_int = self.info.rec.priority_type == "int" if self.info is not None else \
            isinstance(prio[0], int)
        try:
            if want_int:
                return pa.array(prio, pa.int64()), pa.nulls(n, pa.string())
            return pa.nulls(n, pa.int64()), pa.array(prio, pa.string())
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            pass
        # Mixed types (a damaged store, or a queue id with no Q record): split them.
        ints = [p if isinstance(p, int) and not isinstance(p, bool) else None for p in prio]
        strs = [p if isinstance(p, str) else None for p in prio]
        for mid, p, a, b in zip(ids, prio, ints, strs, strict=True):
            if a is None and b is None:
                raise self._bad_record(mid, f"priority {p!r} is neither int nor str")
        return pa.array(ints, pa.int64()), pa.array(strs, pa.string())

    def _payloads(self, file_id: list[int], offset: list[int],
                  length: list[int]) -> tuple[list[bytes | None], list[str | None]]:
        read = self.snap.read_payload
        bodies: list[bytes | None] = []
        problems: list[str | None] = []
        for ref in zip(file_id, offset, length, strict=True):
            try:
                bodies.append(read(PayloadRef(*ref)))
                problems.append(None)
            except Corruption as exc:
                if not self.verify:
                    raise
                bodies.append(None)
                problems.append(exc.reason)
        return bodies, problems

    def _index_ok(self, ids: list[int], state: list[int], prio: list[Any], when: list[int],
                  digest: list[bytes | None], expires: list[int] | None
                  ) -> list[bool | None]:
        """Whether each message's index key (and its dedup key, and its expiry key if
        it has a TTL) exists; None if unknowable."""
        if self.info is None:
            return [None] * len(ids)
        qid, rec = self.qid, self.info.rec
        wanted: list[bytes] = []
        for mid, s, p, w in zip(ids, state, prio, when, strict=True):
            wanted.append(expected_index_key(qid, rec, mid, s, p, w) or b"")
        dead_own = self.snap.dead_keep_dedup  # else a dead letter's digest owns no key
        dedup_at = [i for i, d in enumerate(digest)
                    if d is not None and (dead_own or state[i] != records.DEAD)]
        dedup_keys = [keys.dedup_key(qid, digest[i]) for i in dedup_at]  # type: ignore[arg-type]
        expiry_at = [] if expires is None else [i for i, e in enumerate(expires) if e]
        expiry_keys = [keys.expiry_key(qid, expires[i], ids[i])  # type: ignore[index]
                       for i in expiry_at]
        found = self.snap.meta.multi_get(wanted + dedup_keys + expiry_keys)
        ok: list[bool | None] = [k != b"" and v is not None
                                 for k, v in zip(wanted, found, strict=False)]
        for j, i in enumerate(dedup_at):
            if found[len(wanted) + j] != keys.U64.pack(ids[i]):
                ok[i] = False
        base = len(wanted) + len(dedup_keys)
        for j, i in enumerate(expiry_at):
            if found[base + j] is None:
                ok[i] = False
        return ok

    def _bad_record(self, mid: int, why: str) -> StorageError:
        return StorageError(f"message {mid} of queue id {self.qid} in {self.snap.path}: "
                            f"undecodable record ({why})")


def expected_index_key(qid: int, rec: records.QueueRecord, mid: int, state: int,
                       priority: Any, when_us: int) -> bytes | None:
    """The index key a message in ``state`` must have (:func:`keys.index_key`), or
    None if it cannot have one (an unknown state, a priority of the wrong type)."""
    if state not in keys.STATE_INDEX:
        return None
    pkey = b""
    if state == records.READY:
        try:
            pkey = keys.priority_key(rec.order, rec.priority_type, priority)
        except (TypeError, ValueError, OverflowError):
            return None
    return keys.index_key(state, qid, mid, pkey, when_us)


_LIMIT = 1 << 63
_NATURAL = ((3, "file_id"), (4, "offset"), (5, "length"), (6, "attempts"), (7, "deliveries"),
            (9, "when_us"))  # positions in the record tuple of the fields that are int >= 0
_NATURAL_2 = ((11, "expires_us"), (12, "aged"))  # the same, of version 2's fields
_V1_TAIL = (0, 0, None)  # version 2's fields of a version 1 record: no TTL, not aged
_PRIORITY_TYPES: dict[str | None, tuple[frozenset[type], ...]] = {
    "int": (frozenset({int}),),
    "str": (frozenset({str}),),
    None: (frozenset({int}), frozenset({str})),  # no Q record: one type or the other
}


@dataclass(frozen=True)
class BadRecord:
    """A message record that cannot be used: its id, its key and why (naming the key)."""

    message_id: int | None  # None: the key names no id (or none Arrow's int64 holds)
    key: bytes
    reason: str


def checked_records(ks: list[bytes], vs: list[bytes], priority_type: str | None
                    ) -> tuple[list[int], list[tuple[Any, ...]], list[BadRecord]]:
    """:func:`_checked_records` of the records whose keys are laid out as message keys,
    ``m qid:u32 id:u64`` with an id below 2**63 (ids count up from 1; Arrow's
    columns are signed); each other key is a :class:`BadRecord`, as the integrity
    check reports it (a key of another length was taken for an id from its last 8
    bytes, and an id of 2**63 or more failed the whole audit)."""
    bad: list[BadRecord] = []
    if any(len(k) != 13 or k[5] >= 0x80 for k in ks):
        kept = []
        for k, v in zip(ks, vs, strict=True):
            if len(k) != 13:
                bad.append(BadRecord(None, k, f"message key {k.hex()} is not m qid:u32 id:u64"))
            elif k[5] >= 0x80:
                bad.append(BadRecord(None, k, f"message key {k.hex()}: id "
                                              f"{int.from_bytes(k[5:], 'big')} is 2**63 or "
                                              "more, which no push hands out"))
            else:
                kept.append((k, v))
        ks, vs = [k for k, _ in kept], [v for _, v in kept]
    ids, rows, more = _checked_records(ks, vs, priority_type)
    return ids, rows, bad + more


def _checked_records(ks: list[bytes], vs: list[bytes], priority_type: str | None
                    ) -> tuple[list[int], list[tuple[Any, ...]], list[BadRecord]]:
    """Decode message records and check every field: (ids, rows, bad records).

    A row is kept when it is a valid message record by the integrity check's
    rules (:func:`qstore._check.message_problem`: it decodes, a known version
    and state, unsigned references, counts and times, a 16-byte or null
    digest, no expiry on a dead letter, a priority of the queue's type,
    ``priority_type``; None: int or str) and fits Arrow's columns (signed
    64-bit ints, a numeric enqueue time). Every other record is returned as
    a :class:`BadRecord`. A whole batch is checked column by column first;
    only a batch with a bad record is checked row by row.

    Rows are tuples in the layout of the records; when a batch holds a
    version 2 record (a TTL, aging or a dead-letter reason), every row has
    version 2's 14 fields (a version 1 row gets ``(0, 0, None)``), else 11.
    """
    ids = [int.from_bytes(k[-8:], "big") for k in ks]
    try:
        rows: list[tuple[Any, ...]] | None = _uniform(records.decode_messages(ks, vs))
    except StorageError:
        rows = None
    if rows is not None and (not rows or _columns_ok(rows, priority_type)):
        return ids, rows, []
    good_ids: list[int] = []
    good: list[tuple[Any, ...]] = []
    bad: list[BadRecord] = []
    for mid, k, v in zip(ids, ks, vs, strict=True):
        try:
            row = records.decode_messages([k], [v])[0]
        except StorageError as exc:
            bad.append(BadRecord(mid, k, str(exc)))
            continue
        problem = _row_problem(row, priority_type)
        if problem is None:
            good_ids.append(mid)
            good.append(row)
        else:
            bad.append(BadRecord(mid, k, f"message key {k.hex()}: {problem}"))
    return good_ids, _uniform(good), bad


def _uniform(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Rows of one length: version 1 rows padded to 14 fields when any row has them."""
    if not rows or all(len(r) == 11 for r in rows):
        return rows
    return [r if len(r) == 14 else r + _V1_TAIL for r in rows]


def _ints_within(col: tuple[Any, ...], low: int) -> bool:
    return set(map(type, col)) <= {int} and min(col) >= low and max(col) < _LIMIT


def _columns_ok(rows: list[tuple[Any, ...]], priority_type: str | None) -> bool:
    cols = list(zip(*rows, strict=True))
    state, prio, enqueued, digest = cols[1], cols[2], cols[8], cols[10]
    if not (_ints_within(state, 0) and max(state) < len(records.STATE_NAMES)):
        return False
    natural = _NATURAL + (_NATURAL_2 if len(cols) == 14 else ())
    if not all(_ints_within(cols[i], 0) for i, _ in natural):
        return False
    if set(map(type, enqueued)) - {int, float} or set(map(type, digest)) - {bytes, type(None)}:
        return False
    if any(d is not None and len(d) != 16 for d in digest):
        return False
    if len(cols) == 14 and any(e and s == records.DEAD for s, e in zip(state, cols[11],
                                                                        strict=True)):
        return False  # a dead letter with an expiry time: the row check names it
    if len(cols) == 14 and set(map(type, cols[13])) - {str, type(None)}:
        return False  # a reason that is not a str: the row check names it
    types = set(map(type, prio))
    if not any(types <= allowed for allowed in _PRIORITY_TYPES[priority_type]):
        return False
    return str in types or (min(prio) >= -_LIMIT and max(prio) < _LIMIT)


def _row_problem(row: tuple[Any, ...], priority_type: str | None) -> str | None:
    """The integrity check's verdict on one record, then what Arrow's columns need."""
    problem = message_problem(records.MessageRecord(*row[1:]), priority_type)
    if problem is not None:
        return problem
    for i, name in _NATURAL + (_NATURAL_2 if len(row) == 14 else ()):
        if row[i] >= _LIMIT:
            return f"field {name} is {row[i]!r}, not a non-negative 64-bit int"
    if type(row[8]) not in (int, float):
        return f"field enqueued_at is {row[8]!r}, not a number"
    prio = row[2]
    if type(prio) not in {"int": (int,), "str": (str,), None: (int, str)}[priority_type]:
        return f"priority {prio!r} is not of the queue's type ({priority_type or 'int or str'})"
    if type(prio) is int and not -_LIMIT <= prio < _LIMIT:
        return f"priority {prio!r} does not fit 64 bits"
    return None

