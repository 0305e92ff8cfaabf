"""The audit's human outputs: a short terminal summary and a self-contained HTML report.

Both render the ``summary.json`` dictionary built by :mod:`.audit`; the HTML
report draws its charts as inline SVG (no scripts, no external files).
"""

from __future__ import annotations

import datetime
import html
from typing import Any

CHART_WIDTH = 760
MAX_DEPTH_BARS = 40
MAX_EXAMPLES = 50
# Findings that explain others come first: a missing or truncated segment, a damaged
# header or record, before the per-message symptoms they cause (out_of_bounds on each
# message of a truncated segment...), then the bookkeeping that disagrees with a recount.
ROOT_CAUSES = ("missing_segment", "segment_truncated", "bad_segment_header", "bad_record",
               "orphan_segment", "unlisted_segment", "message_without_queue",
               "orphan_queue_keys")
SYMPTOMS = ("out_of_bounds", "length_mismatch", "crc_mismatch", "overlap", "index_missing",
            "stray_index_key", "segment_record_mismatch", "counter_mismatch")


def finding_rank(f: dict[str, Any]) -> tuple[Any, ...]:
    """Root causes first, then symptoms; within a kind, whole-segment findings (no
    message) before per-message ones, then by queue, message, segment, offset."""
    kind = f["kind"]
    order = (*ROOT_CAUSES, *SYMPTOMS)
    rank = order.index(kind) if kind in order else len(order)
    return (rank, kind, f.get("message_id") is not None, f.get("queue") or "",
            f.get("message_id") or 0, f.get("file_id") or 0, f.get("offset") or 0)


def kinds_in_order(by_kind: dict[str, int]) -> list[tuple[str, int]]:
    return sorted(by_kind.items(), key=lambda kv: finding_rank({"kind": kv[0]}))


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _age(seconds: float | None) -> str:
    """A duration the way an operator reads it: 42 s, 7.5 min, 3.2 h, 12.0 d."""
    if seconds is None:
        return ""
    for limit, unit, div in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{seconds / div:.0f} {unit}" if unit == "s" else f"{seconds / div:.1f} {unit}"
    return f"{seconds / 86400:.1f} d"


def _where(f: dict[str, Any]) -> str:
    parts = []
    if f.get("message_id") is not None:
        parts.append(f"message {f['message_id']}")
    if f.get("queue") is not None:
        parts.append(f"in {f['queue']!r}")
    if f.get("file_id") is not None:
        at = f" @ {f['offset']}" if f.get("offset") is not None else ""
        parts.append(f"segment {f['file_id']}{at}")
    return " ".join(parts) or "store"


def _notes(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary's notes (a summary written before audits had notes has none)."""
    notes: dict[str, Any] = summary.get("notes", {"total": 0, "examples": []})
    return notes


def render_text(summary: dict[str, Any]) -> str:
    """A few lines for the terminal: what was audited, the queues, the verdict."""
    msgs = summary["messages"]
    disk = summary["disk"]
    lines = [
        f"qstore audit of {summary['snapshot']}",
        f"  snapshot taken {_when(summary['snapshot_created_at'])}; "
        f"audited in {summary['seconds']:.1f} s",
        f"  {msgs['total']:,} messages in {len(summary['queues'])} queues; "
        f"{disk['segments']} segments, {_size(disk['bytes'])}, "
        f"{disk['garbage_ratio']:.1%} garbage",
    ]
    if summary["queues"]:
        lines.append(f"  {'queue':<20} {'ready':>10} {'delayed':>9} {'in_flight':>9} "
                     f"{'dead':>7} {'bytes':>12} {'oldest ready':>12}  counters")
        for name, q in summary["queues"].items():
            c = q["recount"]
            lines.append(f"  {name[:20]:<20} {c['ready']:>10,} {c['delayed']:>9,} "
                         f"{c['in_flight']:>9,} {c['dead']:>7,} {c['bytes']:>12,} "
                         f"{_age(q.get('oldest_ready_age_s')):>12}  "
                         f"{'ok' if q['match'] else 'MISMATCH'}")
    found = summary["findings"]
    if found["total"] == 0:
        lines.append("  CLEAN: every reference resolves to an intact record; counters, segment "
                     "records and indexes match a recount (exit 0)")
    else:
        lines.append(f"  FINDINGS: {found['total']:,} (exit 1)")
        examples = {f["kind"]: f for f in sorted(found["examples"], key=finding_rank,
                                                  reverse=True)}
        for kind, n in kinds_in_order(found["by_kind"]):
            ex = examples.get(kind)
            hint = f"  e.g. {_where(ex)}: {ex['detail']}" if ex else ""
            lines.append(f"    {kind:<24} {n:>8,}{hint}"[:160])
    notes = _notes(summary)
    if notes["total"]:
        lines.append(f"  notes: {notes['total']:,} damaged payloads already set aside in the "
                     "dead letters (not findings)")
        lines += [f"    {n['kind']}: {_where(n)}: {n['detail']}"[:160]
                  for n in notes["examples"][:5]]
    outs = summary.get("outputs", {})
    if outs:
        lines.append(f"  wrote {', '.join(outs.values())}")
    return "\n".join(lines)


def render_html(summary: dict[str, Any]) -> str:
    """The report page: verdict, findings, queues, and two charts."""
    e = html.escape
    found = summary["findings"]
    verdict = ("<p class=ok>Clean: no findings (exit 0).</p>" if found["total"] == 0 else
               f"<p class=bad>{found['total']:,} findings (exit 1).</p>")
    kinds = "".join(f"<tr><td>{e(k)}</td><td>{'root cause' if k in ROOT_CAUSES else 'symptom'}"
                    f"</td><td class=n>{n:,}</td></tr>"
                    for k, n in kinds_in_order(found["by_kind"]))
    examples = "".join(
        f"<tr><td>{e(f['kind'])}</td><td>{e(str(f.get('queue') or ''))}</td>"
        f"<td class=n>{_cell(f.get('message_id'))}</td><td class=n>{_cell(f.get('file_id'))}</td>"
        f"<td class=n>{_cell(f.get('offset'))}</td><td>{e(f['detail'])}</td></tr>"
        for f in sorted(found["examples"], key=finding_rank)[:MAX_EXAMPLES])
    queues = "".join(
        f"<tr><td>{e(name)}</td>"
        + "".join(f"<td class=n>{q['recount'][k]:,}</td>"
                  for k in ("ready", "delayed", "in_flight", "dead", "bytes"))
        + f"<td class=n>{_age(q.get('oldest_ready_age_s'))}</td>"
        + f"<td>{'ok' if q['match'] else '<b>mismatch</b>'}</td></tr>"
        for name, q in summary["queues"].items())
    attempts = "".join(
        f"<tr><td>{e(name)}</td><td>{e(_attempts(q['attempts']))}</td></tr>"
        for name, q in summary["queues"].items() if q.get("attempts"))
    sizes = "".join(
        f"<tr><td>{e(s['queue'] or '')}</td><td>{e(str(s['priority']))}</td>"
        + "".join(f"<td class=n>{_cell(s[k])}</td>"
                  for k in ("count", "min", "p50", "p90", "p99", "max", "bytes"))
        + "</tr>"
        for s in summary["payload_sizes"][:MAX_DEPTH_BARS])
    findings_html = "" if not found["total"] else (
        "<h2>Findings by kind (root causes first)</h2>"
        f"<table><tr><th>kind</th><th>level</th><th>count</th></tr>{kinds}</table>"
        "<table><tr><th>kind</th><th>queue</th><th>message</th><th>segment</th>"
        f"<th>offset</th><th>detail</th></tr>{examples}</table>")
    queues_html = "<p>No queues.</p>" if not queues else (
        "<table><tr><th>queue</th><th>ready</th><th>delayed</th><th>in flight</th>"
        "<th>dead</th><th>payload bytes</th><th>oldest ready</th><th>C record</th></tr>"
        f"{queues}</table>")
    attempts_html = "<p>No messages.</p>" if not attempts else (
        "<table><tr><th>queue</th><th>attempts: messages</th></tr>"
        f"{attempts}</table>")
    sizes_html = "<p>No messages.</p>" if not sizes else (
        "<table><tr><th>queue</th><th>priority</th><th>messages</th><th>min</th><th>p50</th>"
        f"<th>p90</th><th>p99</th><th>max</th><th>total</th></tr>{sizes}</table>")
    more = (f"<p>Showing {MAX_EXAMPLES} of {found['total']:,}; every finding is in "
            "findings.parquet.</p>" if found["total"] > MAX_EXAMPLES else "")
    notes = _notes(summary)
    note_rows = "".join(
        f"<tr><td>{e(str(n.get('queue') or ''))}</td><td class=n>{_cell(n.get('message_id'))}"
        f"</td><td class=n>{_cell(n.get('file_id'))}</td><td class=n>{_cell(n.get('offset'))}"
        f"</td><td>{e(n['detail'])}</td></tr>" for n in notes["examples"])
    notes_html = "" if not notes["total"] else (
        f"<h2>Notes: {notes['total']:,} damaged payloads already set aside</h2>"
        "<p>Moved to the dead letters for their damage (by a pop or <code>qstore check "
        "--repair</code>); the bytes are kept as they are. Not findings.</p>"
        "<table><tr><th>queue</th><th>message</th><th>segment</th><th>offset</th>"
        f"<th>detail</th></tr>{note_rows}</table>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>qstore audit</title>
<style>
body{{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222;max-width:60em}}
table{{border-collapse:collapse;margin:.5em 0 1.5em}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:left}}
td.n{{text-align:right;font-variant-numeric:tabular-nums}}
.ok{{color:#176f2c;font-weight:bold}} .bad{{color:#b00020;font-weight:bold}}
svg text{{font:11px system-ui,sans-serif}}
</style></head><body>
<h1>qstore audit</h1>
<p>Snapshot <code>{e(summary['snapshot'])}</code>, taken {_when(summary['snapshot_created_at'])};
audited {_when(summary['audited_at'])} in {summary['seconds']:.1f} s.
{summary['messages']['total']:,} messages, {summary['disk']['segments']} segments
({_size(summary['disk']['bytes'])}, {summary['disk']['garbage_ratio']:.1%} garbage).</p>
{verdict}
{findings_html}{more}{notes_html}
<h2>Queues (recount; oldest ready: its age when the snapshot was taken)</h2>
{queues_html}
<h2>Attempts per message</h2>
{attempts_html}
<h2>Garbage ratio per segment</h2>
{garbage_chart(summary['segments'])}
<h2>Ready backlog per queue and priority</h2>
{depth_chart(summary.get('ready_depth', []))}
<h2>Payload sizes per queue and priority (bytes)</h2>
{sizes_html}
</body></html>
"""


def _attempts(dist: dict[str, int]) -> str:
    """``{"0": 50, "2": 1}`` as ``0: 50, 2: 1`` (attempts: messages)."""
    return ", ".join(f"{a}: {n:,}" for a, n in sorted(dist.items(), key=lambda kv: int(kv[0])))


def _cell(v: Any) -> str:
    if v is None:
        return ""
    return f"{v:,}" if isinstance(v, int) else html.escape(str(v))


def garbage_chart(segments: list[dict[str, Any]]) -> str:
    """Vertical bars, one per segment, height = garbage ratio (0 to 100%)."""
    if not segments:
        return "<p>No segments.</p>"
    height, left, bottom = 160, 40, 30
    step = max(3.0, min(40.0, (CHART_WIDTH - left) / len(segments)))
    width = left + step * len(segments) + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
             f'height="{height + bottom + 10}" role="img" aria-label="garbage ratio per segment">']
    for frac in (0.0, 0.5, 1.0):
        y = 10 + height * (1 - frac)
        parts.append(f'<line x1="{left}" x2="{width - 5:.0f}" y1="{y:.1f}" y2="{y:.1f}" '
                     'stroke="#ddd"/>')
        parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{frac:.0%}</text>')
    label_every = max(1, int(30 // step) + 1)
    for i, seg in enumerate(segments):
        ratio = float(seg["garbage_ratio"])
        h = height * ratio
        x = left + i * step
        color = "#4a7bd0" if not seg["active"] else "#8fb3ea"
        parts.append(f'<rect x="{x + 1:.1f}" y="{10 + height - h:.1f}" width="{step - 2:.1f}" '
                     f'height="{h:.1f}" fill="{color}"><title>segment {seg["file_id"]}: '
                     f'{ratio:.1%} garbage, {seg["messages"]:,} live messages</title></rect>')
        if i % label_every == 0:
            parts.append(f'<text x="{x + step / 2:.1f}" y="{height + 24}" '
                         f'text-anchor="middle">{seg["file_id"]}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def depth_chart(groups: list[dict[str, Any]]) -> str:
    """Horizontal bars: ready messages per (queue, priority), for the largest groups.

    Only the ready backlog: delayed, in-flight and dead messages are not
    waiting to be popped (the queues table counts them)."""
    shown = sorted(groups[:MAX_DEPTH_BARS], key=lambda g: (
        g["queue"] or "", isinstance(g["priority"], str), g["priority"]))
    if not shown:
        return "<p>No ready messages.</p>"
    label_w, bar_h = 220, 16
    top = max(g["ready"] for g in shown) or 1
    span = CHART_WIDTH - label_w - 80
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_WIDTH}" '
             f'height="{len(shown) * (bar_h + 4) + 10}" role="img" '
             'aria-label="ready backlog per queue and priority">']
    for i, g in enumerate(shown):
        y = 5 + i * (bar_h + 4)
        w = max(1.0, span * g["ready"] / top)
        label = html.escape(f"{g['queue']} / {g['priority']}"[:36])
        parts.append(f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end">{label}</text>')
        parts.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" '
                     'fill="#d0894a"/>')
        parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + 12}">{g["ready"]:,}</text>')
    if len(groups) > len(shown):
        parts.append("</svg>")
        return "\n".join(parts) + f"<p>{len(shown)} largest of {len(groups)} groups.</p>"
    parts.append("</svg>")
    return "\n".join(parts)
