"""The backfill job: bulk loads from Parquet, JSON, CSV and DataFrames (docs/backfill.md)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

import qstore
from qstore._check import check_path
from qstore._errors import StorageError
from qstore.cli import main as qstore_cli
from qstore.meta import MetaDB, keys, records
from qstore.payload import _format as fmt
from qstore.spark import _ingest
from qstore.spark._bulk import PartitionLoader, PartitionPlan
from qstore.spark._rows import LoadSpec
from qstore.spark.audit import run_audit
from qstore.spark.backfill import run_backfill
from tests.conftest import FakeClock, fill_disk

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("_backfill_child.py")


# -- helpers ------------------------------------------------------------------


def check_consistent(path: Any, orphans: bool = False) -> dict[str, list[int]]:
    """Assert ``qstore check`` finds nothing (counters, indexes, segment records, every
    payload, ids below the high-water mark), or, with ``orphans``, nothing but orphan
    segment files; returns each queue's counters [ready, delayed, in_flight, dead, bytes].
    """
    report = check_path(path)
    allowed = {"orphan_segment"} if orphans else set()
    assert {f.kind for f in report.findings} <= allowed, "\n".join(map(str, report.findings))
    with qstore.open(path, readonly=True) as s:
        return {name: list(s.core.queues[name].counts) for name in s.queues()}


def drain(path: Any, queue: str) -> list[tuple[int, Any, bytes]]:
    """(id, priority, payload) of every ready message, in pop order (leases them)."""
    with qstore.open(path, compactor=False) as s:
        return [(m.id, m.priority, m.payload) for m in s.queue(queue).pop_many(100_000)]


def backfill_cli(*args: Any) -> Result:
    """``qstore backfill ARGS...`` in this process (it uses the session's Spark)."""
    return CliRunner().invoke(qstore_cli, ["backfill", *map(str, args)])


def write_parquet(path: Path, **columns: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


# -- loading ------------------------------------------------------------------


def test_parquet_rows_pop_by_priority_then_source_order(spark: Any, tmp_path: Path) -> None:
    n = 40
    bodies = [bytes([i, 0xFF, 0x00]) + b"x" * i for i in range(n)]  # binary, not UTF-8
    prios = [(i * 7) % 5 for i in range(n)]
    src = write_parquet(tmp_path / "src" / "part.parquet", body=bodies, prio=prios)
    store = tmp_path / "store"
    result = run_backfill(str(src), into=store, queue="jobs", payload_col="body",
                          priority_col="prio", spark=spark)
    assert (result.rows, result.loaded, result.rejected) == (n, n, 0)
    assert result.rejects_path is None
    assert result.end_id - result.first_id == n
    assert check_consistent(store)["jobs"] == [n, 0, 0, 0, sum(map(len, bodies))]
    expected = sorted(range(n), key=lambda i: (-prios[i], i))
    got = drain(store, "jobs")
    assert [(p, b) for _, p, b in got] == [(prios[i], bodies[i]) for i in expected]
    # Ids follow source row order.
    assert [mid for mid, _, _ in got] == [result.first_id + i for i in expected]
    assert not os.listdir(store / "staging")


def test_a_backfill_is_refused_while_the_disk_refuses_pushes(spark: Any, small_disk: str,
                                                            tmp_path: Path) -> None:
    # Its segments would take the room the released space reserve keeps for the
    # acks and compaction that free the disk (docs/faults.md): refused as a push is.
    path = os.path.join(small_disk, "s")
    with qstore.open(path, compactor=False) as store:
        store.create_queue("q").push(b"first")
    filler = os.path.join(small_disk, "filler")
    fill_disk(filler)
    src = write_parquet(tmp_path / "src" / "part.parquet", payload=[b"a", b"b", b"c"])
    store = qstore.open(path, compactor=False)  # releases the reserve: pushes refused
    try:
        for queue in ("q", "fresh"):  # refused before anything: no queue is created
            with pytest.raises(StorageError, match="backfills are refused until space is "
                               "back") as refused:
                run_backfill(str(src), into=store, queue=queue, spark=spark)
            assert refused.value.errno == errno.ENOSPC
        assert store.queues() == ["q"] and store.queue("q").stats().ready == 1
        staging = os.path.join(path, "staging")
        assert not os.path.isdir(staging) or not os.listdir(staging)  # nothing written
        os.unlink(filler)  # space is back: the same backfill loads
        result = run_backfill(str(src), into=store, queue="q", spark=spark)
        assert result.loaded == 3
        assert sorted(m.payload for m in store.queue("q").pop_many(10)) == [
            b"a", b"b", b"c", b"first"]
    finally:
        store.close()
    check_consistent(path)


@pytest.mark.parametrize("kind", ["dictionary", "fixed-size", "binary-view", "string-view"])
def test_parquet_payload_columns_of_other_arrow_layouts_load(spark: Any, tmp_path: Path,
                                                             kind: str) -> None:
    # The tasks read the files' own Arrow types (a pandas categorical column is
    # dictionary-encoded, a UUID column fixed-size): each failed the whole job.
    bodies = [b"abcd", b"efgh", b"ijkl"]
    column = {
        "dictionary": pa.array([b.decode() for b in bodies]).dictionary_encode(),
        "fixed-size": pa.array(bodies, pa.binary(4)),
        "binary-view": pa.array(bodies, pa.binary_view()),
        "string-view": pa.array([b.decode() for b in bodies], pa.string_view()),
    }[kind]
    src = tmp_path / "src" / "part.parquet"
    src.parent.mkdir(parents=True)
    pq.write_table(pa.table({"payload": column, "p": [1, 2, 3]}), src)
    store = tmp_path / "store"
    result = run_backfill(str(src), into=store, queue="q", priority_col="p", spark=spark)
    assert (result.loaded, result.rejected) == (3, 0)
    assert [b for _, _, b in drain(store, "q")] == bodies[::-1]


def test_parquet_files_with_narrower_and_wider_numbers_load(spark: Any,
                                                            tmp_path: Path) -> None:
    # Spark takes a Parquet source's schema from one file: a second file that
    # wrote the priority as int64 where the first wrote int32 (or the delay as
    # double where it wrote float) failed the whole job, exit 3.
    src = tmp_path / "src"
    write_parquet(src / "a.parquet", payload=[b"a", b"b"], p=pa.array([1, 2], pa.int32()),
                  wait=pa.array([0.0, 3600.0], pa.float32()))
    write_parquet(src / "b.parquet", payload=[b"c", b"d"], p=pa.array([3, 2**40], pa.int64()),
                  wait=pa.array([0.0, 7200.5], pa.float64()))
    write_parquet(src / "c.parquet", payload=[b"e"], p=pa.array([-7], pa.int8()),
                  wait=pa.array([0.0], pa.float32()))
    store = tmp_path / "store"
    result = backfill_cli(src, "--queue", "q", "--priority-col", "p", "--delay-col", "wait",
                          "--into", store)
    assert result.exit_code == 0, result.output
    assert check_consistent(store)["q"][:2] == [3, 2]
    assert [(p, b) for _, p, b in drain(store, "q")] == [(3, b"c"),
                                                         (1, b"a"), (-7, b"e")]
    with qstore.open(store, compactor=False, clock=FakeClock(time.time() + 7201)) as s:
        later = [(m.priority, m.payload) for m in s.queue("q").pop_many(10)]
    # The delayed two are due, and the three drained above are back (their leases ran out).
    assert later == [(2**40, b"d"), (3, b"c"), (2, b"b"), (1, b"a"), (-7, b"e")]


def test_json_string_payloads_delays_and_new_str_queue(spark: Any, tmp_path: Path) -> None:
    rows = [{"body": f"héllo {i}", "p": "ab"[i % 2], "wait": 3600.0 if i % 3 == 0 else 0}
            for i in range(12)]
    src = tmp_path / "src.json"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    store = tmp_path / "store"
    before = time.time()
    result = run_backfill(str(src), into=store, queue="mail", fmt="json", payload_col="body",
                          priority_col="p", delay_col="wait", spark=spark,
                          create_queue_options={"order": "min", "priority_type": "str"})
    assert (result.ready, result.delayed) == (8, 4)
    counts = check_consistent(store)["mail"]
    assert counts[:2] == [8, 4]
    assert counts[4] == sum(len(r["body"].encode("utf-8")) for r in rows)
    with qstore.open(store, compactor=False) as s:
        q = s.queue("mail")
        assert (q.order, q.priority_type) == ("min", "str")
        first = q.pop_many(100, lease=10_000)
    ready = [i for i in range(12) if i % 3]
    expect_ready = sorted(ready, key=lambda i: (rows[i]["p"], i))
    assert [m.payload.decode() for m in first] == [rows[i]["body"] for i in expect_ready]
    assert all(m.enqueued_at >= before - 1 for m in first)
    # The delayed ones become ready an hour after the load, not before.
    with qstore.open(store, compactor=False, clock=FakeClock(before + 3500)) as s:
        assert s.queue("mail").stats().delayed == 4
    with qstore.open(store, compactor=False, clock=FakeClock(time.time() + 3601)) as s:
        late = s.queue("mail").pop_many(100)
    delayed = [i for i in range(12) if i % 3 == 0]
    assert [m.payload.decode() for m in late] == [
        rows[i]["body"] for i in sorted(delayed, key=lambda i: (rows[i]["p"], i))]


def test_csv_payloads_dedup_keys_and_str_priorities_are_the_text_as_written(
        spark: Any, tmp_path: Path) -> None:
    # CSV columns are inferred: "007" was the int 7, so a payload column of
    # numbers was refused (not binary or string), a dedup key "007" loaded as
    # "7" (a later push of key "007" made a second message), and a str queue's
    # numeric-looking priorities were a usage error.
    src = tmp_path / "rows.csv"
    src.write_text("body,key,p\n007,007,10\n42,x1,9\n")
    store = tmp_path / "store"
    with qstore.open(store, compactor=False) as s:
        s.create_queue("d", dedup=True, priority_type="str")
    result = run_backfill(str(src), into=store, queue="d", fmt="csv", payload_col="body",
                          dedup_col="key", priority_col="p", spark=spark)
    assert (result.loaded, result.rejected) == (2, 0)
    with qstore.open(store, compactor=False) as s:
        q = s.queue("d")
        got = {m.payload: m.priority for m in q.peek(5)}
        assert got == {b"007": "10", b"42": "9"}
        first = next(m.id for m in q.peek(5) if m.payload == b"007")
        assert q.push(b"other", priority="a", dedup_key="007") == first
        assert s.check().ok


def test_csv_bad_rows_go_to_the_rejects_table_with_reasons(spark: Any, tmp_path: Path) -> None:
    src = tmp_path / "src.csv"
    src.write_text(
        "payload,priority,delay\n"
        "a,1,0\n"
        "b,high,0\n"
        "c,2,-5\n"
        ",3,0\n"
        "d,99999999999999999999,0\n"
        "e,4,3600.5\n", encoding="utf-8")
    store = tmp_path / "store"
    rejects = tmp_path / "rejects"
    run = backfill_cli(src, "--format", "csv", "--queue", "q", "--priority-col", "priority",
                       "--delay-col", "delay", "--into", store, "--rejects", rejects)
    assert run.exit_code == 1, run.output  # loaded, with rejects
    assert f"rejects table: {rejects}" in run.output
    assert check_consistent(store)["q"] == [1, 1, 0, 0, 2]
    assert (rejects / "_SUCCESS").exists()
    table = spark.read.parquet(str(rejects)).orderBy("source_row").collect()
    reasons = {r["source_row"]: r["reject_reason"] for r in table}
    assert sorted(reasons) == [1, 2, 3, 4]
    assert reasons[1] == "priority: 'high' is not an integer"
    assert reasons[2] == "delay: -5.0 is negative"
    assert reasons[3] == "payload: null"
    assert reasons[4].startswith("priority: 99999999999999999999 is outside")
    assert [r["payload"] for r in table] == ["b", "c", None, "d"]  # the source's own values
    assert [b for _, _, b in drain(store, "q")] == [b"a"]


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_large_int_priorities_beside_a_fraction_load_exactly(spark: Any, tmp_path: Path,
                                                            fmt: str) -> None:
    # A priority column that also holds 2.5 is inferred as double, which rounded
    # 9007199254740993 to ...992 and loaded it with no reject (Spark audit).
    cells = ["9007199254740993", "1234567890123456789", "2.5", "7", "3.0", "1e3"]
    src = tmp_path / f"src.{fmt}"
    if fmt == "csv":
        src.write_text("payload,p\n" + "".join(f"r{i},{c}\n" for i, c in enumerate(cells)),
                       encoding="utf-8")
    else:
        src.write_text("".join(f'{{"payload": "r{i}", "p": {c}}}\n'
                               for i, c in enumerate(cells)), encoding="utf-8")
    store, rejects = tmp_path / "store", tmp_path / "rejects"
    run = backfill_cli(src, "--format", fmt, "--queue", "q", "--priority-col", "p",
                       "--into", store, "--rejects", rejects)
    assert run.exit_code == 1, run.output
    got = {bytes(b): p for _, p, b in drain(store, "q")}
    assert got == {b"r0": 9007199254740993, b"r1": 1234567890123456789, b"r3": 7, b"r4": 3,
                   b"r5": 1000}
    table = spark.read.parquet(str(rejects)).collect()
    assert [(r["payload"], r["reject_reason"]) for r in table] == [
        ("r2", "priority: '2.5' is not an integer")]


def test_json_columns_of_the_wrong_type_stay_usage_errors(spark: Any, tmp_path: Path) -> None:
    # The exact read of int priorities re-read every JSON source with the payload
    # (and a str queue's priority) as text: an object payload loaded as its JSON
    # text, an int priority into a str queue as "10" (review of this change).
    objects = tmp_path / "objects.json"
    objects.write_text("".join(f'{{"payload": {{"n": {i}}}}}\n' for i in range(3)),
                       encoding="utf-8")
    ints = tmp_path / "ints.json"
    ints.write_text("".join(f'{{"payload": "m{i}", "p": {10 + i}}}\n' for i in range(3)),
                    encoding="utf-8")
    store = tmp_path / "store"
    run = backfill_cli(objects, "--format", "json", "--queue", "q", "--into", store)
    assert run.exit_code == 2 and "payload column 'payload' has type struct" in run.output
    run = backfill_cli(ints, "--format", "json", "--queue", "s", "--priority-type", "str",
                       "--priority-col", "p", "--into", store)
    assert run.exit_code == 2 and "priority column 'p' has type bigint" in run.output
    with qstore.open(store, compactor=False) as s:
        assert [s.queue(n).stats().total for n in s.queues()] in ([], [0], [0, 0])


def test_csv_malformed_lines_are_rejected_not_loaded(spark: Any, tmp_path: Path) -> None:
    # Spark's PERMISSIVE mode loaded a line with a field missing with a null
    # (priority 0), one with a field too many without it, and an unclosed quote
    # as text up to the end of its line: each as if it were well formed.
    src = tmp_path / "src.csv"
    src.write_text(
        "payload,priority,note,malformed_line\n"
        "a,5,x,y\n"
        "short\n"
        "long,6,x,y,extra\n"
        '"open,7,x,y\n'
        "b,8,x,y\n", encoding="utf-8")
    store, rejects = tmp_path / "store", tmp_path / "rejects"
    pruning = "spark.sql.csv.parser.columnPruning.enabled"
    before = spark.conf.get(pruning, None)
    run = backfill_cli(src, "--format", "csv", "--queue", "q", "--priority-col", "priority",
                       "--into", store, "--rejects", rejects)
    assert run.exit_code == 1, run.output
    assert spark.conf.get(pruning, None) == before  # the session is left as it was
    # A quoted field runs to its closing quote, over line breaks (RFC 4180, as
    # Python's csv module reads it): an unclosed one takes the rest of the file
    # into one malformed record, rejected with its text; nothing of it loads.
    assert [(p, b) for _, p, b in drain(store, "q")] == [(5, b"a")]
    table = spark.read.parquet(str(rejects)).orderBy("source_row").collect()
    assert [r["source_row"] for r in table] == [1, 2, 3]
    # A source column already has the name: the job's column takes a "_" more.
    assert [r["malformed_line_"] for r in table] == ["short", "long,6,x,y,extra",
                                                     '"open,7,x,y\nb,8,x,y']
    assert {r["reject_reason"] for r in table} == {
        "malformed CSV line (its text is in column 'malformed_line_')"}


def test_csv_as_python_s_csv_module_writes_it_loads_as_written(spark: Any,
                                                               tmp_path: Path) -> None:
    # Spark's own CSV defaults (a backslash escape, one line a record) loaded
    # `"say ""hi"""` as those very bytes, split a JSON body at its comma, and
    # loaded the second half of a quoted field with a line break as a message of
    # its own (a backfill audit of real files).
    import csv
    bodies = ['say "hi"', '{"id": 7, "op": "refund"}', "a,b", "ship order 42\nto: Alice",
              "back\\slash"]
    src = tmp_path / "rows.csv"
    with open(src, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["payload", "priority"])
        w.writerows((b, i) for i, b in enumerate(bodies))
    store = tmp_path / "store"
    run = backfill_cli(src, "--format", "csv", "--queue", "q", "--priority-col", "priority",
                       "--into", store)
    assert run.exit_code == 0, run.output
    assert f"loaded {len(bodies)} of {len(bodies)} rows" in run.output
    assert sorted((p, b) for _, p, b in drain(store, "q")) == [
        (i, b.encode()) for i, b in enumerate(bodies)]


def test_csv_files_whose_headers_differ_in_order_are_a_usage_error(spark: Any,
                                                                   tmp_path: Path) -> None:
    # Spark read every file by the position of the first one's columns: payload
    # and priority of b.csv swapped, exit 0 (a backfill audit).
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.csv").write_text("payload,priority\n1001,1\n1002,2\n", encoding="utf-8")
    (src / "b.csv").write_text("priority,payload\n3,1003\n4,1004\n", encoding="utf-8")
    store = tmp_path / "store"
    run = backfill_cli(src, "--format", "csv", "--queue", "q", "--priority-col", "priority",
                       "--into", store)
    assert run.exit_code == 2, run.output
    text = " ".join(run.output.split())
    assert f"the CSV file {src / 'b.csv'} has the header 'priority, payload'" in text
    assert "must name the same columns in the same order" in text
    with qstore.open(store, compactor=False) as s:
        assert [s.queue(n).stats().total for n in s.queues()] in ([], [0])


def test_a_source_with_no_readable_column_says_so(spark: Any, tmp_path: Path) -> None:
    # A pretty-printed JSON array, or only empty files, said "payload column
    # 'payload' is not in the source; its columns are []" (a backfill audit).
    pretty = tmp_path / "pretty.json"
    pretty.write_text('{\n  "payload": "a",\n  "priority": 1\n}\n', encoding="utf-8")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.csv").write_text("", encoding="utf-8")
    for src, kind in ((pretty, "json"), (empty, "csv")):
        run = backfill_cli(src, "--format", kind, "--queue", "q", "--into", tmp_path / "store")
        assert run.exit_code == 2, run.output
        text = " ".join(run.output.split())
        assert f"no column could be read from the {kind.upper()} source" in text
        assert ("JSON Lines" in text) == (kind == "json")


def test_json_malformed_lines_are_rejected_with_their_text(spark: Any, tmp_path: Path) -> None:
    # A line that does not parse was loaded in PERMISSIVE mode with every column
    # null: rejected as "payload: null", its text lost (CSV kept it; a review).
    src = tmp_path / "src.json"
    cut = '{"payload": "important order 42", "priority": 9, '
    src.write_text(
        '{"payload": "a", "priority": 5, "malformed_line": "mine"}\n'
        f"{cut}\n"
        "not json at all\n"
        '{"payload": "b", "priority": 8}\n', encoding="utf-8")
    store, rejects = tmp_path / "store", tmp_path / "rejects"
    run = backfill_cli(src, "--format", "json", "--queue", "q", "--priority-col", "priority",
                       "--into", store, "--rejects", rejects)
    assert run.exit_code == 1, run.output
    assert [(p, b) for _, p, b in drain(store, "q")] == [(8, b"b"), (5, b"a")]
    table = spark.read.parquet(str(rejects)).orderBy("source_row").collect()
    assert [r["source_row"] for r in table] == [1, 2]
    # A source key already has the name: the job's column takes a "_" more.
    assert [r["malformed_line_"] for r in table] == [cut, "not json at all"]
    assert {r["reject_reason"] for r in table} == {
        "malformed JSON line (its text is in column 'malformed_line_')"}
    assert "_corrupt_record" not in table[0].asDict()


def test_dedup_rejects_rows_matching_live_messages_or_earlier_rows(spark: Any,
                                                                    tmp_path: Path) -> None:
    store = tmp_path / "store"
    with qstore.open(store, compactor=False) as s:
        q = s.create_queue("d", dedup=True)
        seen_id = q.push(b"seen")
        k1_id = q.push(b"other", dedup_key="k1")
    src = write_parquet(tmp_path / "src.parquet",
                        payload=[b"x", b"seen", b"x", b"y", b"z", b"w"],
                        key=[None, None, None, "k1", "k2", "k2"])
    result = run_backfill(str(src), into=store, queue="d", dedup_col="key", spark=spark)
    assert (result.loaded, result.rejected, result.duplicates) == (2, 4, 4)
    reasons = {r["source_row"]: r["reject_reason"]
               for r in spark.read.parquet(result.rejects_path).collect()}
    assert reasons == {
        1: f"duplicate: message {seen_id} of the queue has this key",
        2: "duplicate: row 0 of partition 0 has this key",
        3: f"duplicate: message {k1_id} of the queue has this key",
        5: "duplicate: row 4 of partition 0 has this key",
    }
    check_consistent(store)
    # Loaded messages take part in dedup exactly like pushed ones.
    with qstore.open(store, compactor=False) as s:
        q = s.queue("d")
        assert q.push(b"x") == result.first_id
        assert q.push(b"anything", dedup_key="k2") == result.first_id + 4
        assert q.stats().ready == 4


def test_dedup_ignores_dead_letters_and_keeps_payloads_and_keys_apart(spark: Any,
                                                                      tmp_path: Path) -> None:
    """Issue 11 case 14, through the backfill: the same digests as push, the same rules."""
    store = tmp_path / "store"
    with qstore.open(store, compactor=False) as s:
        q = s.create_queue("d", dedup=True, max_attempts=1)
        q.push(b"dead", dedup_key="gone")
        q.nack(q.pop())  # type: ignore[arg-type]
        keyed = q.push(b"v", dedup_key="foo")
    src = write_parquet(tmp_path / "src.parquet", payload=[b"kfoo", b"w"], key=[None, "gone"])
    result = run_backfill(str(src), into=store, queue="d", dedup_col="key", spark=spark)
    assert (result.loaded, result.rejected) == (2, 0)
    check_consistent(store)
    with qstore.open(store, compactor=False) as s:
        snap = s.snapshot(str(tmp_path / "snap"))
        q = s.queue("d")
        assert q.push(b"kfoo") == result.first_id
        assert q.push(b"z", dedup_key="gone") == result.first_id + 1
        assert q.push(b"z", dedup_key="foo") == keyed
    audit = run_audit(snap, out=tmp_path / "audit", spark=spark, quiet=True)
    assert (audit.exit_code, audit.findings) == (0, 0), audit.text


def test_loading_into_a_store_with_messages_keeps_them_intact(spark: Any,
                                                             tmp_path: Path) -> None:
    store = tmp_path / "store"
    with qstore.open(store, compactor=False) as s:
        q = s.create_queue("q", max_attempts=1)
        old = q.push_many([(b"r1", 9), (b"r2", 0), (b"fly", 5), (b"dead", 5)])
        old.append(q.push(b"later", priority=1, delay=3600))
        q.pop(lease=3600)  # r1 (priority 9) in flight
        q.nack(q.pop())  # fly: max_attempts 1, so it is dead
    src = write_parquet(tmp_path / "src.parquet", payload=[b"n%d" % i for i in range(20)],
                        priority=[5] * 20)
    result = run_backfill(str(src), into=store, queue="q", priority_col="priority",
                          spark=spark)
    assert result.first_id > max(old)
    assert check_consistent(store)["q"][:4] == [22, 1, 1, 1]
    with qstore.open(store, compactor=False) as s:
        q = s.queue("q")
        assert [q.get(i).payload for i in old] == [b"r1", b"r2", b"fly", b"dead", b"later"]
        assert [m.payload for m in q.dead_letters()] == [b"fly"]
        popped = q.pop_many(100)
        assert [m.payload for m in popped] == [b"dead"] + [b"n%d" % i for i in range(20)] + [
            b"r2"]
        # New pushes get ids above the loaded ones.
        assert q.push(b"new") >= result.end_id


def test_dataframe_partitions_load_in_partition_then_row_order(spark: Any,
                                                               tmp_path: Path) -> None:
    df = spark.range(0, 400, 1, 4).selectExpr("cast(id as string) as payload")
    store = tmp_path / "store"
    result = run_backfill(df, into=store, queue="fifo", spark=spark,
                          create_queue_options={"order": "fifo"})
    assert (result.partitions, result.loaded, len(result.segments)) == (4, 400, 4)
    assert [b for _, _, b in drain(store, "fifo")] == [str(i).encode() for i in range(400)]
    with qstore.open(store, compactor=False) as s:
        segs = {seg.file_id: seg for seg in s.stats().segments}
        assert all(segs[fid].live_count == 100 for fid in result.segments)
        assert segs[max(result.segments)].active  # the newest segment takes new pushes
    check_consistent(store)
    # A sorted DataFrame loads in its sort order (range partitions, in order).
    desc = spark.range(0, 300, 1, 3).selectExpr("cast(id as string) as payload", "id")
    result = run_backfill(desc.orderBy(desc.id.desc()), into=store, queue="sorted",
                          spark=spark, create_queue_options={"order": "fifo"})
    assert result.partitions > 1
    assert [b for _, _, b in drain(store, "sorted")] == [str(i).encode()
                                                          for i in range(299, -1, -1)]
    assert spark.conf.get("spark.sql.adaptive.enabled") == "true"  # restored


def test_backfilled_store_audits_clean(spark: Any, tmp_path: Path) -> None:
    store = tmp_path / "store"
    with qstore.open(store, compactor=False) as s:
        s.create_queue("q").push_many([b"old1", b"old2"])
    src = write_parquet(tmp_path / "src.parquet", payload=[b"p%d" % i for i in range(50)],
                        d=[float(i % 2) * 30 for i in range(50)])
    run_backfill(str(src), into=store, queue="q", delay_col="d", spark=spark)
    with qstore.open(store, compactor=False) as s:
        snap = s.snapshot(str(tmp_path / "snap"))
    report = run_audit(snap, spark=spark)
    assert (report.exit_code, report.findings) == (0, 0)


# -- the command line: queue options apply only to a queue it creates -------------


def test_cli_loads_into_an_existing_queue_with_other_settings(spark: Any,
                                                              tmp_path: Path) -> None:
    store = tmp_path / "store"
    with qstore.open(store, compactor=False) as s:
        s.create_queue("q", order="min", priority_type="str", max_attempts=2)
    src = write_parquet(tmp_path / "src.parquet", payload=[b"b", b"a"], p=["y", "x"])
    run = backfill_cli(src, "--queue", "q", "--priority-col", "p", "--into", store)
    assert run.exit_code == 0, run.output
    assert "loaded 2 of 2 rows into queue 'q'" in run.output
    with qstore.open(store, compactor=False) as s:
        q = s.queue("q")
        assert (q.order, q.priority_type, q.max_attempts, q.dedup) == ("min", "str", 2, False)
    assert [(p, b) for _, p, b in drain(store, "q")] == [("x", b"a"), ("y", b"b")]


def test_cli_dedup_col_into_an_existing_dedup_queue_needs_no_dedup_flag(
        spark: Any, tmp_path: Path) -> None:
    store = tmp_path / "store"
    with qstore.open(store, compactor=False) as s:
        held = s.create_queue("d", dedup=True, max_attempts=9).push(b"old", dedup_key="k1")
    src = write_parquet(tmp_path / "src.parquet", payload=[b"x", b"y", b"z"],
                        key=["k1", "k2", "k2"])
    run = backfill_cli(src, "--queue", "d", "--dedup-col", "key", "--into", store)
    assert run.exit_code == 1, run.output  # loaded, two duplicates rejected
    assert "rejected 2 (2 duplicates)" in run.output
    with qstore.open(store, compactor=False) as s:
        q = s.queue("d")
        assert (q.dedup, q.max_attempts) == (True, 9)
        assert q.push(b"again", dedup_key="k1") == held
    assert [b for _, _, b in drain(store, "d")] == [b"old", b"y"]


def test_cli_loads_every_source_given(spark: Any, tmp_path: Path) -> None:
    first = write_parquet(tmp_path / "one.parquet", payload=[b"a1", b"a2"])
    second = write_parquet(tmp_path / "two.parquet", payload=[b"b1", b"b2", b"b3"])
    store = tmp_path / "store"
    run = backfill_cli(first, second, "--queue", "q", "--order", "fifo", "--max-attempts",
                       "3", "--into", store)
    assert run.exit_code == 0, run.output
    assert "loaded 5 of 5 rows" in run.output
    with qstore.open(store, compactor=False) as s:
        q = s.queue("q")
        assert (q.order, q.max_attempts) == ("fifo", 3)
    assert sorted(b for _, _, b in drain(store, "q")) == [b"a1", b"a2", b"b1", b"b2", b"b3"]


@pytest.mark.parametrize("option", [["--order", "max"], ["--priority-type", "str"],
                                    ["--max-attempts", "5"], ["--dedup"]])
def test_cli_option_that_contradicts_the_existing_queue_exits_2(
        spark: Any, tmp_path: Path, option: list[str]) -> None:
    store = tmp_path / "store"
    with qstore.open(store, compactor=False) as s:
        s.create_queue("q", order="fifo", max_attempts=2).push(b"old")
    src = write_parquet(tmp_path / "src.parquet", payload=[b"new"])
    run = backfill_cli(src, "--queue", "q", *option, "--into", store)
    assert run.exit_code == 2, run.output
    assert "queue 'q' exists with" in run.output
    assert option[0].lstrip("-").replace("-", "_") in run.output
    assert [b for _, _, b in drain(store, "q")] == [b"old"]


# -- refusals -------------------------------------------------------------------


def test_store_locked_by_another_process(spark: Any, tmp_path: Path) -> None:
    store = tmp_path / "store"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import qstore, sys; s = qstore.open(sys.argv[1]); "
         "print('open', flush=True); sys.stdin.read()", str(store)],  # holds until killed
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        src = write_parquet(tmp_path / "src.parquet", payload=[b"a"])
        with pytest.raises(qstore.StoreLocked, match="locked by another writer"):
            run_backfill(str(src), into=store, queue="q", spark=spark)
        assert backfill_cli(src, "--queue", "q", "--into", store).exit_code == 3
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None and holder.stdin is not None
        holder.stdout.close()
        holder.stdin.close()
    with qstore.open(store, compactor=False) as s:
        assert s.queues() == []


def test_bad_arguments_change_nothing(spark: Any, tmp_path: Path) -> None:
    store = tmp_path / "store"
    src = write_parquet(tmp_path / "src.parquet", payload=[b"a"], n=[1], flag=[True])
    bad: list[tuple[dict[str, Any], str]] = [
        ({"priority_col": "n", "create_queue_options": {"priority_type": "str"}},
         "has type bigint; it must be string"),
        ({"priority_col": "flag"}, "has type boolean"),
        ({"payload_col": "nope"}, "'nope' is not in the source"),
        ({"dedup_col": "n", "create_queue_options": {"dedup": False}}, "not created with dedup"),
        ({"create_queue_options": {"colour": "red"}}, "unknown create_queue_options"),
    ]
    for kwargs, message in bad:
        with pytest.raises(qstore.InvalidArgument, match=message):
            run_backfill(str(src), into=store, queue="q", spark=spark, **kwargs)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(qstore.InvalidArgument, match="not empty"):
        run_backfill(str(src), into=store, queue="q", spark=spark, rejects=tmp_path / "full")
    assert backfill_cli(tmp_path / "missing.parquet", "--queue", "q", "--into",
                        store).exit_code == 2
    with qstore.open(store, compactor=False) as s:
        assert s.queues() == []


def test_a_damaged_source_file_is_named_in_the_error(spark: Any, tmp_path: Path) -> None:
    # Read by the direct path, a damaged Parquet file among the sources failed the
    # job with only "Corrupt snappy compressed data." (a Spark fault audit).
    src = tmp_path / "src"
    src.mkdir()
    for k in range(3):
        pq.write_table(pa.table({"payload": pa.array(
            [b"payload-%d-%06d-" % (k, i) * 20 for i in range(3000)], pa.binary())}),
            src / f"part-{k}.parquet", row_group_size=1000, compression="snappy")
    damaged = src / "part-1.parquet"
    data = bytearray(damaged.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    damaged.write_bytes(bytes(data))
    store = tmp_path / "store"
    with pytest.raises(Exception) as failed:
        run_backfill(str(src), into=store, queue="q", spark=spark)
    assert f"reading {damaged} (row groups" in str(failed.value)
    with qstore.open(store, readonly=True) as s:  # nothing was loaded
        assert s.queue("q").stats().total == 0


def test_a_store_disk_filled_by_the_executors_is_a_storage_error(spark: Any,
                                                                 tmp_path: Path) -> None:
    # The store's disk filled while the executors wrote their staging files: exit 3
    # ("the Spark run failed") and about 200 lines naming neither the file nor the
    # filesystem (a Spark fault audit). Now a StorageError (exit 5), ENOSPC.
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.strip()})")
    try:
        src = write_parquet(tmp_path / "src" / "big.parquet",
                            payload=[b"%06d" % i + b"x" * 1000 for i in range(12_000)])
        store = disk / "store"
        with qstore.open(store, compactor=False) as s:
            s.create_queue("q").push(b"before")
        with pytest.raises(StorageError) as failed:
            run_backfill(str(src), into=store, queue="q", spark=spark)
        assert failed.value.errno == errno.ENOSPC
        assert "No space left on device" in str(failed.value)
        assert "\n" not in str(failed.value)  # one line, not the task's traceback
        assert check_consistent(store)["q"][0] == 1  # nothing loaded
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# -- crash safety -------------------------------------------------------------------


def _commit_in_child(store: Path, staging: Path, crash_at: str | None,
                     fingerprint: str | None = None, *more: str) -> int:
    env = dict(os.environ)
    env.pop(_ingest.CRASH_ENV, None)
    if crash_at is not None:
        env[_ingest.CRASH_ENV] = crash_at
    extra = [] if fingerprint is None else [fingerprint, *more]
    return subprocess.run([sys.executable, str(CHILD), str(store), str(staging), *extra],
                          env=env, timeout=60).returncode


def test_kill_at_every_step_leaves_none_or_all_of_the_rows(spark: Any, tmp_path: Path,
                                                           monkeypatch: Any) -> None:
    """A crash after each step leaves a store that opens with none or all of the rows.

    The Spark part runs once, here; the directory copied at ``reserved`` and at
    ``staged`` is exactly what a SIGKILL at that point leaves (nothing is being
    written then). The driver's commit steps are then run in child processes
    that SIGKILL themselves after each step.
    """
    src = tmp_path / "src"
    write_parquet(src / "a.parquet", payload=[b"a%d" % i for i in range(30)],
                  p=list(range(30)))
    write_parquet(src / "b.parquet", payload=[b"b%d" % i for i in range(30)] + [None],
                  p=list(range(31)))
    store = tmp_path / "store"
    with qstore.open(store, compactor=False) as s:
        s.create_queue("q").push_many([(b"old%d" % i, 100) for i in range(3)])
    old = {b"old0", b"old1", b"old2"}
    loaded = {b"a%d" % i for i in range(30)} | {b"b%d" % i for i in range(30)}

    def image(step: str) -> None:
        if step in ("reserved", "staged"):
            shutil.copytree(store, tmp_path / f"image-{step}")

    monkeypatch.setattr(_ingest, "step_hook", image)
    result = run_backfill(str(src), into=store, queue="q", priority_col="p", spark=spark)
    monkeypatch.setattr(_ingest, "step_hook", None)
    assert (result.partitions, len(result.segments), result.rejected) == (2, 2, 1)
    assert {b for _, _, b in drain(store, "q")} == old | loaded
    for step in ("reserved", "staged"):
        assert check_consistent(tmp_path / f"image-{step}")["q"] == [3, 0, 0, 0, 12]
    (staging,) = (tmp_path / "image-staged" / "staging").iterdir()

    for crash_at, outcome in [("rejects_published", old), ("moving", old), ("moved", old),
                              ("ingested", old | loaded), ("cleaned", old | loaded),
                              (None, old | loaded)]:
        work = tmp_path / f"after-{crash_at}"
        shutil.copytree(tmp_path / "image-staged", work)
        code = _commit_in_child(work, work / "staging" / staging.name, crash_at)
        assert code == (0 if crash_at is None else -signal.SIGKILL), crash_at
        # Segments moved into payload/ by a job that never committed are orphans
        # until a compaction pass deletes them; nothing else may be found.
        uncommitted = crash_at in ("moving", "moved")
        assert check_consistent(work, orphans=uncommitted)["q"][0] == len(outcome), crash_at
        with qstore.open(work, compactor=False) as s:
            s.compact(threshold=0.5)
            for seg in s.stats().segments:
                assert seg.active or seg.live_count > 0, (crash_at, seg)
        check_consistent(work)
        assert {b for _, _, b in drain(work, "q")} == outcome, crash_at

    # A rejects move cut short (a copy across filesystems on a full disk) left a
    # truncated Parquet file under its final name, beside the complete ones, in a
    # job that said nothing was loaded (a Spark fault audit). Now nothing of it.
    work = tmp_path / "rejects-cut"
    shutil.copytree(tmp_path / "image-staged", work)

    def cut_move(src: str, dst: str) -> None:
        with open(dst, "wb") as f:
            f.write(b"PAR1 cut short")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_ingest.shutil, "move", cut_move)
    with qstore.open(work, compactor=False) as s, pytest.raises(OSError):
        _ingest.commit_job(s, str(work / "staging" / staging.name))
    monkeypatch.undo()
    assert [os.listdir(d) for d in (work / "rejects").iterdir()] == [[]]
    assert check_consistent(work)["q"][0] == len(old)

    # A crash after the ingestion, before _SUCCESS: the rejects directory looked
    # like one of a job that loaded nothing, and a rerun loaded every row twice
    # (Spark audit). The ingestion wrote the job's marker with the rows: the
    # rerun marks the directory and refuses, and so does each rerun after it
    # until one is given again=True.
    work = tmp_path / "after-ingested-rerun"
    shutil.copytree(tmp_path / "image-staged", work)
    mark = _ingest.job_fingerprint(str(src), "parquet", "q", ("payload", "p", None, None, None))
    code = _commit_in_child(work, work / "staging" / staging.name, "ingested", mark)
    assert code == -signal.SIGKILL
    (rejects,) = (work / "rejects").iterdir()
    assert not (rejects / "_SUCCESS").exists()
    with pytest.raises(_ingest.AlreadyLoaded, match="loaded its 60 rows"):
        run_backfill(str(src), into=work, queue="q", priority_col="p", spark=spark)
    assert (rejects / "_SUCCESS").exists()
    assert check_consistent(work)["q"][0] == len(old | loaded)  # nothing loaded twice
    # A refusal changes no marker: a run killed while refusing, before anyone saw
    # it, left the next run to load the rows twice (a crash-point audit).
    refused = backfill_cli(src, "--queue", "q", "--priority-col", "p", "--into", work)
    assert refused.exit_code == 5 and "run it again with --again" in refused.output
    assert check_consistent(work)["q"][0] == len(old | loaded)
    again = backfill_cli(src, "--queue", "q", "--priority-col", "p", "--into", work,
                         "--again")  # asked to, it loads them a second time (1 reject: exit 1)
    assert again.exit_code == 1 and "loaded 60 of 61 rows" in again.output, again.output
    with qstore.open(work, compactor=False) as s:  # a job that finished leaves no marker
        assert s.core.meta.scan_keys(keys.BACKFILL_JOB, keys.prefix_end(keys.BACKFILL_JOB)) == []

    # Killed as the store closed, after the commit: the marker was deleted before
    # the close (a sync, a flush: 23 syncs in a power-loss audit's run), so a
    # crash there left the rows in, no marker and no word to the caller, and the
    # rerun loaded every row twice. The marker goes in the closing batch now.
    work = tmp_path / "killed-closing"
    shutil.copytree(tmp_path / "image-staged", work)
    code = _commit_in_child(work, work / "staging" / staging.name, None, mark,
                            "kill-before-close")
    assert code == -signal.SIGKILL
    with pytest.raises(_ingest.AlreadyLoaded, match="loaded its 60 rows"):
        run_backfill(str(src), into=work, queue="q", priority_col="p", spark=spark)
    assert check_consistent(work)["q"][0] == len(old | loaded)

    # The next backfill after a crash cleans the old staging directory and loads
    # everything once (here: segments moved but never ingested, then compacted).
    work = tmp_path / "after-moved"
    with qstore.open(work, compactor=False) as s:
        s.queue("q").purge()
    assert (work / "staging" / staging.name).exists()
    result = run_backfill(str(src), into=work, queue="q", priority_col="p", spark=spark)
    assert result.loaded == 60
    assert os.listdir(work / "staging") == []
    assert {b for _, _, b in drain(work, "q")} == loaded
    check_consistent(work)


def test_a_close_that_cannot_delete_the_marker_says_so_and_the_job_stands(
        spark: Any, tmp_path: Path, monkeypatch: Any, caplog: Any) -> None:
    # The marker of a job into a store the backfill opened goes in the close's
    # last batch. A close that could not write it (a full disk) returned as
    # usual: the job reported success, and a rerun was refused as if it had been
    # killed, with nothing said (a review). It is logged now; the rows stand.
    from qstore import _core

    src = write_parquet(tmp_path / "src.parquet", payload=[b"r%d" % i for i in range(20)])
    real = _core.Core._close_writer

    def full_disk_close(self: Any) -> Any:
        def refused(*args: Any, **kwargs: Any) -> None:
            raise StorageError("metadata write failed: [Errno 28] No space left on device")
        self.meta.write = refused
        try:
            return real(self)
        finally:
            del self.meta.write

    monkeypatch.setattr(_core.Core, "_close_writer", full_disk_close)
    with caplog.at_level("WARNING", logger="qstore.backfill"):
        result = run_backfill(str(src), into=tmp_path / "store", queue="q", spark=spark)
    monkeypatch.undo()
    assert result.loaded == 20
    assert any("could not delete the job's marker" in r.getMessage() for r in caplog.records)
    assert len(_markers(tmp_path / "store")) == 1
    with pytest.raises(_ingest.AlreadyLoaded):  # as the log said
        run_backfill(str(src), into=tmp_path / "store", queue="q", spark=spark)
    assert check_consistent(tmp_path / "store")["q"][0] == 20


def test_a_report_that_cannot_be_written_is_no_failed_run(
        spark: Any, tmp_path: Path, monkeypatch: Any) -> None:
    # The report moved before Spark stops, inside the except that turns a failed
    # run into "nothing was loaded", exit 3: a broken pipe there said so after the
    # rows were in (and their marker gone), and the rerun it invited loaded them
    # twice (a review). A broken pipe is exit 141, as for every command.
    from qstore import cli

    src = write_parquet(tmp_path / "src.parquet", payload=[b"a", b"b", b"c"])

    def gone(result: Any) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_report_backfill", gone)
    r = backfill_cli(src, "--queue", "q", "--into", tmp_path / "store")
    assert r.exit_code == 141, r.output
    assert "nothing was loaded" not in r.output
    assert check_consistent(tmp_path / "store")["q"][0] == 3


def _markers(store: Path) -> dict[str, list[Any]]:
    """The backfill job markers in ``store``: job id -> decoded record."""
    with qstore.open(store, readonly=True) as s:
        return {key[len(keys.BACKFILL_JOB):].decode(): records.unpack(raw, "backfill job",
                                                                      _ingest.MARKER_VERSIONS)
                for key, raw in s.core.meta.scan(keys.BACKFILL_JOB,
                                                 keys.prefix_end(keys.BACKFILL_JOB))}


def test_a_rerun_after_a_kill_is_refused_even_when_another_job_ran_between(
        spark: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """Job A killed after its ingestion, then another job B, then A again (an audit):
    B's start deleted A's marker with its own, so the rerun of A loaded every row a
    second time and succeeded. B settles A (its rejects get ``_SUCCESS``) and keeps
    its marker: the rerun is refused, and each row is in the store once."""
    src_a = write_parquet(tmp_path / "a.parquet", payload=[b"a%d" % i for i in range(20)]
                          + [None], p=list(range(21)))
    src_b = write_parquet(tmp_path / "b.parquet", payload=[b"b%d" % i for i in range(5)],
                          p=list(range(5)))
    store, image, work = tmp_path / "store", tmp_path / "image-staged", tmp_path / "work"

    def keep_staged(step: str) -> None:
        if step == "staged":
            shutil.copytree(store, image)

    monkeypatch.setattr(_ingest, "step_hook", keep_staged)
    run_backfill(str(src_a), into=store, queue="q", priority_col="p", spark=spark)
    monkeypatch.setattr(_ingest, "step_hook", None)
    shutil.copytree(image, work)
    (staging,) = (work / "staging").iterdir()
    mark_a = _ingest.job_fingerprint(str(src_a), "parquet", "q",
                                     ("payload", "p", None, None, None))
    assert _commit_in_child(work, staging, "ingested", mark_a) == -signal.SIGKILL
    (rejects_a,) = (work / "rejects").iterdir()
    assert not (rejects_a / "_SUCCESS").exists()
    # Version 3: builds before version 2 settle and delete every version 1 marker
    # (this one too, then the rerun below loaded twice); they refuse a version 3.
    assert [m[0] for m in _markers(work).values()] == [_ingest.MARKER_UNSETTLED] == [3]

    assert run_backfill(str(src_b), into=work, queue="q", priority_col="p",
                        spark=spark).loaded == 5
    assert (rejects_a / "_SUCCESS").exists()  # B settled A's job...
    assert [m[0] for m in _markers(work).values()] == [_ingest.MARKER_SETTLED]  # ...kept
    check_consistent(work)  # a kept marker is no finding
    with pytest.raises(_ingest.AlreadyLoaded, match="loaded its 20 rows"):
        run_backfill(str(src_a), into=work, queue="q", priority_col="p", spark=spark)
    assert [m[0] for m in _markers(work).values()] == [_ingest.MARKER_SETTLED]  # kept
    assert check_consistent(work)["q"][0] == 25
    bodies = [b for _, _, b in drain(work, "q")]
    assert sorted(bodies) == sorted([b"a%d" % i for i in range(20)]
                                    + [b"b%d" % i for i in range(5)])  # each once


def test_settling_keeps_other_jobs_markers_once_settled_until_their_rerun(
        tmp_path: Path) -> None:
    """The marker's lifetime: a later job settles it once (``_SUCCESS``, reported,
    version 2) and keeps it while the job it names has not run with ``again``;
    a rerun without it is refused and changes nothing; a marker naming no job
    (a DataFrame) goes at once."""
    rejects = tmp_path / "rejects-a"
    rejects.mkdir()
    with qstore.open(tmp_path / "store", compactor=False) as s:
        s.core.write_synced([  # "a" as this build writes it, "df" as builds before 2 did
            (keys.backfill_job_key("a"), records.pack([3, 7, str(rejects), "job-a"])),
            (keys.backfill_job_key("df"), records.pack([1, 3, None, None])),
        ])
        assert sorted(_ingest.settle_loaded(s, "job-b")) == [("a", 7), ("df", 3)]
        assert (rejects / "_SUCCESS").exists()
        (rejects / "_SUCCESS").unlink()
        assert _ingest.settle_loaded(s, None) == []  # settled: not again
        assert not (rejects / "_SUCCESS").exists()
        for _ in range(2):  # refused each time: a refusal changes nothing
            with pytest.raises(_ingest.AlreadyLoaded, match="job a: .* its 7 rows"):
                _ingest.settle_loaded(s, "job-a")
        assert _ingest.settle_loaded(s, "job-a", again=True) == []  # asked to: it goes
        assert s.check().ok
    assert _markers(tmp_path / "store") == {}


def test_a_marker_of_a_newer_build_refuses_the_backfill_saying_why(tmp_path: Path) -> None:
    # It said "unsupported backfill job record version: [9, 7, ..." cut at 80
    # characters, naming neither the job nor what to do (a cross-version audit).
    with qstore.open(tmp_path / "store", compactor=False) as s:
        s.core.write_synced([(keys.backfill_job_key("j1"), records.pack([9, 7, None, "x"]))])
        with pytest.raises(StorageError, match=r"marker of backfill j1 .*version 9.*newer qstore"
                           r".*cannot tell whether that job's rows are loaded"):
            _ingest.settle_loaded(s, "job-b")
        s.core.write_synced([(keys.backfill_job_key("j1"), b"\xc1")])  # not a record at all
        with pytest.raises(StorageError, match="marker of backfill j1 .* is damaged"):
            _ingest.settle_loaded(s, "job-b")  # was msgpack's FormatError, a traceback


def _segment_files(store: Path) -> list[str]:
    return sorted(n for n in os.listdir(store / "payload") if n.endswith(".seg"))


def test_a_commit_that_raises_in_an_open_store_withdraws_its_segments(
        spark: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """A load that failed after moving its segments into ``payload/`` left them
    there until the store's next open: a server kept their disk space (on a
    full disk, what the load needed) and its check reported them as orphans."""
    src = write_parquet(tmp_path / "src.parquet", payload=[b"n%d" % i for i in range(20)]
                        + [None], p=list(range(21)))
    store, rejects = tmp_path / "store", tmp_path / "rejects"

    def fail(step: str) -> None:
        if step == "moved":
            raise StorageError("injected: the ingestion's disk is full")

    with qstore.open(store, compactor=False) as s:
        s.create_queue("q").push(b"old")
        before = _segment_files(store)
        monkeypatch.setattr(_ingest, "step_hook", fail)
        with pytest.raises(StorageError, match="injected"):
            run_backfill(str(src), into=s, queue="q", priority_col="p", spark=spark,
                         rejects=str(rejects))
        monkeypatch.setattr(_ingest, "step_hook", None)
        assert _segment_files(store) == before
        assert s.check().ok, s.check().findings
        assert not rejects.exists() or os.listdir(rejects) == []  # withdrawn
        assert s.queue("q").stats().ready == 1
        result = run_backfill(str(src), into=s, queue="q", priority_col="p", spark=spark,
                              rejects=str(tmp_path / "rejects2"))
        assert (result.loaded, result.rejected) == (20, 1)
    assert check_consistent(store)["q"][0] == 21


def test_a_commit_that_raises_after_its_ingestion_landed_keeps_the_load(
        spark: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """The database holds the job's marker: every row is in, so neither its
    segments nor its rejects are withdrawn, and the next job settles it."""
    src = write_parquet(tmp_path / "src.parquet", payload=[b"n%d" % i for i in range(20)]
                        + [None], p=list(range(21)))
    store, rejects = tmp_path / "store", tmp_path / "rejects"
    with qstore.open(store, compactor=False) as s:
        s.create_queue("q")
        ingest = s.core.ingest

        def ingest_then_fail(*args: Any, **kwargs: Any) -> None:
            ingest(*args, **kwargs)
            raise KeyboardInterrupt

        monkeypatch.setattr(s.core, "ingest", ingest_then_fail)
        with pytest.raises(KeyboardInterrupt):
            run_backfill(str(src), into=s, queue="q", priority_col="p", spark=spark,
                         rejects=str(rejects))
        monkeypatch.undo()
        assert s.queue("q").stats().ready == 20
        assert [f.kind for f in s.check().findings] == []
    assert len(list(rejects.glob("*.parquet"))) == 1
    assert check_consistent(store)["q"][0] == 20
    assert len(drain(store, "q")) == 20


def test_the_spark_submit_entry_point_runs_the_qstore_backfill_command() -> None:
    entry = [str(ROOT / "spark" / "backfill.py")]
    run = subprocess.run([sys.executable, *entry, "--help"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Usage: ")
    assert "SOURCE..." in run.stdout and "--dedup / --no-dedup" in run.stdout
    assert "Exit codes" in run.stdout
    # Bad usage is the command's own: the same message and exit code as `qstore backfill`.
    run = subprocess.run([sys.executable, *entry, "src.parquet", "--into", "store"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "Missing option '--queue'" in run.stderr


# -- the partition writer on its own ------------------------------------------------


def _ingest_into_fresh_db(staging: Path, ssts: list[str], path: Path) -> dict[bytes, bytes]:
    db = MetaDB(str(path), readonly=False, store_path=str(path))
    try:
        db.ingest([str(staging / "sst" / n) for n in ssts])
        return dict(db.items(b"", b"\xff"))  # every key starts with an ASCII letter
    finally:
        db.close()


def test_staged_files_are_byte_identical_to_what_push_many_writes(tmp_path: Path,
                                                                   clock: Any) -> None:
    items = [(b"body%d" % i, (i * 3) % 4, 0.0 if i % 4 else 10.0, None if i % 5 else f"k{i}")
             for i in range(25)]
    pushed = tmp_path / "pushed"
    with qstore.open(pushed, compactor=False, clock=clock) as s:
        q = s.create_queue("q", order="min", dedup=True)
        ids = q.push_many(items)
        qid = s.core.queues["q"].qid
    assert ids == list(range(1, 26))
    spec = LoadSpec(qid=qid, order="min", priority_type="int", dedup=True, now=clock(),
                    max_payload_bytes=1 << 20, segment_max_bytes=1 << 20, payload_col="b",
                    priority_col="p", delay_col="d", dedup_col="k")
    staging = tmp_path / "staging"
    for sub in ("seg", "sst", "rejects"):
        (staging / sub).mkdir(parents=True)
    loader = PartitionLoader(spec, PartitionPlan(0, 25, 1, [1]), str(staging), "t")
    cols = list(zip(*items, strict=True))
    loader.add(pa.RecordBatch.from_pydict(
        {"b": list(cols[0]), "p": list(cols[1]), "d": list(cols[2]), "k": list(cols[3])}))
    summary = loader.finish()
    assert summary["segments"] == [{"file_id": 1, "live_bytes": sum(8 + len(b) for b in cols[0]),
                                    "live_count": 25, "end": os.path.getsize(
                                        staging / "seg" / fmt.segment_name(1))}]
    staged = _ingest_into_fresh_db(staging, summary["ssts"], tmp_path / "db")
    with qstore.open(pushed, readonly=True) as s:
        per_queue = {k: v for k, v in s.core.meta.scan(b"d", b"s")}
    assert staged == per_queue
    seg = fmt.segment_name(1)
    assert (staging / "seg" / seg).read_bytes() == (pushed / "payload" / seg).read_bytes()


def test_partition_writer_rolls_segments_while_ids_last_and_checks_row_counts(
        tmp_path: Path) -> None:
    spec = LoadSpec(qid=1, order="max", priority_type="int", dedup=False, now=1.0,
                    max_payload_bytes=1000, segment_max_bytes=fmt.HEADER_SIZE + 3 * 108,
                    payload_col="b")
    staging = tmp_path / "staging"
    for sub in ("seg", "sst", "rejects"):
        (staging / sub).mkdir(parents=True)
    batch = pa.RecordBatch.from_pydict({"b": [b"x" * 100] * 7})
    loader = PartitionLoader(spec, PartitionPlan(0, 7, 10, [5, 6, 7]), str(staging), "t")
    loader.add(batch)
    summary = loader.finish()
    assert [(s["file_id"], s["live_count"]) for s in summary["segments"]] == [
        (5, 3), (6, 3), (7, 1)]
    # Out of reserved ids, the last segment takes the rest instead of failing.
    short = PartitionLoader(spec, PartitionPlan(1, 7, 20, [8, 9]), str(staging), "w")
    short.add(batch)
    assert [(s["file_id"], s["live_count"], s["end"]) for s in short.finish()["segments"]] == [
        (8, 3, fmt.HEADER_SIZE + 3 * 108), (9, 4, fmt.HEADER_SIZE + 4 * 108)]
    too_few = PartitionLoader(spec, PartitionPlan(0, 8, 10, [5, 6, 7]), str(staging), "u")
    too_few.add(batch)
    with pytest.raises(RuntimeError, match="not deterministic"):
        too_few.finish()  # closes what it opened, publishes nothing
    too_many = PartitionLoader(spec, PartitionPlan(0, 6, 10, [5, 6, 7]), str(staging), "v")
    with pytest.raises(RuntimeError, match="not deterministic"):
        too_many.add(batch)


def test_row_rules_are_push_rules(tmp_path: Path) -> None:
    """What parse() accepts, push accepts with the same values; what it rejects, push refuses."""
    from decimal import Decimal

    from qstore.spark._rows import parse

    spec = LoadSpec(qid=1, order="max", priority_type="int", dedup=False, now=0.0,
                    max_payload_bytes=8, segment_max_bytes=1 << 20, payload_col="b",
                    priority_col="p", delay_col="d")
    cases: list[tuple[Any, Any, Any, str | None]] = [  # payload, priority, delay, reason
        (b"ok", 3, 1.5, None),
        (b"ok", None, None, None),
        (b"123456789", 1, 0.0, "payload: 9 bytes, over max_payload_bytes 8"),
        (None, 1, 0.0, "payload: null"),
        (b"ok", 1, -0.5, "delay: -0.5 is negative"),
        (b"ok", 1, float("nan"), "delay: nan is not finite"),
        (b"ok", 1, float("inf"), "delay: inf is not finite"),
    ]
    batch = pa.RecordBatch.from_pydict({"b": [c[0] for c in cases], "p": [c[1] for c in cases],
                                        "d": [c[2] for c in cases]})
    assert parse(batch, spec).reasons == [c[3] for c in cases]
    as_text = pa.RecordBatch.from_pydict({"b": ["é", "x", "y", "z", "w"],
                                          "p": [" 7 ", "2.5", "high", str(2**63), "-9"],
                                          "d": ["0", "1e3", "soon", "0", "-1"]})
    rows = parse(as_text, spec)
    assert rows.reasons == [None, "priority: '2.5' is not an integer",
                            "priority: 'high' is not an integer",
                            f"priority: {2**63} is outside signed 64-bit range",
                            "delay: -1.0 is negative"]
    assert bytes(rows.body(0)) == "é".encode()
    assert rows.priorities[0] == 7 and rows.delays[1] == 1000.0
    # Python's int() and float() also read "1_000" and other scripts' digits,
    # which push's ints never are: rejected as they would be in push.
    odd = pa.RecordBatch.from_pydict({"b": ["x", "y", "z"], "p": ["1_000", "\u0663", "1"],
                                      "d": ["0", "0", "1_0"]})
    assert parse(odd, spec).reasons == ["priority: '1_000' is not an integer",
                                        "priority: '\u0663' is not an integer",
                                        "delay: '1_0' is not a number of seconds"]
    numeric = pa.RecordBatch.from_pydict({"b": [b"a", b"b", b"c"],
                                          "p": [Decimal("4"), Decimal("4.5"), None],
                                          "d": [Decimal("2.5"), None, Decimal("1")]})
    rows = parse(numeric, spec)
    assert rows.reasons == [None, "priority: 4.5 is not an integer", None]
    assert rows.priorities.tolist() == [4, 0, 0] and rows.delays.tolist() == [2.5, 0.0, 1.0]
    # The same values through push: accepted ones load, rejected ones raise.
    with qstore.open(tmp_path / "s", compactor=False, max_payload_bytes=8) as s:
        q = s.create_queue("q")
        for body, prio, delay, reason in cases:
            args = (body, prio, 0.0 if delay is None else delay)
            if reason is None:
                q.push(*args)
            else:
                with pytest.raises(qstore.InvalidArgument):
                    q.push(*args)


def test_equal_length_payloads_stage_the_bytes_push_many_writes(tmp_path: Path,
                                                                clock: Any) -> None:
    """Batches whose payloads all have one length take a faster path: same bytes."""
    items = [(b"%04d" % i * 50, (i * 7) % 300 - 150, 0.0 if i % 3 else 2.5) for i in range(90)]
    pushed = tmp_path / "pushed"
    with qstore.open(pushed, compactor=False, clock=clock) as s:
        q = s.create_queue("q")
        ids = q.push_many(items)
        qid = s.core.queues["q"].qid
    spec = LoadSpec(qid=qid, order="max", priority_type="int", dedup=False, now=clock(),
                    max_payload_bytes=1 << 20, segment_max_bytes=1 << 20, payload_col="b",
                    priority_col="p", delay_col="d")
    staging = tmp_path / "staging"
    for sub in ("seg", "sst", "rejects"):
        (staging / sub).mkdir(parents=True)
    loader = PartitionLoader(spec, PartitionPlan(0, 90, ids[0], [1]), str(staging), "t")
    cols = list(zip(*items, strict=True))
    for lo in (0, 40):  # two batches, each one chunk
        hi = 40 if lo == 0 else 90
        loader.add(pa.RecordBatch.from_pydict(
            {"b": list(cols[0][lo:hi]), "p": list(cols[1][lo:hi]), "d": list(cols[2][lo:hi])}))
    summary = loader.finish()
    seg = fmt.segment_name(1)
    assert summary["segments"][0]["end"] == os.path.getsize(staging / "seg" / seg)
    staged = _ingest_into_fresh_db(staging, summary["ssts"], tmp_path / "db")
    with qstore.open(pushed, readonly=True) as s:
        per_queue = {k: v for k, v in s.core.meta.scan(b"d", b"s")}
    assert staged == per_queue
    assert (staging / "seg" / seg).read_bytes() == (pushed / "payload" / seg).read_bytes()


# -- TTL column (issue 13) -------------------------------------------------------


def test_ttl_rows_stage_the_bytes_push_many_writes_with_the_queue_default(
        tmp_path: Path, clock: Any) -> None:
    """A TTL per row, or the queue's default for a null one: the same records (version 2),
    expiry keys and segment bytes as push_many with the same ttls."""
    items = [(b"t%03d" % i, i % 3, 5.0 if i % 4 == 0 else 0.0, None,
              None if i % 3 == 0 else 0.5 + i * 10) for i in range(30)]
    pushed = tmp_path / "pushed"
    with qstore.open(pushed, compactor=False, clock=clock) as s:
        q = s.create_queue("q", ttl=600.0)
        ids = q.push_many(items)
        qid = s.core.queues["q"].qid
    spec = LoadSpec(qid=qid, order="max", priority_type="int", dedup=False, now=clock(),
                    max_payload_bytes=1 << 20, segment_max_bytes=1 << 20, payload_col="b",
                    priority_col="p", delay_col="d", ttl_col="t", default_ttl=600.0)
    staging = tmp_path / "staging"
    for sub in ("seg", "sst", "rejects"):
        (staging / sub).mkdir(parents=True)
    loader = PartitionLoader(spec, PartitionPlan(0, 30, ids[0], [1]), str(staging), "t")
    cols = list(zip(*items, strict=True))
    loader.add(pa.RecordBatch.from_pydict({"b": list(cols[0]), "p": list(cols[1]),
                                           "d": list(cols[2]), "t": list(cols[4])}))
    summary = loader.finish()
    # The earliest timer event of the partition: a due time or an expiry.
    assert summary["min_due_us"] == int((clock() + 5.0) * 1e6)
    staged = _ingest_into_fresh_db(staging, summary["ssts"], tmp_path / "db")
    with qstore.open(pushed, readonly=True) as s:
        per_queue = {k: v for k, v in s.core.meta.scan(b"d", b"s")}
    assert sum(k[:1] == b"e" for k in staged) == 30  # every message has a TTL
    assert staged == per_queue
    seg = fmt.segment_name(1)
    assert (staging / "seg" / seg).read_bytes() == (pushed / "payload" / seg).read_bytes()


def test_ttl_rules_are_push_rules(tmp_path: Path) -> None:
    from qstore.spark._rows import parse

    spec = LoadSpec(qid=1, order="max", priority_type="int", dedup=False, now=0.0,
                    max_payload_bytes=8, segment_max_bytes=1 << 20, payload_col="b",
                    ttl_col="t")
    cases: list[tuple[Any, str | None]] = [  # ttl, reason
        (30.0, None), (None, None), (0.0, "ttl: 0.0 is not > 0"),
        (-1.0, "ttl: -1.0 is not > 0"), (float("nan"), "ttl: nan is not finite"),
        (1e12, "ttl: 1000000000000.0 is over 3162240000 seconds"),
    ]
    batch = pa.RecordBatch.from_pydict({"b": [b"x"] * len(cases), "t": [c[0] for c in cases]})
    rows = parse(batch, spec)
    assert rows.reasons == [c[1] for c in cases]
    assert rows.ttls is not None and rows.ttls[0] == 30.0 and np.isnan(rows.ttls[1])
    text = parse(pa.RecordBatch.from_pydict({"b": [b"x", b"y"], "t": [" 9 ", "soon"]}), spec)
    assert text.reasons == [None, "ttl: 'soon' is not a number of seconds"]
    assert text.ttls is not None and text.ttls[0] == 9.0
    # A null TTL takes the queue's default; without a column every row does.
    with_default = LoadSpec(**{**spec.__dict__, "default_ttl": 45.0})
    assert parse(batch, with_default).ttls[1] == 45.0  # type: ignore[index]
    no_col = LoadSpec(**{**spec.__dict__, "ttl_col": None, "default_ttl": 45.0})
    assert parse(batch, no_col).ttls.tolist() == [45.0] * len(cases)  # type: ignore[union-attr]
    assert parse(batch, LoadSpec(**{**spec.__dict__, "ttl_col": None})).ttls is None
    with qstore.open(tmp_path / "s", compactor=False) as s:
        q = s.create_queue("q")
        for ttl, reason in cases:
            if reason is None:
                q.push(b"x", ttl=ttl)
            else:
                with pytest.raises(qstore.InvalidArgument):
                    q.push(b"x", ttl=ttl)


def test_ttl_column_loads_expiring_messages_and_the_audit_checks_the_expiry_index(
        spark: Any, tmp_path: Path) -> None:
    n = 12
    ttls = [None if i % 3 == 0 else 100.0 * (i + 1) for i in range(n)]
    src = write_parquet(tmp_path / "src.parquet", payload=[b"m%d" % i for i in range(n)],
                        ttl=pa.array(ttls, pa.float64()))
    store = tmp_path / "store"
    with qstore.open(store, compactor=False) as s:
        s.create_queue("q", ttl=5000.0, on_expire="dead")
    before = time.time()
    result = run_backfill(str(src), into=store, queue="q", ttl_col="ttl", spark=spark)
    after = time.time()
    assert result.loaded == n
    check_consistent(store)
    with qstore.open(store, readonly=True) as s:
        q = s.queue("q")
        for i, mid in enumerate(range(result.first_id, result.end_id)):
            got = q.get(mid).expires_at
            ttl = 5000.0 if ttls[i] is None else ttls[i]
            assert got is not None and before + ttl - 1e-3 <= got <= after + ttl, i
    # The messages expire on the clock as pushed ones do: dead letters, counted.
    with qstore.open(store, compactor=False, clock=FakeClock(after + 650)) as s:
        stats = s.queue("q").stats()
        assert (stats.ready, stats.dead, stats.expired) == (n - 4, 4, 4)  # ttl 200..600
    snap = tmp_path / "snap"
    with qstore.open(store, compactor=False) as s:
        s.snapshot(str(snap))
    assert run_audit(str(snap), spark=spark, out=str(tmp_path / "a"), quiet=True).exit_code == 0


# -- the direct path for Parquet files ---------------------------------------------


@pytest.mark.parametrize("runner", ["rdd", "data source"])
def test_parquet_files_are_read_by_the_tasks_in_file_then_row_order(
        spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runner: str) -> None:
    """Files in name order, row groups split across tasks; the same messages as Spark's
    reader loads (the DataFrame of the same files), rejects included. The tasks run as
    an RDD job, or (Spark Connect, no SparkContext) through the data source."""
    from qstore.spark import _bulk_files, backfill

    calls = []
    real_run_parts = _bulk_files.run_parts

    def run_parts(*args: Any) -> list[str]:
        calls.append(len(args[3]))
        return real_run_parts(*args)

    monkeypatch.setattr(_bulk_files, "run_parts", run_parts)
    if runner == "data source":
        monkeypatch.setattr(backfill, "_context", lambda spark: None)
    src = tmp_path / "src"
    src.mkdir()
    rows = []
    for f, n in (("b.parquet", 70), ("a.parquet", 50), ("c.parquet", 1)):
        bodies = [None if i == 3 else b"%s-%d" % (f.encode(), i) for i in range(n)]
        prios = [i % 4 for i in range(n)]
        pq.write_table(pa.table({"payload": pa.array(bodies, pa.binary()),
                                 "prio": pa.array(prios, pa.int64())}), src / f,
                       row_group_size=20)
        rows.append((f, bodies, prios))
    (src / "_SUCCESS").write_bytes(b"")  # not data: skipped, as Spark skips it
    store = tmp_path / "store"
    result = run_backfill(str(src), into=store, queue="q", priority_col="prio", spark=spark)
    assert [name for name, _ in result.phases] == ["plan", "write", "commit"]
    assert result.partitions >= 2  # at least one task per core
    assert calls == ([result.partitions] if runner == "rdd" else [])
    assert (result.rows, result.loaded, result.rejected) == (121, 119, 2)
    in_order = [(b, p) for _, bodies, prios in sorted(rows) for b, p in zip(bodies, prios,
                                                                           strict=True)]
    check_consistent(store)
    got = {m[0]: (m[2], m[1]) for m in drain(store, "q")}
    want = {result.first_id + i: bp for i, bp in enumerate(in_order) if bp[0] is not None}
    assert got == want  # id = position in file-name order, then row order
    rejects = pq.read_table(result.rejects_path).to_pylist()
    # Row 3 of a.parquet and of b.parquet; each file starts a task here.
    assert sorted((r["source_row"], r["prio"], r["reject_reason"]) for r in rejects) == [
        (3, 3, "payload: null")] * 2
    assert len({r["source_partition"] for r in rejects}) == 2
    # Spark's own reader (a DataFrame source) loads the same messages.
    spark_store = tmp_path / "spark-store"
    df = spark.read.parquet(str(src))
    other = run_backfill(df, into=spark_store, queue="q", priority_col="prio", spark=spark)
    assert [name for name, _ in other.phases] == ["count", "write", "commit"]
    assert sorted(v for v in got.values()) == sorted(
        (m[2], m[1]) for m in drain(spark_store, "q"))


def test_sources_the_direct_path_cannot_take_go_through_spark(spark: Any,
                                                              tmp_path: Path) -> None:
    hive = tmp_path / "hive" / "day=1"
    write_parquet(hive / "part.parquet", payload=[b"x", b"y"])
    result = run_backfill(str(tmp_path / "hive"), into=tmp_path / "s1", queue="q", spark=spark)
    assert result.phases[0][0] == "count" and result.loaded == 2
    src = write_parquet(tmp_path / "d.parquet", payload=[b"x", b"x", b"y"])
    result = run_backfill(str(src), into=tmp_path / "s2", queue="q", spark=spark,
                          create_queue_options={"dedup": True})
    assert result.phases[0][0] == "count" and (result.loaded, result.duplicates) == (2, 1)


def test_a_directory_with_a_subdirectory_loads_the_same_rows_on_both_paths(
        spark: Any, tmp_path: Path) -> None:
    # The direct path walked every subdirectory, Spark's reader does not: a plain
    # queue got archive/'s row and a dedup queue (Spark's reader) did not, both
    # exit 0 (a backfill audit). Spark's listing decides for both now.
    src = tmp_path / "events"
    write_parquet(src / "part-0.parquet", payload=[b"top-1", b"top-2"])
    write_parquet(src / "archive" / "part-0.parquet", payload=[b"archive-1"])
    loaded = {}
    for name, options in (("plain", {}), ("dedup", {"dedup": True})):
        result = run_backfill(str(src), into=tmp_path / name, queue="q", spark=spark,
                              create_queue_options=options)
        assert result.phases[0][0] == "count"  # Spark's reader, not the direct path
        loaded[name] = sorted(b for _, _, b in drain(tmp_path / name, "q"))
    assert loaded["plain"] == loaded["dedup"]


def test_a_parquet_file_without_a_column_the_others_have_is_a_usage_error(
        spark: Any, tmp_path: Path) -> None:
    # Spark takes the schema from one file: with the file lacking "prio" named
    # b.parquet its rows loaded at priority 0, exit 0; named a.parquet the job
    # said the column was missing (a backfill audit). Both are refused now.
    src = tmp_path / "src"
    write_parquet(src / "a.parquet", payload=[b"x"], prio=[5])
    write_parquet(src / "b.parquet", payload=[b"y"])
    run = backfill_cli(src, "--format", "parquet", "--queue", "q", "--priority-col", "prio",
                       "--into", tmp_path / "store")
    assert run.exit_code == 2, run.output
    text = " ".join(run.output.split())
    assert f"the Parquet file {src / 'b.parquet'} has no column 'prio'" in text


def test_a_partition_directory_naming_a_file_column_is_a_usage_error(
        spark: Any, tmp_path: Path) -> None:
    # p=1/ and p=2/ whose rows hold p = 101 and 102 loaded at priorities 1 and 2.
    src = tmp_path / "src"
    write_parquet(src / "p=1" / "part.parquet", payload=[b"x"], p=[101])
    write_parquet(src / "p=2" / "part.parquet", payload=[b"y"], p=[102])
    run = backfill_cli(src, "--format", "parquet", "--queue", "q", "--priority-col", "p",
                       "--into", tmp_path / "store")
    assert run.exit_code == 2, run.output
    assert "is both a column of the Parquet file" in " ".join(run.output.split())


def test_a_name_with_an_equals_sign_above_the_source_is_no_partition(tmp_path: Path) -> None:
    # Only directories below the source are partitions, as Spark finds them: an
    # export under day=2024-01-01/ whose files have a day column was refused (a
    # review of the per-file column check).
    from qstore.spark._bulk_files import check_file_columns

    src = tmp_path / "day=2024-01-01" / "export"
    f = write_parquet(src / "a.parquet", payload=[b"x"], day=["2024-01-01"])
    check_file_columns([f"file://{f}"], ["payload", "day"], [str(src)])
    below = write_parquet(src / "day=2" / "b.parquet", payload=[b"y"], day=["2"])
    with pytest.raises(qstore.InvalidArgument, match="is both a column"):
        check_file_columns([f"file://{below}"], ["payload", "day"], [str(src)])


def test_plan_files_cuts_whole_row_groups_in_file_order(tmp_path: Path) -> None:
    from qstore.spark import _bulk_files as bf

    for name, n in (("x.parquet", 10), ("w.parquet", 25)):
        pq.write_table(pa.table({"p": [b"."] * n, "q": list(range(n))}), tmp_path / name,
                       row_group_size=10)
    parts = bf.plan_files([str(tmp_path)], ["p", "q"], cores=2)
    assert parts is not None
    # 35 rows over 2 cores: whole row groups, none of the parts over 18 rows.
    assert [p.rows for p in parts] == [10, 15, 10]
    w, x = str(tmp_path / "w.parquet"), str(tmp_path / "x.parquet")
    assert [p.groups for p in parts] == [((w, (0,)),), ((w, (1, 2)),), ((x, (0,)),)]
    assert bf.parts_from_json(bf.parts_to_json(parts)) == parts
    got = [b.num_rows for p in parts for b in bf.read_part(p, ["p"])]
    assert sum(got) == 35
    assert bf.plan_files([str(tmp_path)], ["p", "missing"], cores=2) is None
    assert bf.plan_files(["hdfs://host/x"], ["p"], cores=2) is None
    pq.write_table(pa.table({"p": [1], "q": [1]}), tmp_path / "y.parquet")  # p: another type
    assert bf.plan_files([str(tmp_path)], ["p", "q"], cores=2) is None
