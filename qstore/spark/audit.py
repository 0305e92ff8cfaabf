"""The Spark audit of a snapshot: ``qstore audit SNAPSHOT`` and ``spark-submit spark/audit.py``.

Passes (docs/spark.md lists every check and finding kind):

1. Driver: the manifest, the ``Q``/``C``/``S`` records, the segment files and
   their headers, per-queue keys of unknown queue ids (:mod:`._audit_checks`).
2. Executors, ``qstore_audit`` (:mod:`._audit_source`): each task reads one
   range of messages once; it checks every reference (segment present, bounds
   within the manifest length, frame length, CRC) and yields findings plus
   small recounts (per state, per segment, payload sizes per priority), runs
   of adjacent records per segment, and fingerprints of the index entries
   the messages imply. The driver adds them up (:mod:`._audit_merge`) and
   reads again exactly the runs of different tasks that overlap.
3. Executors, ``qstore_index`` (:mod:`._index_source`): one task per queue and
   index fingerprints the entries it holds. Where a fingerprint differs from
   the messages', a second look names the keys no message owns and the
   messages whose keys are missing.

Outputs go to ``OUT`` (default ``SNAPSHOT/audit``): ``summary.json``,
``findings.parquet`` (one row per problem) and ``report.html``; a short
summary is printed. Exit codes: 0 clean, 1 findings, 2 bad usage (including
a path that is not a snapshot), 3 the audit could not complete, 5 the
snapshot cannot be read (damaged metadata, met by the driver or by a task:
:mod:`._task_errors`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

import pyarrow.parquet as pq

from .. import _check_report as kinds
from .._check_report import OVERLAP, Finding
from .._fs import write_json_durably
from ..payload import _format as fmt
from . import _audit_checks as checks
from ._audit_checks import MetaFacts
from ._audit_merge import cross_task_overlaps, merge
from ._index_hash import MASK
from ._report import render_html, render_text
from ._snapshot_view import ROWS_PER_PARTITION, Snapshot
from ._task_errors import task_corruption

SUMMARY_FORMAT = 1  # never change the meaning of 1
MAX_SIZE_GROUPS = 1000  # (queue, priority) groups kept in summary.json
MAX_EXAMPLES = 200  # findings copied into summary.json (all of them are in the Parquet file)
STATES = ("ready", "delayed", "in_flight", "dead")
EXIT_INCOMPLETE = 3  # the audit could not complete (a failed Spark run); never 1


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """What :func:`run_audit` found and wrote. ``text`` is the printed summary."""

    findings: int
    summary: dict[str, Any]
    paths: dict[str, str]  # "summary", "findings", "report" -> file written
    exit_code: int  # 0 clean, 1 findings
    text: str


def run_audit(snapshot: str | os.PathLike[str], *, master: str | None = None,
              out: str | os.PathLike[str] | None = None, spark: Any = None,
              quiet: bool = False) -> AuditResult:
    """Audit ``snapshot`` with Spark; write the outputs and print the summary.

    ``spark``: a session to use (the ``qstore`` sources are registered on it);
    without one, a session is made with :func:`qstore.spark.get_session`
    (``master`` or ``$QSTORE_SPARK_MASTER`` or ``local[2]``) and stopped at
    the end if it was not already running. ``quiet`` skips the printing;
    the text is in the result either way. Raises InvalidArgument if
    ``snapshot`` is not a snapshot, :class:`~qstore.Corruption` if its
    metadata is damaged (also where only a Spark task reads it).
    """
    started = time.time()
    path = os.path.abspath(os.fspath(snapshot))  # executors resolve it, not our cwd
    with Snapshot(path) as snap:
        facts = checks.read_meta_facts(snap)
    out_dir = os.path.abspath(os.fspath(out)) if out is not None else os.path.join(path, "audit")
    session, stop = _session(spark, master)
    try:
        passes = _spark_passes(session, path, facts)
    except Exception as exc:
        # Damaged metadata met by a task (keys only executors read): the snapshot
        # cannot be read, as when the driver meets it, not a failed run.
        damage = task_corruption(exc)
        if damage is None:
            raise
        raise damage from None
    finally:
        if stop:
            session.stop()
    summary, findings = _assemble(facts, passes, started)
    os.makedirs(out_dir, exist_ok=True)
    paths = {"summary": os.path.join(out_dir, "summary.json"),
             "findings": os.path.join(out_dir, "findings.parquet"),
             "report": os.path.join(out_dir, "report.html")}
    summary["outputs"] = paths
    pq.write_table(checks.findings_table(findings), paths["findings"])
    write_json_durably(paths["summary"], summary)
    with open(paths["report"], "w", encoding="utf-8") as f:
        f.write(render_html(summary))
    text = render_text(summary)
    if not quiet:
        print(text)
    return AuditResult(len(findings), summary, paths, summary["exit_code"], text)


def _session(spark: Any, master: str | None) -> tuple[Any, bool]:
    from pyspark.sql import SparkSession

    from ._audit_source import AuditSource
    from ._index_source import IndexSource
    from ._session import get_session, register

    if spark is not None:
        register(spark)
        stop = False
    else:
        stop = SparkSession.getActiveSession() is None
        spark = get_session(master, "qstore-audit")
    spark.dataSource.register(AuditSource)
    spark.dataSource.register(IndexSource)
    return spark, stop


@dataclasses.dataclass
class _Passes:
    findings: list[Finding]
    messages: int
    segments: dict[int, tuple[int, int]]  # fid -> (messages, bytes with frames)
    queues: dict[str, list[int]]  # name -> [ready, delayed, in_flight, dead, bytes]
    sizes: list[dict[str, Any]]
    sizes_truncated: bool
    index: dict[str, dict[str, dict[str, int]]]  # queue -> index -> keys, expected
    ready: list[dict[str, Any]]  # per (queue, priority): ready, oldest enqueue time
    attempts: dict[str, dict[int, int]]  # queue -> attempts -> messages
    runs: Any  # pyarrow.Table of the runs of records per segment (offset, end)
    notes: list[Finding]  # damage already set aside (damaged_set_aside), not findings
    late: dict[int, tuple[int, int]]  # fid -> (messages, bytes) its S record defers


def _spark_passes(spark: Any, path: str, facts: MetaFacts) -> _Passes:
    n_parts = _partitions(spark, sum(sum(c[:4]) for c in facts.counters.values() if c))
    table = (spark.read.format("qstore_audit").option("partitions", str(n_parts)).load(path)
             .toArrow())
    got = merge(table)
    with Snapshot(path) as snap:
        findings = _dedup([*got.findings, *cross_task_overlaps(snap, got.runs, facts.queues)])
    # A message record that does not decode is a bad_record finding, and its
    # index keys are left out of what its queue's indexes should hold.
    unreadable = frozenset(f.queue for f in findings if f.kind == kinds.BAD_RECORD)
    index_findings, index = _index_pass(spark, path, facts, got.index, unreadable)
    queues = {facts.queues[qid]: c for qid, c in got.queues.items() if qid in facts.queues}
    attempts = {facts.queues[qid]: a for qid, a in got.attempts.items() if qid in facts.queues}
    return _Passes(findings + index_findings, got.messages, got.segments, queues,
                   got.sizes[:MAX_SIZE_GROUPS], len(got.sizes) > MAX_SIZE_GROUPS, index,
                   got.ready, attempts, got.runs, got.notes, got.late)


def _dedup(findings: list[Finding]) -> list[Finding]:
    """An overlap can be found by its task and again by the check between tasks. Only
    overlaps are told apart by where alone: two other findings of one kind at one
    place (a bad message key and a huge id, both with no message id) are two."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for f in findings:
        key = ((f.kind, f.message_id, f.file_id, f.offset) if f.kind == OVERLAP
               else (f.kind, f.queue, f.message_id, f.file_id, f.offset, f.detail))
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def _index_pass(spark: Any, path: str, facts: MetaFacts,
                expected: dict[tuple[int, str], tuple[int, int]],
                unreadable: frozenset[str | None] = frozenset()
                ) -> tuple[list[Finding], dict[str, dict[str, dict[str, int]]]]:
    """Compare each index's fingerprint with the one its messages imply; name the
    culprits of the indexes that differ (keys no message owns, messages without keys)."""
    from ._index_source import KINDS

    rows = spark.read.format("qstore_index").load(path).collect()
    index: dict[str, dict[str, dict[str, int]]] = {}
    differ = []
    seen = set()
    for r in rows:
        seen.add((r["qid"], r["kind"]))
        want_n, want_h = expected.get((r["qid"], r["kind"]), (0, 0))
        name = facts.queues[r["qid"]]
        index.setdefault(name, {})[r["kind"]] = {"keys": r["keys"], "expected": want_n}
        if (r["keys"], r["hash"] & MASK) != (want_n, want_h):
            differ.append((r["qid"], r["kind"]))
    for (qid, kind), (want_n, _) in sorted(expected.items()):
        if (qid, kind) not in seen and want_n and qid in facts.queues:  # no key at all
            index.setdefault(facts.queues[qid], {})[kind] = {"keys": 0, "expected": want_n}
            differ.append((qid, kind))
    if not differ:
        return [], index
    assert set(k for _, k in differ) <= set(KINDS)
    out = []
    strays = (spark.read.format("qstore_index")
              .option("verify", json.dumps([f"{qid}:{kind}" for qid, kind in differ]))
              .load(path).where("message_id is not null or detail is not null").collect())
    for r in strays:
        out.append(Finding(kinds.STRAY_INDEX_KEY, queue=facts.queues[r["qid"]],
                           message_id=r["message_id"], detail=f"{r['kind']} index: {r['detail']}"))
    names = sorted({facts.queues[qid] for qid, _ in differ})
    missing = (spark.read.format("qstore").option("check_index", "true")
               .option("bad_records", "skip")  # found by the message pass
               .option("queue", ",".join(names)).load(path).where("not index_ok").collect())
    expiry_differs = {facts.queues[qid] for qid, kind in differ if kind == "expiry"}
    for r in missing:
        out.append(Finding(kinds.INDEX_MISSING, queue=r["queue"], message_id=r["id"],
                           file_id=r["file_id"], offset=r["offset"],
                           detail=f"its key in the {r['state']} index"
                                  + (" or its dedup key" if r["dedup_digest"] else "")
                                  + (" or its expiry key" if r["queue"] in expiry_differs
                                     else "") + " is missing"))
    # A fingerprint that differs with no key or message to blame is still a
    # difference: reported, never taken for clean. (Unless a message record of
    # the queue does not decode: the keys of such a message are what differs,
    # and its bad_record finding names it.)
    blamed = {f.queue for f in out} | unreadable
    for qid, kind in differ:
        name = facts.queues[qid]
        if name in blamed:
            continue
        have, want = index[name][kind]["keys"], index[name][kind]["expected"]
        out.append(Finding(kinds.STRAY_INDEX_KEY if have > want else kinds.INDEX_MISSING,
                           queue=name, detail=f"the {kind} index holds {have} keys where "
                           f"the messages imply {want} (the fingerprints differ), and no "
                           "single key or message was found to blame"))
    return out, index


def _partitions(spark: Any, messages: int) -> int:
    """At least two tasks per core, and no task over ``ROWS_PER_PARTITION`` messages."""
    try:
        cores = int(spark.sparkContext.defaultParallelism)
    except Exception:  # Spark Connect has no SparkContext: fall back to the row count alone
        cores = 1
    return max(2 * cores, math.ceil(messages / ROWS_PER_PARTITION), 1)


def _assemble(facts: MetaFacts, p: _Passes, started: float
              ) -> tuple[dict[str, Any], list[Finding]]:
    seg_findings, segments = checks.check_segments(facts, p.segments, p.runs, p.late)
    seg_findings, notes = _set_aside_segments(seg_findings, p.findings, p.notes)
    counter_findings, queues = checks.check_counters(facts, p.queues)
    findings = sorted([*p.findings, *seg_findings, *counter_findings, *facts.orphan_queue_keys,
                       *facts.bad_records],
                      key=Finding.sort_key)
    oldest: dict[str, float] = {}
    for g in p.ready:
        if g["queue"] is not None:
            oldest[g["queue"]] = min(oldest.get(g["queue"], g["oldest"]), g["oldest"])
    for name, q in queues.items():
        q["priority_type"] = facts.queue_types.get(name)
        q["index"] = p.index.get(name, {})
        # Age at the snapshot's moment, so that the report does not age with the audit.
        q["oldest_ready_age_s"] = (round(max(0.0, facts.created_at - oldest[name]), 3)
                                   if name in oldest else None)
        q["attempts"] = {str(a): n for a, n in sorted(p.attempts.get(name, {}).items())}
    by_kind: dict[str, int] = {}
    for f in findings:
        by_kind[f.kind] = by_kind.get(f.kind, 0) + 1
    total_len = sum(s["length"] for s in segments)
    live = sum(s["live_bytes"] for s in segments)
    body = total_len - fmt.HEADER_SIZE * len(segments)
    by_state = {s: sum(c[i] for c in p.queues.values()) for i, s in enumerate(STATES)}
    exit_code = 1 if findings else 0
    summary: dict[str, Any] = {
        "format": SUMMARY_FORMAT,
        "kind": "qstore-audit",
        "snapshot": facts.path,
        "snapshot_created_at": facts.created_at,
        "audited_at": time.time(),
        "seconds": round(time.time() - started, 3),
        "clean": not findings,
        "exit_code": exit_code,
        "findings": {
            "total": len(findings),
            "by_kind": by_kind,
            "examples": [dataclasses.asdict(f) for f in _examples(findings)],
        },
        # Damage already dealt with: messages moved to the dead letters for it, and
        # segment damage that touches only those (as `qstore check` reports them).
        "notes": {
            "total": len(notes),
            "examples": [dataclasses.asdict(f) for f in notes[:MAX_EXAMPLES]],
        },
        "messages": {"total": p.messages, "by_state": by_state,
                     "without_queue": p.messages - sum(by_state.values()),
                     "bytes": sum(c[4] for c in p.queues.values())},
        "queues": queues,
        "disk": {"segments": len(segments), "bytes": total_len, "live_bytes": live,
                 "garbage_ratio": round(max(0.0, (body - live) / body), 6) if body > 0 else 0.0},
        "segments": segments,
        "payload_sizes": p.sizes,
        "payload_sizes_truncated": p.sizes_truncated,
        "ready_depth": [{k: g[k] for k in ("queue", "priority", "ready")}
                        for g in p.ready[:MAX_SIZE_GROUPS] if g["queue"] is not None],
        "ready_depth_truncated": len(p.ready) > MAX_SIZE_GROUPS,
    }
    return summary, findings


def _set_aside_segments(seg_findings: list[Finding], message_findings: list[Finding],
                        notes: list[Finding]) -> tuple[list[Finding], list[Finding]]:
    """Segment damage (missing, truncated, bad header) that only messages already set
    aside meet becomes a note, as in the integrity check (``_check.Check.run``)."""
    aside = {n.file_id for n in notes}
    not_aside = {f.file_id for f in message_findings if f.message_id is not None}
    kept = []
    notes = sorted(notes, key=Finding.sort_key)
    for f in seg_findings:
        if f.kind in kinds.SEGMENT_DAMAGE and f.file_id in aside and f.file_id not in not_aside:
            notes.append(Finding(kinds.DAMAGED_SET_ASIDE, file_id=f.file_id, offset=f.offset,
                                 detail=f"{f.kind}: {f.detail}; every message damaged by it "
                                 "was moved to the dead letters"))
        else:
            kept.append(f)
    return kept, notes


def _examples(findings: list[Finding]) -> list[Finding]:
    """Up to MAX_EXAMPLES findings, every kind represented."""
    first: dict[str, Finding] = {}
    for f in findings:
        first.setdefault(f.kind, f)
    chosen = list(first.values())
    seen = set(map(id, chosen))
    chosen += [f for f in findings if id(f) not in seen][:max(0, MAX_EXAMPLES - len(chosen))]
    return sorted(chosen, key=Finding.sort_key)
