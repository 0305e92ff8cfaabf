"""durability="always": an operation never returns before its payload is durable.

Either its bodies are in the synced WAL (the payload journal) or an fdatasync
covered its segment. The compactor syncs the payload outside the writer lock;
a group-commit waiter that needs a payload sync and finds the unsynced flag
already taken by it must wait for that fdatasync.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

import qstore
from qstore._fs import calls


@pytest.mark.parametrize("compactor_calls", ["payload.sync", "syncer.sync_now"])
def test_a_sync_finding_the_compactors_fdatasync_in_progress_waits_for_it(
        store_path: str, monkeypatch: pytest.MonkeyPatch, compactor_calls: str) -> None:
    # Bytes no journal key covers are written (the flag set, the payload
    # needed), then the compactor blocks in its fdatasync before the waiter
    # syncs: whether it synced the segment itself (it cleared the unsynced flag)
    # or called Syncer.sync_now, which takes the payload flag: then the waiter's
    # sync took the journaled path, synced only the log and returned first (a
    # race audit, found by reading).
    store = qstore.open(store_path, durability="always", compactor=False)
    try:
        q = store.create_queue("q")
        core = store.core
        entered, release = threading.Event(), threading.Event()
        order: list[str] = []
        real = calls.fdatasync

        def gated(fd: int) -> Any:
            # The compactor's own thread, or sync_now's pool thread working for it.
            if threading.current_thread().name.startswith(("compactor", "qstore-fdatasync")) \
                    and not release.is_set():
                entered.set()
                assert release.wait(60)
                order.append("compactor fdatasync done")
            return real(fd)

        monkeypatch.setattr(calls, "fdatasync", gated)
        core.payload.append(b"must be durable when the push returns")
        core.syncer.payload_needed = True
        target = core.payload.sync if compactor_calls == "payload.sync" else core.syncer.sync_now
        compactor = threading.Thread(target=target, name="compactor")
        compactor.start()
        assert entered.wait(60)
        if compactor_calls == "payload.sync":
            assert not core.payload.unsynced
        else:
            assert not core.syncer.payload_needed  # it took the flag
        waiter = threading.Thread(target=lambda: (core.syncer.sync_now(),
                                                  order.append("waiter returned")))
        waiter.start()
        waiter.join(0.5)  # the broken code returns here at once; the fixed one waits
        release.set()
        compactor.join(60)
        waiter.join(60)
        assert order == ["compactor fdatasync done", "waiter returned"]
        assert q.push(b"x") >= 1
    finally:
        store.close()


def test_a_sync_cut_short_as_it_starts_keeps_the_payload_flag(
        store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # An interrupt at the call that runs the syncs, right after the flag was
    # taken, lost it: the next sync took the journaled path and synced only the
    # log while unjournaled bytes were not on disk (a review of the lock that
    # made taking and syncing one step).
    store = qstore.open(store_path, durability="always", compactor=False)
    try:
        syncer = store.core.syncer
        store.core.payload.append(b"no journal key covers this")
        syncer.payload_needed = True

        def cut(*args: Any) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(syncer, "_sync_now", cut)
        with pytest.raises(KeyboardInterrupt):
            syncer.sync_now()
        assert syncer.payload_needed  # kept: still not known to be on disk
        monkeypatch.undo()
        syncer.sync_now()
        assert not syncer.payload_needed and not store.core.payload.unsynced
    finally:
        store.close()


# -- case 4, second half: the durable mark covers what was synced before a push returned

ALWAYS_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import qstore
    from qstore.meta import keys, records
    store = qstore.open(sys.argv[1], durability="always", compactor=False)
    q = store.create_queue("q")
    ids = [q.push(b"always %02d " % i * 8) for i in range(6)]  # each returned: durable
    store.core.syncer.checkpoint()  # the segment synced, the journal keys deleted
    raw = store.core.meta.get(keys.message_key(q._q.qid, ids[-1]))
    rec = records.MessageRecord.decode(raw)
    print(json.dumps({"ids": ids, "fid": rec.file_id, "offset": rec.offset}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close: the mark is what the pushes left
""")


def test_a_damaged_final_record_synced_in_always_mode_is_kept_as_damage(
        store_path: str, caplog: pytest.LogCaptureFixture) -> None:
    r = subprocess.run([sys.executable, "-c", ALWAYS_CHILD, store_path], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    info = json.loads(r.stdout)
    ids, last = info["ids"], info["ids"][-1]
    seg = os.path.join(store_path, "payload", f"{info['fid']:010d}.seg")
    with open(seg, "r+b") as f:  # flip one byte of the final record's body
        f.seek(info["offset"] + 8 + 3)
        b = f.read(1)
        f.seek(info["offset"] + 8 + 3)
        f.write(bytes([b[0] ^ 0x5A]))
    end = info["offset"] + 8 + len(b"always 05 " * 8)
    with caplog.at_level(logging.WARNING), qstore.open(store_path, compactor=False) as store:
        q = store.queue("q")
        # Kept on open, never cut like an unsynced tail: the file still holds it.
        assert not [m for m in caplog.messages if "torn tail" in m or "dropped" in m]
        assert os.path.getsize(seg) >= end
        assert q.stats().ready == 6
        for i, mid in enumerate(ids[:-1]):
            assert q.get(mid).payload == b"always %02d " % i * 8
        with pytest.raises(qstore.Corruption) as exc:
            q.get(last)
        assert exc.value.reason == "record checksum mismatch"
        assert [f.kind for f in store.check().findings] == ["crc_mismatch"]
        # A pop reaching it moves it aside with the reason, and logs it.
        assert [m.id for m in q.pop_many(10)] == ids[:-1]
        [dead] = q.dead_letters(10)
        assert dead.id == last and dead.dead_reason == "damaged payload: record checksum mismatch"
        assert any(f"message {last} moved to the dead letters" in m for m in caplog.messages)


def test_a_failed_write_of_the_durable_mark_does_not_fail_what_the_sync_covered(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # On a full disk, a push's batch was written and synced, then the write of the
    # durable mark after the sync failed, and the push raised: its message was in
    # the store all the same, so a retry pushed it twice (a disk-full test). The
    # mark is a saving: what the sync covered returns, and the next write reopens.
    big = b"b" * (1 << 20) + b"x"  # past the journal's limit: the segment is synced
    with qstore.open(str(tmp_path / "s"), durability="always", compactor=False) as store:
        q = store.create_queue("q")
        q.push(big + b"1")
        meta = store.core.meta
        real = meta.write
        writes: list[int] = []

        def write(batch: Any, *, sync: bool = False) -> None:
            writes.append(1)
            if len(writes) == 2:  # the push's batch, then the mark's
                raise meta._failure("metadata write failed",
                                    OSError("IO error: No space left on device"))
            real(batch, sync=sync)

        monkeypatch.setattr(meta, "write", write)
        q.push(big + b"2")  # returns: durable
        monkeypatch.undo()
        assert len(writes) == 2 and meta.failed is not None
        assert "the durable mark was not moved" in caplog.text
        q.push(big + b"3")  # the next write reopens the database
        assert meta.failed is None
        assert [m.payload[-1:] for m in q.pop_many(5)] == [b"1", b"2", b"3"]
