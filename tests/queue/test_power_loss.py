"""A power loss may keep the RocksDB WAL but lose payload bytes that were not synced.

A child process pushes, syncs part of what it pushed, and is SIGKILLed; the
test then throws away the payload bytes past the synced point (zeros or a
shorter file), which is what lost page cache leaves, and reopens.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import qstore
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
        assert q.get(info["kept"]).payload == b"A" * 100
        for mid in info["lost"]:
            with pytest.raises(qstore.MessageNotFound):
                q.get(mid)
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
