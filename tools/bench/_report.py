"""The tables printed at the end of a run, rendered from the results document alone."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ._plan import KiB

WORKLOAD_ORDER = ("push", "pop+ack", "push_many", "pop_many+ack_many", "mixed", "push (threads)")
STATUS_STYLE = {"met": "green", "missed": "bold red", "n/a": "dim"}


def _num(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "x":
        return f"{value:.2f}x" if abs(value) >= 0.1 else f"{value:.3f}x"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _size(n: int) -> str:
    return f"{n // KiB} KiB" if n % KiB == 0 else f"{n} B"


def throughput_table(doc: dict[str, Any]) -> Table:
    peers = {p["name"]: p for p in doc["peers"]}
    peer_order = {p["name"]: i for i, p in enumerate(doc["peers"])}

    def order(row: dict[str, Any]) -> tuple[int, int, int, int]:
        w = row["workload"]
        wi = WORKLOAD_ORDER.index(w) if w in WORKLOAD_ORDER else len(WORKLOAD_ORDER)
        return (wi, row["size"], row["threads"], peer_order.get(row["peer"], 99))

    table = Table(title=f"Throughput: median of {doc['params']['repeat']} run(s), "
                        "messages per second",
                  caption="qstore÷this: the rate of the qstore row in 'vs' divided by this "
                          "row's rate (what the targets compare). Latency: one call of the "
                          "timed op (push, pop, or one batch call).",
                  caption_justify="left")
    for name, justify in (("workload", "left"), ("size", "right"), ("peer", "left"),
                          ("durability", "left"), ("thr", "right"), ("msgs/s", "right"),
                          ("p50 µs", "right"), ("p99 µs", "right"), ("qstore÷this", "right"),
                          ("vs", "left"), ("note", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    last = None
    for row in sorted(doc["rows"], key=order):
        group = (row["workload"], row["size"])
        if last is not None and group != last:
            table.add_section()
        last = group
        spec = peers.get(row["peer"], {})
        ok = row["status"] == "ok"
        ref = row.get("compare_to") or ""
        if row["peer"] == ref:
            ratio = "1.00x"
        elif row["ratio"] is None:
            ratio, ref = "-", ""
        else:
            ratio = _num(row["ratio"], "x")
        status = row["status"] if len(row["status"]) <= 40 else row["status"][:39] + "…"
        table.add_row(
            row["workload"], _size(row["size"]), row["peer"], spec.get("durability", "?"),
            str(row["threads"]), _num(row["rate"]) if ok else f"[yellow]{escape(status)}[/]",
            _num(row["p50_us"]), _num(row["p99_us"]), ratio, ref.removeprefix("qstore/"),
            row.get("note", ""),
        )
    return table


def metrics_table(doc: dict[str, Any]) -> Table:
    table = Table(title="qstore scaling, open and compaction (median)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("unit")
    table.add_column("runs", justify="right")
    for m in doc["metrics"]:
        runs = ", ".join(_num(v, m["unit"]) for v in m["runs"]) if len(m["runs"]) > 1 else ""
        table.add_row(m["label"], _num(m["value"], m["unit"]), m["unit"], runs)
    return table


def targets_table(doc: dict[str, Any]) -> Table:
    table = Table(title="Contract targets (CONTRACT.md section 7)")
    table.add_column("target")
    table.add_column("measured", justify="right")
    table.add_column("required", justify="right")
    table.add_column("status")
    table.add_column("note")
    for t in doc["targets"]:
        unit = t["unit"]
        shown = _num(t["measured"], unit) + ("" if unit == "x" or t["measured"] is None
                                             else f" {unit}")
        required = f"{t['kind']} {_num(t['required'], unit)}" + ("" if unit == "x" else f" {unit}")
        style = STATUS_STYLE.get(t["status"], "")
        table.add_row(t["text"], shown, required, f"[{style}]{t['status']}[/]", t["note"])
    return table


def summary_line(doc: dict[str, Any]) -> str:
    p = doc["params"]
    env = doc["environment"]
    missing = [f"{x['name']} ({x['status']})" for x in doc["peers"] if x["status"] != "ok"]
    text = (f"qstore benchmarks, mode {p['mode']}: {p['repeat']} repeat(s), n={p['n']:,}, "
            f"budget {p['budget']} s per measurement; {env['cpus']} CPUs, Python "
            f"{env['python']}; took {doc['seconds']:.0f} s")
    if missing:
        text += "; not run: " + ", ".join(missing)
    return text


def render(doc: dict[str, Any], console: Console) -> None:
    console.print(summary_line(doc))
    if doc["rows"]:
        console.print(throughput_table(doc))
    if doc["metrics"]:
        console.print(metrics_table(doc))
    console.print(targets_table(doc))
    for error in doc.get("errors", []):
        console.print(f"[red]not measured[/]: {escape(error)}")
    for name, text in doc.get("profiles", {}).items():
        console.rule(f"profile: {name}")
        console.print(text, markup=False, highlight=False)


def make_console(file: Any = None) -> Console:
    """A console for the report; at least 140 columns when not a terminal, so rows don't wrap."""
    console = Console(file=file, highlight=False)
    if not console.is_terminal:
        console = Console(file=file, highlight=False, width=max(console.width, 160))
    return console
