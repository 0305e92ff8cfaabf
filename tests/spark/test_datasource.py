"""The ``qstore`` data source: rows, columns, options, partitions and pushed-down filters."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import functions as F  # noqa: N812
from pyspark.sql.datasource import InputPartition
from pyspark.sql.pandas.types import to_arrow_schema

import qstore
from qstore.spark._datasource import QStoreReader, ReadSettings, spark_schema
from qstore.spark._scan import message_schema, scan_snapshot
from tests.conftest import FakeClock

from .conftest import Snap

pytestmark = pytest.mark.spark


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    return sorted(table.to_pylist(), key=lambda r: (r["queue"], r["id"]))


@pytest.mark.parametrize("options", [{}, {"payload": True, "verify": True, "check_index": True}])
def test_spark_schema_is_exactly_the_arrow_schema_of_the_batches(options: dict[str, bool]) -> None:
    schema = message_schema(**options)
    assert to_arrow_schema(spark_schema(schema), timezone="UTC").equals(schema)


def test_rows_match_the_store(spark: Any, clean_snap: Snap) -> None:
    rows = _rows(spark.read.format("qstore").load(clean_snap.path).toArrow())
    counts = Counter((r["queue"], r["state"]) for r in rows)
    for name, st in clean_snap.stats.items():
        assert (counts[(name, "ready")], counts[(name, "delayed")], counts[(name, "in_flight")],
                counts[(name, "dead")]) == (st.ready, st.delayed, st.in_flight, st.dead), name
        assert sum(r["length"] for r in rows if r["queue"] == name) == st.bytes
    assert {(r["queue"], r["id"]) for r in rows} == set(clean_snap.payloads)
    with qstore.open(clean_snap.path, readonly=True) as snap_store:
        for r in rows:
            m = snap_store.queue(r["queue"]).get(r["id"])
            priority = r["priority_int"] if r["priority_int"] is not None else r["priority_str"]
            assert (priority, r["state"], r["attempts"], r["enqueued_at"]) == \
                (m.priority, m.state, m.attempts, m.enqueued_at)
            assert r["length"] == len(m.payload)
            if m.state == "in_flight":
                assert r["due_or_deadline"] == pytest.approx(m.lease_deadline)
    tags = [r for r in rows if r["queue"] == "tags"]
    assert all(r["priority_int"] is None and len(r["dedup_digest"]) == 16 for r in tags)
    jobs = [r for r in rows if r["queue"] == "jobs"]
    assert all(r["priority_str"] is None and r["dedup_digest"] is None for r in jobs)
    delayed = [r for r in jobs if r["state"] == "delayed"]
    assert len(delayed) == 4 and all(r["due_or_deadline"] > r["enqueued_at"] for r in delayed)
    assert all(r["due_or_deadline"] is None for r in rows if r["state"] in ("ready", "dead"))


def test_payload_option_adds_the_bodies(spark: Any, clean_snap: Snap) -> None:
    df = spark.read.format("qstore").option("payload", "true").load(clean_snap.path)
    assert df.columns[-1] == "payload"
    got = {(r["queue"], r["id"]): r["payload"] for r in df.toArrow().to_pylist()}
    assert got == clean_snap.payloads


def test_reads_are_split_into_several_partitions(spark: Any, clean_snap: Snap) -> None:
    df = (spark.read.format("qstore").option("partitions", "6").load(clean_snap.path)
          .select("queue", "id", F.spark_partition_id().alias("part")))
    rows = df.collect()
    assert len({r["part"] for r in rows}) >= 6  # jobs gets 4 of them, tags and poison 1 each
    ids = [(r["queue"], r["id"]) for r in rows]
    assert len(ids) == len(set(ids)) == len(clean_snap.payloads)


def test_filters_on_a_reused_dataframe_give_the_right_counts(spark: Any, clean_snap: Snap) -> None:
    # Guards against pushdown: PySpark 4.3 reuses a reader planned with pushed
    # filters for the next query on the same DataFrame that pushes none.
    df = spark.read.format("qstore").load(clean_snap.path)
    ready_tags = df.where("queue = 'tags' and state in ('ready', 'dead')").toArrow()
    assert set(ready_tags["queue"].to_pylist()) == {"tags"}
    assert ready_tags.num_rows == clean_snap.stats["tags"].ready
    assert df.count() == len(clean_snap.payloads)


def test_queue_and_state_options(spark: Any, clean_snap: Snap) -> None:
    df = (spark.read.format("qstore").option("queue", "jobs,poison").option("state", "dead")
          .load(clean_snap.path))
    assert [(r["queue"], r["state"]) for r in df.collect()] == [("poison", "dead")]


def test_queue_option_plans_partitions_of_those_queues_only(clean_snap: Snap) -> None:
    reader = QStoreReader(ReadSettings(clean_snap.path, queues=frozenset({"tags"}),
                                       states=frozenset({"ready"})))
    parts = reader.partitions()
    assert len(parts) == 1
    table = pa.Table.from_batches(list(reader.read(parts[0])))
    assert set(table["queue"].to_pylist()) == {"tags"}
    assert table.num_rows == clean_snap.stats["tags"].ready
    nothing = QStoreReader(ReadSettings(clean_snap.path, queues=frozenset({"empty"})))
    assert nothing.partitions() == []  # a queue with no messages
    assert list(nothing.read(InputPartition(None))) == []  # Spark's placeholder partition
    unknown = QStoreReader(ReadSettings(clean_snap.path, queues=frozenset({"empty", "nope"})))
    with pytest.raises(qstore.InvalidArgument, match="nope"):  # a typo is not zero rows
        unknown.partitions()


@pytest.mark.parametrize("option, value", [("bogus", "1"), ("payload", "yes"),
                                           ("partitions", "0"), ("state", "done")])
def test_bad_options_are_errors(option: str, value: str, clean_snap: Snap) -> None:
    with pytest.raises(qstore.InvalidArgument):
        ReadSettings.from_options({"path": clean_snap.path, option: value})


def test_plain_scan_gives_the_same_table_as_spark(spark: Any, clean_snap: Snap) -> None:
    opts = {"payload": True, "verify": True, "check_index": True}
    plain = scan_snapshot(clean_snap.path, **opts)
    reader = spark.read.format("qstore")
    for key in opts:
        reader = reader.option(key, "true")
    assert _rows(plain) == _rows(reader.load(clean_snap.path).toArrow())
    assert set(plain["problem"].to_pylist()) == {None}
    assert set(plain["index_ok"].to_pylist()) == {True}


def test_ttl_aging_and_dead_reason_columns(spark: Any, tmp_path: Any) -> None:
    clock = FakeClock()
    with qstore.open(str(tmp_path / "s"), clock=clock, compactor=False) as s:
        q = s.create_queue("q", on_expire="dead", aging=10.0, aging_cap=5)
        plain = q.push(b"plain", 1)
        lives = q.push(b"ttl", 2, ttl=100.0)
        dies = q.push(b"expires", 3, ttl=5.0)
        clock.advance(25.0)  # two aging rounds; the 5 s TTL runs out
        assert q.stats().dead == 1
        want = {m: q.get(m) for m in (plain, lives, dies)}
        s.snapshot(str(tmp_path / "snap"))
    rows = {r["id"]: r for r in spark.read.format("qstore").load(str(tmp_path / "snap")).collect()}
    for mid, m in want.items():
        r = rows[mid]
        assert r["expires_at"] == (pytest.approx(m.expires_at) if m.expires_at else None)
        assert r["dead_reason"] == m.dead_reason
        assert r["priority_int"] == m.priority
    assert rows[lives]["expires_at"] == pytest.approx(1_700_000_100.0)
    assert rows[dies]["dead_reason"] == "expired" and rows[dies]["state"] == "dead"
    assert rows[plain]["aged"] == rows[lives]["aged"] == 2  # 25 s at 10 s a level
    assert rows[plain]["priority_int"] == 3 and rows[plain]["expires_at"] is None
