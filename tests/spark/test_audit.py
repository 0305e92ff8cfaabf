"""The Spark audit: clean on a clean store, and each kind of real damage named precisely."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import qstore
from qstore._check import check_path
from qstore.cli import main as qstore_cli
from qstore.meta import MetaDB, keys, new_batch, records
from qstore.payload._format import segment_name
from qstore.payload._writer import SegmentWriter, create_segment_file
from qstore.spark._audit_checks import FINDINGS_SCHEMA, read_meta_facts
from qstore.spark._audit_merge import cross_task_overlaps, merge
from qstore.spark._audit_source import AUDIT_SCHEMA, audit_range
from qstore.spark._scan import scan_snapshot
from qstore.spark._snapshot_view import SCRATCH_PREFIX, Snapshot, plan_ranges
from qstore.spark._task_errors import task_corruption
from qstore.spark.audit import AuditResult, run_audit
from tests.conftest import FakeClock

from .conftest import Snap

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.spark

def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


BODY = 100  # every payload of the damaged store has this length, so two records can overlap


def test_clean_snapshot_audits_clean(spark: Any, clean_snap: Snap, tmp_path: Any,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    result = run_audit(clean_snap.path, spark=spark, out=str(tmp_path / "out"))
    assert (result.exit_code, result.findings) == (0, 0)
    assert "CLEAN" in capsys.readouterr().out
    summary = json.loads(_read(result.paths["summary"]))
    assert summary["clean"] and summary["exit_code"] == 0
    assert summary["messages"]["total"] == len(clean_snap.payloads)
    for name, st in clean_snap.stats.items():
        q = summary["queues"][name]
        assert q["match"] and q["recount"] == {"ready": st.ready, "delayed": st.delayed,
                                               "in_flight": st.in_flight, "dead": st.dead,
                                               "bytes": st.bytes}
    assert summary["queues"]["tags"]["index"]["dedup"] == {"keys": 12, "expected": 12}
    assert len(summary["segments"]) >= 3
    assert {(g["queue"], g["priority"]) for g in summary["payload_sizes"]} >= {
        ("jobs", 9), ("tags", "p0"), ("poison", 1)}
    table = pq.read_table(result.paths["findings"])
    assert table.num_rows == 0 and table.schema.equals(FINDINGS_SCHEMA)
    report = _read(result.paths["report"])
    assert report.count("<svg") == 2 and "Clean" in report and "tags" in report


@dataclass(frozen=True)
class Damage:
    """A damaged snapshot, the audit of it, and which message or segment got which damage."""

    result: AuditResult
    findings: list[dict[str, Any]]
    flipped: int  # message whose payload byte was flipped
    truncated: tuple[int, int]  # (segment, its last message) cut short
    deleted: tuple[int, list[int]]  # (segment, its messages) whose file was removed
    orphan: int  # segment file added with no reference and no S record
    overlapped: tuple[int, int]  # (message repointed, message whose bytes it now shares)
    unindexed: int  # message whose ready key was deleted
    stray: int  # message id of a ready key added with no message


@pytest.fixture(scope="module")
def damage(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Damage:
    base = tmp_path_factory.mktemp("damaged")
    with qstore.open(os.path.join(base, "store"), clock=FakeClock(), compactor=False,
                     segment_max_bytes=1200) as store:
        jobs = store.create_queue("jobs")
        jobs.push_many([(b"%-100d" % i, i % 10) for i in range(80)])
        tags = store.create_queue("tags", priority_type="str")
        tags.push_many([(b"%-100d" % i, "t") for i in range(5)])
        snap = store.snapshot(os.path.join(base, "snap"))
    # The snapshot's segments are hard links of the (closed) store's: damage them in place.
    rows = scan_snapshot(snap, queues=["jobs"]).to_pylist()
    by_seg: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_seg.setdefault(r["file_id"], []).append(r)
    segs = sorted(by_seg)
    assert len(segs) >= 6 and all(r["length"] == BODY for r in rows)

    flipped = by_seg[segs[0]][1]
    with open(os.path.join(snap, "payload", segment_name(segs[0])), "r+b") as f:
        f.seek(flipped["offset"] + 8 + 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    cut = os.path.join(snap, "payload", segment_name(segs[1]))
    os.truncate(cut, os.path.getsize(cut) - 5)
    os.unlink(os.path.join(snap, "payload", segment_name(segs[2])))
    orphan = max(segs) + 100
    orphan_path = os.path.join(snap, "payload", segment_name(orphan))
    create_segment_file(orphan_path, orphan)
    writer = SegmentWriter(orphan_path, orphan, 24, 1 << 20)
    writer.reserve(200)
    writer.append([b"nobody refers to me"])
    writer.finish()

    db = MetaDB(os.path.join(snap, "meta"), readonly=False, store_path=snap)
    qid_jobs, qid_tags = 1, 2
    mover, target = by_seg[segs[3]][0], by_seg[segs[3]][1]
    raw = db.get(keys.message_key(qid_jobs, mover["id"]))
    assert raw is not None
    rec = records.MessageRecord.decode(raw)
    rec.offset = target["offset"]
    damage = new_batch()
    damage.put(keys.message_key(qid_jobs, mover["id"]), rec.encode())
    unindexed = by_seg[segs[4]][0]
    pkey = keys.priority_key("max", "int", unindexed["priority_int"])
    damage.delete(keys.ready_key(qid_jobs, pkey, unindexed["id"]))
    stray = 999_999
    damage.put(keys.ready_key(qid_jobs, keys.priority_key("max", "int", 5), stray), b"")
    damage.put(keys.counts_key(qid_tags), records.encode_counts([99, 0, 0, 0, 123]))
    db.write(damage, sync=True)
    db.close()

    result = run_audit(snap, spark=spark, quiet=True)
    findings = pq.read_table(result.paths["findings"]).to_pylist()
    return Damage(result, findings, flipped["id"], (segs[1], by_seg[segs[1]][-1]["id"]),
                  (segs[2], [r["id"] for r in by_seg[segs[2]]]), orphan,
                  (mover["id"], target["id"]), unindexed["id"], stray)


def _of(damage: Damage, kind: str) -> list[dict[str, Any]]:
    return [f for f in damage.findings if f["kind"] == kind]


def test_flipped_payload_byte_is_a_crc_finding_for_that_message(damage: Damage) -> None:
    [f] = _of(damage, "crc_mismatch")
    assert (f["queue"], f["message_id"]) == ("jobs", damage.flipped)


def test_truncated_segment_is_a_bounds_finding_for_its_last_message(damage: Damage) -> None:
    fid, last = damage.truncated
    [f] = _of(damage, "out_of_bounds")
    assert (f["message_id"], f["file_id"]) == (last, fid)
    [seg] = _of(damage, "segment_truncated")
    assert seg["file_id"] == fid and seg["message_id"] is None


def test_deleted_segment_is_missing_for_each_of_its_messages(damage: Damage) -> None:
    fid, ids = damage.deleted
    found = _of(damage, "missing_segment")
    assert {f["file_id"] for f in found} == {fid}
    assert sorted(f["message_id"] for f in found if f["message_id"] is not None) == sorted(ids)
    assert [f for f in found if f["message_id"] is None]  # and once for the segment itself


def test_added_segment_file_is_an_orphan(damage: Damage) -> None:
    [f] = _of(damage, "orphan_segment")
    assert f["file_id"] == damage.orphan


def test_records_sharing_bytes_are_an_overlap(damage: Damage) -> None:
    mover, target = damage.overlapped
    [f] = _of(damage, "overlap")
    assert {f["message_id"], int(f["detail"].rsplit(" ", 1)[1].rstrip(")"))} == {mover, target}


def test_overlap_between_tasks_is_named_the_same_way(damage: Damage) -> None:
    # One message per task: the overlap can only be seen between tasks' runs.
    with Snapshot(damage.result.summary["snapshot"]) as snap:
        ranges = [r for r in plan_ranges(snap, partitions=10_000) if r.qid == 1]
        facts = merge(pa.Table.from_batches(
            [b for r in ranges for b in audit_range(snap, r)], schema=AUDIT_SCHEMA))
        assert not [f for f in facts.findings if f.kind == "overlap"]
        [f] = cross_task_overlaps(snap, facts.runs, {1: "jobs"})
    [expected] = _of(damage, "overlap")
    assert (f.kind, f.queue, f.message_id, f.detail) == (
        "overlap", "jobs", expected["message_id"], expected["detail"])


def test_missing_and_stray_index_keys_are_named(damage: Damage) -> None:
    [missing] = _of(damage, "index_missing")
    assert missing["message_id"] == damage.unindexed and "ready index" in missing["detail"]
    [stray] = _of(damage, "stray_index_key")
    assert (stray["queue"], stray["message_id"]) == ("jobs", damage.stray)


def test_wrong_counter_is_a_counter_finding(damage: Damage) -> None:
    [f] = _of(damage, "counter_mismatch")
    assert f["queue"] == "tags" and "ready: stored 99, recount 5" in f["detail"]


def test_damaged_audit_exits_1_and_reports_only_the_damage(damage: Damage) -> None:
    result = damage.result
    assert result.exit_code == 1 and result.findings == len(damage.findings)
    assert {f["kind"] for f in damage.findings} == {
        "crc_mismatch", "out_of_bounds", "segment_truncated", "missing_segment",
        "orphan_segment", "overlap", "index_missing", "stray_index_key", "counter_mismatch"}
    summary = json.loads(_read(result.paths["summary"]))
    assert summary["exit_code"] == 1 and summary["findings"]["total"] == result.findings
    assert set(summary["findings"]["by_kind"]) == {f["kind"] for f in damage.findings}
    assert not summary["queues"]["tags"]["match"]
    report = _read(result.paths["report"])
    assert "crc_mismatch" in report and "<svg" in report
    assert "FINDINGS" in result.text and "crc_mismatch" in result.text


def test_audit_command_exit_codes_for_bad_usage(tmp_path: Any) -> None:
    runner = CliRunner()
    assert runner.invoke(qstore_cli, ["audit", "--help"]).exit_code == 0
    assert runner.invoke(qstore_cli, ["audit"]).exit_code == 2
    bad = runner.invoke(qstore_cli, ["audit", str(tmp_path)])  # not a snapshot: no Spark
    assert bad.exit_code == 2 and "no MANIFEST.json" in bad.output


def test_audit_of_a_snapshot_in_a_store_format_it_does_not_read_exits_5(tmp_path: Any) -> None:
    # It read a format 9 snapshot as its own (a review); refused before Spark, it
    # exits 5 as check does, not 3 ("the audit could not complete").
    with qstore.open(str(tmp_path / "store"), compactor=False) as store:
        store.create_queue("q").push(b"x")
        snap = store.snapshot(str(tmp_path / "snap"))
    db = MetaDB(os.path.join(snap, "meta"), readonly=False, store_path=snap)
    batch = new_batch()
    batch.put(keys.FORMAT_KEY, records.pack([records.RECORD_VERSION, 9]))
    db.write(batch, sync=True)
    db.close()
    r = CliRunner().invoke(qstore_cli, ["audit", snap])
    assert r.exit_code == 5 and "unsupported store format 9" in r.output
    r = CliRunner().invoke(qstore_cli, ["check", snap])
    assert r.exit_code == 5 and "unsupported store format 9" in r.output


def test_the_spark_submit_entry_point_runs_the_qstore_audit_command(tmp_path: Any) -> None:
    entry = [sys.executable, str(ROOT / "spark" / "audit.py")]
    run = subprocess.run([*entry, "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Usage: spark-submit spark/audit.py")
    assert "--master" in run.stdout and "--quiet" in run.stdout
    run = subprocess.run([*entry, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "no MANIFEST.json" in run.stderr


def test_expiry_index_missing_extra_and_mismatched_keys_are_findings(
        spark: Any, tmp_path: Any) -> None:
    clock = FakeClock()
    with qstore.open(tmp_path / "store", clock=clock, compactor=False) as store:
        q = store.create_queue("q")
        ids = q.push_many([(b"m%d" % i, 0, 0.0, None, 100.0 + i) for i in range(6)])
        plain = q.push(b"no ttl")
        qid = store.core.queues["q"].qid
        snap = store.snapshot(str(tmp_path / "snap"))
    assert run_audit(snap, spark=spark, out=str(tmp_path / "a0"), quiet=True).exit_code == 0

    def exp(i: int) -> int:
        return keys.to_us(clock() + 100.0 + i)

    db = MetaDB(str(tmp_path / "snap" / "meta"), readonly=False, store_path=snap)
    batch = new_batch()
    batch.delete(keys.expiry_key(qid, exp(1), ids[1]))  # missing
    batch.delete(keys.expiry_key(qid, exp(4), ids[4]))  # mismatched: another time
    batch.put(keys.expiry_key(qid, exp(4) + 5, ids[4]), b"")
    batch.put(keys.expiry_key(qid, exp(0), plain), b"")  # extra: its message has no TTL
    db.write(batch, sync=True)
    db.close()
    result = run_audit(snap, spark=spark, out=str(tmp_path / "a1"), quiet=True)
    found = sorted((f["kind"], f["message_id"]) for f in result.summary["findings"]["examples"])
    assert found == sorted([("index_missing", ids[1]), ("index_missing", ids[4]),
                            ("stray_index_key", ids[4]), ("stray_index_key", plain)])
    missing = [f for f in result.summary["findings"]["examples"] if f["kind"] == "index_missing"]
    assert all("or its expiry key is missing" in f["detail"] for f in missing)
    strays = [f for f in result.summary["findings"]["examples"]
              if f["kind"] == "stray_index_key"]
    assert all(f["detail"].startswith("expiry index: ") for f in strays)
    assert result.summary["queues"]["q"]["index"]["expiry"] == {"keys": 6, "expected": 6}


def test_damage_already_set_aside_is_a_note_as_in_the_check(spark: Any, tmp_path: Any) -> None:
    """A segment cut inside a message, and a flipped byte in another: after a repair has
    moved both messages' damage to the dead letters, the audit is clean and names the
    damage as notes, as ``store.check()`` does; before it, both are findings."""
    clock = FakeClock()
    path = str(tmp_path / "s")
    with qstore.open(path, clock=clock, compactor=False) as store:
        q = store.create_queue("q")
        ids = q.push_many([b"%03d" % i * 30 for i in range(6)])
        recs = {mid: store.core.message_record(keys.message_key(q._q.qid, mid)) for mid in ids}
        fid = recs[ids[0]].file_id  # type: ignore[union-attr]
        cut_at = recs[ids[5]].offset + 5  # type: ignore[union-attr]
        flip_at = recs[ids[1]].offset + 20  # type: ignore[union-attr]
        store.core.payload.seal()
    seg = os.path.join(path, "payload", segment_name(fid))
    with open(seg, "r+b") as f:
        f.truncate(cut_at)
        f.seek(flip_at)
        byte = f.read(1)
        f.seek(flip_at)
        f.write(bytes([byte[0] ^ 0xFF]))

    def audit(name: str) -> AuditResult:
        with qstore.open(path, clock=clock, compactor=False) as store:
            snap = store.snapshot(str(tmp_path / name))
        return run_audit(snap, spark=spark, out=str(tmp_path / f"{name}-out"), quiet=True)

    before = audit("before")
    assert before.exit_code == 1
    assert {(f["kind"], f["message_id"]) for f in before.summary["findings"]["examples"]} >= {
        ("crc_mismatch", ids[1]), ("out_of_bounds", ids[5])}
    with qstore.open(path, clock=clock, compactor=False) as store:
        report = store.check(repair=True)
        assert report.ok
        check_notes = sorted((n.message_id or 0, n.file_id) for n in report.notes)
    after = audit("after")
    assert (after.exit_code, after.findings) == (0, 0), after.summary["findings"]["examples"]
    notes = after.summary["notes"]
    assert notes["total"] == len(check_notes) == 3
    assert sorted((n["message_id"] or 0, n["file_id"]) for n in notes["examples"]) == \
        check_notes == sorted([(0, fid), (ids[1], fid), (ids[5], fid)])
    assert all(n["kind"] == "damaged_set_aside" for n in notes["examples"])
    assert "notes: 3 damaged payloads already set aside" in after.text
    assert "Notes: 3 damaged payloads already set aside" in _read(after.paths["report"])


def test_a_snapshot_whose_segment_record_defers_pushes_audits_clean(
        spark: Any, tmp_path: Any) -> None:
    """A read-only view's snapshot keeps the writer's S record as it is: single
    pushes after it are counted by the audit apart (qstore/_seg_accounts.py)."""
    with qstore.open(tmp_path / "store", compactor=False, durability="none") as store:
        q = store.create_queue("q")
        for i in range(30):
            q.push(b"d%d" % i, priority=i % 3)
        store.core.meta.flush()
        with qstore.open(tmp_path / "store", readonly=True) as view:
            snap = view.snapshot(str(tmp_path / "snap"))
    with Snapshot(snap) as s:
        assert list(s.covered.values()) == [2]  # the record counts the first push only
    result = run_audit(snap, spark=spark, out=str(tmp_path / "out"), quiet=True)
    assert (result.exit_code, result.findings) == (0, 0), result.summary["findings"]
    (seg,) = result.summary["segments"]
    assert (seg["messages"], seg["stored_live_count"]) == (30, 30)
    # Damage below the covered id is still found: the first push's bytes miscounted.
    db = MetaDB(str(tmp_path / "snap" / "meta"), readonly=False, store_path=snap)
    ((key, value),) = list(db.scan(keys.SEGMENT, keys.prefix_end(keys.SEGMENT)))
    b, n, end = records.decode_segment(value)
    batch = new_batch()
    batch.put(key, records.encode_segment(b + 1, n, end, records.segment_covered(value)))
    db.write(batch, sync=True)
    db.close()
    bad = run_audit(snap, spark=spark, out=str(tmp_path / "out2"), quiet=True)
    assert [f["kind"] for f in bad.summary["findings"]["examples"]] == [
        "segment_record_mismatch"]


def test_malformed_keys_and_a_short_s_end_are_findings_as_in_the_check(
        spark: Any, tmp_path: Any) -> None:
    # A differential audit of the two checkers: an index key too short for an id,
    # a message key of the wrong length and a message id of 2**63 or more failed
    # the whole audit (exit 3; or made up an id), and an S record whose data end
    # is before records messages refer to went unseen (the check reports it).
    with qstore.open(str(tmp_path / "store"), clock=FakeClock(), compactor=False,
                     segment_max_bytes=1200) as store:
        jobs = store.create_queue("jobs")
        jobs.push_many([(b"%-100d" % i, i % 3) for i in range(30)])
        snap = store.snapshot(str(tmp_path / "snap"))
    first = min(r["file_id"] for r in scan_snapshot(snap, queues=["jobs"]).to_pylist())
    db = MetaDB(os.path.join(snap, "meta"), readonly=False, store_path=snap)
    seg = records.decode_segment(db.get(keys.segment_key(first)) or b"")
    any_id = keys.trailing_id(db.scan_keys(keys.prefix(keys.MESSAGE, 1),
                                            keys.prefix_end(keys.prefix(keys.MESSAGE, 1)), 1)[0])
    some = db.get(keys.message_key(1, any_id)) or b""
    batch = new_batch()
    batch.put(keys.prefix(keys.DELAYED, 1), b"")  # d qid: no time, no id
    batch.put(keys.message_key(1, 7) + b"\x01", some)  # one byte too many
    batch.put(keys.message_key(1, 2**63 + 5), some)
    batch.put(keys.MESSAGE + b"\x00\x01", some)  # no queue id: no partition read it
    # Too short, and last of its queue's keys: the audit's planning read an id out
    # of it and failed with struct.error, exit 3 (a second differential).
    tail_key = keys.prefix(keys.MESSAGE, 1) + b"\xff\xff"
    batch.put(tail_key, some)
    batch.put(keys.segment_key(first), records.encode_segment(seg[0], seg[1], seg[2] - 1))
    db.write(batch, sync=True)
    db.close()

    checked = {(f.kind, f.detail.split(":")[0]) for f in check_path(snap).findings}
    result = run_audit(snap, spark=spark, quiet=True)
    audited = pq.read_table(result.paths["findings"]).to_pylist()
    short = keys.prefix(keys.DELAYED, 1).hex()
    assert ("stray_index_key", f"delayed index key {short}") in checked
    assert [f["detail"] for f in audited if f["kind"] == "stray_index_key"] == [
        f"delayed index: index key {short}: malformed key"]
    long_key = (keys.message_key(1, 7) + b"\x01").hex()
    bad = sorted(f["detail"] for f in audited if f["kind"] == "bad_record")
    no_qid = (keys.MESSAGE + b"\x00\x01").hex()
    assert bad == sorted([f"message key {long_key} is not m qid:u32 id:u64",
                          f"message key {no_qid} is not m qid:u32 id:u64",
                          f"message key {tail_key.hex()} is not m qid:u32 id:u64",
                          f"message key {keys.message_key(1, 2**63 + 5).hex()}: id "
                          f"{2**63 + 5} is 2**63 or more, which no push hands out"])
    assert ("bad_record", f"message key {no_qid} is not m qid") in {
        (kind, detail.split(":u32")[0]) for kind, detail in checked}
    past = (f"messages refer to records up to offset {seg[2]}, past the S record's data end "
            f"{seg[2] - 1}")
    assert past in [f.detail for f in check_path(snap).findings]
    assert past in [f["detail"] for f in audited if f["file_id"] == first]


def test_segment_findings_agree_with_the_check_word_for_word(spark: Any, tmp_path: Any) -> None:
    """Every segment-level finding of the audit is the check's, in the same words: a
    damaged header, a file deleted under its messages, a
    dead segment's file deleted (listed, S record, nothing refers to it) and an S
    record of a file that neither exists nor is listed. The last two used to be
    worded by the audit alone ("listed in MANIFEST.json ... but absent from
    payload/", "S record for a segment that does not exist")."""
    path = str(tmp_path / "store")
    with qstore.open(path, clock=FakeClock(), compactor=False, segment_max_bytes=1200) as s:
        jobs = s.create_queue("jobs")
        ids = jobs.push_many([(b"%-100d" % i, 0) for i in range(60)])
        fids = {mid: s.core.message_record(keys.message_key(1, mid)).file_id  # type: ignore[union-attr]
                for mid in ids}
        by_seg: dict[int, list[int]] = {}
        for mid, fid in fids.items():
            by_seg.setdefault(fid, []).append(mid)
        segs = sorted(by_seg)
        assert len(segs) >= 5
        dead_seg, header_seg, deleted_seg = segs[0], segs[1], segs[2]
        done = jobs.pop_many(len(by_seg[dead_seg]))  # the first segment's, in push order
        assert sorted(m.id for m in done) == by_seg[dead_seg]
        jobs.ack_many(done)  # dead: an S record counting nothing, kept (no compactor)
        snap = s.snapshot(str(tmp_path / "snap"))
    # The snapshot's segments are hard links of the (closed) store's: damaged in place.
    with open(os.path.join(snap, "payload", segment_name(header_seg)), "r+b") as f:
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 1]))
    for fid in (dead_seg, deleted_seg):
        os.unlink(os.path.join(snap, "payload", segment_name(fid)))
    ghost = max(segs) + 50
    db = MetaDB(os.path.join(snap, "meta"), readonly=False, store_path=snap)
    batch = new_batch()
    batch.put(keys.segment_key(ghost), records.encode_segment(0, 0, 24))
    db.write(batch, sync=True)
    db.close()

    def segment_level(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        return sorted(r for r in rows if r[1] is None and r[2] is not None)

    checked = segment_level([(f.kind, f.message_id, f.file_id, f.detail)
                             for f in check_path(snap).findings])
    result = run_audit(snap, spark=spark, out=str(tmp_path / "out"), quiet=True)
    audited = segment_level([(f["kind"], f["message_id"], f["file_id"], f["detail"])
                             for f in pq.read_table(result.paths["findings"]).to_pylist()])
    name = segment_name
    assert checked == sorted([
        ("bad_segment_header", None, header_seg, "bad magic"),
        ("missing_segment", None, dead_seg, f"no file {name(dead_seg)}; 0 messages reference "
                                            "it, it has an S record, MANIFEST.json lists it"),
        ("missing_segment", None, deleted_seg, f"no file {name(deleted_seg)}; "
         f"{len(by_seg[deleted_seg])} messages reference it, it has an S record, "
         "MANIFEST.json lists it"),
        ("missing_segment", None, ghost, f"no file {name(ghost)}; 0 messages reference it, "
                                         "it has an S record"),
    ])
    assert audited == checked


def test_damaged_metadata_only_tasks_read_exits_5_naming_the_snapshots_file(
        spark: Any, tmp_path: Any) -> None:
    """Bytes flipped in a block of the metadata table that only executors read (message
    records; the driver's reads pass it by). The task's Corruption used to fail the
    job: exit 3, "the audit could not complete", a Python traceback. Now it is exit
    5 with the one-line message the check gives, naming the snapshot's table file,
    not the reader's private scratch copy (deleted by the time anyone reads it)."""
    path = str(tmp_path / "store")
    with qstore.open(path, compactor=False) as store:
        store.create_queue("jobs").push_many([(b"job %d" % i, i % 10) for i in range(2000)])
    with qstore.open(path, compactor=False) as store:  # the reopen writes the table file
        snap = store.snapshot(str(tmp_path / "snap"))
    [sst] = glob.glob(os.path.join(snap, "meta", "*.sst"))
    at = os.path.getsize(sst) * 3 // 10  # inside the message records' data blocks
    with open(sst, "r+b") as f:
        f.seek(at)
        data = f.read(16)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))
    with Snapshot(snap) as view:  # the driver's own reads meet no damage
        read_meta_facts(view)
        plan_ranges(view)
    with pytest.raises(qstore.Corruption) as info:
        run_audit(snap, spark=spark, out=str(tmp_path / "out"), quiet=True)
    assert info.value.path == os.path.join(snap, "meta")
    assert "metadata is damaged" in info.value.reason and sst in info.value.reason
    assert SCRATCH_PREFIX not in str(info.value)
    r = CliRunner().invoke(qstore_cli, ["audit", snap, "--out", str(tmp_path / "out")])
    said, unwrapped = " ".join(r.output.split()), "".join(r.output.split())
    assert r.exit_code == 5, r.output
    assert "Traceback" not in said and "could not complete" not in said
    assert sst in unwrapped and SCRATCH_PREFIX not in unwrapped
    checked = CliRunner().invoke(qstore_cli, ["check", snap])
    assert checked.exit_code == 5 and "metadata is damaged" in " ".join(checked.output.split())


def test_damaged_metadata_the_driver_reads_names_the_snapshots_file(tmp_path: Any) -> None:
    """A snapshot whose metadata is damaged where the driver reads it (before Spark):
    the message named the reader's private scratch copy of meta/, not the snapshot."""
    path = str(tmp_path / "store")
    with qstore.open(path, compactor=False) as store:
        store.create_queue("jobs").push_many([(b"job %d" % i, i % 10) for i in range(50)])
    with qstore.open(path, compactor=False) as store:
        snap = store.snapshot(str(tmp_path / "snap"))
    [sst] = glob.glob(os.path.join(snap, "meta", "*.sst"))
    with open(sst, "r+b") as f:  # the one data block: every read meets it
        f.seek(100)
        data = f.read(16)
        f.seek(100)
        f.write(bytes(b ^ 0xFF for b in data))
    r = CliRunner().invoke(qstore_cli, ["audit", snap, "--out", str(tmp_path / "out")])
    said, unwrapped = " ".join(r.output.split()), "".join(r.output.split())
    assert r.exit_code == 5, r.output
    assert "metadata is damaged" in said
    assert sst in unwrapped and SCRATCH_PREFIX not in unwrapped


def test_a_tasks_corruption_is_found_in_the_failed_jobs_text() -> None:
    # What PySpark's PythonException (and a Py4JJavaError's Java text) carries: the
    # task's traceback, then Spark's suffix; with retries, the last attempt is last.
    def failure(path: str) -> str:
        return ("An exception was thrown from the Python worker: Traceback (most recent "
                "call last):\n  File \"x.py\", line 1, in _read\nqstore._errors.Corruption: "
                f"corruption in {path} at offset 0: metadata is damaged: Corruption: block "
                f"checksum mismatch in {path}/000009.sst offset 2954 size 3008\n SQLSTATE: 38000")
    found = task_corruption(Exception(failure("/old/meta") + "\n" + failure("/s/meta")))
    assert found is not None
    assert (found.path, found.offset) == ("/s/meta", 0)
    assert found.reason.endswith("in /s/meta/000009.sst offset 2954 size 3008")
    assert task_corruption(Exception("Traceback ...\nqstore._errors.StorageError: disk")) is None
    assert task_corruption(Exception("Traceback ...\nValueError: corruption in x at "
                                     "offset 0: y")) is None


def _audit_with_tmpdir(snap: str, tmpdir: str, out: str,
                       monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(tempfile, "tempdir", tmpdir)  # what TMPDIR sets at start-up
    return CliRunner().invoke(qstore_cli, ["audit", snap, "--out", out])


def test_an_unusable_tmpdir_is_a_storage_error_naming_it_not_a_bad_snapshot(
        clean_snap: Snap, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Readers copy meta/'s small files into TMPDIR; it failing said "SNAP is not a
    # qstore snapshot: cannot list SNAP/meta" and exited 2, about an intact snapshot.
    gone = str(tmp_path / "no-such-tmpdir")
    monkeypatch.setattr(tempfile, "tempdir", gone)
    with pytest.raises(qstore.StorageError) as info:
        Snapshot(clean_snap.path)
    assert info.value.errno == errno.ENOENT and gone in str(info.value)
    r = _audit_with_tmpdir(clean_snap.path, gone, str(tmp_path / "out"), monkeypatch)
    said = "".join(r.output.split())
    assert r.exit_code == 5, r.output
    assert "notaqstoresnapshot" not in said and f"{gone}(TMPDIR)" in said


def test_a_full_tmpdir_is_enospc_naming_it_exit_5(
        clean_snap: Snap, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        fd = os.open(os.path.join(mnt, "filler"), os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        r = _audit_with_tmpdir(clean_snap.path, mnt, str(tmp_path / "out"), monkeypatch)
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
    said, unwrapped = " ".join(r.output.split()), "".join(r.output.split())
    assert r.exit_code == 5, r.output
    assert "not a qstore snapshot" not in said and "No space left on device" in said
    assert f"{mnt}(TMPDIR)" in unwrapped and "errno28" in unwrapped
    assert check_path(clean_snap.path).ok  # the snapshot itself is intact
