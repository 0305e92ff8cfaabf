"""Rich tables of store statistics, for the command line and the demo.

Queue names, payloads and findings are data: they go into a table as
:class:`~rich.text.Text`, never as console markup, so a queue named
``x[/y]`` prints as it is instead of raising ``MarkupError`` (and
``[bold]`` in a payload is shown, not obeyed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.cells import cell_len
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


# Rows past which a table is printed as plain aligned columns: rich lays out
# about 3,000 rows a second here (8,000 queues took 3 s, a scale audit).
RICH_ROWS_MAX = 500


def _printable(text: str) -> str:
    """``text`` with control characters escaped: a newline in a queue name split
    its row in two, and the second half read as a row of its own (a review)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def print_table(console: Console, title: str, columns: Sequence[tuple[str, bool]],
                rows: Sequence[Sequence[str]]) -> None:
    """``rows`` under ``columns`` ((name, left-justified), ...): a rich table, or
    plain columns when there are more than :data:`RICH_ROWS_MAX` rows."""
    if len(rows) <= RICH_ROWS_MAX:
        table = Table(title=title)
        for name, left in columns:
            table.add_column(name, justify="left" if left else "right")
        for row in rows:
            add_plain_row(table, *row)
        console.print(table)
        return
    cells = [[_printable(c) for c in row] for row in rows]
    widths = [max(cell_len(name), *(cell_len(row[i]) for row in cells))
              for i, (name, _) in enumerate(columns)]

    def line(row: Sequence[str]) -> str:
        out = []
        for c, w, (_, left) in zip(row, widths, columns, strict=True):
            pad = " " * (w - cell_len(c))  # terminal cells: wide characters take two
            out.append(c + pad if left else pad + c)
        return "  ".join(out).rstrip()

    text = "\n".join([f"{title} ({len(rows):,})", line([n for n, _ in columns]),
                      *(line(row) for row in cells)])
    console.print(Text(text), soft_wrap=True)


def print_stats(st: Any, console: Console | None = None) -> None:
    """Tables of a StoreStats: per queue, per payload segment, and the totals."""
    console = console or Console()
    print_table(console, "queues",
                [("queue", True), ("ready", False), ("delayed", False), ("in flight", False),
                 ("dead", False), ("bytes", False), ("expired", False), ("options", True)],
                [[q.queue, *(f"{v:,}" for v in (q.ready, q.delayed, q.in_flight, q.dead,
                                                 q.bytes, q.expired)), _options(q)]
                 for q in st.queues])
    print_table(console, "payload segments",
                [("file", False), ("size", False), ("live bytes", False),
                 ("live msgs", False), ("garbage", False)],
                [[f"{s.file_id}{' (active)' if s.active else ''}", f"{s.size:,}",
                  f"{s.live_bytes:,}", f"{s.live_count:,}", f"{s.garbage_ratio:.0%}"]
                 for s in st.segments])
    console.print(f"disk {st.disk_bytes:,} bytes, live {st.live_bytes:,}, "
                  f"garbage {st.garbage_ratio:.0%}")
