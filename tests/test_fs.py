"""qstore._fs: writes are whole even when the kernel writes less, JSON replaced durably."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


_SMALL_LIMIT = """
import resource, sys
import qstore
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
with qstore.open(sys.argv[1], segment_max_bytes=4096, compactor=False) as s:
    q = s.create_queue("q", exist_ok=True)
    for i in range(int(sys.argv[2])):
        q.push(b"%05d" % i + bytes(1500))
    got = q.peek(1000)  # every payload read back
    print(len(s.stats().segments), len(got), all(len(m.payload) == 1505 for m in got))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="RLIMIT_NOFILE is a Unix limit")
def test_a_store_of_many_segments_works_under_a_small_soft_file_limit(tmp_path: Path) -> None:
    # Two descriptors a segment: under a soft limit of 256 a store failed every
    # rotation with EMFILE after about 120 segments, and could not be opened
    # again (a resource audit, at the usual limit of 1,024 and 480 segments).
    # The store raises its process's soft limit toward the hard one.
    path = str(tmp_path / "s")
    for pushes, segments, messages in ((400, 200, 400), (10, 205, 410)):  # then a reopen
        r = subprocess.run([sys.executable, "-c", _SMALL_LIMIT, path, str(pushes)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [str(segments), str(messages), "True"]


def test_remove_paths_takes_trees_by_name_and_closes_no_descriptor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # shutil.rmtree works through directory descriptors and marks one closed only
    # after os.close returned: an interrupt in between closed that number again,
    # another thread's file by then (an interrupt audit: EBADF in other threads
    # after cut snapshots). The removal now goes by names.
    tree = tmp_path / "snap"
    (tree / "meta" / "deep").mkdir(parents=True)
    (tree / "meta" / "deep" / "f").write_bytes(b"x")
    (tree / "a").write_bytes(b"y")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_bytes(b"z")
    (tree / "link").symlink_to(outside)  # a link to a directory: the link goes, not its files
    lone = tmp_path / "file"
    lone.write_bytes(b"w")

    def no_close(fd: int) -> None:
        raise AssertionError("a descriptor was closed in Python code")

    monkeypatch.setattr(os, "close", no_close)
    assert _fs.remove_paths([str(tree), str(lone), str(tmp_path / "missing")]) == []
    monkeypatch.undo()
    assert not tree.exists() and not lone.exists()
    assert (outside / "kept").read_bytes() == b"z"
