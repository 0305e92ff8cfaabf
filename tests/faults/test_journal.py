"""The payload journal of durability="always" (qstore/_durability.py).

An always-mode operation returns after one sync of the RocksDB log, whose
batch carries the bodies it appended (``J`` keys); the segment is synced
later by a checkpoint. These tests check that no payload fdatasync runs per
operation, that a power loss taking the unsynced segment bytes loses nothing
that returned (the open writes the journal back), that checkpoints and a
clean close leave no journal behind, and that journaling stops on a nearly
full disk.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

import qstore
from qstore import _core, _hot
from qstore._check import check_path
from qstore._fs import calls
from qstore._hot import JOURNAL_MAX_BYTES
from qstore.meta import keys

from ._inject import FaultyCalls


def _journal_keys(store: qstore.Store) -> list[bytes]:
    return store.core.meta.scan_keys(keys.JOURNAL, keys.prefix_end(keys.JOURNAL))


@pytest.fixture
def fdatasyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The fds passed to every fdatasync from now on."""
    seen: list[int] = []
    real = calls.fdatasync

    def counted(fd: int) -> Any:
        seen.append(fd)
        return real(fd)

    monkeypatch.setattr(calls, "fdatasync", counted)
    return seen


def test_an_always_push_syncs_the_log_and_not_the_segment(
        store_path: str, fdatasyncs: list[int]) -> None:
    with qstore.open(store_path, durability="always", sync_interval=3600,
                     compactor=False) as store:
        q = store.create_queue("q", dedup=True)
        assert store.core.journaling
        syncs = store.core.syncer.syncs
        q.push(b"one", priority=1)
        q.push_many([(b"two", 2), (b"three", 3)])
        q.push(b"four", delay=5.0, dedup_key="k")  # the general path
        assert store.core.syncer.syncs == syncs + 3  # each returned after its own sync
        assert fdatasyncs == []  # ... of the log alone
        assert len(_journal_keys(store)) == 4
        # The checkpoint syncs the segment and deletes the keys it covers.
        store.core.syncer.checkpoint()
        assert len(fdatasyncs) == 1
        assert _journal_keys(store) == [] and store.core._awaiting_sync == []
        q.push(b"five")
        assert len(_journal_keys(store)) == 1
        # A batch over the journal's limit is synced in its segment instead (and
        # that sync covers the journaled record before it: its key goes too).
        q.push_many([b"x" * (JOURNAL_MAX_BYTES // 2 + 1), b"y" * (JOURNAL_MAX_BYTES // 2)])
        assert len(fdatasyncs) == 2
        assert _journal_keys(store) == []
        q.push(b"six")
        assert len(_journal_keys(store)) == 1
    with qstore.open(store_path, readonly=True) as view:  # a clean close leaves none
        assert _journal_keys(view) == []
        stats = view.queue("q").stats()
        assert (stats.ready, stats.delayed) == (7, 1)


def test_a_large_journal_is_checkpointed_at_once_not_at_the_interval(
        store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The checkpoint ran only every sync_interval: with 600 s, 150 MB of bodies sat
    # in the journal, a second copy in the metadata, for ten minutes (a
    # configuration audit). Past JOURNAL_FLUSH_BYTES journaled the sync thread is
    # woken at once; here the interval is an hour.
    monkeypatch.setattr(_hot, "JOURNAL_FLUSH_BYTES", 10_000)  # the kick
    monkeypatch.setattr(_core, "JOURNAL_FLUSH_BYTES", 10_000)  # the policy's flush
    with qstore.open(store_path, durability="always", sync_interval=3600,
                     compactor=False) as store:
        core = store.core
        ran = threading.Event()
        policy = core.syncer.on_checkpoint
        assert policy is not None

        def checkpointed() -> None:
            policy()
            ran.set()

        core.syncer.on_checkpoint = checkpointed
        q = store.create_queue("q")
        q.push(b"a" * 4000)
        q.push(b"b" * 4000)
        assert len(_journal_keys(store)) == 2 and not ran.is_set()  # under the bound
        q.push(b"c" * 4000)  # 12,000 bytes journaled: past it
        assert ran.wait(30)
        assert _journal_keys(store) == [] and core._journal_bytes == 0
        assert [m.payload[:1] for m in q.pop_many(3)] == [b"a", b"b", b"c"]


def test_a_failed_operation_makes_the_next_sync_cover_the_segment(
        store_path: str, fdatasyncs: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Its bytes lie before the next record in the segment, unjournaled: were they
    lost, open's tail scan would stop at them and cut the next record too."""
    with qstore.open(store_path, durability="always", sync_interval=3600,
                     compactor=False) as store:
        q = store.create_queue("q")
        q.push(b"first")
        assert fdatasyncs == []
        meta = store.core.meta
        real_write = meta.write
        monkeypatch.setattr(meta, "write", lambda *a, **k: (_ for _ in ()).throw(
            qstore.StorageError("injected metadata write failure")))
        with pytest.raises(qstore.StorageError):
            q.push(b"appended, never committed")
        monkeypatch.setattr(meta, "write", real_write)
        q.push(b"after")
        assert len(fdatasyncs) == 1
        assert [m.payload for m in q.pop_many(5)] == [b"first", b"after"]


CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import qstore
    store = qstore.open(sys.argv[1], durability="always", sync_interval=3600,
                        compactor=False)
    q = store.create_queue("q", dedup=True)
    ids = {}
    ids[q.push(b"single " * 20, priority=3)] = "single " * 20
    for i, mid in enumerate(q.push_many([(b"batch %d " % i * 30, i) for i in range(3)])):
        ids[mid] = "batch %d " % i * 30
    ids[q.push(b"general " * 10, priority=9, dedup_key="d")] = "general " * 10
    fid, synced = store.core.payload.synced_position()
    print(json.dumps({"ids": ids, "fid": fid, "synced": synced}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _crashed(path: str) -> dict[str, Any]:
    """Run CHILD on ``path``; what it printed, and its segment's path as ``seg``."""
    r = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    info: dict[str, Any] = json.loads(r.stdout)
    info["seg"] = os.path.join(path, "payload", f"{info['fid']:010d}.seg")
    return info


@pytest.mark.parametrize("loss", ["zeros", "truncated", "none"])
def test_a_power_loss_after_always_pushes_returned_loses_none_of_them(
        store_path: str, loss: str, caplog: pytest.LogCaptureFixture) -> None:
    info = _crashed(store_path)
    assert info["synced"] == 24  # no segment sync ran: only the log holds the bodies
    with open(info["seg"], "r+b") as f:  # what lost page cache leaves of the segment
        if loss == "zeros":
            size = f.seek(0, os.SEEK_END)
            f.seek(info["synced"])
            f.write(bytes(size - info["synced"]))
        elif loss == "truncated":
            f.truncate(info["synced"])
    # The check of the stopped store names no damage: the journal holds the bytes.
    report = check_path(store_path)
    assert report.ok
    assert len([n for n in report.notes if n.kind == "journaled"]) == (
        {"zeros": 5, "truncated": 6, "none": 0}[loss])
    with caplog.at_level(logging.WARNING, logger="qstore"), \
            qstore.open(store_path, compactor=False) as store:
        q = store.queue("q")
        got = {str(m.id): m.payload.decode() for m in q.pop_many(10)}
        assert got == info["ids"]
        assert _journal_keys(store) == []
        assert store.check().ok
        rewritten = [m for m in caplog.messages if "back into their segments" in m]
        assert bool(rewritten) == (loss != "none")
        assert not [m for m in caplog.messages if "dropped" in m]
        if loss != "none":
            assert "wrote 5 payload record(s)" in rewritten[0]


def _crash_and_lose_the_segment(path: str) -> dict[str, Any]:
    """The child's store, its segment bytes past the header zeroed (lost page cache)."""
    info = _crashed(path)
    with open(info["seg"], "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(24)
        f.write(bytes(size - 24))
    return info


def test_a_file_call_failing_while_the_journal_is_written_back_loses_nothing(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each file call of the open fails in turn: the open raises or works, and the
    next open has every message, exact (the journal goes only once written back)."""
    crashed = str(tmp_path / "crashed")
    info = _crash_and_lose_the_segment(crashed)
    faults = FaultyCalls(monkeypatch, names=("open_fd", "pread", "pwritev", "pwrite", "fsync"))
    probe = str(tmp_path / "probe")
    shutil.copytree(crashed, probe)
    faults.counting()
    qstore.open(probe, compactor=False).close()
    calls_of_an_open = faults.count
    assert calls_of_an_open >= 8  # reads and writes of 5 records, an fsync, ...
    raised = 0
    for n in range(1, calls_of_an_open + 1):
        path = str(tmp_path / f"fail{n}")
        shutil.copytree(crashed, path)
        faults.arm(n)
        try:
            qstore.open(path, compactor=False).close()
        except qstore.QStoreError:
            raised += 1
        faults.heal()
        with qstore.open(path, compactor=False) as store:
            got = {str(m.id): m.payload.decode() for m in store.queue("q").pop_many(10)}
            assert got == info["ids"], n
            assert _journal_keys(store) == []
    # Every failed call fails the open (those of the write-back included): none
    # is ignored, and the journal is dropped only after it was written back.
    assert raised == calls_of_an_open


def test_a_read_only_view_reads_what_the_journal_holds_for_a_lost_segment(
        store_path: str) -> None:
    """Before any read-write open writes the journal back, a view reads the bodies
    the segment lost from it: peek and get return them exact, none is left out as
    damaged, and the view changes nothing (the journal is still there after)."""
    info = _crash_and_lose_the_segment(store_path)
    with qstore.open(store_path, readonly=True) as view:
        q = view.queue("q")
        got = {str(m.id): m.payload.decode() for m in q.peek(10)}
        assert got == info["ids"]
        for mid, body in info["ids"].items():
            m = q.get(int(mid))
            assert m is not None and m.payload.decode() == body
        assert len(_journal_keys(view)) == 5
    # A record the journal does not hold is still damage, in a view as anywhere.
    with qstore.open(store_path) as store:
        assert store.check().ok and _journal_keys(store) == []
    with open(info["seg"], "r+b") as f:
        f.seek(24 + 8 + 2)
        f.write(b"\xff")
    with qstore.open(store_path, readonly=True) as view:
        q = view.queue("q")
        assert len(q.peek(10)) == 4  # the damaged one is left out
        with pytest.raises(qstore.Corruption):
            q.get(min(int(mid) for mid in info["ids"]))


def test_damage_to_a_record_the_journal_still_holds_is_written_over_on_open(
        store_path: str) -> None:
    info = _crashed(store_path)
    with open(info["seg"], "r+b") as f:  # one flipped byte in the first body
        f.seek(24 + 8 + 2)
        b = f.read(1)
        f.seek(24 + 8 + 2)
        f.write(bytes([b[0] ^ 0xFF]))
    with qstore.open(store_path, compactor=False) as store:
        assert store.check().ok
        q = store.queue("q")
        assert {str(m.id): m.payload.decode() for m in q.pop_many(10)} == info["ids"]


def test_journaling_stops_on_a_nearly_full_disk_and_the_log_is_flushed(
        store_path: str, fdatasyncs: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    with qstore.open(store_path, durability="always", sync_interval=3600,
                     compactor=False) as store:
        core = store.core
        q = store.create_queue("q")
        q.push(b"journaled")
        assert core.journaling and fdatasyncs == [] and core._journal_bytes == 9
        flushes: list[int] = []
        real_flush = core.meta.flush
        monkeypatch.setattr(core.meta, "flush", lambda: (flushes.append(1), real_flush()))
        # Less free space than journaling asks for: it stops, and the log that
        # holds journaled bodies is flushed away at once.
        monkeypatch.setattr(_core, "JOURNAL_MIN_FREE", 1 << 62)
        core.syncer.checkpoint()
        assert not core.journaling
        assert flushes == [1] and core._journal_bytes == 0
        q.push(b"synced in its segment")
        assert len(fdatasyncs) == 2  # the checkpoint's, then this push's own
        assert _journal_keys(store) == []
        # Room again: journaling resumes at the next checkpoint.
        monkeypatch.setattr(_core, "JOURNAL_MIN_FREE", 0)
        core.syncer.checkpoint()
        assert core.journaling
        q.push(b"journaled again")
        assert len(fdatasyncs) == 2 and len(_journal_keys(store)) == 1
        # Enough journaled: the checkpoint flushes the memtable (the log shrinks).
        monkeypatch.setattr(_core, "JOURNAL_FLUSH_BYTES", 10)
        core.syncer.checkpoint()
        assert flushes == [1, 1] and core._journal_bytes == 0
        assert [m.payload for m in q.pop_many(5)] == [
            b"journaled", b"synced in its segment", b"journaled again"]
