"""What a run produces: samples and metrics per repeat, their medians, and the JSON document.

The document (``FORMAT``) is self-contained: the table is rendered from it, so
``python -m bench --show FILE`` prints a saved run exactly as it was printed.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT = "qstore-bench/1"


@dataclass(frozen=True)
class Sample:
    """One throughput measurement in one repeat."""

    workload: str  # "push", "pop+ack", "push_many", "pop_many+ack_many", "mixed", "push (threads)"
    size: int  # payload bytes
    peer: str  # a PeerSpec name
    threads: int
    ops: int  # messages done
    seconds: float
    p50_us: float | None = None  # latency of one call of the measured op
    p99_us: float | None = None
    note: str = ""

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Metric:
    """One scalar that is not a rate of a peer (scaling, open, compaction)."""

    name: str  # stable id, e.g. "churn.pop_after"
    label: str
    value: float
    unit: str
    note: str = ""


@dataclass(frozen=True)
class Failure:
    """A measurement that could not be taken: a peer not installed, or an error."""

    workload: str
    size: int
    peer: str
    threads: int
    status: str


@dataclass
class Collected:
    """Everything measured, over every repeat."""

    samples: list[Sample] = field(default_factory=list)
    metrics: list[Metric] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    profiles: dict[str, str] = field(default_factory=dict)


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def row_key(workload: str, size: int, peer: str, threads: int) -> tuple[str, int, str, int]:
    return (workload, size, peer, threads)


def aggregate_rows(collected: Collected, compare_to: dict[str, str]) -> list[dict[str, Any]]:
    """One row per (workload, size, peer, threads): median rate and latencies, and the ratio.

    ``ratio`` is the rate of the qstore row named by ``compare_to[peer]``
    divided by this row's rate: how many times this peer's rate qstore does.
    """
    groups: dict[tuple[str, int, str, int], list[Sample]] = {}
    for s in collected.samples:
        groups.setdefault(row_key(s.workload, s.size, s.peer, s.threads), []).append(s)
    rows: dict[tuple[str, int, str, int], dict[str, Any]] = {}
    for key, samples in groups.items():
        rates = [s.rate for s in samples]
        rows[key] = {
            "workload": key[0], "size": key[1], "peer": key[2], "threads": key[3],
            "status": "ok",
            "rate": _median(rates),
            "runs": rates,
            "ops": [s.ops for s in samples],
            "p50_us": _median(s.p50_us for s in samples),
            "p99_us": _median(s.p99_us for s in samples),
            "note": samples[0].note,
        }
    for f in collected.failures:
        key = row_key(f.workload, f.size, f.peer, f.threads)
        if key not in rows:  # a failure in one repeat does not hide the others' figures
            rows[key] = {"workload": f.workload, "size": f.size, "peer": f.peer,
                         "threads": f.threads, "status": f.status, "rate": None, "runs": [],
                         "ops": [], "p50_us": None, "p99_us": None, "note": ""}
    for key, row in rows.items():
        ref_peer = compare_to.get(key[2])
        ref = rows.get(row_key(key[0], key[1], ref_peer, key[3])) if ref_peer else None
        row["compare_to"] = ref_peer
        row["ratio"] = (ref["rate"] / row["rate"]
                        if ref is not None and ref["rate"] and row["rate"] else None)
    return list(rows.values())


def aggregate_metrics(collected: Collected) -> list[dict[str, Any]]:
    groups: dict[str, list[Metric]] = {}
    for m in collected.metrics:
        groups.setdefault(m.name, []).append(m)
    return [{"name": name, "label": ms[0].label, "unit": ms[0].unit, "note": ms[0].note,
             "value": _median(m.value for m in ms), "runs": [m.value for m in ms]}
            for name, ms in groups.items()]


def sample_dict(s: Sample) -> dict[str, Any]:
    d = asdict(s)
    d["rate"] = s.rate
    return d


def save(doc: dict[str, Any], path: str) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def load(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        doc: dict[str, Any] = json.load(f)
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} results file")
    return doc
