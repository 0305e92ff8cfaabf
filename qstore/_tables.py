"""Rich tables of store statistics, for the command line and the demo."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def print_stats(st: Any, console: Console | None = None) -> None:
    """Tables of a StoreStats: per queue, per payload segment, and the totals."""
    console = console or Console()
    table = Table(title="queues")
    for col in ("queue", "ready", "delayed", "in flight", "dead", "bytes"):
        table.add_column(col, justify="left" if col == "queue" else "right")
    for q in st.queues:
        table.add_row(q.queue, *(f"{v:,}" for v in (q.ready, q.delayed, q.in_flight, q.dead,
                                                     q.bytes)))
    console.print(table)
    segs = Table(title="payload segments")
    for col in ("file", "size", "live bytes", "live msgs", "garbage"):
        segs.add_column(col, justify="right")
    for s in st.segments:
        segs.add_row(f"{s.file_id}{' (active)' if s.active else ''}", f"{s.size:,}",
                     f"{s.live_bytes:,}", f"{s.live_count:,}", f"{s.garbage_ratio:.0%}")
    console.print(segs)
    console.print(f"disk {st.disk_bytes:,} bytes, live {st.live_bytes:,}, "
                  f"garbage {st.garbage_ratio:.0%}")
