"""Combining, on the driver, the facts the audit's message tasks yield (``qstore_audit``).

Sums the per-task recounts (per queue and state, per segment), merges the
payload size histograms into percentiles, adds up the index fingerprints, and
checks the runs of records of all tasks for overlaps between tasks: runs that
overlap are read again exactly (only their id ranges), so every overlap is
named by message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .._check_report import Finding
from .._check_segments import overlaps, running_end
from . import _audit_source as src
from ._index_hash import MASK
from ._scan import scan_range
from ._snapshot_view import ScanRange, Snapshot

STATES = ("ready", "delayed", "in_flight", "dead")
PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


@dataclass
class MessageFacts:
    findings: list[Finding]
    messages: int  # every message read, those of unknown queue ids included
    queues: dict[int, list[int]]  # qid -> [ready, delayed, in_flight, dead, payload bytes]
    segments: dict[int, tuple[int, int]]  # file id -> (messages, bytes with frames)
    sizes: list[dict[str, Any]]  # per (queue, priority), the largest groups first
    index: dict[tuple[int, str], tuple[int, int]]  # (qid, index) -> entries, hash sum
    runs: pa.Table
    ready: list[dict[str, Any]]  # per (queue, priority): ready messages, oldest enqueue time
    attempts: dict[int, dict[int, int]]  # qid -> attempts -> messages
    notes: list[Finding]  # damage of messages already set aside (damaged_set_aside)
    # file id -> (messages, bytes with frames) its S record defers (_seg_accounts.py):
    # not in ``segments``, which is compared with the record
    late: dict[int, tuple[int, int]]


def merge(table: pa.Table) -> MessageFacts:
    """Add up the facts of every task (``table`` has the schema of ``qstore_audit``)."""
    rows = {kind: table.filter(pc.equal(table["row"], kind)) for kind in (
        src.FINDING, src.COUNT, src.SEGMENT, src.RUN, src.SIZE, src.SIZE_BUCKET, src.INDEX,
        src.READY, src.ATTEMPTS, src.NOTE)}
    findings, notes = ([Finding(r["kind"], r["queue"], r["message_id"], r["file_id"], r["offset"],
                                r["detail"]) for r in rows[kind].to_pylist()]
                       for kind in (src.FINDING, src.NOTE))
    queues: dict[int, list[int]] = {}
    messages = 0
    for r in rows[src.COUNT].to_pylist():
        counts = queues.setdefault(r["qid"], [0, 0, 0, 0, 0])
        counts[STATES.index(r["state"])] += r["n"]
        counts[4] += r["bytes"]
        messages += r["n"]
    segments: dict[int, tuple[int, int]] = {}
    late: dict[int, tuple[int, int]] = {}
    for r in rows[src.SEGMENT].to_pylist():
        into = late if r["state"] == src.DEFERRED else segments
        n, b = into.get(r["file_id"], (0, 0))
        into[r["file_id"]] = (n + r["n"], b + r["bytes"])
    index: dict[tuple[int, str], tuple[int, int]] = {}
    for r in rows[src.INDEX].to_pylist():
        n, h = index.get((r["qid"], r["state"]), (0, 0))
        index[(r["qid"], r["state"])] = (n + r["n"], (h + r["hash"]) & MASK)
    attempts: dict[int, dict[int, int]] = {}
    for r in rows[src.ATTEMPTS].to_pylist():
        per = attempts.setdefault(r["qid"], {})
        per[r["bucket"]] = per.get(r["bucket"], 0) + r["n"]
    return MessageFacts(findings, messages, queues, segments,
                        _sizes(rows[src.SIZE], rows[src.SIZE_BUCKET]), index, rows[src.RUN],
                        _ready(rows[src.READY]), attempts, notes, late)


def _ready(table: pa.Table) -> list[dict[str, Any]]:
    """Ready messages per (queue, priority), the oldest enqueue time of each; largest first."""
    merged: dict[tuple[Any, ...], list[Any]] = {}
    for r in table.to_pylist():
        key = (r["queue"], r["qid"], r["priority_int"], r["priority_str"])
        g = merged.get(key)
        if g is None:
            merged[key] = [r["n"], r["oldest"]]
        else:
            g[0] += r["n"]
            g[1] = min(g[1], r["oldest"])
    out = [{"queue": queue, "qid": qid, "priority": p_int if p_str is None else p_str,
            "ready": n, "oldest": oldest}
           for (queue, qid, p_int, p_str), (n, oldest) in merged.items()]
    out.sort(key=lambda r: (-r["ready"], r["queue"] or "", str(r["priority"])))
    return out


def _sizes(groups: pa.Table, buckets: pa.Table) -> list[dict[str, Any]]:
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in groups.to_pylist():
        key = (r["queue"], r["qid"], r["priority_int"], r["priority_str"])
        g = merged.get(key)
        if g is None:
            merged[key] = {"n": r["n"], "bytes": r["bytes"], "min": r["min_len"],
                           "max": r["max_len"], "hist": {}}
        else:
            g["n"] += r["n"]
            g["bytes"] += r["bytes"]
            g["min"] = min(g["min"], r["min_len"])
            g["max"] = max(g["max"], r["max_len"])
    for r in buckets.to_pylist():
        hist = merged[(r["queue"], r["qid"], r["priority_int"], r["priority_str"])]["hist"]
        hist[r["bucket"]] = hist.get(r["bucket"], 0) + r["n"]
    out = []
    for (queue, _qid, p_int, p_str), g in merged.items():
        row = {"queue": queue, "priority": p_int if p_str is None else p_str, "count": g["n"],
               "bytes": g["bytes"], "min": g["min"], "max": g["max"]}
        for name, q in PERCENTILES:
            row[name] = _percentile(g["hist"], g["n"], q, g["max"])
        out.append(row)
    out.sort(key=lambda r: (-r["count"], r["queue"] or "", str(r["priority"])))
    return out


def _percentile(hist: dict[int, int], n: int, q: float, top: int) -> int:
    """The upper end of the bucket holding the q-quantile (exact below 64 bytes,
    otherwise at most 1/32 above it), never above the largest length."""
    target = max(1, math.ceil(q * n))
    seen = 0
    for bucket in sorted(hist):
        seen += hist[bucket]
        if seen >= target:
            return min(src.bucket_top(bucket), top)
    return top


def cross_task_overlaps(snap: Snapshot, runs: pa.Table, names: dict[int, str]
                        ) -> list[Finding]:
    """Overlaps between records of different tasks, each named by message.

    Each task reports maximal runs of adjacent records per segment. Runs of
    different tasks never touch in a sound store; where they overlap, every
    run of that segment is read again and checked record by record.
    """
    if runs.num_rows == 0:
        return []
    f, o, e = (runs[c].to_numpy() for c in ("file_id", "offset", "end"))
    order = np.lexsort((o, f))
    f, o, e = f[order], o[order], e[order]
    prev = running_end(f, e)
    bad = set(f[o < prev].tolist())
    if not bad:
        return []
    found: list[Finding] = []
    for fid in sorted(bad):
        mine = runs.filter(pc.equal(runs["file_id"], fid)).to_pylist()
        refs: list[tuple[int, int, int, int]] = []
        queue_of: dict[int, str | None] = {}
        for run in mine:
            rng = ScanRange(run["qid"], run["lo_id"], run["hi_id"] + 1)
            for batch in scan_range(snap, rng):
                for r in batch.to_pylist():
                    if r["file_id"] == fid:
                        refs.append((r["file_id"], r["offset"], r["offset"] + 8 + r["length"],
                                     r["id"]))
                        queue_of[r["id"]] = names.get(run["qid"])
        arrays = [np.array(col, np.int64) for col in zip(*refs, strict=True)]
        for kind, mid, file_id, off, detail in overlaps(*arrays):
            found.append(Finding(kind, queue_of.get(mid), mid, file_id, off, detail))
    return found
