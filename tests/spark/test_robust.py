"""Robustness: damaged or unexpected bytes in a snapshot, bad source rows, failed Spark runs."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import qstore
from qstore.meta import MetaDB, keys, new_batch
from qstore.spark.audit import run_audit
from qstore.spark.backfill import run_backfill
from tests.conftest import FakeClock

pytestmark = pytest.mark.spark
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _record(*fields: Any) -> bytes:
    packed: bytes = msgpack.packb(list(fields))
    return packed


# message id -> (record stored under its key, words its finding's detail must contain)
BAD_MESSAGES: dict[int, tuple[bytes, str]] = {
    3: (b"\xc1 not msgpack", "undecodable"),
    4: (_record(1, 9, 1, 1, 24, 2, 0, 0, 1.0, 0, None), "unknown state 9"),
    5: (_record(7, 0, 1, 1, 24, 2, 0, 0, 1.0, 0, None), "version"),
    6: (_record(1, 0, 1, "one", 24, 2, 0, 0, 1.0, 0, None), "file_id is 'one'"),
    7: (_record(1, 0, [1], 1, 24, 2, 0, 0, 1.0, 0, None), "priority (1,) is not"),
    8: (_record(1, 0, 1, 1, 24, 2, "x", 0, 1.0, 0, None), "attempts is 'x'"),
    9: (_record(1, 0, 1, 1, 24, 2, 0, 0, "noon", 0, None), "enqueued_at"),
}


def _digest(root: str) -> dict[str, str]:
    """Every file under ``root``: its path and a hash of its bytes."""
    out = {}
    for d, _, names in os.walk(root):
        for name in names:
            p = os.path.join(d, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def damaged(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    base = str(tmp_path_factory.mktemp("robust"))
    with qstore.open(os.path.join(base, "store"), clock=FakeClock(), compactor=False) as store:
        store.create_queue("jobs").push_many([(b"job %d" % i, i % 3) for i in range(20)])
        store.create_queue("tags", priority_type="str").push_many([(b"t", "a")])
        store.create_queue("third").push_many([(b"x", 1)])
        snap = store.snapshot(os.path.join(base, "snap"))
    db = MetaDB(os.path.join(snap, "meta"), readonly=False, store_path=snap)
    batch = new_batch()
    for mid, (raw, _) in BAD_MESSAGES.items():
        batch.put(keys.message_key(1, mid), raw)
    batch.put(keys.QUEUE + b"tags", b"\xc1\xc1")  # an undecodable queue record
    batch.put(keys.counts_key(3), _record(1, "many", 0, 0, 0, 1))  # a counter of the wrong type
    batch.put(keys.totals_key(3), b"\xc1")  # an undecodable E (expired totals) record
    batch.put(keys.totals_key(77), _record(1, 3))  # E of a queue id with no Q record
    db.write(batch, sync=True)
    db.close()
    out = os.path.join(base, "out")
    return out, run_audit(snap, spark=spark, out=out, quiet=True)


def test_each_bad_message_record_is_a_finding_naming_its_key(damaged: tuple[str, Any]) -> None:
    out, result = damaged
    rows = pq.read_table(os.path.join(out, "findings.parquet")).to_pylist()
    bad = {r["message_id"]: r for r in rows if r["kind"] == "bad_record"
           and r["message_id"] is not None}
    assert sorted(bad) == sorted(BAD_MESSAGES)
    for mid, (_, words) in BAD_MESSAGES.items():
        assert bad[mid]["queue"] == "jobs"
        assert keys.message_key(1, mid).hex() in bad[mid]["detail"]
        assert words in bad[mid]["detail"], bad[mid]["detail"]
    # The intact messages of the queue are still audited and counted.
    assert result.summary["queues"]["jobs"]["recount"]["ready"] == 20 - len(BAD_MESSAGES)
    # Their index keys are what the queue's indexes hold beyond the recount: the
    # bad_record findings explain it, no second finding blames nothing.
    assert not [r for r in rows if r["queue"] == "jobs" and r["message_id"] is None
                and r["kind"] in ("stray_index_key", "index_missing")]


def test_bad_queue_and_counter_records_are_findings_and_outputs_are_written(
        damaged: tuple[str, Any]) -> None:
    out, result = damaged
    assert result.exit_code == 1
    assert all(os.path.getsize(p) > 0 for p in result.paths.values())
    details = [f["detail"] for f in result.summary["findings"]["examples"]
               if f["kind"] == "bad_record" and f["message_id"] is None]
    assert any(d.startswith(f"queue key {(keys.QUEUE + b'tags').hex()}") for d in details)
    assert any(d.startswith(f"counter key {keys.counts_key(3).hex()}") for d in details)
    assert any(d.startswith(f"totals key {keys.totals_key(3).hex()}") for d in details)
    assert any(f["kind"] == "orphan_queue_keys" and "'E' for queue id 77" in f["detail"]
               for f in result.summary["findings"]["examples"])
    # The queue with a bad counter record is audited; its counters are not a second finding.
    assert result.summary["queues"]["third"]["recount"]["ready"] == 1
    assert not [f for f in result.summary["findings"]["examples"]
                if f["kind"] == "counter_mismatch" and f["queue"] == "third"]


def test_data_source_reports_the_bad_record_or_skips_it_when_asked(
        spark: Any, damaged: tuple[str, Any]) -> None:
    snap = os.path.dirname(damaged[0]) + "/snap"
    with pytest.raises(Exception, match=keys.message_key(1, 3).hex()):
        spark.read.format("qstore").option("queue", "jobs").load(snap).collect()
    rows = (spark.read.format("qstore").option("queue", "jobs").option("bad_records", "skip")
            .load(snap).collect())
    assert sorted(r["id"] for r in rows) == [i for i in range(1, 21) if i not in BAD_MESSAGES]


def test_unknown_queue_option_is_an_error(spark: Any, clean_snap: Any) -> None:
    with pytest.raises(Exception, match="no queue.*'nope'"):
        spark.read.format("qstore").option("queue", "jobs,nope").load(clean_snap.path).count()
    assert spark.read.format("qstore").option("queue", "jobs").load(clean_snap.path).count() > 0
    for empty in ("", " , "):  # a typo, not zero rows
        with pytest.raises(Exception, match="at least one name"):
            spark.read.format("qstore").option("queue", empty).load(clean_snap.path).count()


@pytest.fixture()
def readonly_copy(clean_snap: Any, tmp_path: Any) -> Any:
    """The clean snapshot copied and mounted read-only (a bind mount as root, else chmod)."""
    src = os.path.join(tmp_path, "src")
    subprocess.run(["cp", "-a", clean_snap.path, src], check=True)
    if os.geteuid() == 0:
        dst = os.path.join(tmp_path, "ro")
        os.mkdir(dst)
        mounted = subprocess.run(["mount", "--bind", src, dst], capture_output=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", dst], check=True)
            yield src, dst
        finally:
            subprocess.run(["umount", dst], check=True)
    else:
        subprocess.run(["chmod", "-R", "a-w", src], check=True)
        try:
            yield src, src
        finally:
            subprocess.run(["chmod", "-R", "u+w", src], check=True)


def test_snapshot_on_a_read_only_mount_audits_without_writing_a_byte(
        spark: Any, readonly_copy: tuple[str, str], clean_snap: Any, tmp_path: Any) -> None:
    src, ro = readonly_copy
    with pytest.raises(OSError):  # the mount really is read-only
        open(os.path.join(ro, "meta", "probe"), "w").close()
    before = _digest(src)
    result = run_audit(ro, spark=spark, out=os.path.join(tmp_path, "out"), quiet=True)
    assert result.exit_code == 0, result.text
    assert result.summary["messages"]["total"] == sum(
        s.ready + s.delayed + s.in_flight + s.dead for s in clean_snap.stats.values())
    rows = spark.read.format("qstore").option("payload", "true").load(ro).collect()
    assert {(r["queue"], r["id"]): r["payload"] for r in rows} == clean_snap.payloads
    assert _digest(src) == before


def test_non_utf8_string_priority_is_a_reject_not_a_failed_job(
        spark: Any, tmp_path: Any) -> None:
    prio = pa.array([b"high", b"\xff\xfe", b"low", None], pa.binary()).cast(pa.string(),
                                                                          safe=False)
    src = os.path.join(tmp_path, "rows.parquet")
    pq.write_table(pa.table({"payload": [b"a", b"b", b"c", b"d"], "prio": prio}), src)
    result = run_backfill(src, into=os.path.join(tmp_path, "store"), queue="q",
                          priority_col="prio", spark=spark,
                          create_queue_options={"priority_type": "str"})
    assert (result.loaded, result.rejected) == (3, 1)
    rejects = spark.read.parquet(result.rejects_path).collect()
    assert len(rejects) == 1 and "not UTF-8" in rejects[0]["reject_reason"]
    with qstore.open(os.path.join(tmp_path, "store"), compactor=False) as store:
        got = store.queue("q").pop_many(10)
        assert sorted(m.payload for m in got) == [b"a", b"c", b"d"]


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("QSTORE_SPARK_MASTER", None)
    return subprocess.run([sys.executable, "-m", "qstore.cli", *args], env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.mark.slow
def test_a_failing_spark_run_exits_3_for_audit_and_backfill(
        clean_snap: Any, tmp_path: Any) -> None:
    bad_master = "nosuchscheme://nowhere"  # Spark cannot start a context for it
    r = _cli("audit", clean_snap.path, "--master", bad_master, "--out", str(tmp_path / "a"))
    assert r.returncode == 3, r.stderr[-2000:]
    assert "could not complete" in r.stderr
    src = os.path.join(tmp_path, "rows.parquet")
    pq.write_table(pa.table({"payload": [b"a"]}), src)
    r = _cli("backfill", src, "--queue", "q", "--into", str(tmp_path / "store"),
             "--master", bad_master)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "nothing was loaded" in r.stderr


def test_only_local_mode_gets_loopback_and_the_drivers_paths(spark: Any) -> None:
    from qstore.spark._session import is_local

    assert is_local("local") and is_local("local[2]") and is_local("local[*]")
    assert not any(is_local(m) for m in ("spark://10.0.0.1:7077", "yarn", "k8s://h:6443",
                                         None, "localhost"))
    conf = spark.sparkContext.getConf()
    # The log configuration path exists on the driver's machine only: never for executors.
    assert "log4j2.configurationFile" not in (conf.get("spark.executor.extraJavaOptions") or "")
    assert "log4j2.configurationFile" in conf.get("spark.driver.extraJavaOptions", "") or \
        "log4j2.configurationFile" in os.environ.get("PYSPARK_SUBMIT_ARGS", "")
