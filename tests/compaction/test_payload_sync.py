"""Syncing payload segments where compaction depends on it (tests/payload covers the rest).

SegmentSet.sync has concurrent callers (the compactor syncs alongside the
store's syncer): a caller must never return before the bytes it covers are on
disk, so one that finds a sync in progress waits for it, and a failed sync is
retried. copy_live syncs its output in the background while it writes, and a
failure there is not lost.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from qstore import StorageError
from qstore._fs import calls as file_calls
from qstore.payload import PayloadRef, SegmentSet, _segments


class _WatchedLock:
    """The set's sync lock, telling the test when a given thread comes to take it."""

    def __init__(self, lock: threading.Lock, thread_name: str) -> None:
        self.lock = lock
        self.thread_name = thread_name
        self.arrived = threading.Event()

    def __enter__(self) -> bool:
        if threading.current_thread().name == self.thread_name:
            self.arrived.set()
        return self.lock.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.lock.__exit__(*exc)


def test_a_sync_that_finds_another_in_progress_returns_only_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    segs = SegmentSet(str(tmp_path), segment_max_bytes=4096, max_payload_bytes=1024)
    segs.append(b"must be on disk before any sync returns")
    entered, release = threading.Event(), threading.Event()
    finished: list[str] = []
    real = os.fdatasync

    def slow_fdatasync(fd: int) -> None:
        entered.set()
        assert release.wait(60)
        real(fd)
        finished.append("fdatasync")

    monkeypatch.setattr(file_calls, "fdatasync", slow_fdatasync)
    watched = _WatchedLock(segs._sync_lock, "second")
    monkeypatch.setattr(segs, "_sync_lock", watched)
    first = threading.Thread(target=segs.sync, name="first")
    first.start()
    assert entered.wait(60)
    second = threading.Thread(target=lambda: finished.append(f"second saw {finished!r}")
                              if segs.sync() is None else None, name="second")
    second.start()
    # The second caller has come to the sync lock while the first holds it inside
    # fdatasync (blocked until `release`): it can only wait, and nothing has finished.
    assert watched.arrived.wait(60)
    assert watched.lock.locked() and first.is_alive()
    assert finished == []
    release.set()
    first.join(timeout=60)
    second.join(timeout=60)
    assert not first.is_alive() and not second.is_alive()

    assert finished == ["fdatasync", "second saw ['fdatasync']"]
    segs.close()


def test_a_failed_sync_is_retried_by_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    segs = SegmentSet(str(tmp_path), segment_max_bytes=4096, max_payload_bytes=1024)
    segs.append(b"x")
    calls: list[int] = []
    real = os.fdatasync

    def failing_once(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(file_calls, "fdatasync", failing_once)
    with pytest.raises(StorageError, match="Input/output error"):
        segs.sync()
    assert segs.unsynced
    segs.sync()
    assert len(calls) == 2 and not segs.unsynced
    segs.close()


def copy_setup(tmp_path: Path) -> tuple[SegmentSet, list[PayloadRef], list[bytes]]:
    segs = SegmentSet(str(tmp_path), segment_max_bytes=64 * 1024, max_payload_bytes=8192)
    bodies = [bytes([i % 251]) * (100 + 37 * i) for i in range(200)]
    refs = segs.append_many(bodies)
    segs.seal()
    return segs, refs[::2], bodies[::2]  # every other record: runs of one record each


def test_copy_live_syncs_in_the_background_as_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    segs, refs, bodies = copy_setup(tmp_path)
    monkeypatch.setattr(_segments, "_FLUSH_BYTES", 4096)
    monkeypatch.setattr(_segments, "_COPY_PIECES", 4)
    synced_by: list[str] = []
    real = os.fdatasync

    def recording(fd: int) -> None:
        synced_by.append(threading.current_thread().name)
        real(fd)

    monkeypatch.setattr(file_calls, "fdatasync", recording)
    fid = segs.reserve_file_id()

    mapping = segs.copy_live(fid, refs)

    assert "qstore-copy-flush" in synced_by
    assert [segs.read(mapping[r]) for r in refs] == bodies
    segs.close()


def test_copy_live_reports_a_failed_background_sync_and_removes_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    segs, refs, bodies = copy_setup(tmp_path)
    monkeypatch.setattr(_segments, "_FLUSH_BYTES", 4096)
    monkeypatch.setattr(_segments, "_COPY_PIECES", 4)

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(file_calls, "fdatasync", failing)
    fid = segs.reserve_file_id()

    with pytest.raises(StorageError, match="Input/output error"):
        segs.copy_live(fid, refs)

    assert not os.path.exists(segs.path_of(fid))
    assert [segs.read(r) for r in refs] == bodies
    segs.close()
