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

from qstore.spark._report import finding_rank, render_html
from qstore.spark.audit import run_audit

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
