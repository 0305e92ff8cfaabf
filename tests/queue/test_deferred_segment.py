"""Single pushes defer their segment's S record (qstore/_seg_accounts.py).

The record carries a ``covered`` id: it counts exactly the messages of its
segment below that id, and whoever reads it (an open, the check, the audit,
``Core.stored_segments``) adds the messages from that id up. These tests
check the records a process leaves behind byte by byte, after a clean close
and after a real SIGKILL, and that the readers count what the writer counted.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import qstore
from qstore import _hot
from qstore._check import check_path
from qstore.meta import keys, new_batch, records
from qstore.payload import FRAME_SIZE


def _raw(store: qstore.Store) -> dict[int, tuple[list[int], int | None]]:
    """Every S record as written: file id -> ([live bytes, count, end], covered id)."""
    return {keys.segment_id(k): (list(records.decode_segment(v)), records.segment_covered(v))
            for k, v in store.core.meta.scan(keys.SEGMENT, keys.prefix_end(keys.SEGMENT))}


def _refs(store: qstore.Store) -> dict[int, tuple[int, int]]:
    """Message id -> (file id, offset), from the message records."""
    out = {}
    for k, v in store.core.meta.scan(keys.MESSAGE, keys.prefix_end(keys.MESSAGE)):
        rec = records.MessageRecord.decode(v)
        out[keys.trailing_id(k)] = (rec.file_id, rec.offset)
    return out


def _frames(*bodies: bytes) -> int:
    return sum(FRAME_SIZE + len(b) for b in bodies)


def test_single_pushes_write_the_record_every_defer_max_pushes(
        store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_hot, "DEFER_MAX", 3)
    with qstore.open(store_path, compactor=False, durability="none") as store:
        q = store.create_queue("q")
        bodies = [b"body %d" % i for i in range(9)]
        covered = []
        for body in bodies:
            mid = q.push(body)
            ((fid, (seg, c)),) = _raw(store).items()
            covered.append((mid, seg[1], c))
            # Whatever is deferred, the readers count what this process counts.
            assert store.core.stored_segments() == store.core.segments
        # The first push writes the record (covering itself: ids below mid + 1),
        # the next three leave it, the fifth writes it again, and so on.
        assert covered == [(1, 1, 2), (2, 1, 2), (3, 1, 2), (4, 1, 2), (5, 5, 6), (6, 5, 6),
                           (7, 5, 6), (8, 5, 6), (9, 9, 10)]
        assert store.core.segments[fid][:2] == [_frames(*bodies), 9]
    with qstore.open(store_path, compactor=False, readonly=True) as view:
        # A clean close writes the record whole: no covered id, nothing to scan.
        assert _raw(view) == {fid: ([_frames(*bodies), 9, view.core.segments[fid][2]], None)}


def test_an_ack_or_a_batch_writes_the_deferred_record_as_counted(store_path: str) -> None:
    with qstore.open(store_path, compactor=False, durability="none") as store:
        q = store.create_queue("q")
        for i in range(5):
            q.push(b"x" * 100, priority=i)
        ((fid, (seg, c)),) = _raw(store).items()
        assert (seg[1], c) == (1, 2)
        m = q.pop()
        assert m is not None
        q.ack(m)  # the ack's record is this process's count, covered up to the next id
        assert _raw(store)[fid] == (store.core.segments[fid], 6)
        assert store.core.segments[fid][:2] == [4 * (FRAME_SIZE + 100), 4]
        q.push_many([(b"y", 0), (b"z", 0)])
        assert _raw(store)[fid] == (store.core.segments[fid], 8)


def test_pushes_that_move_to_a_new_segment_write_the_sealed_ones_record_whole(
        store_path: str) -> None:
    with qstore.open(store_path, compactor=False, durability="none",
                     segment_max_bytes=4096) as store:
        q = store.create_queue("q")
        for _ in range(10):
            q.push(b"p" * 1000)
        raw = _raw(store)
        assert len(raw) == 3  # 4 records of 1 KiB a segment
        active = store.core.payload.active_id
        for fid, (seg, c) in raw.items():
            if fid == active:  # 2 pushes, the second deferred
                assert (seg[1], c) == (1, 10)
            else:  # sealed: exact, and no open ever scans for it
                assert (seg, c) == (store.core.segments[fid], None)
                assert seg[:2] == [4 * (FRAME_SIZE + 1000), 4]
        assert store.core.stored_segments() == store.core.segments


CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import qstore
    store = qstore.open(sys.argv[1], durability=sys.argv[2], compactor=False,
                        segment_max_bytes=64 * 1024)
    q = store.create_queue("q")
    ids = {q.push(b"%d:" % i + b"m" * (i % 700), priority=i % 10): i for i in range(300)}
    print(json.dumps({"ids": ids, "fids": store.core.payload.file_ids()}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("durability", ["interval", "always"])
def test_a_process_killed_after_deferred_pushes_loses_no_accounting(
        store_path: str, durability: str) -> None:
    r = subprocess.run([sys.executable, "-c", CHILD, store_path, durability],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    info: dict[str, Any] = json.loads(r.stdout)
    bodies = {int(mid): b"%d:" % i + b"m" * (i % 700) for mid, i in info["ids"].items()}
    with qstore.open(store_path, readonly=True) as view:
        raw = _raw(view)
        active = max(info["fids"])
        seg, covered = raw[active]
        refs = _refs(view)
        assert sorted(refs) == sorted(bodies)
        # The killed process left the active segment's record behind its pushes.
        assert covered is not None and seg[1] < sum(
            1 for fid, _ in refs.values() if fid == active)
        expected = {fid: [0, 0, 0] for fid in info["fids"]}
        for mid, body in bodies.items():
            fid, offset = refs[mid]
            e = expected[fid]
            e[0] += FRAME_SIZE + len(body)
            e[1] += 1
            e[2] = max(e[2], offset + FRAME_SIZE + len(body))
        # A view (the open's loader) counts the deferred pushes.
        assert {f: s[:2] for f, s in view.core.segments.items()} == {
            f: e[:2] for f, e in expected.items()}
    # The check of the stopped store compares the record with what it covers.
    assert check_path(store_path).ok
    with qstore.open(store_path, compactor=False) as store:
        assert {f: s[:2] for f, s in store.core.segments.items()} == {
            f: e[:2] for f, e in expected.items()}
        # The open wrote the record whole, so the next open scans nothing.
        assert _raw(store)[active] == (store.core.segments[active], None)
        q = store.queue("q")
        got = {m.id: m.payload for m in q.pop_many(1000)}
        assert got == bodies
        assert store.check().ok


def test_the_check_still_finds_a_wrong_count_below_the_covered_id(store_path: str) -> None:
    with qstore.open(store_path, compactor=False, durability="none") as store:
        q = store.create_queue("q")
        for _ in range(20):
            q.push(b"z" * 50)
        ((fid, (seg, c)),) = _raw(store).items()
        assert c is not None and seg[1] == 1
        batch = new_batch()
        batch.put(keys.segment_key(fid), records.encode_segment(seg[0] + 8, seg[1], seg[2], c))
        store.core.meta.write(batch)
        (finding,) = store.check().findings
        assert finding.kind == "segment_record_mismatch" and finding.file_id == fid
        assert "recount finds 1 /" in finding.detail


def test_a_repair_snapshot_or_id_reservation_catches_the_record_up(
        store_path: str, tmp_path: Any) -> None:
    with qstore.open(store_path, compactor=False, durability="none") as store:
        q = store.create_queue("q")
        for _ in range(10):
            q.push(b"r" * 10)
        ((fid, (seg, c)),) = _raw(store).items()
        assert (seg[1], c) == (1, 2)
        report = store.check(repair=True)
        assert report.ok and report.repairs == ()
        assert _raw(store)[fid] == (store.core.segments[fid], 11)
        q.push(b"after the repair")
        store.snapshot(str(tmp_path / "snap"))
        with qstore.open(str(tmp_path / "snap"), readonly=True) as snap:
            assert _raw(snap)[fid] == (store.core.segments[fid], 12)
        first = store.core.reserve_ids(1000)
        assert (first, _raw(store)[fid][1]) == (12, 1012)


def test_a_snapshot_of_a_view_checks_clean_with_deferred_pushes(
        store_path: str, tmp_path: Any) -> None:
    with qstore.open(store_path, compactor=False, durability="none") as store:
        q = store.create_queue("q")
        for i in range(40):
            q.push(b"v%d" % i)
        store.core.meta.flush()  # a view reads what reached the database's files
        with qstore.open(store_path, readonly=True) as view:
            view.snapshot(str(tmp_path / "snap"))
        with qstore.open(str(tmp_path / "snap"), readonly=True) as snap:
            ((_, (seg, c)),) = _raw(snap).items()
            assert (seg[1], c) == (1, 2)  # deferred: the readers count the other 39
            assert [s[1] for s in snap.core.segments.values()] == [40]
        assert check_path(str(tmp_path / "snap")).ok
