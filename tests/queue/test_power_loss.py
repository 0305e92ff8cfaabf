"""A power loss may keep the RocksDB WAL but lose payload bytes that were not synced.

A child process pushes, syncs part of what it pushed, and is SIGKILLed; the
test then throws away the payload bytes past the synced point (zeros or a
shorter file), which is what lost page cache leaves, and reopens.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import qstore
from qstore import _core
from qstore.meta import keys, records

CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import qstore
    store = qstore.open(sys.argv[1], durability="interval", sync_interval=3600, compactor=False)
    q = store.create_queue("q")
    kept = q.push(b"A" * 100, priority=1)
    store.core.syncer.sync_now()                 # A's bytes are durable, and so is the metadata
    lost = q.push_many([(b"B" * 100, 5), (b"C" * 100, 9)])   # written to the OS only
    store.core.meta.sync_wal()     # the WAL reached the disk, the payload did not
    fid, synced = store.core.payload.synced_position()
    print(json.dumps({"kept": kept, "lost": lost, "fid": fid, "synced": synced}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _kept_and_gone(q: qstore.Queue, kept: int, gone: list[int]) -> None:
    """The synced message ``kept`` reads back whole; every one of ``gone`` is gone."""
    assert q.get(kept).payload == b"A" * 100
    for mid in gone:
        with pytest.raises(qstore.MessageNotFound):
            q.get(mid)


def crashed_store(path: str) -> dict[str, int]:
    r = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("loss", ["zeros", "truncated"])
def test_messages_whose_payload_never_reached_the_disk_are_dropped_on_open(
    store_path: str, loss: str, caplog: pytest.LogCaptureFixture
) -> None:
    info = crashed_store(store_path)
    seg = os.path.join(store_path, "payload", f"{info['fid']:010d}.seg")
    with open(seg, "r+b") as f:
        if loss == "zeros":
            size = f.seek(0, os.SEEK_END)
            f.seek(info["synced"])
            f.write(bytes(size - info["synced"]))
        else:
            f.truncate(info["synced"])
    with caplog.at_level(logging.ERROR, logger="qstore"), \
            qstore.open(store_path, compactor=False) as store:
        q = store.queue("q")
        _kept_and_gone(q, info["kept"], info["lost"])
        st = q.stats()
        assert (st.ready, st.bytes) == (1, 100)
        seg_stats = {s.file_id: s for s in store.stats().segments}[info["fid"]]
        assert (seg_stats.live_count, seg_stats.live_bytes) == (1, 108)
        m = q.pop()
        assert m is not None and m.id == info["kept"]
        assert q.pop() is None
        assert any("2 message(s) dropped" in r.getMessage() for r in caplog.records)
        # New pushes land after the cut and read back.
        new = q.push(b"D" * 10)
        assert q.get(new).payload == b"D" * 10
    # And the drop itself was durable: a second open finds nothing more to do.
    with qstore.open(store_path, compactor=False) as store:
        assert store.queue("q").stats().ready == 1


def test_every_batch_records_how_far_the_active_segment_is_durable(store_path: str) -> None:
    with qstore.open(store_path, durability="interval", sync_interval=3600,
                     compactor=False) as store:
        q = store.create_queue("q")
        q.push(b"x" * 50)
        store.core.syncer.sync_now()
        q.push(b"y" * 50)
        fid, off = store.core.payload.synced_position()
        raw = store.core.meta.get(keys.SYNCED_KEY)
        assert raw is not None
        # The second push's batch was written after the first push's sync.
        _, rec_fid, rec_off = records.unpack(raw, "synced")
        assert rec_fid == fid and 24 + 58 <= rec_off <= off


def test_clean_close_records_the_whole_active_segment_as_durable(store_path: str) -> None:
    """Else the next open scans the whole active segment (durability="none" never syncs)."""
    with qstore.open(store_path, durability="none", compactor=False) as store:
        store.create_queue("q").push_many([b"z" * 100] * 50)
        active, end = store.core.payload.active_id, store.core.payload.active_end
    with qstore.open(store_path, readonly=True) as view:
        raw = view.core.meta.get(keys.SYNCED_KEY)
        assert raw is not None
        assert records.unpack(raw, "synced")[1:] == [active, end]


ROTATING_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import qstore
    store = qstore.open(sys.argv[1], durability="interval", sync_interval=3600,
                        compactor=False, segment_max_bytes=64 * 1024)
    q = store.create_queue("q")
    kept = q.push(b"A" * 100)
    store.core.syncer.sync_now()
    first = store.core.payload.active_id
    # Three records fill the first segment (sealed, so fsynced, as the batch
    # rotates); the fourth opens the next one, which no sync reaches.
    batch = q.push_many([bytes([65 + i]) * 20_000 for i in range(4)])
    store.core.meta.sync_wal()   # the WAL reached the disk (another write's sync, say)
    print(json.dumps({"kept": kept, "batch": batch, "first": first,
                      "last": store.core.payload.active_id}), flush=True)
    if sys.argv[2] == "kill-after-sync":
        store.core.syncer.sync_now()
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _crash(path: str, how: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-c", ROTATING_CHILD, path, how],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def _pending_batch_keys(store: qstore.Store) -> list[bytes]:
    return [k for k, _ in store.core.meta.scan(keys.PENDING_BATCH,
                                                keys.prefix_end(keys.PENDING_BATCH))]


def test_a_batch_that_lost_part_of_its_payload_is_dropped_whole(
        store_path: str, caplog: pytest.LogCaptureFixture) -> None:
    # A push_many is one atomic batch. A power loss that kept its metadata (the
    # log synced) and the records in the segment it sealed, but not the record
    # in the segment it went on to, kept 3 of its 4 messages (a power-loss
    # audit that replayed every recorded sync: 18 partial batches).
    info = _crash(store_path, "kill")
    assert info["last"] == info["first"] + 1
    seg = os.path.join(store_path, "payload", f"{info['last']:010d}.seg")
    with open(seg, "r+b") as f:
        f.truncate(24)  # its header was made durable; the record was not
    with caplog.at_level(logging.ERROR, logger="qstore"), \
            qstore.open(store_path, compactor=False) as store:
        q = store.queue("q")
        _kept_and_gone(q, info["kept"], info["batch"])
        assert q.stats().ready == 1
        assert store.check().ok
        assert _pending_batch_keys(store) == []
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "1 message(s) dropped" in said and "all or nothing" in said
        assert f"3 more of queue 'q' (ids {info['batch'][0]}-{info['batch'][-1]})" in said
    with qstore.open(store_path, compactor=False) as store:  # and that was durable
        assert store.queue("q").stats().ready == 1


KILLED_RECOVERY = textwrap.dedent("""
    import os, signal, sys
    import qstore
    from qstore import _core
    def die(*args):  # as the open settles the pending batches
        os.kill(os.getpid(), signal.SIGKILL)
    _core.Core._settle_pending_batches = die
    qstore.open(sys.argv[1], compactor=False)
""")


def test_a_recovery_cut_short_drops_the_whole_batch_at_the_next_open(store_path: str) -> None:
    # The open dropped the messages whose bytes were lost, in a synced batch of
    # its own, before it looked at the pending batches: killed in between, the
    # next open found nothing lost (the segment was cut already) and kept the
    # rest of the batch for good (a review). One batch now, all or nothing.
    info = _crash(store_path, "kill")
    with open(os.path.join(store_path, "payload", f"{info['last']:010d}.seg"), "r+b") as f:
        f.truncate(24)
    r = subprocess.run([sys.executable, "-c", KILLED_RECOVERY, store_path],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    with qstore.open(store_path, compactor=False) as store:
        q = store.queue("q")
        _kept_and_gone(q, info["kept"], info["batch"])
        assert q.stats().ready == 1 and store.check().ok
        assert _pending_batch_keys(store) == []


def test_an_open_whose_recovery_fails_leaves_the_store_to_the_next_open(
        store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The open's settling of the pending batches fsyncs their segment; when that
    # failed (EIO), the open raised but kept RocksDB's LOCK and this process's
    # claim: every later open, here or in another process, said StoreLocked
    # while this one lived (a faults audit). Now the next open recovers.
    info = _crash(store_path, "kill")

    def failing(path: str) -> None:
        raise OSError(errno.EIO, "Input/output error", path)

    monkeypatch.setattr(_core, "fsync_file", failing)
    with pytest.raises(qstore.StorageError, match="Input/output error"):
        qstore.open(store_path, compactor=False)
    monkeypatch.undo()
    with qstore.open(store_path, compactor=False) as store:
        q = store.queue("q")
        assert [q.get(mid).payload for mid in info["batch"]] == [
            bytes([65 + i]) * 20_000 for i in range(4)]
        assert _pending_batch_keys(store) == [] and store.check().ok


@pytest.mark.parametrize("how", ["kill", "kill-after-sync"])
def test_a_whole_batch_left_by_a_kill_is_kept_and_its_key_settled(store_path: str,
                                                                    how: str) -> None:
    # A kill (no power loss) keeps every byte: the batch stays, its segments are
    # made durable at the open, and its pending key goes.
    info = _crash(store_path, how)
    with qstore.open(store_path, compactor=False) as store:
        q = store.queue("q")
        assert [q.get(mid).payload for mid in info["batch"]] == [
            bytes([65 + i]) * 20_000 for i in range(4)]
        assert _pending_batch_keys(store) == []
        assert store.check().ok


def test_pending_batch_keys_live_until_a_sync_covers_their_batch(tmp_path: Any) -> None:
    with qstore.open(str(tmp_path / "i"), durability="interval", sync_interval=3600,
                     compactor=False) as store:
        q = store.create_queue("q")
        q.push(b"single")  # one message: atomic by its one record
        assert _pending_batch_keys(store) == []
        ids = q.push_many([b"a", b"b", b"c"])
        pending = _pending_batch_keys(store)
        assert pending == [keys.pending_batch_key(store.core.queues["q"].qid, ids[0])]
        value = store.core.meta.get(pending[0])
        assert value is not None
        assert records.unpack(value, "pending batch")[1:3] == [ids[-1],
                                                               store.core.payload.active_id]
        q.push_many([b"d", b"e"])
        assert len(_pending_batch_keys(store)) == 2
        store.core.syncer.sync_now()
        assert _pending_batch_keys(store) == [] and store.core._awaiting_sync == []
        q.push_many([b"f", b"g"])
    with qstore.open(str(tmp_path / "i"), readonly=True) as view:  # close synced it
        assert _pending_batch_keys(view) == []
    with qstore.open(str(tmp_path / "n"), durability="none", compactor=False) as store:
        store.create_queue("q").push_many([b"a", b"b"])  # nothing would delete it
        assert _pending_batch_keys(store) == []


def test_always_mode_writes_a_pending_key_only_for_a_batch_the_journal_does_not_carry(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[bytes]] = []
    with qstore.open(str(tmp_path / "a"), durability="always", compactor=False) as store:
        q = store.create_queue("q")
        real = store.core._record_synced_mark

        def look() -> None:  # what the group commit's sync finds, before the mark
            seen.append(_pending_batch_keys(store))
            real()

        monkeypatch.setattr(store.core.syncer, "on_synced", look)
        q.push_many([b"small"] * 3)  # journaled: its bodies are in the log
        q.push_many([b"x" * (600 * 1024)] * 2)  # 1.2 MiB: over the journal's limit
        assert seen[0] == [] and len(seen[1]) == 1
        assert _pending_batch_keys(store) == []  # gone before the push returned
