"""Snapshots: consistent while the store is written, readable read-only, immune to compaction."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from typing import Any

import pytest

import qstore
from qstore.spark._scan import scan_snapshot
from qstore.spark._snapshot_view import SCRATCH_PREFIX, Snapshot
from qstore.spark.audit import run_audit
from tests.conftest import FakeClock

from .conftest import Snap, populate

pytestmark = pytest.mark.spark
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state_counts(path: str, queue: str) -> tuple[int, int, int, int, int]:
    table = scan_snapshot(path, queues=[queue])
    states = Counter(table["state"].to_pylist())
    return (states["ready"], states["delayed"], states["in_flight"], states["dead"],
            sum(table["length"].to_pylist()))


def test_snapshot_taken_while_writing_matches_the_stats_of_that_moment(
        spark: Any, tmp_path: Any) -> None:
    store = qstore.open(tmp_path / "store", clock=FakeClock(), compactor=False,
                        segment_max_bytes=4096)
    q = store.create_queue("live")
    rounds = 0
    enough = threading.Event()
    stop = threading.Event()

    def write() -> None:
        nonlocal rounds
        while not stop.is_set():
            q.push_many([(b"body %d" % rounds, rounds % 5)] * 20)
            q.ack_many(q.pop_many(5)[:3])
            rounds += 1
            if rounds >= 20:
                enough.set()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert enough.wait(60)
        # Nothing commits while the writer lock is held, so both see the same instant.
        with store.core.lock:
            at_snapshot = q.stats()
            dest = store.snapshot(str(tmp_path / "snap"))
            rounds_at_snapshot = rounds
        while rounds < rounds_at_snapshot + 5:
            q.stats()  # the writer keeps going after the snapshot
    finally:
        stop.set()
        writer.join()
    assert q.stats() != at_snapshot
    store.close()
    expected = (at_snapshot.ready, at_snapshot.delayed, at_snapshot.in_flight, at_snapshot.dead,
                at_snapshot.bytes)
    assert _state_counts(dest, "live") == expected
    assert spark.read.format("qstore").load(dest).count() == at_snapshot.total
    with qstore.open(dest, readonly=True) as snap_store:
        assert snap_store.queue("live").stats() == at_snapshot


def test_snapshot_opens_read_only_with_every_message(clean_snap: Snap) -> None:
    with qstore.open(clean_snap.path, readonly=True) as snap_store:
        assert {n: snap_store.queue(n).stats() for n in snap_store.queues()} == clean_snap.stats
        for (name, mid), payload in clean_snap.payloads.items():
            assert snap_store.queue(name).get(mid).payload == payload
        with pytest.raises(qstore.ReadOnlyStore):
            snap_store.queue("jobs").push(b"no")


def test_snapshot_survives_writes_and_compaction_of_the_live_store(
        spark: Any, tmp_path: Any) -> None:
    store = qstore.open(tmp_path / "store", clock=FakeClock(), compactor=False,
                        segment_max_bytes=2048)
    populate(store)
    dest = store.snapshot(str(tmp_path / "snap"))

    def read() -> list[dict[str, Any]]:
        df = spark.read.format("qstore").option("payload", "true").load(dest)
        return sorted(df.toArrow().to_pylist(), key=lambda r: (r["queue"], r["id"]))

    before = read()
    for name in ("jobs", "tags"):
        q = store.queue(name)
        q.ack_many(q.pop_many(1000))
    store.queue("poison").push_many([b"after the snapshot"] * 30)  # grows the shared active file
    result = store.compact(threshold=0.0)
    assert result.segments_deleted
    for fid in result.segments_deleted:
        assert not os.path.exists(store.core.payload.path_of(fid))
    store.close()
    assert read() == before
    checked = scan_snapshot(dest, verify=True, check_index=True)
    assert checked.num_rows == len(before)
    assert set(checked["problem"].to_pylist()) == {None}
    assert set(checked["index_ok"].to_pylist()) == {True}


def _scratch_of(snapshot: str) -> list[str]:
    """Scratch copies (in the temporary directory) whose links point into ``snapshot``."""
    meta = os.path.realpath(os.path.join(snapshot, "meta"))
    root = tempfile.gettempdir()
    found = []
    for name in os.listdir(root):
        d = os.path.join(root, name)
        if not name.startswith(SCRATCH_PREFIX) or not os.path.isdir(d):
            continue
        with contextlib.suppress(OSError):  # another reader may remove its copy meanwhile
            if any(os.path.realpath(os.path.join(d, f)).startswith(meta + os.sep)
                   for f in os.listdir(d)):
                found.append(d)
    return found


def test_scratch_copies_are_gone_when_the_jobs_end(spark: Any, clean_snap: Snap,
                                                   tmp_path: Any) -> None:
    """Every reader (the driver, each task) removes its private copy of the metadata,
    also a task whose rows were not all consumed (a limit)."""
    assert _scratch_of(clean_snap.path) == []
    run_audit(clean_snap.path, spark=spark, out=str(tmp_path / "audit"), quiet=True)
    df = spark.read.format("qstore").option("payload", "true").load(clean_snap.path)
    assert len(df.limit(3).collect()) == 3
    assert df.count() > 3
    assert _scratch_of(clean_snap.path) == []


def test_scratch_copy_of_a_killed_reader_is_removed_by_the_next_reader(
        clean_snap: Snap) -> None:
    code = ("import os, signal, sys; from qstore.spark._snapshot_view import Snapshot; "
            "s = Snapshot(sys.argv[1]); print(s._scratch, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    child = subprocess.run([sys.executable, "-c", code, clean_snap.path], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert child.returncode == -signal.SIGKILL, child.stderr
    left = child.stdout.strip()
    assert os.path.isdir(left) and left in _scratch_of(clean_snap.path)
    with Snapshot(clean_snap.path) as snap:  # the next reader on this machine
        assert snap.queues
        assert not os.path.exists(left)
        assert _scratch_of(clean_snap.path) == [snap._scratch]  # its own, while open
    assert _scratch_of(clean_snap.path) == []
