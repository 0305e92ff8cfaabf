"""A backfill into a store that ``qstore serve`` owns: the server runs the job on
its own store while its clients go on (contract section 6: every command that
changes a store works while a server owns it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import qstore
from qstore.cli import main as qstore_cli
from qstore.spark import _ingest
from qstore.spark.backfill import run_backfill

from ..server._support import serving

pytestmark = pytest.mark.spark


def _parquet(path: Path, **columns: list[Any]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return str(path)


def test_a_backfill_through_the_server_loads_while_clients_go_on(
        spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = str(tmp_path / "store")
    src = _parquet(tmp_path / "src" / "rows.parquet",
                   payload=[b"row %d" % i for i in range(40)], p=[i % 4 for i in range(40)])
    with serving(store) as address, qstore.connect(address) as client:
        q = client.create_queue("q")
        q.push(b"before", priority=9)
        monkeypatch.chdir(tmp_path)  # a relative SOURCE is this machine's path
        r = CliRunner().invoke(qstore_cli, ["backfill", os.path.relpath(src, tmp_path),
                                            "--into", store, "--queue", "q",
                                            "--priority-col", "p"])
        assert r.exit_code == 0, r.output
        assert "loaded 40 of 40 rows" in r.output
        q.push(b"after", priority=9)  # the server kept serving
        got = q.pop_many(100)
        assert [m.payload for m in got[:2]] == [b"before", b"after"]
        assert sorted(m.payload for m in got[2:]) == sorted(b"row %d" % i for i in range(40))
        assert [m.priority for m in got[2:]] == sorted((i % 4 for i in range(40)), reverse=True)
        assert client.check().ok
        assert not os.listdir(os.path.join(store, "staging"))
        # Through an address, paths must be absolute: they name the server's files.
        r = CliRunner().invoke(qstore_cli, ["backfill", "rows.parquet", "--into", address,
                                            "--queue", "q"])
        assert r.exit_code == 2 and "absolute" in r.output
        assert q.stats().ready == 0 and q.stats().in_flight == 42


def test_a_key_pushed_while_a_shared_store_backfills_makes_the_commit_load_nothing(
        spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _parquet(tmp_path / "src" / "rows.parquet",
                   payload=[b"row %d" % i for i in range(20)], key=[f"k{i}" for i in range(20)])
    with qstore.open(str(tmp_path / "store"), compactor=False) as store:
        q = store.create_queue("d", dedup=True)
        pushed = []

        def push_during(step: str) -> None:
            if step == "staged":  # after the job looked the keys up, before its commit
                pushed.append(q.push(b"a live one", dedup_key="k7"))
                with pytest.raises(qstore.QStoreError, match="already running"):
                    run_backfill(src, into=store, queue="d", spark=spark)

        monkeypatch.setattr(_ingest, "step_hook", push_during)
        with pytest.raises(qstore.QStoreError, match="pushed while it ran"):
            run_backfill(src, into=store, queue="d", dedup_col="key", spark=spark)
        monkeypatch.setattr(_ingest, "step_hook", None)
        assert q.stats().ready == 1 and [m.id for m in q.peek(5)] == pushed
        assert q.push(b"again", dedup_key="k7") == pushed[0]  # still the only owner
        assert store.check().ok
        assert not os.listdir(os.path.join(store.path, "staging"))
        # Run again, it loads the rest; k7 is a duplicate of the live message.
        result = run_backfill(src, into=store, queue="d", dedup_col="key", spark=spark)
        assert (result.loaded, result.duplicates) == (19, 1)
        assert q.stats().ready == 20 and store.check().ok


def test_segments_loaded_into_an_open_store_are_in_its_stats_snapshots_and_compaction(
        spark: Any, tmp_path: Path) -> None:
    # The loaded segments were known to the metadata but not to the open store's
    # segment set until a message of them was read: stats() left them out, and a
    # snapshot taken before such a read missed them (its check: missing_segment
    # for every loaded message; Spark audit).
    src = _parquet(tmp_path / "src" / "rows.parquet",
                   payload=[b"row %d" % i for i in range(30)])
    with qstore.open(str(tmp_path / "store"), compactor=False) as store:
        q = store.create_queue("q")
        q.push(b"before")
        before = {s.file_id for s in store.stats().segments}
        run_backfill(src, into=store, queue="q", spark=spark)
        segs = {s.file_id: s for s in store.stats().segments}
        loaded = set(segs) - before
        assert loaded and sum(segs[f].live_count for f in loaded) == 30
        snap = str(tmp_path / "snap")
        store.snapshot(snap)
        with qstore.open(snap, readonly=True) as view:
            report = view.check()
            assert report.ok, report.summary()
            assert sorted(m.payload for m in view.queue("q").peek(31)) == sorted(
                [b"before", *(b"row %d" % i for i in range(30))])
