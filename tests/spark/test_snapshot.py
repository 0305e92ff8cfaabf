"""Snapshots: consistent while the store is written, readable read-only, immune to compaction."""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any

import pytest

import qstore
from qstore.spark._scan import scan_snapshot
from tests.conftest import FakeClock

from .conftest import Snap, populate

pytestmark = pytest.mark.spark


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
