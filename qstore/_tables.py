"""Rich tables of store statistics, for the command line and the demo.

Queue names, payloads and findings are data: they go into a table as
:class:`~rich.text.Text`, never as console markup, so a queue named
``x[/y]`` prints as it is instead of raising ``MarkupError`` (and
``[bold]`` in a payload is shown, not obeyed).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def add_plain_row(table: Table, *cells: str) -> None:
    """A row of plain text (no markup, no highlighting)."""
    table.add_row(*(Text(c) for c in cells))


def _options(q: Any) -> str:
    """The queue options of contract section 10 that are set, e.g. ``ttl=30s dead``."""
    out = []
    if q.ttl is not None:
        out.append(f"ttl={q.ttl:g}s" + (" dead" if q.on_expire == "dead" else ""))
    elif q.on_expire == "dead":  # no default TTL: per-push ones make dead letters
        out.append("on_expire=dead")
    if q.aging is not None:
        cap = "" if q.aging_cap is None else f" cap={q.aging_cap}"
        out.append(f"aging={q.aging:g}s{cap}")
    if q.rate is not None:
        out.append(f"rate={q.rate[0]}/{q.rate[1]:g}s")
    return " ".join(out) or "-"


def print_stats(st: Any, console: Console | None = None) -> None:
    """Tables of a StoreStats: per queue, per payload segment, and the totals."""
    console = console or Console()
    table = Table(title="queues")
    for col in ("queue", "ready", "delayed", "in flight", "dead", "bytes", "expired",
                "options"):
        table.add_column(col, justify="left" if col in ("queue", "options") else "right")
    for q in st.queues:
        add_plain_row(table, q.queue, *(f"{v:,}" for v in (q.ready, q.delayed, q.in_flight,
                                                            q.dead, q.bytes, q.expired)),
                      _options(q))
    console.print(table)
    segs = Table(title="payload segments")
    for col in ("file", "size", "live bytes", "live msgs", "garbage"):
        segs.add_column(col, justify="right")
    for s in st.segments:
        add_plain_row(segs, f"{s.file_id}{' (active)' if s.active else ''}", f"{s.size:,}",
                      f"{s.live_bytes:,}", f"{s.live_count:,}", f"{s.garbage_ratio:.0%}")
    console.print(segs)
    console.print(f"disk {st.disk_bytes:,} bytes, live {st.live_bytes:,}, "
                  f"garbage {st.garbage_ratio:.0%}")
