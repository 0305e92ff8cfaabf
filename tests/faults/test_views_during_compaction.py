"""Case 11: read-only views opened while the writer compacts never see false corruption.

A real writer process compacts in a loop (every pass moves the same kept
messages to a new segment and deletes the old ones, while pushes rotate
segments) and this process opens read-only views of the store again and
again, reading every kept message and the store's stats from each. Before
views pinned their segments, 2-4% of such opens failed ("segment file is
missing", "file shorter than its header", a raw FileNotFoundError).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

import qstore
from qstore import _compact, _core
from qstore._check import check_path
from qstore._errors import Corruption, StorageError
from qstore.payload import _views

KEPT = 40
VIEWS = 200

WRITER = textwrap.dedent("""
    import os, sys
    import qstore
    path = sys.argv[1]
    store = qstore.open(path, compactor=False, segment_max_bytes=64 * 1024)
    keep = store.create_queue("keep")
    churn = store.create_queue("churn")
    keep.push_many([(b"kept %04d " % i * 20, 1) for i in range(KEPT)])
    store.compact(threshold=0.0)
    print("ready", flush=True)
    n = 0
    while True:
        churn.push_many([b"churn %06d " % (n + i) * 30 for i in range(60)])  # rotates
        churn.ack_many(churn.pop_many(60))
        store.compact(threshold=0.0)  # seals, copies the kept messages, deletes sources
        n += 60
        if n % 3000 == 0:
            store.core.meta.flush()  # a read-only open replays the WAL: keep it short
""").replace("KEPT", str(KEPT))


def test_views_opened_during_compaction_read_everything(store_path: str) -> None:
    writer = subprocess.Popen([sys.executable, "-c", WRITER, store_path],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "ready", writer.stderr
        failures: list[str] = []
        for _ in range(VIEWS):
            try:
                with qstore.open(store_path, readonly=True) as view:
                    msgs = view.queue("keep").peek(2 * KEPT)
                    got = {m.id: m.payload for m in msgs}
                    # Every kept message is listed and reads back byte for byte,
                    # by peek and by get.
                    assert sorted(got.values()) == [b"kept %04d " % i * 20 for i in range(KEPT)]
                    for mid, payload in got.items():
                        assert view.queue("keep").get(mid).payload == payload
                    for m in view.queue("churn").peek(100):
                        assert m.payload.startswith(b"churn ")
                    st = view.stats()
                    assert sum(s.live_count for s in st.segments) >= KEPT
            except Exception as exc:  # counted, then asserted: every failure is a bug
                failures.append(f"{type(exc).__name__}: {exc}")
        assert writer.poll() is None, writer.stderr.read() if writer.stderr else ""
        assert failures == []
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.communicate()  # waits, and closes the pipes
    # The writer was killed mid-pass: the store still opens and checks clean.
    with qstore.open(store_path, compactor=False) as store:
        assert store.queue("keep").stats().ready == KEPT
        assert store.check().ok
    assert os.path.isdir(store_path)


def test_a_views_check_is_clean_after_the_writer_deleted_what_it_pinned(store_path: str) -> None:
    # A view's own check lists the segment files when it runs; a segment the
    # writer compacted away after the view opened is still the view's (pinned,
    # and its metadata refers to it), never a missing_segment.
    with qstore.open(store_path, compactor=False, segment_max_bytes=4096) as writer:
        q = writer.create_queue("q")
        kept = q.push_many([b"kept %03d " % i * 10 for i in range(20)])
        doomed = q.push_many([b"gone %03d " % i * 10 for i in range(40)])
        q.ack_many([m for m in q.pop_many(60) if m.id in set(doomed)])
        with qstore.open(store_path, readonly=True) as view:
            before = set(view.core.payload.file_ids())
            result = writer.compact(threshold=0.0)  # copies the kept ones, deletes sources
            assert result.segments_deleted
            assert not before <= {int(n[:10]) for n in os.listdir(
                os.path.join(store_path, "payload")) if n.endswith(".seg")}
            report = view.check()
            assert report.ok, report.summary()
            vq = view.queue("q")
            assert vq.stats().in_flight == len(kept)
            assert [vq.get(m).payload for m in kept] == [b"kept %03d " % i * 10
                                                         for i in range(20)]


def test_a_view_opens_again_when_its_open_raced_the_writer(store_path: str,
                                                          monkeypatch: Any) -> None:
    """A read-only open that met a file the writer just removed is tried again; a
    failure that persists is reported, and damage is never retried away."""
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue("q").push(b"x")
    real = _core.MetaDB
    failures: list[Exception] = []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop(0)
        return real(*args, **kwargs)

    monkeypatch.setattr(_core, "MetaDB", flaky)
    gone = "IO error: No such file or directory while reading: meta/000017.log"
    failures[:] = [StorageError(gone), Corruption("meta", 0, "000009.sst: No such file or "
                                                             "directory")]
    with qstore.open(store_path, readonly=True) as view:
        assert view.queue("q").stats().ready == 1
    assert failures == []
    failures[:] = [StorageError(gone)] * _core.VIEW_ATTEMPTS
    with pytest.raises(StorageError, match="No such file"):
        qstore.open(store_path, readonly=True)
    failures[:] = [StorageError("IO error: Permission denied")]  # not a race: no retry
    with pytest.raises(StorageError, match="Permission denied"):
        qstore.open(store_path, readonly=True)
    assert failures == []


def test_a_views_check_sizes_a_pinned_segment_the_writer_appended_to_since(
        store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A view pins the segment files, then opens its metadata. Pinned while the
    # writer's fresh active segment held only its header, the segment's S record
    # (read after pushes made it longer) gave a data end past the size the check
    # took, its map's: segment_truncated from a healthy store (a race audit).
    store = qstore.open(store_path, compactor=False)
    try:
        q = store.create_queue("q")
        q.push_many([b"a" * 100] * 10)
        store.core.payload.seal()  # a fresh active segment: a header only
        real = _core.MetaDB

        def pushes_then_meta(*args: Any, **kwargs: Any) -> Any:
            q.push_many([b"b" * 1000] * 50)  # after the pins, before the metadata
            return real(*args, **kwargs)

        monkeypatch.setattr(_core, "MetaDB", pushes_then_meta)
        with qstore.open(store_path, readonly=True) as view:
            monkeypatch.setattr(_core, "MetaDB", real)
            assert view.queue("q").stats().ready == 60
            report = view.check()
            assert report.ok, report.summary()
    finally:
        store.close()


def test_a_views_check_takes_the_writers_fresh_active_segment_for_no_orphan(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A view does not know the writer's active segment; its check took the
    # highest id on disk for it. While a pass copied, that is the pass's output,
    # and the new active segment, holding a push's bytes whose records were not
    # written yet, was reported as an orphan (a race audit: `qstore check` beside
    # a busy server exits 1).
    path = str(tmp_path / "s")
    store = qstore.open(path, compactor=False, segment_max_bytes=64 * 1024)
    q = store.create_queue("q")
    for _ in range(200):
        q.push(b"x" * 1000)
    for m in q.pop_many(200):
        if m.id % 10:
            q.ack(m)
        else:
            q.nack(m)
    reports: list[Any] = []
    blocked, release = threading.Event(), threading.Event()
    real_write = store.core.meta.write

    def write(batch: Any, *, sync: bool = False) -> None:
        if threading.current_thread().name == "pusher":
            blocked.set()  # its bytes are in the active segment, its records not written
            release.wait(30)
        real_write(batch, sync=sync)

    def copied(step: str) -> None:
        if step != "copied":
            return
        monkeypatch.setattr(store.core.meta, "write", write)
        pusher = threading.Thread(target=lambda: q.push(b"y" * 1000), name="pusher")
        pusher.start()
        assert blocked.wait(30)
        try:
            with qstore.open(path, readonly=True) as view:
                reports.append(view.check())
            reports.append(check_path(path))  # `qstore check STORE` beside the writer
        finally:
            release.set()
            pusher.join(30)
            monkeypatch.setattr(store.core.meta, "write", real_write)

    monkeypatch.setattr(_compact, "step_hook", copied)
    result = store.compact(threshold=0.3)
    assert result.output is not None and result.output > store.core.payload.active_id
    assert len(reports) == 2
    for report in reports:
        assert report.ok, report.summary()
    assert store.check().ok
    store.close()


def test_views_opening_back_to_back_do_not_keep_the_writer_from_deleting(
        store_path: str, monkeypatch: Any) -> None:
    # The writer took the views lock without waiting and skipped the deletion if a
    # view was opening. Two processes polling `qstore stats` beside a busy writer
    # always held it between them: 862 dead segments, 817 MB, after a minute (a
    # resource audit). Now the writer closes the gate to new views and waits for
    # the ones opening.
    payload_dir = os.path.join(store_path, "payload")
    with qstore.open(store_path, compactor=False, segment_max_bytes=64 * 1024) as store:
        q = store.create_queue("q")
        for _ in range(4):
            q.push_many([b"x" * 2000] * 40)  # rotates: sealed segments
        q.ack_many(q.pop_many(160))
        dead = sorted(fid for fid, seg in store.core.segments.items()
                      if seg[1] == 0 and fid != store.core.payload.active_id)
        assert len(dead) >= 3
        opening = _views.viewing(payload_dir)  # a view is opening as the pass starts
        assert opening.__enter__()
        waits = threading.Event()
        real_pause = _views._pause

        def pause() -> None:
            waits.set()
            real_pause()

        monkeypatch.setattr(_views, "_pause", pause)
        result: dict[str, Any] = {}
        t = threading.Thread(target=lambda: result.update(done=store.compact(threshold=1.0)))
        t.start()
        try:
            assert waits.wait(30)  # the pass waits for the view ...
            gate = os.open(os.path.join(payload_dir, _views.VIEWS_GATE), os.O_RDONLY)
            try:  # ... with the gate closed: a view arriving now waits behind it
                with pytest.raises(BlockingIOError):
                    fcntl.flock(gate, fcntl.LOCK_SH | fcntl.LOCK_NB)
            finally:
                os.close(gate)
        finally:
            opening.__exit__(None, None, None)  # the view is open: the pass goes on
        t.join(30)
        assert not t.is_alive()
        assert set(dead) <= set(result["done"].segments_deleted)
        assert not set(dead) & set(store.core.payload.file_ids())
        with _views.viewing(payload_dir) as locked:  # and views open again
            assert locked
        with qstore.open(store_path, readonly=True) as view:
            assert view.queue("q").stats().total == 0
