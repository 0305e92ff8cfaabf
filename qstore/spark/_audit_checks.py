"""The audit's findings and the checks that run on the driver.

The driver reads what is small (the manifest, the ``Q``, ``C`` and ``S``
records, the list of segment files and their headers) and compares it with
what the executors recounted from the messages. Message-level checks (every
reference, every index key, overlaps) run in Spark; see :mod:`.audit`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .. import _check_segments as segs
from .._check_report import BAD_RECORD, COUNTER_MISMATCH, ORPHAN_QUEUE_KEYS, Finding
from .._check_segments import found
from .._message import SegmentStats
from ..meta import keys, records
from ..payload import _format as fmt
from ._snapshot_view import Snapshot

# Finding kinds (one row of findings.parquet each; docs/spark.md explains each):
# the integrity check's (qstore/_check_report.py), plus the audit's own.

FINDINGS_SCHEMA = pa.schema([
    pa.field("kind", pa.string()),
    pa.field("queue", pa.string()),
    pa.field("message_id", pa.int64()),
    pa.field("file_id", pa.int64()),
    pa.field("offset", pa.int64()),
    pa.field("detail", pa.string()),
])
COUNTER_FIELDS = ("ready", "delayed", "in_flight", "dead", "bytes")


def findings_table(findings: Iterable[Finding]) -> pa.Table:
    rows = sorted(findings, key=Finding.sort_key)
    return pa.table({
        "kind": pa.array([f.kind for f in rows], pa.string()),
        "queue": pa.array([f.queue for f in rows], pa.string()),
        "message_id": pa.array([f.message_id for f in rows], pa.int64()),
        "file_id": pa.array([f.file_id for f in rows], pa.int64()),
        "offset": pa.array([f.offset for f in rows], pa.int64()),
        "detail": pa.array([f.detail for f in rows], pa.string()),
    }, schema=FINDINGS_SCHEMA)


@dataclass
class MetaFacts:
    """What the driver reads from a snapshot before the Spark passes."""

    path: str
    created_at: float
    queues: dict[int, str]  # qid -> name
    queue_types: dict[str, str]  # name -> priority type
    counters: dict[int, list[int] | None]  # qid -> stored [ready, delayed, in_flight, dead, bytes]
    segment_records: dict[int, tuple[int, int, int]]  # fid -> (live bytes, live count, end)
    manifest: dict[int, int]  # fid -> data length at the checkpoint
    active_id: int | None
    files: dict[int, int]  # fid -> size of the file in payload/
    headers: dict[int, str]  # fid -> why its header is damaged (damaged ones only)
    compaction_output: int | None  # output of a compaction that never committed
    orphan_queue_keys: list[Finding] = field(default_factory=list)
    bad_records: list[Finding] = field(default_factory=list)  # unusable Q, C, S, compaction
    unreadable_counters: set[int] = field(default_factory=set)  # qids with a bad C record


def _naturals(value: Any, n: int) -> bool:
    """Whether ``value`` is a list or tuple of ``n`` ints, each 0 <= x < 2**63."""
    return (isinstance(value, (list, tuple)) and len(value) == n
            and all(type(x) is int and 0 <= x < 1 << 63 for x in value))


def _bad(key: bytes, what: str, why: object, queue: str | None = None,
         file_id: int | None = None) -> Finding:
    return Finding(BAD_RECORD, queue=queue, file_id=file_id,
                   detail=f"{what} key {key.hex()}: {_why(why)}")


def read_meta_facts(snap: Snapshot) -> MetaFacts:
    """The small records and the segment files; a record that cannot be used is a
    ``bad_record`` finding naming its key (and is then treated as absent)."""
    meta = snap.meta
    bad: list[Finding] = [Finding(BAD_RECORD, detail=why) for _, why in snap.bad_queue_records]
    counters: dict[int, list[int] | None] = {}
    unreadable_counters: set[int] = set()
    for qid, info in snap.queues.items():
        key = keys.counts_key(qid)
        raw = meta.get(key)
        counters[qid] = None
        if raw is None:
            continue
        why: object
        counts: Any
        try:
            counts = records.decode_counts(raw)
        except Exception as exc:  # msgpack's errors have no common base
            counts, why = None, exc
        else:
            why = f"counters {counts!r:.80} are not five non-negative ints"
        if _naturals(counts, len(COUNTER_FIELDS)):
            counters[qid] = list(counts or [])
        else:
            unreadable_counters.add(qid)
            bad.append(_bad(key, "counter", why, queue=info.name))
    for qid, info in snap.queues.items():  # the E totals (expired count), as the check
        key = keys.totals_key(qid)
        raw = meta.get(key)
        if raw is None:
            continue  # nothing expired yet
        try:
            expired: Any = records.decode_totals(raw)
        except Exception as exc:  # msgpack's errors have no common base
            bad.append(_bad(key, "totals", exc, queue=info.name))
            continue
        if type(expired) is not int or expired < 0:
            bad.append(_bad(key, "totals", f"expired {expired!r:.40} is not a non-negative "
                                           "int", queue=info.name))
    segs: dict[int, tuple[int, int, int]] = {}
    for k, v in meta.scan(keys.SEGMENT, keys.prefix_end(keys.SEGMENT)):
        try:
            fid = keys.segment_id(k)
            seg: Any = records.decode_segment(v)
        except Exception as exc:
            bad.append(_bad(k, "segment", exc))
            continue
        if _naturals(seg, 3):
            segs[fid] = (seg[0], seg[1], seg[2])
        else:
            bad.append(_bad(k, "segment", f"fields {seg!r:.80} are not three non-negative "
                                          "ints", file_id=fid))
    output = None
    raw = meta.get(keys.COMPACTION_KEY)
    if raw is not None:
        try:
            phase, out, _sources = records.decode_compaction(raw)
            if type(out) is not int or phase not in (records.COPYING, records.REPOINTING,
                                                     records.DELETING):
                raise ValueError(f"phase {phase!r:.40}, output {out!r:.40}")
            output = out if phase == records.COPYING else None
        except Exception as exc:
            bad.append(_bad(keys.COMPACTION_KEY, "compaction", exc))
    files: dict[int, int] = {}
    headers: dict[int, str] = {}
    directory = os.path.join(snap.path, "payload")
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        file_id = fmt.parse_segment_name(name)
        if file_id is None:
            continue
        path = os.path.join(directory, name)
        files[file_id] = os.path.getsize(path)
        with open(path, "rb") as f:
            problem = fmt.header_problem(f.read(fmt.HEADER_SIZE), file_id)
        if problem is not None:
            headers[file_id] = problem
    orphans = []
    short: list[bytes] = []  # message keys no partition reads: no queue id in them
    for kind in (*keys.PER_QUEUE_KINDS, keys.COUNTS, keys.TOTALS):
        for qid in snap.qids_with_keys(kind, short if kind == keys.MESSAGE else None):
            if qid not in snap.queues and kind != keys.MESSAGE:  # messages: found row by row
                orphans.append(Finding(ORPHAN_QUEUE_KEYS, detail=(
                    f"keys with prefix {kind.decode()!r} for queue id {qid}, "
                    "which has no Q record")))
    # As the check names them (the check found these; the audit skipped them).
    bad.extend(Finding(BAD_RECORD, detail=f"message key {key.hex()} is not m qid:u32 id:u64")
               for key in short)
    return MetaFacts(
        path=snap.path,
        created_at=float(snap.manifest.get("created_at", 0.0)),
        queues={qid: info.name for qid, info in snap.queues.items()},
        queue_types={info.name: info.rec.priority_type for info in snap.queues.values()},
        counters=counters,
        segment_records=segs,
        manifest=dict(snap.segment_lengths),
        active_id=snap.active_id,
        files=files,
        headers=headers,
        compaction_output=output,
        orphan_queue_keys=orphans,
        bad_records=bad,
        unreadable_counters=unreadable_counters,
    )


MAX_RANGES = 10  # unreferenced byte ranges named in one finding


def unreferenced_ranges(runs: pa.Table | None, fid: int, end: int) -> list[tuple[int, int]]:
    """The byte ranges of segment ``fid`` in ``[header, end)`` that no message references,
    from the runs of records the message tasks reported (``file_id``, ``offset``, ``end``)."""
    spans: list[tuple[int, int]] = []
    if runs is not None and runs.num_rows:
        mine = runs.filter(pc.equal(runs["file_id"], fid))
        spans = sorted(zip(mine["offset"].to_pylist(), mine["end"].to_pylist(), strict=True))
    gaps = []
    at = fmt.HEADER_SIZE
    for lo, hi in spans:
        if lo > at:
            gaps.append((at, min(lo, end)))
        at = max(at, hi)
        if at >= end:
            break
    if at < end:
        gaps.append((at, end))
    return [(a, b) for a, b in gaps if a < b]


def check_segments(facts: MetaFacts, recount: Mapping[int, tuple[int, int]],
                   runs: pa.Table | None = None,
                   late: Mapping[int, tuple[int, int]] | None = None
                   ) -> tuple[list[Finding], list[dict[str, Any]]]:
    """Segment-level findings and one summary row per segment.

    ``recount`` maps a file id to (messages referencing it, their bytes with
    frames) that its ``S`` record counts; ``late``, the same for the messages
    the record defers (ids from its ``covered`` id up, qstore/_seg_accounts.py),
    not compared with it; ``runs``, the runs of records the message tasks saw, lets a
    finding of live bytes that no message references name where they can be.
    A segment file is an orphan when no message references it, it
    has no ``S`` record, and it is neither the snapshot's active segment (a
    fresh one has no record yet) nor the output of an unfinished compaction
    (discarded when the store reopens), and it holds more than its header (a
    compaction pass seals and then deletes an empty active segment; a snapshot
    may fall in between). A segment that still has an ``S``
    record but no live message is garbage awaiting compaction, not an orphan.
    """
    findings: list[Finding] = []
    rows: list[dict[str, Any]] = []
    late = late or {}
    fids = sorted(set(facts.manifest) | set(facts.files) | set(facts.segment_records)
                  | set(recount) | set(late))
    # Where each segment's referenced records end, from the runs (which hold the
    # records of deferred pushes too: a segment with any is not compared).
    ends: dict[int, int] = {}
    if runs is not None and runs.num_rows:
        by = runs.group_by("file_id").aggregate([("end", "max")])
        ends = dict(zip(by["file_id"].to_pylist(), by["end_max"].to_pylist(), strict=True))
    for fid in fids:
        listed = fid in facts.manifest
        present = fid in facts.files
        count, frame_bytes = recount.get(fid, (0, 0))
        late_count, late_bytes = late.get(fid, (0, 0))
        refs = count + late_count  # messages that reference the segment
        stored = facts.segment_records.get(fid)
        length = facts.manifest.get(fid, facts.files.get(fid, 0))
        if not present:  # as the check words it
            findings += found(segs.missing_file(fid, refs, stored is not None, listed))
        if present:
            findings += found(segs.header_finding(fid, facts.headers.get(fid)))
        truncated = None
        if listed and present:
            truncated = segs.manifest_truncation(fid, facts.files[fid], length)
            findings += found(truncated)
        unaccounted = refs == 0 and stored is None and not segs.orphan_exempt(
            fid, length, facts.active_id, facts.compaction_output)
        if present and unaccounted:
            findings.append(segs.orphan(fid, facts.files[fid],
                                        "" if listed else "; not listed in MANIFEST.json"))
        elif present and not listed and refs:
            findings.append(segs.unlisted(fid, refs))
        live_bytes, live_count, end = stored if stored is not None else (0, 0, 0)
        where, at = "", None
        if live_bytes > frame_bytes and present and (live_bytes, live_count) != (frame_bytes,
                                                                                 count):
            # Live bytes no message references: name the ranges they can lie in.
            gaps = unreferenced_ranges(runs, fid, min(end or length, length, facts.files[fid]))
            if gaps:
                at = gaps[0][0]
                total = sum(b - a for a, b in gaps)
                shown = ", ".join(f"[{a}, {b})" for a, b in gaps[:MAX_RANGES])
                more = f" and {len(gaps) - MAX_RANGES} more" if len(gaps) > MAX_RANGES else ""
                exact = ("exactly the difference" if total == live_bytes - frame_bytes
                         else "acked records' garbage included")
                where = f"; {total} bytes no message references, at {shown}{more} ({exact})"
        findings += found(segs.record_mismatch(fid, stored, count, frame_bytes, where, at))
        if stored is not None and truncated is None and present and end > facts.files[fid]:
            findings += found(segs.end_past_file(fid, facts.files[fid], end))  # as the check
        elif stored is not None and listed:
            findings += found(segs.end_past_manifest(fid, end, length))
        if stored is not None and fid in ends and fid not in late and live_bytes >= 0:
            findings += found(segs.records_past_end(fid, ends[fid], end))  # as the check
        active = fid == facts.active_id
        rows.append({
            "file_id": fid,
            "length": length,
            "file_size": facts.files.get(fid),
            "listed": listed,
            "active": active,
            "messages": refs,
            "live_bytes": frame_bytes + late_bytes,
            # what the S record accounts for, the pushes it defers counted
            "stored_live_count": stored[1] + late_count if stored is not None else None,
            "stored_live_bytes": stored[0] + late_bytes if stored is not None else None,
            "garbage_ratio": round(SegmentStats(fid, length, frame_bytes + late_bytes, refs,
                                                active).garbage_ratio, 6),
        })
    return findings, rows


def check_counters(facts: MetaFacts, recount: Mapping[str, list[int]]
                   ) -> tuple[list[Finding], dict[str, dict[str, Any]]]:
    """Compare each queue's ``C`` record with the recount by state (plus payload bytes)."""
    findings = []
    table: dict[str, dict[str, Any]] = {}
    for qid, name in sorted(facts.queues.items(), key=lambda kv: kv[1]):
        counted = recount.get(name, [0, 0, 0, 0, 0])
        stored = facts.counters.get(qid)
        if stored is None:
            if qid not in facts.unreadable_counters:  # else already a bad_record finding
                findings.append(Finding(COUNTER_MISMATCH, queue=name, detail="no C record"))
        elif list(stored) != counted:
            diffs = [f"{f}: stored {s}, recount {c}"
                     for f, s, c in zip(COUNTER_FIELDS, stored, counted, strict=True) if s != c]
            findings.append(Finding(COUNTER_MISMATCH, queue=name, detail="; ".join(diffs)))
        table[name] = {
            "recount": dict(zip(COUNTER_FIELDS, counted, strict=True)),
            "stored": dict(zip(COUNTER_FIELDS, stored, strict=True)) if stored else None,
            "match": stored is not None and list(stored) == counted,
        }
    return findings, table


def _why(why: object) -> str:
    """An exception as a readable reason (msgpack's errors often have no message)."""
    if isinstance(why, BaseException):
        return f"undecodable ({type(why).__name__}{': ' + str(why) if str(why) else ''})"
    return str(why)
