"""`store.check(repair=True)` and `qstore check --repair`.

Real damage: payload bytes flipped or a sealed segment cut on disk; index
keys deleted or added, counters and segment records skewed through the
metadata database. The repair must report exactly what it did, set the
damaged messages aside, leave every other message intact, and leave a check
that is clean but for notes of the damage set aside; on a clean store it
changes nothing.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest
from click.testing import CliRunner

import qstore
from qstore._check import check_path
from qstore.cli import main
from qstore.meta import keys, new_batch, records
from tests.faults._inject import FaultyCalls
from tests.queue._support import dump
from tests.test_check import write_meta

CRC = "damaged payload: record checksum mismatch"


def _rec(store: qstore.Store, q: qstore.Queue, mid: int) -> records.MessageRecord:
    raw = store.core.meta.get(keys.message_key(q._q.qid, mid))
    assert raw is not None
    return records.MessageRecord.decode(raw)


def _flip(store: qstore.Store, q: qstore.Queue, mid: int) -> None:
    rec = _rec(store, q, mid)
    path = os.path.join(store.path, "payload", f"{rec.file_id:010d}.seg")
    with open(path, "r+b") as f:
        f.seek(rec.offset + 8 + 2)
        b = f.read(1)
        f.seek(rec.offset + 8 + 2)
        f.write(bytes([b[0] ^ 0xFF]))


def _payload(i: int) -> bytes:
    return b"message %03d " % i * 4


def _damaged_store(path: str, clock: Any) -> dict[str, Any]:
    """A store with damaged payloads (ready, in flight, dead) and skewed derived state."""
    store = qstore.open(path, clock=clock, compactor=False)
    q = store.create_queue("q", max_attempts=1)
    other = store.create_queue("other")
    ids = q.push_many([(_payload(i), 5) for i in range(8)])
    other_ids = other.push_many([(_payload(100 + i), 1) for i in range(3)])
    # ids[0] dead (max_attempts=1, nacked), ids[1] in flight, the rest ready.
    first = q.pop()
    assert first is not None and first.id == ids[0]
    q.nack(first)
    second = q.pop()
    assert second is not None and second.id == ids[1]
    store.core.syncer.sync_now()
    for mid in (ids[0], ids[1], ids[2]):
        _flip(store, q, mid)
    # Derived state skewed behind the store's back, then reloaded by a reopen.
    qid, oqid = q._q.qid, other._q.qid
    rec5 = _rec(store, q, ids[5])
    missing_key = keys.ready_key(qid, keys.priority_key("max", "int", 5), ids[5])
    stray_key = keys.ready_key(oqid, keys.priority_key("max", "int", 1), 999)
    batch = new_batch()
    batch.delete(missing_key)
    batch.put(stray_key, b"")
    batch.put(keys.counts_key(oqid), records.encode_counts([7, 0, 0, 0, 1]))
    batch.put(keys.segment_key(rec5.file_id), records.encode_segment(1, 1, 4000))
    store.core.meta.write(batch, sync=True)
    seg_size = store.core.payload.segment_size(rec5.file_id)
    store.close()
    return {"ids": ids, "other_ids": other_ids, "missing_key": missing_key,
            "stray_key": stray_key, "fid": rec5.file_id, "seg_size": seg_size}


def _summary(report: qstore.CheckReport) -> set[tuple[str, Any, Any]]:
    return {(r.kind, r.queue, r.message_id) for r in report.repairs}


def _assert_intact(store: qstore.Store, info: dict[str, Any]) -> None:
    q, other = store.queue("q"), store.queue("other")
    for i, mid in enumerate(info["ids"][3:], start=3):
        assert q.get(mid).payload == _payload(i)
    for i, mid in enumerate(info["other_ids"]):
        assert other.get(mid).payload == _payload(100 + i)
    dead = {m.id: m.dead_reason for m in q.dead_letters(10)}
    assert dead == {mid: CRC for mid in info["ids"][:3]}


def test_repair_sets_damage_aside_and_rebuilds_derived_state(store_path: str,
                                                             clock: Any) -> None:
    info = _damaged_store(store_path, clock)
    ids = info["ids"]
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        before = store.check()
        assert before.by_kind() == {"counter_mismatch": 1, "crc_mismatch": 3,
                                    "index_missing": 1, "segment_record_mismatch": 1,
                                    "stray_index_key": 1}
        report = store.check(repair=True)
        assert _summary(report) == {
            ("moved_aside", "q", ids[1]), ("moved_aside", "q", ids[2]),
            ("reason_recorded", "q", ids[0]),
            ("index_key_added", None, None), ("index_key_removed", None, None),
            ("counters_rebuilt", "other", None),
            ("segment_record_rebuilt", None, None),
        }
        added = [r for r in report.repairs if r.kind == "index_key_added"]
        removed = [r for r in report.repairs if r.kind == "index_key_removed"]
        assert [r.detail for r in added] == [f"key {info['missing_key'].hex()}"]
        assert removed[0].detail.startswith(f"key {info['stray_key'].hex()}")
        moved = {r.message_id: r.detail for r in report.repairs if r.kind == "moved_aside"}
        assert moved == {ids[1]: f"in_flight -> dead letters: {CRC}",
                         ids[2]: f"ready -> dead letters: {CRC}"}
        # Clean after it, but for notes of the damage set aside.
        assert report.ok, report.findings
        assert sorted(n.message_id for n in report.notes
                      if n.kind == "damaged_set_aside") == ids[:3]
        _assert_intact(store, info)
        q = store.queue("q")
        st = q.stats()
        assert (st.ready, st.in_flight, st.dead) == (5, 0, 3)
        assert store.queue("other").stats().ready == 3
        # The restored ready key pops again; the stray one popped nothing.
        assert sorted(m.id for m in q.pop_many(10)) == ids[3:]
        assert store.check().ok
        # A second repair finds nothing to do and changes nothing.
        snapshot = dump(store)
        again = store.check(repair=True)
        assert again.repairs == () and again.ok
        assert dump(store) == snapshot
    with qstore.open(store_path, readonly=True) as view:  # and it all survives a reopen
        assert view.check().ok


def test_repair_of_a_clean_store_changes_nothing(store_path: str, clock: Any) -> None:
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        q = store.create_queue("q")
        q.push_many([(_payload(i), i % 3) for i in range(20)])
        m = q.pop()
        assert m is not None
        before = dump(store)
        report = store.check(repair=True)
        assert report.ok and report.repairs == () and report.notes == ()
        assert dump(store) == before


def test_repair_on_a_read_only_view_is_refused(store_path: str) -> None:
    qstore.open(store_path).close()
    with qstore.open(store_path, readonly=True) as view, pytest.raises(qstore.ReadOnlyStore):
        view.check(repair=True)


@pytest.mark.parametrize("lost", [2, 1], ids=["all-lost", "some-lost"])
def test_repair_leaves_a_segment_record_whose_messages_may_be_lost(store_path: str,
                                                                   clock: Any, lost: int) -> None:
    """Live records in S but no message record refers to them: never lowered (so never
    deleted by compaction), reported as left. Also when only some were lost: a count
    lowered to the messages that are left would reach 0 once compaction moved them,
    and the file, with the lost messages' bytes, would be deleted."""
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        q = store.create_queue("q")
        ids = q.push_many([_payload(i) for i in range(2)])
        fid = _rec(store, q, ids[0]).file_id
        store.core.payload.seal()
        batch = new_batch()  # the message records are lost; S still counts them
        for mid in ids[:lost]:
            batch.delete(keys.message_key(q._q.qid, mid))
            batch.delete(keys.ready_key(q._q.qid, keys.priority_key("max", "int", 0), mid))
        left = len(ids) - lost
        batch.put(keys.counts_key(q._q.qid), records.encode_counts(
            [left, 0, 0, 0, left * len(_payload(0))]))
        store.core.meta.write(batch, sync=True)
    seg = os.path.join(store_path, "payload", f"{fid:010d}.seg")
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        report = store.check(repair=True)
        assert report.repairs == ()
        assert [(f.kind, f.file_id) for f in report.findings] == [
            ("segment_record_mismatch", fid)]
        store.compact(threshold=0.0)
        assert os.path.exists(seg)  # the bytes of the lost messages are still there
        assert [m.payload for m in store.queue("q").peek(5)] == [
            _payload(i) for i in range(lost, len(ids))]


def test_cli_check_repair_prints_what_it_did(store_path: str, clock: Any,
                                             tmp_path: Any) -> None:
    info = _damaged_store(store_path, clock)
    runner = CliRunner()
    r = runner.invoke(main, ["check", store_path])
    assert r.exit_code == 1
    r = runner.invoke(main, ["check", "--repair", store_path])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    repaired = [line for line in lines if line.startswith("repaired: ")]
    assert len(repaired) == 7
    assert (f"repaired: moved_aside: message {info['ids'][2]} in 'q' segment {info['fid']}"
            in r.output)
    assert "repaired: counters_rebuilt: queue 'other': [ready, delayed, in_flight, dead, " \
           "bytes] [7, 0, 0, 0, 1] -> [3, 0, 0, 0, 144]" in r.output
    assert any(line.startswith("clean: 11 messages in 2 queues") for line in lines)
    # "clean", and the headline says what is gone (it said only "clean").
    assert [line for line in lines if line.startswith("clean: ")][0].endswith(
        "; notes: 3 damaged_set_aside")
    assert sum(line.startswith("note: damaged_set_aside: ") for line in lines) == 3
    r = runner.invoke(main, ["check", store_path])  # the plain check: clean, with the notes
    assert r.exit_code == 0 and "note: damaged_set_aside" in r.output
    r = runner.invoke(main, ["check", "--repair", store_path])
    assert r.exit_code == 0 and "repaired: nothing to repair" in r.output
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        _assert_intact(store, info)
        snap = store.snapshot(os.path.join(str(tmp_path), "snap"))
    r = runner.invoke(main, ["check", "--repair", snap])
    assert r.exit_code == 2 and "snapshot" in r.output
    r = runner.invoke(main, ["check", "--repair", os.path.join(str(tmp_path), "nothing")])
    assert r.exit_code == 2
    assert not os.path.exists(os.path.join(str(tmp_path), "nothing"))


def test_repair_of_a_cut_sealed_segment_sets_its_lost_messages_aside(store_path: str,
                                                                     clock: Any) -> None:
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        q = store.create_queue("q")
        ids = q.push_many([_payload(i) for i in range(6)])
        fid = _rec(store, q, ids[0]).file_id
        cut_at = _rec(store, q, ids[4]).offset + 5  # inside message 4
        store.core.payload.seal()
    with open(os.path.join(store_path, "payload", f"{fid:010d}.seg"), "r+b") as f:
        f.truncate(cut_at)
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        assert "segment_truncated" in store.check().by_kind()
        report = store.check(repair=True)
        assert sorted(r.message_id for r in report.repairs if r.kind == "moved_aside") == \
            ids[4:]
        assert report.ok, report.findings
        kinds = sorted((n.kind, n.message_id or 0, n.file_id) for n in report.notes)
        assert kinds == [("damaged_set_aside", 0, fid), ("damaged_set_aside", ids[4], fid),
                         ("damaged_set_aside", ids[5], fid)]
        q = store.queue("q")
        assert [q.get(mid).payload for mid in ids[:4]] == [_payload(i) for i in range(4)]
        assert [m.dead_reason for m in q.dead_letters(10)] == [
            "damaged payload: reference points past the end of the segment"] * 2


def _retirable(store_path: str, clock: Any) -> str:
    """A store whose damaged segment 3 no message refers to any more; its path."""
    with qstore.open(store_path, clock=clock, compactor=False, segment_max_bytes=4096) as s:
        s.create_queue("q").push_many([_payload(i) * 10 for i in range(40)])
    seg = os.path.join(store_path, "payload", "0000000003.seg")
    _flip_header(seg)
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        store.check(repair=True)
        store.queue("q").purge()
        store.compact(threshold=0.0)
    return seg


def test_a_view_older_than_a_retirement_refuses_to_snapshot(
        store_path: str, clock: Any, tmp_path: Any) -> None:
    # The view's metadata still names the retired file: its snapshot left the file
    # out and kept the S record, a snapshot that never checked clean (a review).
    seg = _retirable(store_path, clock)
    with qstore.open(store_path, readonly=True) as view:
        with qstore.open(store_path, clock=clock, compactor=False) as store:
            assert [r.kind for r in store.check(repair=True).repairs] == ["segment_retired"]
        with pytest.raises(qstore.StorageError, match="retired by a repair"):
            view.snapshot(str(tmp_path / "old"))
        assert not os.path.exists(tmp_path / "old")  # nothing half made is left
    assert not os.path.exists(seg)
    with qstore.open(store_path, readonly=True) as view:  # a new view: clean
        view.snapshot(str(tmp_path / "new"))
    assert check_path(str(tmp_path / "new")).ok


def test_no_segment_is_retired_while_a_message_record_is_unreadable(
        store_path: str, clock: Any) -> None:
    # Such a record may name the segment, and is counted in none: with its S
    # record gone as well, the repair retired the file (a review, two faults).
    seg = _retirable(store_path, clock)
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        other = store.create_queue("r")
        mid = other.push(b"x")
        qid = store.core.queues["r"].qid
    write_meta(store_path, puts={keys.message_key(qid, mid): b"\xc1garbage"},
               deletes=[keys.segment_key(3)])
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        report = store.check(repair=True)
        assert "segment_retired" not in [r.kind for r in report.repairs]
        assert "bad_record" in report.by_kind()
    assert os.path.exists(seg)


def _flip_header(path: str) -> bytes:
    """Flip byte 5 of the segment file's header (its magic); the file's bytes after."""
    with open(path, "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 1]))
        f.seek(0)
        return f.read()


def test_repair_retires_a_damaged_segment_once_nothing_refers_to_it(
        store_path: str, clock: Any, tmp_path: Any) -> None:
    """A segment whose header is damaged stays while dead letters refer to it; once
    none does, the repair renames it to ``<segment>.damaged`` (bytes kept) and drops
    its S record, and the store checks clean: before, the check reported
    ``bad_segment_header`` for it forever, the repair having nothing to offer."""
    with qstore.open(store_path, clock=clock, compactor=False, segment_max_bytes=4096) as s:
        s.create_queue("q").push_many([_payload(i) * 10 for i in range(40)])
    name = "0000000003.seg"
    seg = os.path.join(store_path, "payload", name)
    kept = seg + ".damaged"
    damaged = _flip_header(seg)
    runner = CliRunner()
    r = runner.invoke(main, ["check", "--repair", store_path])
    assert r.exit_code == 0, r.output
    assert "repaired: moved_aside: " in r.output and "segment_retired" not in r.output
    assert os.path.exists(seg) and not os.path.exists(kept)  # dead letters refer to it
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        q = store.queue("q")
        assert q.stats().dead > 0
        q.purge()
        store.compact(threshold=0.0)
        assert os.path.exists(seg)  # never chosen by compaction, never deleted
        assert store.check().by_kind() == {"bad_segment_header": 1}
        report = store.check(repair=True)
        assert [(r.kind, r.file_id) for r in report.repairs] == [("segment_retired", 3)]
        assert report.repairs[0].detail == (
            f"header damaged (bad magic) and no message refers to it: {name} renamed to "
            f"{name}.damaged, its S record [0, 0, {len(damaged)}] removed")
        assert report.ok and report.notes == (), report.findings
        assert 3 not in store.core.segments and 3 not in store.core.payload.damaged
        q.push(b"after")
        assert store.check().ok
    assert not os.path.exists(seg)
    with open(kept, "rb") as f:  # the evidence, byte for byte
        assert f.read() == damaged
    r = runner.invoke(main, ["check", "--repair", store_path])
    assert r.exit_code == 0 and "repaired: nothing to repair" in r.output, r.output
    assert "orphan" not in r.output
    with qstore.open(store_path, readonly=True) as view:  # a view ignores it too
        assert view.check().ok
        assert [m.payload for m in view.queue("q").peek(5)] == [b"after"]
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        assert store.check().ok
        store.compact(threshold=0.0)
        snap = store.snapshot(os.path.join(str(tmp_path), "snap"))
    assert name + ".damaged" not in os.listdir(os.path.join(snap, "payload"))
    assert runner.invoke(main, ["check", snap]).exit_code == 0
    assert os.path.exists(kept)


@pytest.mark.parametrize("call", ["replace", "fsync"])
def test_a_retirement_that_fails_is_finished_by_the_next_repair(
        store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    """The rename failing leaves everything as it was; the directory fsync after it
    failing leaves the S record of a file that is gone, which the next repair removes.
    Either way the damaged bytes are kept and the store ends clean."""
    with qstore.open(store_path, clock=clock, compactor=False, segment_max_bytes=4096) as s:
        s.create_queue("q").push_many([_payload(i) * 10 for i in range(40)])
    seg = os.path.join(store_path, "payload", "0000000003.seg")
    damaged = _flip_header(seg)
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        store.check(repair=True)
        store.queue("q").purge()
        faults = FaultyCalls(monkeypatch, names=(call,), err=errno.EIO)
        faults.arm(1)
        with pytest.raises(qstore.StorageError) as raised:
            store.check(repair=True)
        assert raised.value.errno == errno.EIO and faults.failed == [call]
        faults.heal()
        after = store.check()
        if call == "replace":
            assert os.path.exists(seg) and after.by_kind() == {"bad_segment_header": 1}
            want = [("segment_retired", 3)]
        else:
            assert not os.path.exists(seg)
            assert [(f.kind, f.detail) for f in after.findings] == [
                ("missing_segment", "no file 0000000003.seg; 0 messages reference it, "
                                    "it has an S record")]
            want = [("segment_record_removed", 3)]
        report = store.check(repair=True)
        assert [(r.kind, r.file_id) for r in report.repairs] == want
        assert report.ok, report.findings
    with open(seg + ".damaged", "rb") as f:
        assert f.read() == damaged


def test_purge_of_a_queue_with_an_undecodable_record_says_which(store_path: str,
                                                                clock: Any) -> None:
    # A small queue's purge decoded records one by one and let msgpack's own
    # FormatError out (a review); a big one's said StorageError naming the key.
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        mid = store.create_queue("q").push(b"x")
        qid = store.core.queues["q"].qid
    write_meta(store_path, puts={keys.message_key(qid, mid): b"\xc1garbage"})
    with qstore.open(store_path, clock=clock, compactor=False) as store, \
            pytest.raises(qstore.StorageError, match=keys.message_key(qid, mid).hex()):
        store.queue("q").purge()
