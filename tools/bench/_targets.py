"""The contract's performance targets (CONTRACT.md section 7), checked against a run.

Each target is a ratio or a bound computed from the run's medians; it is
"met", "missed", or "n/a" when the run did not measure what it needs (a
workload left out with --only, a peer not installed, or a Spark target that
this harness does not run). A target whose scale the run did not reach (the
1,000,000-message ones outside --full) says so in its note.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._plan import CONTRACT_SCALE, KiB

KIND_MIN = ">="
KIND_MAX = "<="


class Lookup:
    """Medians of one run, by what the targets ask for."""

    def __init__(self, rows: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> None:
        self._rows = {(r["workload"], r["size"], r["peer"], r["threads"]): r["rate"] for r in rows}
        self._metrics = {m["name"]: m["value"] for m in metrics}

    def rate(self, workload: str, peer: str, size: int = KiB, threads: int = 1) -> float | None:
        value = self._rows.get((workload, size, peer, threads))
        return float(value) if value else None

    def metric(self, name: str) -> float | None:
        value = self._metrics.get(name)
        return None if value is None else float(value)

    def ratio(self, a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None


@dataclass(frozen=True)
class Target:
    id: str
    text: str
    kind: str  # ">=" or "<="
    required: float
    unit: str  # "x", "s", "MB"
    measure: Callable[[Lookup], float | None]
    scaled: bool = False  # the contract states it at CONTRACT_SCALE messages


def _vs(workload: str, peer: str, other: str, threads: int = 1) -> Callable[[Lookup], float | None]:
    return lambda lk: lk.ratio(lk.rate(workload, peer, threads=threads),
                               lk.rate(workload, other, threads=threads))


def _metric(name: str) -> Callable[[Lookup], float | None]:
    return lambda lk: lk.metric(name)


def _paired(name: str, a: str, b: str) -> Callable[[Lookup], float | None]:
    """The median of the per-repeat ratios ``name``; from a results file written
    before those existed, the ratio of the medians of ``a`` and ``b``."""
    def measure(lk: Lookup) -> float | None:
        value = lk.metric(name)
        return value if value is not None else lk.ratio(lk.metric(a), lk.metric(b))
    return measure


TARGETS: tuple[Target, ...] = (
    Target("interval-push-bare", "interval: push vs bare queue push", KIND_MIN, 0.35, "x",
           _vs("push", "qstore/interval", "bare")),
    Target("interval-push-litequeue", "interval: push vs litequeue push", KIND_MIN, 5.0, "x",
           _vs("push", "qstore/interval", "litequeue")),
    Target("interval-pop-bare", "interval: pop+ack vs bare queue", KIND_MIN, 0.4, "x",
           _vs("pop+ack", "qstore/interval", "bare")),
    Target("interval-pop-litequeue", "interval: pop+ack vs litequeue", KIND_MIN, 50.0, "x",
           _vs("pop+ack", "qstore/interval", "litequeue")),
    Target("always-push-bare", "always: push vs bare queue sync=True", KIND_MIN, 0.7, "x",
           _vs("push", "qstore/always", "bare-sync")),
    Target("always-push-persist", "always: push vs persist-queue SQLiteAckQueue", KIND_MIN, 0.5,
           "x", _vs("push", "qstore/always", "persist-ack")),
    Target("always-pop-bare", "always: pop+ack vs bare queue sync=True", KIND_MIN, 0.8, "x",
           _vs("pop+ack", "qstore/always", "bare-sync")),
    Target("always-pop-persist", "always: pop+ack vs persist-queue SQLiteAckQueue", KIND_MIN,
           5.0, "x", _vs("pop+ack", "qstore/always", "persist-ack")),
    Target("always-group-commit", "always: push with 8 threads vs 1 thread", KIND_MIN, 4.0, "x",
           lambda lk: lk.ratio(lk.rate("push (threads)", "qstore/always", threads=8),
                               lk.rate("push (threads)", "qstore/always", threads=1))),
    Target("batch-push", "push_many(100) vs single push (interval)", KIND_MIN, 3.0, "x",
           lambda lk: lk.ratio(lk.rate("push_many", "qstore/interval"),
                               lk.rate("push", "qstore/interval"))),
    Target("batch-pop", "pop_many+ack_many(100) vs single pop+ack (interval)", KIND_MIN, 3.0,
           "x", lambda lk: lk.ratio(lk.rate("pop_many+ack_many", "qstore/interval"),
                                    lk.rate("pop+ack", "qstore/interval"))),
    # The same four ratios with both sides alternating in chunks (_interleaved.py).
    Target("interleaved-push-bare", "interval: push vs bare queue push, interleaved",
           KIND_MIN, 0.35, "x", _metric("interleaved.push_vs_bare")),
    Target("interleaved-pop-bare", "interval: pop+ack vs bare queue, interleaved", KIND_MIN,
           0.4, "x", _metric("interleaved.pop_ack_vs_bare")),
    Target("interleaved-batch-push", "push_many(100) vs single push, interleaved", KIND_MIN,
           3.0, "x", _metric("interleaved.push_many_vs_push")),
    Target("interleaved-batch-pop", "pop_many+ack_many(100) vs single pop+ack, interleaved",
           KIND_MIN, 3.0, "x", _metric("interleaved.pop_many_vs_pop_ack")),
    Target("churn", "pop rate after N push/pop/ack cycles vs fresh", KIND_MIN, 0.8, "x",
           _metric("churn.ratio"), scaled=True),
    Target("open-time", "open with an N-message backlog", KIND_MAX, 1.0, "s",
           _metric("open.seconds"), scaled=True),
    Target("open-rss", "RSS after opening an N-message backlog", KIND_MAX, 200.0, "MB",
           _metric("open.rss_mb"), scaled=True),
    Target("compaction", "compaction rewrite rate vs disk sequential write", KIND_MIN, 0.5, "x",
           _metric("compaction.ratio")),
    Target("server-push", "server, 4 clients: push vs beanstalkd put", KIND_MIN, 0.5, "x",
           _paired("server.ratio.push", "server.qstore.push", "server.beanstalkd.put")),
    Target("server-pop", "server, 4 clients: pop+ack vs beanstalkd reserve+delete", KIND_MIN,
           0.5, "x", _paired("server.ratio.pop_ack", "server.qstore.pop_ack",
                             "server.beanstalkd.reserve_delete")),
    Target("server-batch-push", "server, 4 clients: push_many(100) vs beanstalkd put",
           KIND_MIN, 2.0, "x", _paired("server.ratio.push_many", "server.qstore.push_many",
                                       "server.beanstalkd.put")),
    Target("server-batch-pop", "server, 4 clients: pop_many+ack_many(100) vs beanstalkd "
           "reserve+delete", KIND_MIN, 2.0, "x",
           _paired("server.ratio.pop_many_ack_many", "server.qstore.pop_many_ack_many",
                   "server.beanstalkd.reserve_delete")),
    Target("spark-audit", "Spark audit time vs single-process scan", KIND_MAX, 3.0, "x",
           _metric("spark.audit_ratio"), scaled=True),
    Target("spark-backfill", "Spark backfill rate vs push_many", KIND_MIN, 3.0, "x",
           _metric("spark.backfill_ratio"), scaled=True),
)


def _rtt_note(lk: Lookup) -> str:
    """One client's round trips, reported next to the server targets (contract section 7)."""
    q50, q99 = lk.metric("server.qstore.rtt_p50_ms"), lk.metric("server.qstore.rtt_p99_ms")
    b50, b99 = lk.metric("server.beanstalkd.rtt_p50_ms"), lk.metric("server.beanstalkd.rtt_p99_ms")
    if q50 is None or q99 is None:
        return ""
    note = f"1-client RTT p50/p99 ms: qstore {q50:.3f}/{q99:.3f}"
    if b50 is not None and b99 is not None:
        note += f", beanstalkd {b50:.3f}/{b99:.3f}"
    return note


def _disk_note(lk: Lookup) -> str:
    """How close the backfill is to the disk, and what 3x push_many would ask of it."""
    have, need = lk.metric("spark.backfill_disk_ratio"), lk.metric("spark.needed_disk_ratio")
    if have is None or need is None:
        return ""
    return f"the backfill writes at {have:.2f}x the disk's rate; 3x would need {need:.2f}x"


def evaluate(rows: list[dict[str, Any]], metrics: list[dict[str, Any]],
             params: dict[str, Any]) -> list[dict[str, Any]]:
    lookup = Lookup(rows, metrics)
    out = []
    for t in TARGETS:
        measured = t.measure(lookup)
        if measured is None:
            status = "n/a"
        elif t.kind == KIND_MIN:
            status = "met" if measured >= t.required else "missed"
        else:
            status = "met" if measured <= t.required else "missed"
        note = ""
        if t.id == "server-push":
            note = _rtt_note(lookup)
        elif t.scaled and measured is not None:
            n = (int(lookup.metric("churn.cycles_done") or 0) if t.id == "churn"
                 else params["spark_messages"] if t.id.startswith("spark")
                 else params["backlog"])
            if n < CONTRACT_SCALE:
                note = f"N={n:,}, contract N={CONTRACT_SCALE:,}: use --full"
            else:
                note = f"N={n:,}"
            if t.id == "spark-backfill":
                note = ", ".join(x for x in (note, _disk_note(lookup)) if x)
        out.append({"id": t.id, "text": t.text, "kind": t.kind, "required": t.required,
                    "unit": t.unit, "measured": measured, "status": status, "note": note})
    return out
