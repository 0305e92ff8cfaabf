"""The audit report: findings ordered root cause first, no empty tables, and the page
rendered by a real headless browser (Debian's ``chromium``) is not blank."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from typing import Any

import numpy as np
import pytest

import qstore
from qstore.meta import MetaDB, keys, new_batch
from qstore.spark._report import finding_rank, render_html, render_text
from qstore.spark.audit import run_audit
from tests.conftest import FakeClock

from .conftest import Snap

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def clean_report(spark: Any, clean_snap: Snap, tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("report")
    return run_audit(clean_snap.path, spark=spark, out=str(out), quiet=True).summary


def test_root_causes_come_before_their_symptoms() -> None:
    findings = [
        {"kind": "out_of_bounds", "message_id": 7, "file_id": 2, "offset": 90},
        {"kind": "crc_mismatch", "message_id": 3, "file_id": 1, "offset": 10},
        {"kind": "segment_truncated", "message_id": None, "file_id": 2, "offset": 80},
        {"kind": "missing_segment", "message_id": 9, "file_id": 3},
        {"kind": "missing_segment", "message_id": None, "file_id": 3},
    ]
    kinds = [(f["kind"], f["message_id"]) for f in sorted(findings, key=finding_rank)]
    assert kinds == [("missing_segment", None), ("missing_segment", 9),
                     ("segment_truncated", None), ("out_of_bounds", 7), ("crc_mismatch", 3)]


def test_clean_report_has_no_empty_tables(clean_report: dict[str, Any]) -> None:
    page = render_html(clean_report)
    assert "Clean: no findings" in page and "Findings by kind" not in page
    for table in page.split("<table>")[1:]:
        body = table.split("</table>")[0]
        assert body.count("<tr>") >= 2, body[:200]  # a header row and at least one row


def test_backlog_oldest_ready_age_and_attempts(spark: Any, tmp_path: Any) -> None:
    """The depth chart counts ready messages only; each queue's oldest ready message is
    aged at the snapshot's moment; attempts are counted per message, every state."""
    clock = FakeClock()
    with qstore.open(tmp_path / "store", clock=clock, compactor=False) as store:
        a = store.create_queue("a")
        a.push_many([(b"a1", 1), (b"a2", 2), (b"a3", 2)])  # at t0
        clock.advance(100)
        a.push_many([(b"later", 2, 1000.0), (b"later", 2, 1000.0)])  # delayed: no backlog
        a.push(b"a6", 2)
        m = a.pop()
        assert m is not None and m.payload == b"a2"
        a.nack(m)  # ready again, one attempt used
        store.create_queue("b").push(b"b1", 0)  # at t0 + 100
        c = store.create_queue("c", max_attempts=1)
        c.push(b"c1", 0)
        m = c.pop()
        assert m is not None
        c.nack(m)  # a dead letter: not in the backlog
        clock.advance(50)
        snap = store.snapshot(str(tmp_path / "snap"))
    summary = run_audit(snap, spark=spark, out=str(tmp_path / "out"), quiet=True).summary
    assert summary["clean"]
    assert sorted((g["queue"], g["priority"], g["ready"]) for g in summary["ready_depth"]) == [
        ("a", 1, 1), ("a", 2, 3), ("b", 0, 1)]
    queues = summary["queues"]
    assert [queues[n]["oldest_ready_age_s"] for n in "abc"] == [150.0, 50.0, None]
    assert [queues[n]["attempts"] for n in "abc"] == [{"0": 5, "1": 1}, {"0": 1}, {"1": 1}]
    page = render_html(summary)
    chart = page.split("Ready backlog per queue and priority</h2>")[1].split("</svg>")[0]
    assert ">a / 2</text>" in chart and ">3</text>" in chart and "c /" not in chart
    assert "<td>a</td><td>0: 5, 1: 1</td>" in page and "2.5 min" in page
    assert "2.5 min" in render_text(summary)


def test_orphaned_live_bytes_name_the_offsets_no_message_references(
        spark: Any, tmp_path: Any) -> None:
    with qstore.open(tmp_path / "store", clock=FakeClock(), compactor=False) as store:
        q = store.create_queue("q")
        ids = q.push_many([b"0123456789"] * 5)  # records of 18 bytes from offset 24
        qid = store.core.queues["q"].qid
        snap = store.snapshot(str(tmp_path / "snap"))
    # The record of the third message is lost; its segment's S record still counts it.
    db = MetaDB(str(tmp_path / "snap" / "meta"), readonly=False, store_path=snap)
    batch = new_batch()
    batch.delete(keys.message_key(qid, ids[2]))
    batch.delete(keys.ready_key(qid, keys.priority_key("max", "int", 0), ids[2]))
    db.write(batch, sync=True)
    db.close()
    result = run_audit(snap, spark=spark, out=str(tmp_path / "out"), quiet=True)
    [f] = [f for f in result.summary["findings"]["examples"]
           if f["kind"] == "segment_record_mismatch"]
    assert f["offset"] == 24 + 2 * 18
    assert "18 bytes no message references, at [60, 78) (exactly the difference)" in f["detail"]


def read_png(path: str) -> np.ndarray:
    """The pixels of an 8-bit, non-interlaced RGB or RGBA PNG (what chromium writes)
    as an (height, width, channels) array; the standard library has no PNG reader."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        length, ctype = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if ctype == b"IHDR":
            header = chunk
        elif ctype == b"IDAT":
            idat += chunk
        pos += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    ch = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * ch
    prev = bytearray(stride)
    rows = []
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)]
        cur = bytearray(line)
        if kind == 2:
            cur = bytearray((v + u) & 255 for v, u in zip(line, prev, strict=True))
        elif kind in (1, 3, 4):  # each byte depends on the one to its left: sequential
            for x in range(stride):
                a = cur[x - ch] if x >= ch else 0
                b = prev[x]
                if kind == 1:
                    pred = a
                elif kind == 3:
                    pred = (a + b) >> 1
                else:
                    c = prev[x - ch] if x >= ch else 0
                    pa_, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                    pred = a if pa_ <= pb and pa_ <= pc else (b if pb <= pc else c)
                cur[x] = (cur[x] + pred) & 255
        rows.append(bytes(cur))
        prev = cur
    out = np.frombuffer(b"".join(rows), np.uint8).astype(np.int64)
    return out.reshape(height, width, ch)[:, :, :3]


def _browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless browser: `make test` installs Debian's chromium as root "
                "(apt-get install chromium)")


def test_report_renders_in_a_headless_browser_and_is_not_blank(
        clean_report: dict[str, Any], tmp_path: Any) -> None:
    page = os.path.join(tmp_path, "report.html")
    with open(page, "w", encoding="utf-8") as f:
        f.write(render_html(clean_report))
    png = os.path.join(tmp_path, "report.png")
    r = subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", f"--screenshot={png}", "--window-size=800,1000",
                        f"file://{page}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and os.path.exists(png), r.stderr[-2000:]
    colored = read_png(png)
    assert colored.shape == (1000, 800, 3)
    pixels = colored.mean(axis=2)
    dark = pixels < 128  # text, table rules and chart bars on a white page
    assert dark.mean() > 0.005, "the rendered page is blank"
    rows_with_ink = np.flatnonzero(dark.any(axis=1))
    assert rows_with_ink.max() - rows_with_ink.min() > 300  # more than a title: tables, charts
    spread = colored.max(axis=2) - colored.min(axis=2)
    assert (spread > 60).mean() > 0.001  # the charts' colored bars were drawn
