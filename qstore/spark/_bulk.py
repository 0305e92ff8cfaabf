"""Executor side of the backfill: one Spark partition in, staged store files out.

A :class:`PartitionLoader` turns the rows of one partition into exactly the
keys and records that :meth:`qstore.Queue.push_many` would have written for
them (a test checks byte equality), but as files instead of WriteBatches:

- payload segment files in the qstore segment format, named and headed with
  the FINAL file ids the driver reserved for this partition, rolled at
  ``segment_max_bytes`` as the store rolls its own while reserved ids last (the
  last one then takes the rest: a sealed segment may be larger, as a
  compaction output may);
- ``p<pid>-m.sst``: the message records ``m qid id``, written as they come
  (ids grow with row order, so they are already sorted);
- ``p<pid>-x.sst``: the index keys, sorted: delayed ``d``, expiry ``e``
  (messages with a TTL), dedup ``k`` and ready ``r`` keys (``d`` < ``e`` <
  ``k`` < ``r`` in byte order);
- ``rejects-p<pid>.parquet``: the rows that cannot be loaded, with a reason.

Row ``n`` of partition ``p`` gets id ``first_id(p) + n`` whether it is loaded
or rejected, so ids follow row order (the FIFO rule for equal priorities) and
a rejected row only leaves a gap. Every output is written under a temporary
name and renamed when complete, so a retried task attempt replaces, never
mixes with, an earlier one. This module does not import pyspark or open the
store: it runs in Spark's Python workers.

Speed: the task works on whole Arrow record batches (Spark hands them over
as Arrow; no Python Row is ever built). A batch's payload records are framed
as one array (a ``(rows, 8 + length)`` array when the payloads have one
length, else one ``numpy.insert``) and written with one call; message keys
(``meta.keys.key_rows``), msgpack records (``meta.records.encode_messages``)
and index keys are built as arrays. Per row there remain the CRC call, a few
slices and the SST puts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .._fs import fsync_dir, fsync_file
from ..meta import SstWriter, keys, records
from ..payload import _format as fmt
from ..payload import _frames as frames
from ..payload._writer import SegmentWriter, create_segment_file
from ._rows import LoadSpec, Rows, parse

# Columns of the rejects table added to the source's columns.
REASON_COL = "reject_reason"
PARTITION_COL = "source_partition"
ROW_COL = "source_row"


@dataclass(frozen=True)
class PartitionPlan:
    """The driver's reservation for one partition."""

    pid: int
    rows: int  # rows the counting pass saw; the task fails if it sees another number
    first_id: int  # ids first_id .. first_id + rows - 1 are this partition's
    file_ids: list[int]  # final segment file ids, used in order
    duplicates: dict[int, str] = field(default_factory=dict)  # row -> reject reason


class _Segments:
    """Payload segments of one partition, rolled at ``segment_max_bytes`` like the store's.

    Each is written through a :class:`SegmentWriter` under a temporary name and
    renamed into place, fsynced, when complete. Records added one by one are
    gathered and written together (:meth:`flush`): one ``pwritev`` per batch.
    """

    def __init__(self, directory: str, file_ids: list[int], max_bytes: int, tmp: str) -> None:
        self._dir = directory
        self._ids = list(file_ids)
        self._max = max_bytes
        self._tmp = tmp
        self._writer: SegmentWriter | None = None
        self._pending: list[bytes | memoryview] = []  # framed records not yet written
        self.end = 0  # where the segment ends, pending records included
        self.file_id = 0
        self.done: list[dict[str, int]] = []  # finished segments
        self._live_count = 0

    def _path(self, fid: int) -> str:
        return os.path.join(self._dir, fmt.segment_name(fid))

    def _open(self) -> None:
        if not self._ids:
            raise RuntimeError("backfill partition has no segment file id reserved")
        self.file_id = self._ids.pop(0)
        path = self._path(self.file_id) + self._tmp
        create_segment_file(path, self.file_id, durable=False)  # synced when finished
        self._writer = SegmentWriter(path, self.file_id, fmt.HEADER_SIZE, self._max)
        self.end = fmt.HEADER_SIZE
        self._live_count = 0

    def fits(self, nbytes: int) -> bool:
        """True if ``nbytes`` of records go in the current segment (opening the first)."""
        if self._writer is None:
            if fmt.HEADER_SIZE + nbytes > self._max and len(self._ids) > 1:
                return False
            self._open()
        return self.end + nbytes <= self._max or not self._ids

    def append(self, frame: bytes, body: memoryview) -> tuple[int, int]:
        """Add one record, rolling first if it does not fit; returns (file id, offset).

        The record is written by the next :meth:`flush` (or roll, or finish).
        """
        nbytes = len(frame) + len(body)
        if self._writer is None:
            self._open()
        elif self.end + nbytes > self._max and self.end > fmt.HEADER_SIZE and self._ids:
            self._close()
            self._open()
        self._pending.append(frame)
        self._pending.append(body)
        return self._count(nbytes, 1)

    def append_chunk(self, chunk: memoryview, count: int) -> tuple[int, int]:
        """Write ``count`` framed records at once (``fits`` said yes); returns the start."""
        self.flush()
        assert self._writer is not None
        self._writer.append_framed([chunk])
        return self._count(chunk.nbytes, count)

    def _count(self, nbytes: int, count: int) -> tuple[int, int]:
        at = self.end
        self.end += nbytes
        self._live_count += count
        return self.file_id, at

    def flush(self) -> None:
        """Write the records added one by one."""
        if self._pending:
            assert self._writer is not None
            self._writer.append_framed(self._pending)
            self._pending = []

    def _close(self) -> None:
        self.flush()
        writer = self._writer
        assert writer is not None
        writer.finish()  # fsyncs and closes
        self._writer = None
        os.replace(writer.path, self._path(self.file_id))
        self.done.append({"file_id": self.file_id, "live_bytes": writer.end - fmt.HEADER_SIZE,
                          "live_count": self._live_count, "end": writer.end})

    def finish(self) -> list[dict[str, int]]:
        if self._writer is not None:
            self._close()
        return self.done

    def abort(self) -> None:
        """Close without publishing (the temporary file goes with the staging directory)."""
        self._pending = []
        if self._writer is not None:
            self._writer.abandon()
            self._writer = None


class PartitionLoader:
    """Writes one partition's staged files; feed it Arrow batches, then :meth:`finish`."""

    def __init__(self, spec: LoadSpec, plan: PartitionPlan, staging: str, attempt: str) -> None:
        self.spec = spec
        self.plan = plan
        self.staging = staging
        self._tmp = f".{attempt}.tmp"
        self._segs = _Segments(os.path.join(staging, "seg"), plan.file_ids,
                               spec.segment_max_bytes, self._tmp)
        self._m_path = os.path.join(staging, "sst", f"p{plan.pid:05d}-m.sst")
        self._m: SstWriter | None = None
        self._delayed: list[tuple[np.ndarray, np.ndarray]] = []  # (due us, id) per batch
        self._expiring: list[tuple[np.ndarray, np.ndarray]] = []  # (expires us, id) per batch
        self._ready: list[tuple[np.ndarray, np.ndarray]] = []  # (priority key, id) per batch
        self._ready_keys: list[bytes] = []  # str priorities: whole keys
        self._dedup: list[tuple[bytes, bytes]] = []
        self._rejects: list[pa.RecordBatch] = []
        self.rows = self.loaded = self.ready = self.delayed = self.nbytes = 0
        self.duplicates = 0
        self.min_due_us: int | None = None  # the earliest due time or expiry (a timer event)

    def add(self, batch: pa.RecordBatch) -> None:
        plan = self.plan
        start = self.rows
        if start + batch.num_rows > plan.rows:
            raise RuntimeError(
                f"partition {plan.pid} has more rows than the counting pass saw ({plan.rows}): "
                "the source is not deterministic; write it to Parquet (or checkpoint the "
                "DataFrame) and backfill from that")
        self.rows += batch.num_rows
        rows = parse(batch, self.spec)
        for row, why in plan.duplicates.items():
            if start <= row < self.rows and rows.reasons[row - start] is None:
                rows.reasons[row - start] = why
                self.duplicates += 1
        reasons = rows.reasons
        if reasons.count(None) == rows.n:  # the usual case: every row loads
            if rows.n:
                self._write(rows, np.arange(rows.n, dtype=np.int64), start)
            return
        valid = [i for i, r in enumerate(reasons) if r is None]
        if valid:
            self._write(rows, np.array(valid, np.int64), start)
        self._add_rejects(batch, [i for i, r in enumerate(reasons) if r is not None],
                          reasons, start)

    def _frame_records(self, rows: Rows, idx: np.ndarray) -> tuple[Any, Any]:
        """Append the payloads of rows ``idx`` to the segments; (file ids, offsets).

        Returns a file id and an offset array when the batch went into one
        segment as one chunk, else two lists.
        """
        offsets = rows.offsets
        starts = offsets[idx]
        lens = offsets[idx + 1] - starts
        crcs = frames.record_crcs(rows.data, starts, lens)
        k = len(idx)
        total = int(lens.sum()) + fmt.FRAME_SIZE * k
        segs = self._segs
        if k == rows.n and segs.fits(total):
            # The whole batch, contiguous in the Arrow buffer: one chunk.
            chunk = frames.frame_contiguous(rows.data, offsets, crcs)
            fid, at = segs.append_chunk(chunk.data, k)
            rel = offsets[:-1] - offsets[0]
            return fid, at + rel + fmt.FRAME_SIZE * np.arange(k)
        fids, ats = [], []
        for i, n, c in zip(idx.tolist(), lens.tolist(), crcs, strict=True):
            fid, at = segs.append(frames.frame_header(n, c), rows.body(i))
            fids.append(fid)
            ats.append(at)
        segs.flush()
        return fids, ats

    def _write(self, rows: Rows, idx: np.ndarray, start: int) -> None:
        spec = self.spec
        qid, now = spec.qid, spec.now
        fids, ats = self._frame_records(rows, idx)
        k = len(idx)
        lens_arr = rows.offsets[idx + 1] - rows.offsets[idx]
        mids = np.int64(self.plan.first_id + start) + idx
        delays = rows.delays[idx]
        late = delays > 0
        # keys.to_us(now + delay), vectorised: the same float64 arithmetic, truncated.
        when = np.where(late, np.maximum(0, ((now + delays) * 1_000_000).astype(np.int64)), 0)
        expires = None
        if rows.ttls is not None:  # the same for now + ttl; 0: no TTL (NaN)
            ttls = rows.ttls[idx]
            has = ~np.isnan(ttls)
            expires = np.where(has, np.maximum(0, ((now + np.where(has, ttls, 0.0))
                                                   * 1_000_000).astype(np.int64)), 0)
            if has.any():
                self._expiring.append((expires[has], mids[has]))
                self._event(int(expires[has].min()))
        prio_arr = rows.priorities[idx] if spec.priority_type == "int" else np.asarray(
            [rows.priorities[i] for i in idx.tolist()], object)
        digests = [None] * k if rows.digests is None else [
            rows.digests[i] for i in idx.tolist()]
        if self._m is None:
            self._m = SstWriter(self._m_path + self._tmp)
        mkeys = keys.split_rows(keys.key_rows(keys.MESSAGE, qid, mids))  # m qid id, in bulk
        states = np.where(late, records.DELAYED, records.READY)
        values = records.encode_messages(states, prio_arr, fids, ats, lens_arr, when, digests,
                                         now, expires)
        self._m.put_many(zip(mkeys, values, strict=True))
        self._index(mids, late, when, prio_arr, digests)
        self.nbytes += int(lens_arr.sum())
        self.loaded += k

    def _index(self, mids: np.ndarray, late: np.ndarray, when: np.ndarray, prios: np.ndarray,
               digests: list[bytes | None]) -> None:
        spec = self.spec
        if late.any():
            self._delayed.append((when[late], mids[late]))
            self._event(int(when[late].min()))
        soon = ~late
        self.delayed += int(late.sum())
        self.ready += int(soon.sum())
        if spec.order == "fifo":
            self._ready.append((np.zeros(0, np.uint64), mids[soon]))
        elif spec.priority_type == "int":
            self._ready.append((keys.int_priority_keys(prios[soon], spec.order), mids[soon]))
        else:
            qid, order = spec.qid, spec.order
            for p, mid in zip(prios[soon].tolist(), mids[soon].tolist(), strict=True):
                self._ready_keys.append(
                    keys.ready_key(qid, keys.priority_key(order, "str", p), mid))
        if spec.dedup:
            self._dedup.extend((keys.dedup_key(spec.qid, dg), keys.U64.pack(mid))
                               for dg, mid in zip(digests, mids.tolist(), strict=True)
                               if dg is not None)

    def _event(self, when_us: int) -> None:
        self.min_due_us = when_us if self.min_due_us is None else min(self.min_due_us, when_us)

    def _write_index(self, writer: SstWriter) -> None:
        """Every index key of the partition, in key order: d, e, k, then r."""
        qid = self.spec.qid
        for kind, timed in ((keys.DELAYED, self._delayed), (keys.EXPIRY, self._expiring)):
            if timed:  # time, then id: the keys' order
                when = np.concatenate([w for w, _ in timed])
                mid = np.concatenate([m for _, m in timed])
                order = np.lexsort((mid, when))
                writer.put_keys(keys.split_rows(keys.key_rows(kind, qid, when[order],
                                                              mid[order])))
        writer.put_many(sorted(self._dedup))
        if self._ready:
            pk = np.concatenate([p for p, _ in self._ready])
            mid = np.concatenate([m for _, m in self._ready])
            if len(pk):
                order = np.lexsort((mid, pk))
                rows = keys.key_rows(keys.READY, qid, pk[order], mid[order])
            else:  # fifo: the id alone
                rows = keys.key_rows(keys.READY, qid, np.sort(mid))
            writer.put_keys(keys.split_rows(rows))
        writer.put_keys(sorted(self._ready_keys))

    def abort(self) -> None:
        """Give up: close open files, publish nothing (a failed task)."""
        self._segs.abort()
        self._m = None

    def _add_rejects(self, batch: pa.RecordBatch, rows: list[int], reasons: list[str | None],
                     start: int) -> None:
        picked = batch.take(pa.array(rows, pa.int64()))
        extra = {
            REASON_COL: pa.array([reasons[i] for i in rows], pa.string()),
            PARTITION_COL: pa.array([self.plan.pid] * len(rows), pa.int32()),
            ROW_COL: pa.array([start + i for i in rows], pa.int64()),
        }
        arrays = list(picked.columns) + list(extra.values())
        names = list(picked.schema.names) + list(extra)
        self._rejects.append(pa.RecordBatch.from_arrays(arrays, names=names))

    def finish(self) -> dict[str, Any]:
        """Close, sync and publish every file; returns the summary the driver needs."""
        plan = self.plan
        if self.rows != plan.rows:
            self.abort()
            raise RuntimeError(
                f"partition {plan.pid} has {self.rows} rows but the counting pass saw "
                f"{plan.rows}: the source is not deterministic; write it to Parquet (or "
                "checkpoint the DataFrame) and backfill from that")
        segments = self._segs.finish()
        ssts = []
        if self._m is not None:
            self._m.finish()  # syncs the file
            os.replace(self._m_path + self._tmp, self._m_path)
            ssts.append(os.path.basename(self._m_path))
        if self.loaded:
            x_path = os.path.join(self.staging, "sst", f"p{plan.pid:05d}-x.sst")
            writer = SstWriter(x_path + self._tmp)
            self._write_index(writer)
            writer.finish()
            os.replace(x_path + self._tmp, x_path)
            ssts.append(os.path.basename(x_path))
        rejects: str | None = None
        if self._rejects:
            rejects = f"rejects-p{plan.pid:05d}.parquet"
            path = os.path.join(self.staging, "rejects", rejects)
            pq.write_table(pa.Table.from_batches(self._rejects), path + self._tmp)
            fsync_file(path + self._tmp)
            os.replace(path + self._tmp, path)
        for sub in ("seg", "sst", "rejects"):
            fsync_dir(os.path.join(self.staging, sub))
        return {
            "pid": plan.pid, "rows": self.rows, "loaded": self.loaded,
            "rejected": self.rows - self.loaded, "duplicates": self.duplicates,
            "ready": self.ready, "delayed": self.delayed, "bytes": self.nbytes,
            "min_due_us": self.min_due_us, "segments": segments, "ssts": ssts,
            "rejects": rejects,
        }


def load_partition(batches: Iterable[pa.RecordBatch], spec: LoadSpec, plan: PartitionPlan,
                   staging: str, attempt: str) -> dict[str, Any]:
    started = time.perf_counter()
    busy = 0.0  # seconds in this module, the rest is Spark handing over batches
    loader = PartitionLoader(spec, plan, staging, attempt)
    try:
        for batch in batches:
            t = time.perf_counter()
            loader.add(batch)
            busy += time.perf_counter() - t
    except BaseException:
        loader.abort()
        raise
    t = time.perf_counter()
    summary = loader.finish()
    summary["finish_s"] = time.perf_counter() - t
    summary["add_s"] = busy
    summary["task_s"] = time.perf_counter() - started
    return summary


def scan_partition(batches: Iterable[pa.RecordBatch], spec: LoadSpec, pid: int) -> dict[str, Any]:
    """The counting pass of a dedup queue: rows, payload bytes, and each valid row's digest."""
    rows = nbytes = 0
    valid: list[int] = []
    digests: list[bytes] = []
    for batch in batches:
        p = parse(batch, spec)
        assert p.digests is not None
        for i, (reason, dg) in enumerate(zip(p.reasons, p.digests, strict=True)):
            if reason is None:
                assert dg is not None
                valid.append(rows + i)
                digests.append(dg)
                nbytes += fmt.FRAME_SIZE + int(p.offsets[i + 1] - p.offsets[i])
        rows += batch.num_rows
    return {"pid": pid, "rows": rows, "bytes": nbytes, "valid": valid,
            "digests": b"".join(digests)}
