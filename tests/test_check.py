"""The integrity check: a clean store is clean, and each real damage is named exactly."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
from click.testing import CliRunner

import qstore
from qstore._check import check_path
from qstore._snapshot import read_manifest
from qstore.cli import main
from qstore.meta import MetaDB, keys, new_batch, records
from qstore.payload import _format as fmt
from qstore.spark._scan import checked_records
from tests.conftest import FakeClock
from tests.faults._inject import FaultyCalls

SEGMENT_MAX = 4096


def build(path: str, clock: FakeClock) -> dict[str, Any]:
    """A closed store with messages in every state, a dedup queue, and several segments.

    Returns the ids by role and where each lives: {name: (queue, id, file_id, offset)}.
    """
    with qstore.open(path, clock=clock, compactor=False, segment_max_bytes=SEGMENT_MAX) as s:
        a = s.create_queue("a", max_attempts=1)
        d = s.create_queue("d", dedup=True, order="min", priority_type="str")
        ids = {f"a{i}": a.push(bytes([65 + i]) * 1900, priority=i) for i in range(8)}
        ids["delayed"] = a.push(b"later", priority=1, delay=60)
        ids["dup"] = d.push(b"same", priority="p")
        ids["keyed"] = d.push(b"other", priority="q", dedup_key="k1")
        assert d.push(b"same", priority="z") == ids["dup"]  # a dedup hit
        flight = a.pop(lease=30)
        assert flight is not None
        ids["flight"] = flight.id
        dead = a.pop(lease=1)
        assert dead is not None
        ids["dead"] = dead.id
        clock.advance(2)
        assert a.stats().dead == 1
        assert s.check().ok
        where = {}
        for role, mid in ids.items():
            queue = "d" if role in ("dup", "keyed") else "a"
            raw = s.core.meta.get(keys.message_key(s.core.queues[queue].qid, mid))
            assert raw is not None
            rec = records.MessageRecord.decode(raw)
            where[role] = (queue, mid, rec.file_id, rec.offset)
        assert len({w[2] for w in where.values()}) >= 3  # several segments
    return where


@pytest.fixture
def damaged(tmp_path: Any, clock: FakeClock) -> tuple[str, dict[str, Any]]:
    path = str(tmp_path / "store")
    return path, build(path, clock)


def seg_path(path: str, fid: int) -> str:
    return os.path.join(path, "payload", fmt.segment_name(fid))


def kinds(report: qstore.CheckReport) -> list[tuple[Any, ...]]:
    return ordered((f.kind, f.queue, f.message_id, f.file_id) for f in report.findings)


def ordered(rows: Any) -> list[tuple[Any, ...]]:
    return sorted(rows, key=lambda r: tuple("" if v is None else str(v) for v in r))


def write_meta(path: str, puts: dict[bytes, bytes] | None = None,
               deletes: list[bytes] | None = None) -> None:
    meta = MetaDB(os.path.join(path, "meta"), readonly=False, store_path=path)
    try:
        batch = new_batch()
        for k, v in (puts or {}).items():
            batch.put(k, v)
        for k in deletes or []:
            batch.delete(k)
        meta.write(batch, sync=True)
    finally:
        meta.close()


def test_clean_store_with_every_state_has_no_findings(damaged: tuple[str, dict[str, Any]],
                                                      clock: FakeClock) -> None:
    path, where = damaged
    report = check_path(path)
    assert report.ok and report.findings == () and report.notes == ()
    assert (report.queues, report.messages) == (2, len({w[1] for w in where.values()}))
    assert report.payload_bytes == 8 * 1900 + len(b"later") + len(b"same") + len(b"other")
    assert report.segments >= 3
    with qstore.open(path, clock=clock, compactor=False) as s:
        assert s.check() == report  # the same answer under the writer lock


def test_flipped_payload_byte_is_a_crc_mismatch_of_that_message(
        damaged: tuple[str, dict[str, Any]]) -> None:
    path, where = damaged
    queue, mid, fid, off = where["a3"]
    with open(seg_path(path, fid), "r+b") as f:
        f.seek(off + fmt.FRAME_SIZE + 10)
        byte = f.read(1)
        f.seek(off + fmt.FRAME_SIZE + 10)
        f.write(bytes([byte[0] ^ 0x01]))
    report = check_path(path)
    assert kinds(report) == [("crc_mismatch", queue, mid, fid)]
    assert report.findings[0].offset == off and report.findings[0].detail == fmt.BAD_CRC
    assert not report.ok


def test_truncated_sealed_segment_names_the_segment_and_the_cut_messages(
        damaged: tuple[str, dict[str, Any]]) -> None:
    path, where = damaged
    _, _, fid, off = where["a0"]
    cut = off + fmt.FRAME_SIZE + 100  # inside a0's body
    size = os.path.getsize(seg_path(path, fid))
    os.truncate(seg_path(path, fid), cut)
    inside = sorted((q, m) for q, m, f, o in where.values() if f == fid and o + 8 < size)
    report = check_path(path)
    assert kinds(report) == ordered([("out_of_bounds", q, m, fid) for q, m in inside]
                                   + [("segment_truncated", None, None, fid)])


def test_deleted_segment_is_missing_for_the_segment_and_each_message(
        damaged: tuple[str, dict[str, Any]]) -> None:
    path, where = damaged
    fid = where["a2"][2]
    os.unlink(seg_path(path, fid))
    in_it = [(q, m) for q, m, f, _ in where.values() if f == fid]
    report = check_path(path)
    assert kinds(report) == ordered([("missing_segment", q, m, fid) for q, m in in_it]
                                   + [("missing_segment", None, None, fid)])


def test_stray_index_key_and_deleted_index_key_are_named(
        damaged: tuple[str, dict[str, Any]]) -> None:
    path, where = damaged
    qid = 1  # queue "a", the first created
    _, flight, _, _ = where["flight"]
    _, ready, _, _ = where["a5"]
    stray = keys.timed_key(keys.DELAYED, qid, 123, 999_999)
    pkey = keys.priority_key("max", "int", 5)
    write_meta(path, puts={stray: b""}, deletes=[keys.ready_key(qid, pkey, ready)])
    report = check_path(path)
    assert kinds(report) == [("index_missing", "a", ready, None),
                             ("stray_index_key", "a", 999_999, None)]
    # An index key of the wrong state (the in-flight message also in the dead index).
    write_meta(path, puts={keys.dead_key(qid, flight): b""},
               deletes=[stray])
    report = check_path(path)
    assert kinds(report) == [("index_missing", "a", ready, None),
                             ("stray_index_key", "a", flight, None)]


def test_dedup_key_pointing_elsewhere_and_missing_dedup_key(
        damaged: tuple[str, dict[str, Any]]) -> None:
    path, where = damaged
    _, dup, _, _ = where["dup"]
    _, keyed, _, _ = where["keyed"]
    qid = 2
    digest_keyed = qstore_digest(path, qid, keyed)
    write_meta(path, puts={keys.dedup_key(qid, digest_keyed): keys.U64.pack(dup)})
    report = check_path(path)
    assert kinds(report) == [("index_missing", "d", keyed, None),
                             ("stray_index_key", "d", dup, None)]


@pytest.mark.parametrize("store_format", [1, 2])
def test_a_dead_letter_holding_a_dedup_key_is_stray_from_format_2(
        tmp_path: Any, clock: FakeClock, store_format: int) -> None:
    """Format 2 dead letters release their dedup key (their record keeps the digest, for a
    redrive); format 1 ones kept the key too (meta-schema)."""
    path = str(tmp_path / "store")
    with qstore.open(path, clock=clock, compactor=False) as s:
        q = s.create_queue("d", dedup=True, max_attempts=1)
        mid = q.push(b"poison")
        q.nack(q.pop())  # type: ignore[arg-type]
        qid = s.core.queues["d"].qid
        raw = s.core.meta.get(keys.message_key(qid, mid))
        assert raw is not None
        rec = records.MessageRecord.decode(raw)
        assert rec.state == records.DEAD and rec.digest == keys.payload_digest(b"poison")
        assert s.core.meta.get(keys.dedup_key(qid, keys.payload_digest(b"poison"))) is None
        assert s.check().ok
    # What format 1 wrote: the dead letter kept its digest and its key.
    write_meta(path, puts={
        keys.message_key(qid, mid): rec.encode(),
        keys.dedup_key(qid, rec.digest): keys.U64.pack(mid),
        keys.FORMAT_KEY: records.pack([records.RECORD_VERSION, store_format])})
    report = check_path(path)
    if store_format == 1:
        assert report.ok
    else:
        assert kinds(report) == [("stray_index_key", "d", mid, None)]
        assert "dead letter" in report.findings[0].detail


def qstore_digest(path: str, qid: int, mid: int) -> bytes:
    meta = MetaDB(os.path.join(path, "meta"), readonly=True, store_path=path)
    try:
        raw = meta.get(keys.message_key(qid, mid))
    finally:
        meta.close()
    assert raw is not None
    digest = records.MessageRecord.decode(raw).digest
    assert digest is not None
    return digest


def test_wrong_counter_and_wrong_segment_record(damaged: tuple[str, dict[str, Any]]) -> None:
    path, where = damaged
    fid = where["a0"][2]
    meta = MetaDB(os.path.join(path, "meta"), readonly=True, store_path=path)
    try:
        counts = records.decode_counts(meta.get(keys.counts_key(1)) or b"")
        seg = records.decode_segment(meta.get(keys.segment_key(fid)) or b"")
    finally:
        meta.close()
    counts[0] += 1
    write_meta(path, puts={keys.counts_key(1): records.encode_counts(counts),
                           keys.segment_key(fid): records.encode_segment(seg[0] + 8, *seg[1:])})
    report = check_path(path)
    assert kinds(report) == [("counter_mismatch", "a", None, None),
                             ("segment_record_mismatch", None, None, fid)]
    assert "ready: stored" in report.findings[0].detail


def test_an_id_hwm_record_that_does_not_decode_is_a_finding(
        damaged: tuple[str, dict[str, Any]]) -> None:
    # It made the whole check raise StorageError (exit 5) and report nothing else
    # (a differential audit against the Spark audit).
    path, where = damaged
    write_meta(path, puts={keys.ID_HWM_KEY: b"\x91\xa1x"})  # msgpack ["x"]
    report = check_path(path)
    assert [(f.kind, f.detail) for f in report.findings] == [
        ("bad_record", "M id_hwm record does not decode: unsupported id record version: "
                       "['x']")]
    assert report.messages == len({w[1] for w in where.values()})  # the rest was checked


def test_orphan_segment_file_is_found(tmp_path: Any, clock: FakeClock) -> None:
    path = str(tmp_path / "store")
    with qstore.open(path, clock=clock, compactor=False, segment_max_bytes=SEGMENT_MAX) as s:
        q = s.create_queue("q")
        first = q.push(b"x" * 3000)
        q.push(b"y" * 3000)  # rotates: segment 1 is sealed
        msg = q.pop()
        assert msg is not None and msg.id == first
        q.ack(msg)
        s.compact()  # deletes segment 1, which holds nothing live
        assert 1 not in s.core.payload.file_ids()
    body = b"lost bytes"
    with open(seg_path(path, 1), "wb") as f:
        f.write(fmt.encode_header(1) + fmt.encode_frame(body) + body)
    report = check_path(path)
    assert kinds(report) == [("orphan_segment", None, None, 1)]


def test_damaged_segment_header_names_the_segment_and_its_messages(
        damaged: tuple[str, dict[str, Any]]) -> None:
    path, where = damaged
    fid = where["a4"][2]
    with open(seg_path(path, fid), "r+b") as f:
        f.seek(2)
        f.write(b"X")
    in_it = [(q, m) for q, m, f, _ in where.values() if f == fid]
    report = check_path(path)
    assert kinds(report) == ordered([("bad_segment_header", q, m, fid) for q, m in in_it]
                                   + [("bad_segment_header", None, None, fid)])
    assert {f.detail for f in report.findings} == {fmt.BAD_MAGIC}


def test_message_record_that_does_not_decode_is_a_bad_record(
        damaged: tuple[str, dict[str, Any]]) -> None:
    path, where = damaged
    _, mid, _, _ = where["a6"]
    write_meta(path, puts={keys.message_key(1, mid): b"\xc1garbage"})
    report = check_path(path)
    # The message is gone from every recount, so its counters and segment disagree too.
    assert ("bad_record", "a", mid, None) in kinds(report)
    assert {f.kind for f in report.findings} == {"bad_record", "counter_mismatch",
                                                 "segment_record_mismatch"}


def test_a_message_record_whose_enqueued_at_is_not_a_number_is_a_bad_record(
        damaged: tuple[str, dict[str, Any]]) -> None:
    # It passed the check, and an aging queue's pass then raised TypeError on it.
    path, where = damaged
    _, mid, _, _ = where["a6"]
    fields = records.unpack(_stored_record(path, mid), "message",
                            (records.RECORD_VERSION, records.RECORD_VERSION_2))
    fields[8] = "x"  # enqueued_at
    write_meta(path, puts={keys.message_key(1, mid): records.pack(fields)})
    report = check_path(path)
    assert ("bad_record", "a", mid, None) in kinds(report)
    assert any("enqueued_at" in f.detail for f in report.findings)


def test_snapshot_checks_clean_and_a_damaged_one_does_not(tmp_path: Any,
                                                          clock: FakeClock) -> None:
    path = str(tmp_path / "store")
    build(path, clock)
    snap = str(tmp_path / "snap")
    with qstore.open(path, clock=clock, compactor=False) as s:
        s.snapshot(snap)
        s.queue("a").push(b"after the snapshot")  # the live store moves on
        report = check_path(snap)
        assert report.ok, report.findings
        assert report.messages == 11
    fid = max(int(n[:10]) for n in os.listdir(os.path.join(snap, "payload")))
    shutil.copy(seg_path(snap, fid), seg_path(snap, fid) + ".bak")
    os.unlink(seg_path(snap, fid))
    assert "missing_segment" in {f.kind for f in check_path(snap).findings}


@pytest.mark.parametrize("through", ["store", "view"])
def test_a_snapshot_links_a_damaged_segment_and_its_check_names_the_same_damage(
        tmp_path: Any, clock: FakeClock, through: str) -> None:
    """A segment whose header is damaged is a file of the store like any other: the
    snapshot links it and lists it, so its check says ``bad_segment_header`` as the
    store's does. Before, the snapshot left it out without a word and its check said
    ``missing_segment`` (not listed in the manifest) instead."""
    path = str(tmp_path / "store")
    where = build(path, clock)
    fid = where["a0"][2]
    with open(seg_path(path, fid), "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 1]))
    size = os.path.getsize(seg_path(path, fid))
    store_report = check_path(path)
    assert ("bad_segment_header", None, None, fid) in kinds(store_report)
    snap = str(tmp_path / "snap")
    if through == "store":
        r = CliRunner().invoke(main, ["snapshot", path, snap])
        assert r.exit_code == 0, r.output
    else:
        with qstore.open(path, compactor=False), qstore.open(path, readonly=True) as view:
            view.snapshot(snap)
    assert {"file_id": fid, "length": size} in read_manifest(snap)["segments"]
    assert os.stat(seg_path(snap, fid)).st_ino == os.stat(seg_path(path, fid)).st_ino
    snap_report = check_path(snap)
    assert [(f.kind, f.queue, f.message_id, f.file_id, f.offset, f.detail)
            for f in snap_report.findings] == [
        (f.kind, f.queue, f.message_id, f.file_id, f.offset, f.detail)
        for f in store_report.findings]
    assert snap_report.by_kind() == {"bad_segment_header": 1 + sum(
        w[2] == fid for w in where.values())}
    with qstore.open(snap, readonly=True) as view, pytest.raises(  # read as the store does
            qstore.Corruption, match="bad magic"):
        view.queue("a").get(where["a0"][1])


_KILLED_SNAPSHOT = """
import os, sys
import qstore
from qstore import _snapshot
real = getattr(_snapshot, {name!r}, None)
def killed(*args, **kwargs):
    if {after!r}:
        real(*args, **kwargs)
    os._exit(9)
setattr(_snapshot, {name!r}, killed)
with qstore.open(sys.argv[1], compactor=False) as s:
    s.snapshot(sys.argv[2])
"""


def _snapshot_killed(path: str, dest: str, name: str, *, after: bool = False) -> None:
    """A snapshot of ``path`` to ``dest`` in a child process that dies (exit 9) at its
    first call of ``_snapshot.<name>`` (``after``: once that call returned)."""
    child = subprocess.run([sys.executable, "-c", _KILLED_SNAPSHOT.format(name=name,
                                                                          after=after),
                            path, dest], capture_output=True, text=True, timeout=120)
    assert child.returncode == 9, child.stderr


def test_a_snapshot_cut_short_by_a_kill_is_named_and_taken_again_in_its_place(
        tmp_path: Any, clock: FakeClock) -> None:
    # A snapshot whose process died left its directory (meta/, payload/, no
    # manifest) behind: `qstore check` said "not a qstore store or snapshot",
    # and a snapshot to it again was refused, "exists and is not empty"
    # (durability audit). A child process dies right before the manifest.
    path, snap = str(tmp_path / "store"), str(tmp_path / "snap")
    build(path, clock)
    _snapshot_killed(path, snap, "write_json_durably")  # checkpoint and links written
    assert sorted(os.listdir(snap)) == [".qstore-snapshot-unfinished", "meta", "payload"]
    r = CliRunner().invoke(main, ["check", snap])
    assert r.exit_code == 2 and "cut short" in r.output
    with qstore.open(path, clock=clock, compactor=False) as s:
        s.snapshot(snap)
    assert sorted(os.listdir(snap)) == ["MANIFEST.json", "meta", "payload"]
    report = check_path(snap)
    assert report.ok and report.messages == 11, report.findings
    # A directory that is not one of ours is never emptied.
    other = tmp_path / "other"
    (other / "payload").mkdir(parents=True)
    (other / "notes.txt").write_text("mine")
    with qstore.open(path, clock=clock, compactor=False) as s, \
            pytest.raises(qstore.InvalidArgument, match="not empty"):
        s.snapshot(str(other))
    assert sorted(os.listdir(other)) == ["notes.txt", "payload"]


def test_a_planted_snapshot_marker_empties_no_directory(tmp_path: Any, clock: FakeClock) -> None:
    # Any directory holding the marker (and no manifest) was taken for a killed
    # snapshot and emptied, subdirectories too: a client of a server could plant
    # it in a directory it may write (a sticky /tmp) and have the server delete
    # others' files there (a security audit).
    path = str(tmp_path / "store")
    build(path, clock)
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "sub" / "keep.db").write_text("theirs")
    (victim / "notes.txt").write_text("theirs")
    (victim / ".qstore-snapshot-unfinished").write_bytes(b"")
    with qstore.open(path, clock=clock, compactor=False) as s, \
            pytest.raises(qstore.InvalidArgument, match=r"also holds \['notes.txt', 'sub'\]"):
        s.snapshot(victim)
    assert sorted(os.listdir(victim)) == [".qstore-snapshot-unfinished", "notes.txt", "sub"]
    assert (victim / "sub" / "keep.db").read_text() == "theirs"
    # A marker another user made is not this process's either.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / ".qstore-snapshot-unfinished").write_bytes(b"")
    os.chown(theirs / ".qstore-snapshot-unfinished", 65534, 65534)
    with qstore.open(path, clock=clock, compactor=False) as s, \
            pytest.raises(qstore.InvalidArgument, match="belongs to user 65534"):
        s.snapshot(theirs)
    assert os.listdir(theirs) == [".qstore-snapshot-unfinished"]


def test_a_snapshot_killed_in_its_checkpoint_is_taken_again_in_place(
        tmp_path: Any, clock: FakeClock) -> None:
    # RocksDB's checkpoint stages in meta.tmp (a view's export writes
    # meta.export.sst): a snapshot killed there was refused its retake, "it also
    # holds ['meta.tmp']" (a review of the marker check).
    path, snap = str(tmp_path / "store"), tmp_path / "snap"
    build(path, clock)
    (snap / "meta.tmp").mkdir(parents=True)
    (snap / "meta.tmp" / "000001.sst").write_bytes(b"half")
    (snap / "payload").mkdir()
    (snap / ".qstore-snapshot-unfinished").write_bytes(b"")
    with qstore.open(path, clock=clock, compactor=False) as s:
        s.snapshot(str(snap))
    assert sorted(os.listdir(snap)) == ["MANIFEST.json", "meta", "payload"]
    assert check_path(str(snap)).ok


def test_an_unfinished_snapshot_is_never_opened_and_stays_marked_until_gone(
        tmp_path: Any, clock: FakeClock) -> None:
    # A read-write open of a killed snapshot was accepted: its segments are hard
    # links to the live store's, and its close cut the shared active segment, so
    # 200 pushes of the live store read back damaged. And a kill while a new
    # snapshot replaced it could remove the marker first, leaving meta/ and
    # payload/ that `qstore check` called a clean store (crash audit).
    path, snap = str(tmp_path / "store"), str(tmp_path / "snap")
    build(path, clock)
    _snapshot_killed(path, snap, "write_json_durably")  # checkpoint and links written
    sizes = {n: os.path.getsize(os.path.join(path, "payload", n))
             for n in os.listdir(os.path.join(path, "payload"))}
    for readonly in (False, True):
        with pytest.raises(qstore.InvalidArgument, match="cut short"):
            qstore.open(snap, readonly=readonly, compactor=False)
    assert {n: os.path.getsize(os.path.join(path, "payload", n)) for n in sizes} == sizes
    _snapshot_killed(path, snap, "remove_paths", after=True)  # after its first removal
    assert os.listdir(snap) == [".qstore-snapshot-unfinished"]  # the marker goes last
    assert CliRunner().invoke(main, ["check", snap]).exit_code == 2
    empty = str(tmp_path / "made")
    _snapshot_killed(path, empty, "open")  # as it makes the marker, the first thing in it
    assert os.listdir(empty) == []  # nothing before the marker: taken again in place
    with qstore.open(path, clock=clock, compactor=False) as s:
        s.snapshot(snap)
        s.snapshot(empty)
    for done in (snap, empty):
        report = check_path(done)
        assert report.ok and report.messages == 11, report.findings


def test_a_snapshot_destination_that_is_empty_or_inside_the_store_is_refused(
        tmp_path: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    # os.path.exists("") is False: an empty destination was written into the
    # current directory (security audit); one inside the store put a copy of
    # the store into its own directories.
    path = str(tmp_path / "store")
    build(path, clock)
    monkeypatch.chdir(tmp_path)
    with qstore.open(path, clock=clock, compactor=False) as s:
        for dest in ("", os.path.join(path, "payload", "snap"), path):
            with pytest.raises(qstore.InvalidArgument):
                s.snapshot(dest)
    assert sorted(os.listdir(tmp_path)) == ["store"]
    assert "snap" not in os.listdir(os.path.join(path, "payload"))


def test_a_snapshot_refuses_a_read_write_open_and_a_copy_of_it_is_a_store(
        tmp_path: Any, clock: FakeClock) -> None:
    # Its segments are hard links to the live store's, the active one included:
    # a read-write open cut that file's tail under the live writer (pushes that
    # had returned then read as Corruption). A copy (files, not links) without
    # its manifest opens as a store of its own.
    path, snap, copy = (str(tmp_path / n) for n in ("store", "snap", "copy"))
    with qstore.open(path, clock=clock, compactor=False) as live:
        q = live.create_queue("q")
        before = [q.push(b"before %d" % i) for i in range(5)]
        live.snapshot(snap)
        with pytest.raises(qstore.InvalidArgument, match="is a snapshot"):
            qstore.open(snap, clock=clock, compactor=False)
        r = CliRunner().invoke(main, ["push", snap, "q", "x"])
        assert r.exit_code == 2 and "snapshot" in r.output
        after = [q.push(b"after %d" % i) for i in range(5)]
        assert [q.get(m).payload for m in before + after] == (
            [b"before %d" % i for i in range(5)] + [b"after %d" % i for i in range(5)])
        assert live.check().ok
    assert check_path(snap).ok
    shutil.copytree(snap, copy)
    os.unlink(os.path.join(copy, "MANIFEST.json"))
    with qstore.open(copy, clock=clock, compactor=False) as restored:
        got = restored.queue("q").pop_many(10)
        assert [m.payload for m in got] == [b"before %d" % i for i in range(5)]
        assert restored.check().ok


def test_a_snapshot_through_a_view_stays_whole_when_the_writer_closes(
        tmp_path: Any, clock: FakeClock) -> None:
    """The writer's active segment, seen by a view, still has its preallocated
    zeros, which the writer's close cuts off in the hard-linked file too: the
    manifest (and the view's stats) list the data the records refer to, not the
    file size."""
    path, snap = str(tmp_path / "store"), str(tmp_path / "snap")
    with qstore.open(path, clock=clock, compactor=False) as s:
        q = s.create_queue("q")
        ids = [q.push(b"m%d" % i) for i in range(5)]
        s.core.meta.flush()
        data = fmt.HEADER_SIZE + sum(fmt.FRAME_SIZE + len(b"m%d" % i) for i in range(5))
        with qstore.open(path, readonly=True) as view:
            view.snapshot(snap)
            (seg,) = view.stats().segments  # its size and garbage: the data, not the zeros
            assert (seg.size, seg.live_bytes, seg.garbage_ratio) == (data, data - 24, 0.0)
        q.push(b"after the snapshot")
    assert read_manifest(snap)["segments"][0]["length"] == data
    report = check_path(snap)
    assert report.ok, report.findings
    with qstore.open(snap, readonly=True) as opened:
        assert [m.id for m in opened.queue("q").peek(10)] == ids


def test_a_view_checks_and_snapshots_while_the_writer_rotates_compacts_and_deletes(
        tmp_path: Any, clock: FakeClock) -> None:
    """A view's check saw the writer's later segments as orphans and its deleted
    dead ones as missing; its snapshot failed on a segment the writer had deleted,
    and (RocksDB's checkpoint of a read-only instance leaves its memtable out)
    held none of what the writer had not flushed: no queue at all."""
    path, snap = str(tmp_path / "store"), str(tmp_path / "snap")
    with qstore.open(path, clock=clock, compactor=False, segment_max_bytes=4096) as w:
        q = w.create_queue("q")
        for i in range(40):
            q.push(b"%03d" % i * 50, priority=i % 5)
        got = q.pop_many(40)
        q.ack_many(got[:30])  # sealed segments with nothing live: S records, files
        with qstore.open(path, readonly=True) as view:
            want = {m.id: m.payload for m in view.queue("q").peek(100)}
            for i in range(40):
                q.push(b"late %03d" % i * 40)  # rotates: segments the view never saw
            result = w.compact(threshold=0.1)
            assert result.segments_deleted  # files the view pinned are gone
            assert view.check().findings == ()
            view.snapshot(snap)
        assert w.check().ok
    report = check_path(snap)
    assert report.ok, report.findings
    with qstore.open(snap, readonly=True) as opened:
        oq = opened.queue("q")
        assert {m.id: m.payload for m in oq.peek(100)} == want
        assert oq.stats().in_flight == 10


def test_unfinished_compaction_is_a_note_not_a_finding(damaged: tuple[str, dict[str, Any]]
                                                       ) -> None:
    path, _ = damaged
    write_meta(path, puts={keys.COMPACTION_KEY: records.pack([1, "copying", 77, [1]])})
    report = check_path(path)
    assert report.ok
    assert [(n.kind, n.file_id) for n in report.notes] == [("compaction_in_progress", 77)]


def test_cli_check_exits_0_clean_and_1_with_a_table_of_findings(
        damaged: tuple[str, dict[str, Any]], tmp_path: Any) -> None:
    path, where = damaged
    runner = CliRunner()
    clean = runner.invoke(main, ["check", path])
    assert clean.exit_code == 0, clean.output
    assert clean.output.startswith("clean: 11 messages in 2 queues")
    _, mid, fid, off = where["a1"]
    with open(seg_path(path, fid), "r+b") as f:
        f.seek(off + fmt.FRAME_SIZE)
        f.write(b"!")
    found = runner.invoke(main, ["check", path])
    assert found.exit_code == 1, found.output
    assert "1 findings" in found.output and "crc_mismatch" in found.output
    assert f"message {mid}" in found.output
    missing = runner.invoke(main, ["check", str(tmp_path / "nothing")])
    assert missing.exit_code == 2


@pytest.mark.parametrize(("damage", "code", "kind"), [
    (b'{"format": 1, "kind": "qstore-snap', 5, qstore.Corruption),  # cut in half
    (b"\xff\xfe not utf-8", 5, qstore.Corruption),
    (b'{"format": 1, "kind": "qstore-snapshot", "active_id": 2, "created_at": 1.0, '
     b'"segments": [{"file_id": 1, "length": "abc"}]}', 5, qstore.Corruption),
    (b'{"format": 1, "kind": "qstore-snapshot", "active_id": 2, "created_at": 1.0}',
     5, qstore.Corruption),  # no segments
    (b'{"format": 9, "kind": "qstore-snapshot", "segments": []}', 2,
     qstore.InvalidArgument),  # a later format: not readable here, not damage
    (b"[1, 2]", 2, qstore.InvalidArgument),  # not a manifest at all
])
def test_a_damaged_snapshot_manifest_is_named_not_a_traceback(
        tmp_path: Any, clock: FakeClock, damage: bytes, code: int, kind: type) -> None:
    path, snap = str(tmp_path / "store"), str(tmp_path / "snap")
    with qstore.open(path, clock=clock, compactor=False) as s:
        s.create_queue("q").push(b"x")
        s.snapshot(snap)
    assert check_path(snap).ok
    with open(os.path.join(snap, "MANIFEST.json"), "wb") as f:
        f.write(damage)
    with pytest.raises(kind) as info:
        read_manifest(snap)
    assert "MANIFEST.json" in str(info.value)
    r = CliRunner().invoke(main, ["check", snap])
    assert r.exit_code == code, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)  # no traceback
    assert "MANIFEST.json" in r.output.replace("\n", "")  # (the console wraps lines)


def test_a_segment_the_check_cannot_read_is_a_storage_error_not_a_finding(
        tmp_path: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    # EACCES (tests run as root, which permissions do not stop: the file call
    # fails by injection). The check could not run: exit 5, never exit 1 or a
    # traceback, and the error is a QStoreError with the errno.
    path = str(tmp_path / "store")
    with qstore.open(path, clock=clock, compactor=False) as s:
        s.create_queue("q").push(b"x")
    faulty = FaultyCalls(monkeypatch, ("open_fd",), err=errno.EACCES,
                         only=lambda name, args: str(args[0]).endswith(".seg"))
    faulty.arm(1, persistent=True)
    with pytest.raises(qstore.StorageError) as info:
        check_path(path)
    assert getattr(info.value, "errno", None) == errno.EACCES
    assert "0000000001.seg" in str(info.value)
    r = CliRunner().invoke(main, ["check", path])
    assert r.exit_code == 5, r.output
    assert "Permission denied" in r.output.replace("\n", " ")


def _ttl_store(path: str, clock: FakeClock) -> dict[str, int]:
    """A closed store whose queue "t" has TTL messages ready, delayed and in flight,
    one without a TTL, and a dead letter whose TTL was dropped when it died."""
    with qstore.open(path, clock=clock, compactor=False) as s:
        t = s.create_queue("t", ttl=100, on_expire="dead", max_attempts=1)
        ids = {"ready": t.push(b"r", ttl=50), "delayed": t.push(b"d", delay=10),
               "plain_ttl": t.push(b"q"), "flight": t.push(b"f", priority=9)}
        s.configure_queue("t", ttl=None)
        ids["no_ttl"] = t.push(b"n")
        ids["dead"] = t.push(b"x", priority=10)
        dead = t.pop(lease=1)
        assert dead is not None and dead.id == ids["dead"]
        clock.advance(2)  # its lease ran out on its last attempt: a dead letter
        flight = t.pop(lease=30)
        assert flight is not None and flight.id == ids["flight"]
        assert t.stats().dead == 1 and t.stats().in_flight == 1
        assert s.check().ok
    return ids


def _stored_record(path: str, mid: int) -> bytes:
    """The message record of message ``mid`` of queue id 1, as stored."""
    meta = MetaDB(os.path.join(path, "meta"), readonly=True, store_path=path)
    try:
        raw = meta.get(keys.message_key(1, mid))
    finally:
        meta.close()
    assert raw is not None
    return raw


def _expires_us(path: str, mid: int) -> int:
    return records.MessageRecord.decode(_stored_record(path, mid)).expires_us


def test_expiry_index_missing_extra_and_mismatched_keys_are_named(
        tmp_path: Any, clock: FakeClock) -> None:
    path = str(tmp_path / "store")
    ids = _ttl_store(path, clock)
    qid = 1
    when = {role: _expires_us(path, ids[role]) for role in ("ready", "delayed", "flight")}
    assert all(when.values()) and _expires_us(path, ids["no_ttl"]) == 0
    assert _expires_us(path, ids["dead"]) == 0  # dead letters do not expire
    # Missing: the ready message's expiry key is deleted.
    write_meta(path, deletes=[keys.expiry_key(qid, when["ready"], ids["ready"])])
    report = check_path(path)
    assert kinds(report) == [("index_missing", "t", ids["ready"], None)]
    assert "expiry index" in report.findings[0].detail
    # Mismatched: the delayed message's key moved to another time.
    write_meta(path, puts={keys.expiry_key(qid, when["delayed"] + 1, ids["delayed"]): b""},
               deletes=[keys.expiry_key(qid, when["delayed"], ids["delayed"])])
    report = check_path(path)
    assert kinds(report) == ordered([("index_missing", "t", ids["ready"], None),
                                     ("index_missing", "t", ids["delayed"], None),
                                     ("stray_index_key", "t", ids["delayed"], None)])
    assert any("another expiry time" in f.detail for f in report.findings)


def test_expiry_keys_of_messages_without_ttl_dead_letters_and_no_message_are_stray(
        tmp_path: Any, clock: FakeClock) -> None:
    path = str(tmp_path / "store")
    ids = _ttl_store(path, clock)
    qid = 1
    t0 = keys.to_us(clock.now)
    write_meta(path, puts={
        keys.expiry_key(qid, t0, ids["no_ttl"]): b"",  # a message without a TTL
        keys.expiry_key(qid, t0, ids["dead"]): b"",  # a dead letter (they do not expire)
        keys.expiry_key(qid, t0, 999_999): b"",  # no message at all
        keys.prefix(keys.EXPIRY, qid) + b"\x00" * 9: b"",  # not e qid expires_us id
    })
    report = check_path(path)
    assert kinds(report) == ordered([("stray_index_key", "t", ids["no_ttl"], None),
                                     ("stray_index_key", "t", ids["dead"], None),
                                     ("stray_index_key", "t", 999_999, None),
                                     ("stray_index_key", "t", None, None)])
    details = {f.message_id: f.detail for f in report.findings}
    assert "has no TTL" in details[ids["no_ttl"]]
    assert "has no TTL" in details[ids["dead"]]
    assert "no message owns it" in details[999_999]
    assert "malformed" in details[None]


def test_dead_letter_with_an_expiry_time_and_bad_totals_record_are_findings(
        tmp_path: Any, clock: FakeClock) -> None:
    path = str(tmp_path / "store")
    ids = _ttl_store(path, clock)
    meta = MetaDB(os.path.join(path, "meta"), readonly=True, store_path=path)
    try:
        raw = meta.get(keys.message_key(1, ids["dead"]))
    finally:
        meta.close()
    assert raw is not None
    rec = records.MessageRecord.decode(raw)
    rec.expires_us = keys.to_us(clock.now + 5)
    write_meta(path, puts={keys.message_key(1, ids["dead"]): rec.encode(),
                           keys.expiry_key(1, rec.expires_us, ids["dead"]): b"",
                           keys.totals_key(1): b"\xc1"})
    report = check_path(path)
    found = kinds(report)
    assert ("bad_record", "t", ids["dead"], None) in found
    assert ("counter_mismatch", "t", None, None) in found
    bad = next(f for f in report.findings if f.kind == "bad_record")
    assert "dead letter has an expiry time" in bad.detail
    assert any("E record" in f.detail for f in report.findings)


def test_a_dead_letter_reason_that_is_not_a_str_is_a_finding_and_the_data_source_skips_it(
        tmp_path: Any, clock: FakeClock) -> None:
    path = str(tmp_path / "store")
    ids = _ttl_store(path, clock)
    key = keys.message_key(1, ids["dead"])
    meta = MetaDB(os.path.join(path, "meta"), readonly=True, store_path=path)
    try:
        raw = meta.get(key)
    finally:
        meta.close()
    assert raw is not None
    rec = records.MessageRecord.decode(raw)
    rec.reason = 7  # type: ignore[assignment]
    damaged = rec.encode()
    write_meta(path, puts={key: damaged})
    bad = [f for f in check_path(path).findings if f.kind == "bad_record"]
    assert [(f.message_id, "dead-letter reason is 7, not a str" in f.detail) for f in bad] == \
        [(ids["dead"], True)]
    good_ids, rows, skipped = checked_records([key, key], [raw, damaged], "int")
    assert good_ids == [ids["dead"]] and len(rows) == 1
    assert [b.message_id for b in skipped] == [ids["dead"]]


def test_a_check_that_a_close_overtakes_raises_store_closed(
        tmp_path: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    # check() looked at the store's state before it took the writer lock only: a
    # close() in between closed the database under it, and it raised
    # StorageError ("the metadata database is closed"; a race audit).
    path = str(tmp_path / "store")
    build(path, clock)
    store = qstore.open(path, clock=clock, compactor=False)
    real = type(store.core).check_open
    calls = []

    def overtaken(core: Any) -> None:
        real(core)
        if not calls:
            calls.append(1)
            store.close()  # as another thread's close() would, right here

    monkeypatch.setattr(type(store.core), "check_open", overtaken)
    with pytest.raises(qstore.StoreClosed):
        store.check()


def test_a_message_id_equal_to_the_id_hwm_is_above_it(damaged: tuple[str, dict[str, Any]]
                                                      ) -> None:
    # M id_hwm says every id below it was handed out: the largest id must be
    # below it, so a mark equal to that id is already one too low (a mutation
    # audit found the boundary unchecked: `>=` as `>` passed).
    path, where = damaged
    queue, top = max(((w[0], w[1]) for w in where.values()), key=lambda w: w[1])
    write_meta(path, puts={keys.ID_HWM_KEY: records.pack([records.RECORD_VERSION, top])})
    report = check_path(path)
    assert kinds(report) == [("id_above_hwm", queue, top, None)]
    assert f"ids below {top}" in report.findings[0].detail


def test_an_s_record_data_end_below_the_last_record_is_a_mismatch(
        damaged: tuple[str, dict[str, Any]]) -> None:
    # The S record's live bytes and count are right, its data end one byte short
    # of the last record a message refers to (a compaction trusts that end). A
    # mutation audit found the check of the end alone unchecked.
    path, where = damaged
    fid = where["a0"][2]
    meta = MetaDB(os.path.join(path, "meta"), readonly=True, store_path=path)
    try:
        live_bytes, count, end = records.decode_segment(meta.get(keys.segment_key(fid)) or b"")
    finally:
        meta.close()
    last = max(o + fmt.FRAME_SIZE + 1900 for _, _, f, o in where.values() if f == fid)
    assert end == last  # the a* payloads are 1900 bytes; the end is the last one's
    write_meta(path, puts={keys.segment_key(fid):
                           records.encode_segment(live_bytes, count, end - 1)})
    report = check_path(path)
    assert kinds(report) == [("segment_record_mismatch", None, None, fid)]
    assert f"past the S record's data end {end - 1}" in report.findings[0].detail


def _message_record(path: str, mid: int) -> tuple[bytes, records.MessageRecord]:
    """Queue "a"'s message ``mid``: its key and its decoded record."""
    meta = MetaDB(os.path.join(path, "meta"), readonly=True, store_path=path)
    try:
        key = keys.message_key(1, mid)
        return key, records.MessageRecord.decode(meta.get(key) or b"")
    finally:
        meta.close()


def _payloads(path: str, clock: FakeClock) -> dict[int, bytes]:
    with qstore.open(path, readonly=True, clock=clock) as view:
        q = view.queue("a")
        return {m.id: m.payload for m in [*q.peek(100), *q.dead_letters(100)]}


def test_a_lost_s_record_never_makes_the_open_delete_a_live_segment(
        damaged: tuple[str, dict[str, Any]], clock: FakeClock, caplog: Any) -> None:
    # A sealed segment with no S record counted as dead: the next read-write open
    # (a `check --repair` too) deleted the file, and the repair then buried every
    # message in it as damaged (a check-vs-audit differential). The open keeps it
    # and rebuilds the record from the messages that refer to it.
    path, where = damaged
    fid = where["a0"][2]
    assert fid != max(w[2] for w in where.values())  # sealed, not the active one
    before = _payloads(path, clock)
    write_meta(path, deletes=[keys.segment_key(fid)])
    report = check_path(path)
    assert kinds(report) == [("segment_record_mismatch", None, None, fid)]
    with qstore.open(path, clock=clock) as store:
        assert os.path.exists(seg_path(path, fid))
        assert store.check().ok
    assert f"segment {seg_path(path, fid)} has no S record, but" in caplog.text
    assert _payloads(path, clock) == before


def test_an_s_record_end_inside_a_record_never_cuts_a_sealed_segment(
        damaged: tuple[str, dict[str, Any]], clock: FakeClock, caplog: Any) -> None:
    # The open cut a sealed segment back to its S record's data end, which damage
    # had put inside a record: every record after it went, and the repair buried
    # their messages as damaged (a check-vs-audit differential). The file stays
    # whole now and the repair rebuilds the record.
    path, where = damaged
    fid = where["a0"][2]
    size = os.path.getsize(seg_path(path, fid))
    meta = MetaDB(os.path.join(path, "meta"), readonly=True, store_path=path)
    try:
        live_bytes, count, end = records.decode_segment(meta.get(keys.segment_key(fid)) or b"")
    finally:
        meta.close()
    write_meta(path, puts={keys.segment_key(fid):
                           records.encode_segment(live_bytes, count, fmt.HEADER_SIZE + 100)})
    before = _payloads(path, clock)
    with qstore.open(path, clock=clock) as store:
        assert os.path.getsize(seg_path(path, fid)) == size
        report = store.check(repair=True)
        assert report.ok and [r.kind for r in report.repairs] == ["segment_record_rebuilt"]
    assert "falls inside a record; the record was damaged, the file is left whole" in caplog.text
    assert _payloads(path, clock) == before


def test_two_messages_naming_one_record_are_an_overlap(damaged: tuple[str, dict[str, Any]],
                                                        clock: FakeClock) -> None:
    # Message a1's record pointed at a0's (same segment, same length): every read
    # was intact, and the check called the store clean while get(a1) returned
    # a0's bytes; the Spark audit said `overlap` (a check-vs-audit differential).
    path, where = damaged
    _, mid0, fid, off0 = where["a0"]
    _, mid1, fid1, _ = where["a1"]
    assert fid1 == fid
    key, rec = _message_record(path, mid1)
    rec.offset = off0
    write_meta(path, puts={key: rec.encode()})
    report = check_path(path)
    assert kinds(report) == [("overlap", "a", max(mid0, mid1), fid)]
    assert "overlaps an earlier record ending at" in report.findings[0].detail
    with qstore.open(path, clock=clock) as store:  # a repair cannot tell whose bytes
        assert [f.kind for f in store.check(repair=True).findings] == ["overlap"]


def test_a_message_id_of_2_63_or_more_is_a_bad_record_and_no_repair_hands_out_such_ids(
        damaged: tuple[str, dict[str, Any]], clock: FakeClock) -> None:
    # The check counted it as a message (the audit called it a bad record), and
    # its repair raised M id_hwm past 2**63: every later push was then an audit
    # finding (a check-vs-audit differential).
    path, where = damaged
    _, mid, _, _ = where["delayed"]
    meta = MetaDB(os.path.join(path, "meta"), readonly=True, store_path=path)
    try:
        raw = meta.get(keys.message_key(1, mid)) or b""
    finally:
        meta.close()
    huge = 2**63 + 5
    write_meta(path, puts={keys.message_key(1, huge): raw})
    report = check_path(path)
    assert kinds(report) == [("bad_record", "a", huge, None)]
    assert "is 2**63 or more" in report.findings[0].detail
    with qstore.open(path, clock=clock) as store:
        store.check(repair=True)
        assert store.queue("a").push(b"next") < 2**63


def test_undecodable_derived_records_are_repaired_and_a_queue_record_is_named(
        damaged: tuple[str, dict[str, Any]], clock: FakeClock) -> None:
    # A C, E or M compaction record that does not decode made every read-write
    # open (and so `check --repair`, which rebuilds them) fail with a bare msgpack
    # FormatError traceback; the check's detail was empty (a differential).
    path, _ = damaged
    before = _payloads(path, clock)
    with qstore.open(path, readonly=True, clock=clock) as view:
        stats = view.queue("a").stats()
    write_meta(path, puts={keys.counts_key(1): b"\xc1", keys.totals_key(1): b"\xc1",
                           keys.COMPACTION_KEY: b"\xc1"})
    details = {f.kind: f.detail for f in check_path(path).findings}
    assert "does not decode: FormatError" in details["counter_mismatch"]
    assert "does not decode: FormatError" in details["bad_compaction_record"]
    with qstore.open(path, clock=clock) as store:
        got = store.queue("a").stats()  # recounted from the message records
        assert (got.ready, got.delayed, got.in_flight, got.dead) == (
            stats.ready, stats.delayed, stats.in_flight, stats.dead)
        report = store.check(repair=True)
        assert report.ok, report.findings
    assert _payloads(path, clock) == before
    write_meta(path, puts={keys.queue_key("a"): b"\xc1"})  # a primary record
    with pytest.raises(qstore.StorageError, match="the record of queue 'a' .* is damaged"):
        qstore.open(path, clock=clock)


def test_a_record_offset_of_2_63_or_more_is_out_of_bounds_not_a_crash(
        damaged: tuple[str, dict[str, Any]]) -> None:
    # The overlap test's table of offsets is int64: such an offset raised
    # OverflowError out of the whole check (a review).
    path, where = damaged
    _, mid, _, _ = where["a3"]
    key, rec = _message_record(path, mid)
    rec.offset = 2**63 + 5
    write_meta(path, puts={key: rec.encode()})
    found = {(f.kind, f.message_id) for f in check_path(path).findings}
    assert ("out_of_bounds", mid) in found


def test_a_negative_expired_total_is_a_counter_mismatch(damaged: tuple[str, dict[str, Any]]
                                                        ) -> None:
    # An E record that decodes but counts -1 expired messages is damage, not a
    # count (a mutation audit found a negative total went unreported).
    path, _ = damaged
    write_meta(path, puts={keys.totals_key(1): records.encode_totals(-1)})
    report = check_path(path)
    assert kinds(report) == [("counter_mismatch", "a", None, None)]
    assert report.findings[0].detail == "E record: expired -1 < 0"


def test_a_store_format_this_version_does_not_read_is_refused_not_checked(
        damaged: tuple[str, dict[str, Any]]) -> None:
    # The check read a format 9 store as its own and called it clean, exit 0,
    # where an open refuses it (a review).
    path, _ = damaged
    write_meta(path, puts={keys.FORMAT_KEY: records.pack([records.RECORD_VERSION, 9])})
    with pytest.raises(qstore.StorageError, match="unsupported store format 9"):
        check_path(path)
