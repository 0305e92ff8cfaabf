"""qstore._fs: writes are whole even when the kernel writes less, JSON replaced durably."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from qstore import _fs


def test_short_pwritev_is_finished_and_many_buffers_are_split(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev
    calls: list[int] = []

    def short(fd: int, parts: Sequence[bytes], at: int) -> int:
        calls.append(len(parts))
        assert len(parts) <= _fs.IOV_MAX
        data = b"".join(parts)
        return real(fd, [data[: len(data) // 2 + 1]], at)  # the kernel stopped half way

    monkeypatch.setattr(_fs.calls, "pwritev", short)
    parts = [b"%05d" % i for i in range(2500)]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"HEAD")
        assert _fs.write_at(fd, [*parts[:3], memoryview(b"mv"), *parts[3:]], 4) == 2500 * 5 + 2
    finally:
        os.close(fd)
    assert calls == [1024, 1024, 453]
    expected = b"HEAD" + b"".join(parts[:3]) + b"mv" + b"".join(parts[3:])
    assert (tmp_path / "f").read_bytes() == expected


def test_write_json_durably_replaces_the_file_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text("old")
    _fs.write_json_durably(str(path), {"b": [1, 2], "a": "x"})
    assert json.loads(path.read_text()) == {"a": "x", "b": [1, 2]}
    assert path.read_text().startswith('{\n "a"')  # sorted keys, indented
    assert os.listdir(tmp_path) == ["job.json"]
