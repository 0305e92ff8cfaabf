"""Power loss that drops a page in the middle of the unsynced region, and a cut sealed segment.

A child process pushes, syncs part of it and is SIGKILLed; the test then
zeroes one 4 KiB page of the payload past the durable mark while later
records survive (what a power loss may leave), and reopens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import qstore

CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import qstore
    store = qstore.open(sys.argv[1], durability="interval", sync_interval=3600, compactor=False)
    q = store.create_queue("q")
    kept = q.push(b"A" * 100, priority=1)
    store.core.syncer.sync_now()
    later = q.push_many([(b"%04d" % i * 50, 2) for i in range(80)])  # 16 KiB, not synced
    store.core.meta.sync_wal()     # the WAL reached the disk, the payload did not
    fid, synced = store.core.payload.synced_position()
    print(json.dumps({"kept": kept, "later": later, "fid": fid, "synced": synced}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_page_lost_in_the_middle_of_the_unsynced_region_is_cut_and_the_store_opens(
        store_path: str) -> None:
    r = subprocess.run([sys.executable, "-c", CHILD, store_path], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    info = json.loads(r.stdout)
    seg = os.path.join(store_path, "payload", f"{info['fid']:010d}.seg")
    page = (info["synced"] // 4096 + 1) * 4096  # the first whole page past the mark
    with open(seg, "r+b") as f:
        f.seek(page)
        f.write(bytes(4096))
    with qstore.open(store_path, compactor=False) as store:
        q = store.queue("q")
        assert q.get(info["kept"]).payload == b"A" * 100
        survived = lost = 0
        for i, mid in enumerate(info["later"]):
            try:
                assert q.get(mid).payload == b"%04d" % i * 50
                survived += 1
            except qstore.MessageNotFound:
                lost += 1
        # From the lost page on everything is cut (nothing there was durable),
        # and the batch is all or nothing: the records before the page go with
        # it (they survived; the batch kept some of its messages before its
        # pending batch key made recovery drop it whole).
        assert survived == 0 and lost == len(info["later"])
        assert q.stats().ready == 1
        assert store.check().ok
        new = q.push(b"after")
        assert q.get(new).payload == b"after"
    kept_aside = [n for n in os.listdir(os.path.join(store_path, "payload")) if ".cut-" in n]
    assert len(kept_aside) == 1
    with qstore.open(store_path, readonly=True) as view:
        assert view.queue("q").stats().ready == 2


def test_a_cut_sealed_segment_keeps_its_messages_and_reads_of_lost_ones_raise(
        store_path: str) -> None:
    bodies = {}
    with qstore.open(store_path, compactor=False, segment_max_bytes=1024) as store:
        q = store.create_queue("q")
        for i in range(30):
            bodies[q.push(b"m%03d" % i * 25)] = b"m%03d" % i * 25
    payload = os.path.join(store_path, "payload")
    first = os.path.join(payload, sorted(n for n in os.listdir(payload) if n.endswith(".seg"))[0])
    os.truncate(first, os.path.getsize(first) - 150)  # the last record and part of the one before
    for readonly in (False, True, False):
        with qstore.open(store_path, compactor=False, readonly=readonly) as store:
            q = store.queue("q")
            assert q.stats().ready == len(bodies)  # nothing dropped on open
            damaged = 0
            for mid, body in bodies.items():
                try:
                    assert q.get(mid).payload == body
                except qstore.Corruption as exc:
                    assert exc.path == first
                    damaged += 1
            assert damaged == 2
