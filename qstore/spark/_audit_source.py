"""The audit's message pass: the internal PySpark data source ``qstore_audit``.

It has the partitions of the ``qstore`` source (ranges of the message
prefix). Each task reads its range once and, instead of one row per message,
yields only what the audit needs, so Spark moves a few rows per task:

- ``finding``: a message whose reference does not resolve to an intact record
  (checked in bulk by ``qstore.payload.SegmentCheck``), whose record cannot be
  decoded, whose queue id has no ``Q`` record, or whose record overlaps
  another in this task;
- ``count``: messages and payload bytes per state (the ``C`` recount);
- ``segment``: messages and bytes with frames per segment (the ``S`` recount);
- ``run``: per segment, maximal runs of contiguous or overlapping records
  (start, end, id range); the driver finds overlaps *between* tasks by
  sorting the runs of all tasks and checking them exactly;
- ``size``, ``size_bucket``: payload sizes per priority, exact count, sum, min
  and max, plus a histogram in buckets 1/32 wide for the percentiles;
- ``index``: the fingerprint (:mod:`._index_hash`) of the index entries the
  messages imply, per index (ready, delayed, in_flight, dead, dedup, and the
  expiry index of the messages with a TTL);
- ``ready``: ready messages per priority and the enqueue time of the oldest
  (the report's depth chart and the age of each queue's oldest ready message);
- ``attempts``: messages per number of attempts (the report's distribution).

Ids and payloads are both allocated in push order, so a task's id range maps
onto a few consecutive segments, which it reads front to back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from .._check_report import BAD_RECORD, DAMAGED_SET_ASIDE, MESSAGE_WITHOUT_QUEUE, REASON_KINDS
from .._check_segments import _sorted, overlaps, running_end
from .._errors import InvalidArgument
from ..meta import keys, records
from ..payload import _format as fmt
from . import _index_hash as ih
from ._datasource import RangePartition, spark_schema
from ._scan import BATCH_ROWS, checked_records
from ._snapshot_view import ScanRange, Snapshot, plan_ranges

FINDING, COUNT, SEGMENT, RUN, SIZE, SIZE_BUCKET, INDEX, READY, ATTEMPTS, NOTE = (
    "finding", "count", "segment", "run", "size", "size_bucket", "index", "ready", "attempts",
    "note")
STATE_NAMES = records.STATE_NAMES
DEFERRED = "deferred"  # a segment row's state: messages its S record defers (_seg_accounts.py)

AUDIT_SCHEMA = pa.schema([
    pa.field("row", pa.string()),
    pa.field("kind", pa.string()),  # finding kind
    pa.field("queue", pa.string()),
    pa.field("qid", pa.int64()),
    pa.field("state", pa.string()),  # count: the state; index: the index
    pa.field("message_id", pa.int64()),
    pa.field("file_id", pa.int64()),
    pa.field("offset", pa.int64()),  # finding: the record; run: its start
    pa.field("end", pa.int64()),  # run: end of its last byte + 1
    pa.field("lo_id", pa.int64()),  # run: smallest message id in it
    pa.field("hi_id", pa.int64()),  # run: largest message id in it
    pa.field("priority_int", pa.int64()),
    pa.field("priority_str", pa.string()),
    pa.field("bucket", pa.int64()),  # size_bucket: lower bound of the bucket; attempts: the number
    pa.field("n", pa.int64()),
    pa.field("bytes", pa.int64()),
    pa.field("min_len", pa.int64()),
    pa.field("max_len", pa.int64()),
    pa.field("hash", pa.int64()),  # index: fingerprint hash sum as int64
    pa.field("oldest", pa.float64()),  # ready: the earliest enqueue time (seconds)
    pa.field("detail", pa.string()),
])


class AuditSource(DataSource):
    """Options: ``path`` and ``partitions``."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        opts = {k.lower(): v for k, v in options.items()}
        if set(opts) - {"path", "partitions"} or "path" not in opts:
            raise InvalidArgument(f"qstore_audit takes path and partitions, not {sorted(opts)}")
        self.path = opts["path"]
        self.partitions = int(opts["partitions"]) if "partitions" in opts else None

    @classmethod
    def name(cls) -> str:
        return "qstore_audit"

    def schema(self) -> Any:
        return spark_schema(AUDIT_SCHEMA)

    def reader(self, schema: Any) -> AuditReader:
        return AuditReader(self.path, self.partitions)


class AuditReader(DataSourceReader):
    def __init__(self, path: str, partitions: int | None) -> None:
        self.path = path
        self.n_partitions = partitions

    def partitions(self) -> list[InputPartition]:
        with Snapshot(self.path) as snap:
            return [RangePartition(r) for r in plan_ranges(snap, partitions=self.n_partitions)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, RangePartition):
            return iter(())
        return self._read(partition.range)

    def _read(self, rng: ScanRange) -> Iterator[pa.RecordBatch]:
        with Snapshot(self.path) as snap:
            yield from audit_range(snap, rng)


def audit_range(snap: Snapshot, rng: ScanRange) -> Iterator[pa.RecordBatch]:
    """The audit facts of one range of messages (see the module docstring)."""
    acc = _RangeAudit(snap, rng.qid)
    lo, hi = rng.bounds()
    items = snap.meta.items(lo, hi)
    ks: list[bytes] = []
    vs: list[bytes] = []
    try:
        for k, v in items:
            ks.append(k)
            vs.append(v)
            if len(ks) >= BATCH_ROWS:
                acc.add(ks, vs)
                ks, vs = [], []
    finally:
        del items
    if ks:
        acc.add(ks, vs)
    yield from acc.finish()


def size_buckets(lengths: np.ndarray) -> np.ndarray:
    """Lengths rounded down to their 6 leading bits: buckets at most 1/32 of the value wide."""
    v = lengths.astype(np.int64)
    bits = np.zeros_like(v)
    nonzero = v > 0
    bits[nonzero] = np.frexp(v[nonzero].astype(np.float64))[1]  # bit length (exact below 2**53)
    shift = np.maximum(bits - 6, 0)
    return (v >> shift) << shift


def bucket_top(bucket: int) -> int:
    """The largest length in the bucket whose lower bound is ``bucket``."""
    return bucket + (1 << max(bucket.bit_length() - 6, 0)) - 1


class _RangeAudit:
    def __init__(self, snap: Snapshot, qid: int) -> None:
        self.snap = snap
        self.qid = qid
        self.info = snap.queues.get(qid)
        self.queue = self.info.name if self.info is not None else None
        self.findings: list[dict[str, Any]] = []
        self.state_n = np.zeros(4, np.int64)  # messages per state
        self.state_bytes = np.zeros(4, np.int64)  # payload bytes per state
        self.segments: dict[int, list[int]] = {}  # file id -> messages, bytes with frames
        self.late: dict[int, list[int]] = {}  # the same, of messages S records defer
        self.sizes: dict[Any, list[int]] = {}  # priority -> count, bytes, min, max
        self.hist: dict[tuple[Any, int], int] = {}  # (priority, bucket) -> count
        self.index: dict[str, list[int]] = {}  # index -> entries, hash sum
        self.refs: list[tuple[np.ndarray, ...]] = []  # (file ids, offsets, ends, ids)
        self.ready: dict[Any, list[Any]] = {}  # priority -> ready messages, oldest enqueue time
        self.attempts: dict[int, int] = {}  # attempts -> messages

    def _finding(self, kind: str, mid: int | None, detail: str, file_id: int | None = None,
                 offset: int | None = None, row: str = FINDING) -> None:
        self.findings.append({"row": row, "kind": kind, "queue": self.queue, "qid": self.qid,
                              "message_id": mid, "file_id": file_id, "offset": offset,
                              "detail": detail})

    def add(self, ks: list[bytes], vs: list[bytes]) -> None:
        ids, rows, bad = checked_records(
            ks, vs, self.info.rec.priority_type if self.info is not None else None)
        for rec in bad:  # a finding each; the rest of the batch is audited as usual
            self._finding(BAD_RECORD, rec.message_id, rec.reason)
        if not rows:
            return
        cols = list(zip(*rows, strict=True))
        (_, state, prio, file_id, offset, length, attempts, _, enqueued, when,
         digest) = cols[:11]
        expires = np.array(cols[11], np.uint64) if len(cols) > 11 else None
        reasons = cols[13] if len(cols) > 11 else None
        for i, problem in enumerate(self.snap.check_refs(file_id, offset, length)):  # type: ignore[arg-type]
            if problem is None:
                continue
            kind = REASON_KINDS.get(problem, BAD_RECORD)
            if records.set_aside(state[i], None if reasons is None else reasons[i]):
                # As the integrity check: moved to the dead letters for this damage
                # already (by a pop or a repair), a note, not a finding.
                self._finding(DAMAGED_SET_ASIDE, ids[i], f"{kind}: {problem}; in the dead "
                              f"letters with reason {reasons[i]!r}",  # type: ignore[index]
                              file_id[i], offset[i], row=NOTE)
            else:
                self._finding(kind, ids[i], problem, file_id[i], offset[i])
        if self.info is None:
            for i, mid in enumerate(ids):
                self._finding(MESSAGE_WITHOUT_QUEUE, mid, "its queue id has no Q record",
                              file_id[i], offset[i])
        st = np.array(state, np.int64)
        ln = np.array(length, np.int64)
        mids = np.array(ids, np.int64)
        np.add.at(self.state_n, st, 1)
        np.add.at(self.state_bytes, st, ln)
        fids = np.array(file_id, np.int64)
        offs = np.array(offset, np.int64)
        self.refs.append((fids, offs, offs + fmt.FRAME_SIZE + ln, mids))
        if self.snap.covered:  # S records count their segment's messages below the covered id
            late = np.zeros(len(fids), bool)
            for fid, c in self.snap.covered.items():
                late |= (fids == fid) & (mids >= c)
            self._add_segments(self.segments, fids[~late], ln[~late])
            self._add_segments(self.late, fids[late], ln[late])
        else:
            self._add_segments(self.segments, fids, ln)
        self._add_sizes(list(prio), ln)
        self._add_backlog(st, list(prio), np.array(enqueued, np.float64),
                          np.array(attempts, np.int64))
        if self.info is not None:
            try:
                due = np.array(when, np.uint64)
            except (TypeError, ValueError, OverflowError):  # a damaged record: the index
                due = np.zeros(len(when), np.uint64)  # fingerprint differs, and says which
            self._add_index(st, list(prio), due, mids, list(digest), expires)

    @staticmethod
    def _add_segments(into: dict[int, list[int]], fids: np.ndarray, ln: np.ndarray) -> None:
        if not len(fids):
            return
        uniq, inv = np.unique(fids, return_inverse=True)
        per_n = np.bincount(inv, minlength=len(uniq))
        per_b = np.zeros(len(uniq), np.int64)
        np.add.at(per_b, inv, ln + fmt.FRAME_SIZE)
        for fid, n, b in zip(uniq.tolist(), per_n.tolist(), per_b.tolist(), strict=True):
            seg = into.setdefault(fid, [0, 0])
            seg[0] += n
            seg[1] += b

    def _add_sizes(self, prio: list[Any], ln: np.ndarray) -> None:
        try:  # one queue's priorities share a type; numpy groups them
            groups, inv = np.unique(np.array(prio, np.int64 if isinstance(prio[0], int)
                                             else object), return_inverse=True)
        except (TypeError, ValueError, OverflowError):  # mixed types: a damaged store
            groups, inv = np.unique(np.array([repr(p) for p in prio], object),
                                    return_inverse=True)
            first = {repr(p): p for p in prio}
            groups = np.array([first[g] for g in groups.tolist()], object)
        k = len(groups)
        count = np.bincount(inv, minlength=k)
        total = np.zeros(k, np.int64)
        np.add.at(total, inv, ln)
        low = np.full(k, np.iinfo(np.int64).max, np.int64)
        np.minimum.at(low, inv, ln)
        high = np.zeros(k, np.int64)
        np.maximum.at(high, inv, ln)
        names = groups.tolist()
        for p, n, b, lo, hi in zip(names, count.tolist(), total.tolist(), low.tolist(),
                                   high.tolist(), strict=True):
            group = self.sizes.get(p)
            if group is None:
                self.sizes[p] = [n, b, lo, hi]
            else:
                group[0] += n
                group[1] += b
                group[2] = min(group[2], lo)
                group[3] = max(group[3], hi)
        pairs, n_pairs = np.unique(inv.astype(np.int64) * (1 << 40) + size_buckets(ln),
                                   return_counts=True)
        for pair, n in zip(pairs.tolist(), n_pairs.tolist(), strict=True):
            key = (names[pair >> 40], pair & ((1 << 40) - 1))
            self.hist[key] = self.hist.get(key, 0) + n

    def _add_backlog(self, st: np.ndarray, prio: list[Any], enqueued: np.ndarray,
                     attempts: np.ndarray) -> None:
        """Ready messages per priority with the oldest enqueue time; attempts counts."""
        values, counts = np.unique(attempts, return_counts=True)
        for a, n in zip(values.tolist(), counts.tolist(), strict=True):
            self.attempts[a] = self.attempts.get(a, 0) + n
        at = np.flatnonzero(st == records.READY)
        if not len(at):
            return
        ready = [prio[i] for i in at.tolist()]
        try:  # one queue's priorities share a type; numpy groups them
            groups, inv = np.unique(np.array(ready, np.int64 if isinstance(ready[0], int)
                                             else object), return_inverse=True)
        except (TypeError, ValueError, OverflowError):  # mixed types: a damaged store
            groups, inv = None, None
        if groups is None or inv is None:
            pairs: Any = ((p, 1, float(enqueued[i])) for p, i in zip(ready, at.tolist(),
                                                                      strict=True))
        else:
            oldest = np.full(len(groups), np.inf)
            np.minimum.at(oldest, inv, enqueued[at])
            pairs = zip(groups.tolist(), np.bincount(inv, minlength=len(groups)).tolist(),
                        oldest.tolist(), strict=True)
        for p, n, t in pairs:
            group = self.ready.get(p)
            if group is None:
                self.ready[p] = [n, t]
            else:
                group[0] += n
                group[1] = min(group[1], t)

    def _add_index(self, st: np.ndarray, prio: list[Any], when: np.ndarray, mids: np.ndarray,
                   digest: list[bytes | None], expires: np.ndarray | None) -> None:
        qid = self.qid
        umids = mids.astype(np.uint64)
        if expires is not None:  # a message with a TTL has its key in the expiry index
            at = np.flatnonzero(expires != 0)
            if len(at):
                self._add_fingerprint("expiry", len(at), ih.hash_rows(
                    keys.key_rows(keys.EXPIRY, qid, expires[at], umids[at])))
        for code, kind in keys.STATE_INDEX.items():
            at = np.flatnonzero(st == code)
            if not len(at):
                continue
            if code == records.READY:
                count, h = self._ready_fingerprint(at, prio, umids)
            elif code == records.DEAD:
                count, h = len(at), ih.hash_rows(keys.key_rows(kind, qid, umids[at]))
            else:
                count, h = len(at), ih.hash_rows(keys.key_rows(kind, qid, when[at], umids[at]))
            self._add_fingerprint(STATE_NAMES[code], count, h)
        # The k keys the records imply: every digest of a live message (and of a
        # dead letter in a format 1 store); a later dead letter's digest owns none.
        dead_own = self.snap.dead_keep_dedup
        owning = [(i, d) for i, d in enumerate(digest)
                  if d is not None and (dead_own or st[i] != records.DEAD)]
        has = [i for i, _ in owning]
        digs = [d for _, d in owning]
        if not digs:
            return
        if all(len(d) == 16 for d in digs):
            tails = np.frombuffer(b"".join(digs), np.uint8).reshape(len(digs), 16)
            count, h = len(digs), ih.hash_rows(keys.key_rows(keys.DEDUP, qid, tails, umids[has]))
        else:
            count, h = ih.fingerprint([keys.dedup_key(qid, d) + keys.U64.pack(int(mids[i]))
                                       for i, d in zip(has, digs, strict=True)])
        self._add_fingerprint("dedup", count, h)

    def _ready_fingerprint(self, at: np.ndarray, prio: list[Any], umids: np.ndarray
                           ) -> tuple[int, int]:
        assert self.info is not None
        qid, rec = self.qid, self.info.rec
        if rec.order == "fifo":
            return len(at), ih.hash_rows(keys.key_rows(keys.READY, qid, umids[at]))
        if rec.priority_type == "int":
            try:
                pk = keys.int_priority_keys(np.array([prio[i] for i in at], np.int64), rec.order)
                return len(at), ih.hash_rows(keys.key_rows(keys.READY, qid, pk, umids[at]))
            except (TypeError, ValueError, OverflowError):
                pass  # a priority of the wrong type: the slow path skips it (the index differs)
        entries = []
        for i in at.tolist():
            try:
                pkey = keys.priority_key(rec.order, rec.priority_type, prio[i])
            except (TypeError, ValueError, OverflowError):
                continue
            entries.append(keys.ready_key(qid, pkey, int(umids[i])))
        return ih.fingerprint(entries)

    def _add_fingerprint(self, index: str, count: int, h: int) -> None:
        entry = self.index.setdefault(index, [0, 0])
        entry[0] += count
        entry[1] = (entry[1] + h) & ih.MASK

    def finish(self) -> Iterator[pa.RecordBatch]:
        rows = list(self.findings)
        runs = self._overlaps_and_runs(rows)
        base = {"queue": self.queue, "qid": self.qid}
        for code in range(4):
            n, b = int(self.state_n[code]), int(self.state_bytes[code])
            if n:
                rows.append({**base, "row": COUNT, "state": STATE_NAMES[code], "n": n, "bytes": b})
        for fid, (n, b) in self.segments.items():
            rows.append({**base, "row": SEGMENT, "file_id": fid, "n": n, "bytes": b})
        for fid, (n, b) in self.late.items():  # "state" marks the messages a record defers
            rows.append({**base, "row": SEGMENT, "state": DEFERRED, "file_id": fid, "n": n,
                         "bytes": b})
        for p, (n, b, lo, hi) in self.sizes.items():
            rows.append({**base, **_priority(p), "row": SIZE, "n": n, "bytes": b, "min_len": lo,
                         "max_len": hi})
        for (p, bucket), n in self.hist.items():
            rows.append({**base, **_priority(p), "row": SIZE_BUCKET, "bucket": bucket, "n": n})
        for index, (n, h) in self.index.items():
            rows.append({**base, "row": INDEX, "state": index, "n": n, "hash": ih.to_signed(h)})
        for p, (n, oldest) in self.ready.items():
            rows.append({**base, **_priority(p), "row": READY, "n": n, "oldest": oldest})
        for a, n in self.attempts.items():
            rows.append({**base, "row": ATTEMPTS, "bucket": a, "n": n})
        yield pa.RecordBatch.from_pylist(rows, schema=AUDIT_SCHEMA)
        if runs is not None:
            yield runs

    def _overlaps_and_runs(self, rows: list[dict[str, Any]]) -> pa.RecordBatch | None:
        """Overlap findings inside this task; its runs of records per segment, as a batch."""
        if not self.refs:
            return None
        f, o, e, m = (np.concatenate(parts) for parts in zip(*self.refs, strict=True))
        for kind, mid, fid, off, detail in overlaps(f, o, e, m):
            rows.append({"row": FINDING, "kind": kind, "queue": self.queue, "qid": self.qid,
                         "message_id": mid, "file_id": fid, "offset": off, "detail": detail})
        rf, rs, re_, rlo, rhi, rn = runs_of(f, o, e, m)
        n = len(rf)
        cols: dict[str, Any] = {
            "row": pa.array([RUN] * n, pa.string()), "qid": pa.array([self.qid] * n, pa.int64()),
            "queue": pa.array([self.queue] * n, pa.string()), "file_id": rf, "offset": rs,
            "end": re_, "lo_id": rlo, "hi_id": rhi, "n": rn,
        }
        arrays = [pa.array(cols[field.name], field.type) if field.name in cols
                  else pa.nulls(n, field.type) for field in AUDIT_SCHEMA]
        return pa.RecordBatch.from_arrays(arrays, schema=AUDIT_SCHEMA)


def _priority(p: Any) -> dict[str, Any]:
    return {"priority_str": p} if isinstance(p, str) else {"priority_int": p}


def runs_of(f: np.ndarray, o: np.ndarray, e: np.ndarray, m: np.ndarray
            ) -> tuple[np.ndarray, ...]:
    """Maximal runs of contiguous or overlapping records per segment:
    (file id, start, end, smallest id, largest id, records) arrays."""
    f, o, e, m = _sorted(f, o, e, m)
    prev = running_end(f, e)
    starts = np.flatnonzero(o > prev)  # a gap (or a segment's first record) starts a run
    return (f[starts], o[starts], np.maximum.reduceat(e, starts),
            np.minimum.reduceat(m, starts), np.maximum.reduceat(m, starts),
            np.diff(np.r_[starts, len(f)]))
