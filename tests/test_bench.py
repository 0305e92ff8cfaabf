"""The benchmark harness's mechanics at a tiny size; no timing assertions (figures are noise).

The harness is tools/bench, imported as ``bench`` (pytest puts tools on the path).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

import feature_overhead
from bench import (
    _interleaved,
    _peers,
    _results,
    _runner,
    _scaling,
    _server,
    _spark,
    _targets,
    run,
)
from bench._plan import MODES

TINY = ["--quick", "--n", "30", "--budget", "0.05", "--quiet"]


@pytest.mark.parametrize("spec", _peers.PEERS, ids=lambda s: s.name)
def test_every_adapter_pushes_pops_and_acks_what_it_was_given(spec: _peers.PeerSpec,
                                                              tmp_path: Any) -> None:
    missing = spec.missing()
    if missing is not None:  # the peers come with the `bench` extra (make install has it)
        pytest.skip(f"{spec.name}: {missing}")
    peer = spec.make(str(tmp_path / "q"), False)
    try:
        peer.fill([(b"a", 1), (b"b", 2)])
        peer.push(b"c", 3)
        peer.push_many([(b"d", 4), (b"e", 5)])
        handles = peer.pop_many(10)
        assert len(handles) == 5
        peer.ack_many(handles[:4])
        peer.ack(handles[4])
        assert peer.pop() is None
    finally:
        peer.close()


def test_every_peer_gets_a_row_and_the_saved_json_renders_the_same_tables(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "results.json")
    assert run([*TINY, "--only", "push,pop_ack", "--dir", str(tmp_path), "--json", out]) == 0
    printed = capsys.readouterr().out
    doc = _results.load(out)
    for workload in ("push", "pop+ack"):
        peers = {r["peer"] for r in doc["rows"] if r["workload"] == workload}
        assert peers == {spec.name for spec in _peers.PEERS}
    assert {t["id"] for t in doc["targets"]} == {t.id for t in _targets.TARGETS}
    assert run(["--show", out]) == 0
    shown = capsys.readouterr().out
    assert printed.replace(f"results written to {out}\n", "") == shown
    assert [p for p in os.listdir(tmp_path) if p.startswith("qstore-bench-")] == []


def test_a_peer_that_is_not_installed_is_reported_not_fatal(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    ghost = dataclasses.replace(_peers.BY_NAME["litequeue"], name="ghost",
                                module="qstore_no_such_module")
    monkeypatch.setattr(_runner, "PEERS", (*_peers.PEERS, ghost))
    monkeypatch.setattr(_runner, "BY_NAME", {**_peers.BY_NAME, "ghost": ghost})
    out = str(tmp_path / "results.json")
    code = run([*TINY, "--only", "push", "--peers", "qstore/interval,ghost", "--dir",
                str(tmp_path), "--json", out])
    assert code == 0
    rows = {r["peer"]: r for r in _results.load(out)["rows"]}
    assert rows["ghost"]["status"] == "not installed"
    assert rows["ghost"]["rate"] is None
    assert rows["qstore/interval"]["status"] == "ok"
    assert "not installed" in capsys.readouterr().out


def test_unknown_workload_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run(["--only", "pushh"])
    assert exc.value.code == 2
    assert "unknown workload pushh" in capsys.readouterr().err


def test_targets_are_not_applicable_when_their_inputs_were_not_measured() -> None:
    rows = [{"workload": "push", "size": 1024, "peer": "qstore/interval", "threads": 1,
             "rate": 100.0},
            {"workload": "push", "size": 1024, "peer": "bare", "threads": 1, "rate": 400.0}]
    got = {t["id"]: t for t in _targets.evaluate(rows, [], dataclasses.asdict(MODES["quick"]))}
    assert got["interval-push-bare"]["measured"] == 0.25
    assert got["interval-push-bare"]["status"] == "missed"
    assert got["interval-push-litequeue"]["status"] == "n/a"
    assert got["spark-audit"]["status"] == "n/a"
    spark = [{"name": "spark.audit_ratio", "value": 2.5}, {"name": "spark.backfill_ratio",
                                                            "value": 1.5}]
    got = {t["id"]: t for t in _targets.evaluate(rows, spark, dataclasses.asdict(MODES["quick"]))}
    assert (got["spark-audit"]["status"], got["spark-backfill"]["status"]) == ("met", "missed")
    assert "N=20,000, contract N=1,000,000" in got["spark-backfill"]["note"]
    assert "disk" not in got["spark-backfill"]["note"]  # not measured: not claimed
    spark += [{"name": "spark.backfill_disk_ratio", "value": 1.08},
              {"name": "spark.needed_disk_ratio", "value": 1.47}]
    got = {t["id"]: t for t in _targets.evaluate(rows, spark, dataclasses.asdict(MODES["quick"]))}
    assert got["spark-backfill"]["note"].endswith(
        "the backfill writes at 1.08x the disk's rate; 3x would need 1.47x")


def test_scaling_measurements_produce_their_metrics(tmp_path: Any) -> None:
    p = dataclasses.replace(MODES["quick"], n=50, budget=0.05, cycles=200, backlog=300,
                            compact_messages=400, disk_bytes=4 * 1024 * 1024)
    names = {m.name for m in _scaling.measure_churn(str(tmp_path / "churn"), p)}
    assert {"churn.steady_fresh", "churn.steady_after", "churn.backlog_after",
            "churn.ratio"} <= names
    store = str(tmp_path / "open")
    _scaling.build_backlog(store, p)
    names = {m.name for m in _scaling.measure_open(store, p)}
    assert {"open.seconds", "open.rss_mb"} <= names
    os.makedirs(tmp_path / "compact")
    names = {m.name for m in _scaling.measure_compaction(str(tmp_path / "compact"), p)}
    assert {"disk.write_mib_s", "compaction.mib_s", "compaction.ratio",
            "compaction.ops_ratio"} <= names


@pytest.mark.spark
def test_the_spark_workload_times_backfill_push_many_scan_and_audit(tmp_path: Any,
                                                                     spark: Any) -> None:
    p = dataclasses.replace(MODES["quick"], spark_messages=300, disk_bytes=4 * 1024 * 1024)
    got = {m.name: m.value for m in _spark.measure_spark(str(tmp_path / "spark"), p)}
    assert set(got) == {"spark.push_many_rate", "spark.backfill_rate", "spark.backfill_ratio",
                        "spark.backfill_mib_s", "spark.disk_mib_s", "spark.backfill_disk_ratio",
                        "spark.needed_disk_ratio", "spark.scan_s", "spark.audit_s",
                        "spark.audit_ratio"}
    assert got["spark.backfill_ratio"] == pytest.approx(
        got["spark.backfill_rate"] / got["spark.push_many_rate"])
    # The loaded store holds at least every payload; the disk ratios follow from the rates.
    bytes_per_row = got["spark.backfill_mib_s"] * 2**20 / got["spark.backfill_rate"]
    assert bytes_per_row >= 1024
    assert got["spark.backfill_disk_ratio"] == pytest.approx(
        got["spark.backfill_mib_s"] / got["spark.disk_mib_s"])
    assert got["spark.needed_disk_ratio"] == pytest.approx(
        3 * got["spark.push_many_rate"] * bytes_per_row / 2**20 / got["spark.disk_mib_s"])
    assert got["spark.audit_ratio"] == pytest.approx(got["spark.audit_s"] / got["spark.scan_s"])
    assert spark.sparkContext._jsc is not None  # the shared test session was not stopped


def test_server_targets_are_ratios_to_beanstalkd_with_round_trips_in_the_note() -> None:
    def metric(name: str, value: float) -> dict[str, Any]:
        return {"name": name, "value": value}

    metrics = [metric("server.qstore.push", 20.0), metric("server.beanstalkd.put", 10.0),
               metric("server.qstore.rtt_p50_ms", 0.1), metric("server.qstore.rtt_p99_ms", 0.5)]
    got = {t["id"]: t for t in _targets.evaluate([], metrics, dataclasses.asdict(MODES["quick"]))}
    assert got["server-push"]["measured"] == 2.0 and got["server-push"]["status"] == "met"
    assert "qstore 0.100/0.500" in got["server-push"]["note"]
    assert got["server-pop"]["status"] == "n/a"


def test_server_targets_prefer_the_median_of_per_repeat_ratios() -> None:
    # Medians of the rates say 2.0x; the repeats' own pairs say 0.4x: the pairs win,
    # as each pair ran back to back under the same load.
    metrics = [{"name": "server.qstore.pop_ack", "value": 20.0},
               {"name": "server.beanstalkd.reserve_delete", "value": 10.0},
               {"name": "server.ratio.pop_ack", "value": 0.4}]
    got = {t["id"]: t for t in _targets.evaluate([], metrics, dataclasses.asdict(MODES["quick"]))}
    assert got["server-pop"]["measured"] == 0.4 and got["server-pop"]["status"] == "missed"


def test_a_server_run_counts_every_message_and_the_cpu_of_both_sides(tmp_path: Any) -> None:
    import qstore

    with _server.qstore_server(str(tmp_path / "store")) as srv:
        with qstore.connect(srv.address) as c:
            c.create_queue(_server.QUEUE)
        idle = srv.cpu()
        n = 2000  # tens of ms of server CPU: many 10 ms ticks, so never read as 0
        d = _server._drive("qstore", srv, "push", n, 60.0, clients=2)
        assert d.messages == n and d.rate > 0
        assert d.server_cpu > 0 and d.client_cpu > 0
        assert srv.cpu() >= idle + d.server_cpu
        assert d.cpu_us(d.server_cpu) == pytest.approx(d.server_cpu / n * 1e6)
        with qstore.connect(srv.address) as c:
            assert c.queue(_server.QUEUE).stats().ready == n


def test_the_framing_floor_answers_the_real_client_from_a_can() -> None:
    import qstore

    with _server.floor_server() as srv:
        with qstore.connect(srv.address) as c:
            q = c.queue(_server.QUEUE)
            m = q.pop(lease=60.0)
            assert m is not None and len(m.payload) == 1024 and m.receipt is not None
            assert q.ack(m) is None
            with pytest.raises(qstore.InvalidArgument, match="framing floor"):
                q.push(b"x")  # no store behind it: refused, the connection kept
            assert q.pop(lease=60.0) == m  # the same canned message every time
        # Enough messages that the server uses many scheduler ticks of CPU (about
        # 20 us a message here; a tick is 10 ms, and 400 messages once read as 0).
        d = _server._drive("qstore", srv, "pop+ack", 5000, 60.0, clients=2)
        assert d.messages == 5000 and d.server_cpu > 0 and d.client_cpu > 0


def test_feature_overhead_extracts_a_commit_or_skips(tmp_path: Any,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    if os.system("git -C . rev-parse --verify -q HEAD >/dev/null 2>&1") != 0:
        pytest.skip("not a git checkout: make bench skips the comparison the same way")
    out = feature_overhead.tree("git:HEAD", str(tmp_path))
    assert out is not None
    assert os.path.isfile(os.path.join(out, "qstore", "__init__.py"))
    assert os.path.isfile(os.path.join(out, "qstore", "_core.py"))
    assert feature_overhead.tree("git:no-such-revision", str(tmp_path)) is None
    assert "skipped" in capsys.readouterr().out
    assert feature_overhead.tree(str(tmp_path), str(tmp_path)) == str(tmp_path)  # a directory


def test_feature_overhead_reports_the_median_of_each_rounds_own_ratio() -> None:
    # The machine slowed threefold from the middle of round 2 on: each round's own
    # ratio still says 5% slower, the ratio of the two medians says 3.15x.
    old = [1.00e-5, 1.00e-5, 3.00e-5]
    new = [1.05e-5, 3.15e-5, 3.15e-5]
    line = feature_overhead.summary("push", old, new)
    assert "after/before 1.050 (median of 3 rounds' ratios; ratio of the medians 3.150)" in line
    assert line.startswith("push: before 10.0 us/op (100,000/s), after 31.5 us/op")


def test_the_interleaved_workload_reports_its_four_ratios(tmp_path: Any) -> None:
    got = _interleaved.measure_interleaved(str(tmp_path / "m"),
                                           dataclasses.replace(MODES["quick"], n=200))
    assert [m.name for m in got] == ["interleaved.push_vs_bare", "interleaved.pop_ack_vs_bare",
                                     "interleaved.push_many_vs_push",
                                     "interleaved.pop_many_vs_pop_ack"]
    assert all(m.value > 0 and m.unit == "x" for m in got)
    ids = {t.id for t in _targets.TARGETS}
    assert {"interleaved-push-bare", "interleaved-batch-pop"} <= ids
