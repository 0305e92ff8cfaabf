"""The Prometheus endpoint of a real server process, scraped over loopback."""

from __future__ import annotations

import select
import socket
import threading
import time
import urllib.request
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

import qstore
from qstore.cli import main

from ._support import frame, raw_socket, read_frames, running


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_report_queue_depths_requests_and_connections(tmp_path: Any) -> None:
    port = _free_port()
    with running(str(tmp_path / "store"), "--metrics-port", str(port)) as srv, \
            qstore.connect(srv.address) as client:
        q = client.create_queue("jobs")
        q.push_many([b"a" * 10, b"b" * 10, b"c" * 10])
        q.push(b"later", delay=3600.0)
        held = q.pop()
        assert held is not None
        with pytest.raises(qstore.QueueNotFound):
            client.queue("missing")
        got = _scrape(port)

        def depth(state: str) -> float:
            return got[("qstore_queue_messages", (("queue", "jobs"), ("state", state)))]

        assert (depth("ready"), depth("delayed"), depth("in_flight"), depth("dead")) == \
            (2, 1, 1, 0)
        assert got[("qstore_queue_bytes", (("queue", "jobs"),))] == 35
        ok = (("outcome", "ok"),)
        assert got[("qstore_requests_total", (("op", "push_many"), *ok))] == 1
        assert got[("qstore_requests_total", (("op", "push"), *ok))] == 1
        assert got[("qstore_requests_total", (("op", "pop"), *ok))] == 1
        assert got[("qstore_requests_total", (("op", "queue"), ("outcome", "error")))] == 1
        assert got[("qstore_request_seconds_count", (("op", "push"),))] == 1
        assert got[("qstore_connections", ())] == 1
        assert got[("qstore_disk_bytes", ())] >= 35

        q.ack(held)
        q.pop_many(10)
        after = _scrape(port)
        assert after[("qstore_queue_messages", (("queue", "jobs"), ("state", "in_flight")))] == 2
        assert after[("qstore_queue_messages", (("queue", "jobs"), ("state", "ready")))] == 0
        assert after[("qstore_requests_total", (("op", "ack"), *ok))] == 1


def test_metrics_count_syncs_compaction_and_the_leases_connections_hold(
        tmp_path: Any) -> None:
    port = _free_port()
    with running(str(tmp_path / "store"), "--metrics-port", str(port),
                 "--durability", "always") as srv, \
            qstore.connect(srv.address) as a, qstore.connect(srv.address) as b:
        qa = a.create_queue("jobs")
        qb = b.queue("jobs")
        qa.push_many([bytes([i]) * 1000 for i in range(100)])
        qa.push(b"last")  # returns once synced
        got = _scrape(port)
        assert got[("qstore_syncs_total", ())] >= 1
        assert got[("qstore_sync_seconds_total", ())] > 0

        # Popped through one connection, settled through another: off the first's table.
        popped = qa.pop_many(60)
        assert _scrape(port)[("qstore_leases_held", ())] == 60
        qb.ack_many(popped[:50])
        for m in popped[50:55]:
            qb.ack(m)
        qb.nack(popped[55])
        assert _scrape(port)[("qstore_leases_held", ())] == 4

        rest = qa.pop_many(100)
        assert len(rest) == 42  # 40 never popped, the one nacked, "last"
        qa.ack_many(rest + popped[56:])
        assert _scrape(port)[("qstore_leases_held", ())] == 0
        before = _scrape(port)
        result = a.compact(threshold=0.0)
        after = _scrape(port)

        def grew(name: str) -> float:
            return after[(name, ())] - before[(name, ())]
        assert result.bytes_freed > 100_000 and result.segments_deleted
        assert grew("qstore_compaction_passes_total") >= 1
        assert grew("qstore_compaction_bytes_freed_total") >= result.bytes_freed
        assert grew("qstore_compaction_seconds_total") >= result.seconds
        assert after[("qstore_compaction_failed_passes_total", ())] == 0


def test_the_leases_of_a_closed_connection_go_back_and_leave_the_book(
        tmp_path: Any) -> None:
    port = _free_port()
    with running(str(tmp_path / "store"), "--metrics-port", str(port)) as srv, \
            qstore.connect(srv.address) as other:
        q = other.create_queue("jobs")
        q.push_many([b"%d" % i for i in range(1200)])  # more than one release slice
        with qstore.connect(srv.address) as consumer:
            assert len(consumer.queue("jobs").pop_many(1100)) == 1100
        deadline = time.monotonic() + 30
        while q.stats().ready != 1200:  # the server gives them back once it sees the close
            assert time.monotonic() < deadline
        assert _scrape(port)[("qstore_leases_held", ())] == 0
        assert sorted(m.attempts for m in q.pop_many(1200)) == [1] * 100 + [2] * 1100


def test_unknown_ops_are_counted_under_one_label(tmp_path: Any) -> None:
    # Any op string a client sent became a label value: a series and a histogram of
    # its own for the life of the process (2,000 made-up names, a 12 MB scrape; an
    # operations audit).
    port = _free_port()
    with running(str(tmp_path / "store"), "--metrics-port", str(port)) as srv:
        # (It says where; a port of 0 was taken and never told, so it is refused.)
        assert srv._expect("metrics on ", time.monotonic() + 30) == \
            f"http://127.0.0.1:{port}/metrics"
        s = raw_socket(srv.address)
        s.sendall(frame({"qstore": 1}))
        read_frames(s, 1)
        s.sendall(b"".join(frame([i, f"made-up-{i}", {}]) for i in range(1, 51)))
        answers = read_frames(s, 50)
        s.close()
        assert all(a[1] == 1 for a in answers)  # each an error: unknown operation
        got = _scrape(port)
    ops = {dict(labels).get("op") for name, labels in got if name == "qstore_requests_total"}
    assert ops == {"unknown"}
    assert got[("qstore_requests_total", (("op", "unknown"), ("outcome", "error")))] == 50


def test_refused_connections_and_parked_pops_are_counted(tmp_path: Any) -> None:
    # Wrong tokens, bad frames and refusals over the limit were counted and logged
    # nowhere, and parked pops were not shown (an observability audit).
    port = _free_port()
    token = tmp_path / "token"
    token.write_text("right")
    with running(str(tmp_path / "store"), "--metrics-port", str(port), "--token-file",
                 str(token), "--max-connections", "2") as srv:
        with pytest.raises(qstore.AuthenticationFailed):
            qstore.connect(srv.address, token="wrong").stats()
        s = raw_socket(srv.address)
        s.sendall(frame([1, 2, 3]))  # not the handshake map
        assert read_frames(s, 1)[0][0] == 0  # an error frame, then the close
        s.close()
        with qstore.connect(srv.address, token="right") as a, \
                qstore.connect(srv.address, token="right") as b:
            with pytest.raises(qstore.ServerBusy):
                qstore.connect(srv.address, token="right").stats()
            q = a.create_queue("jobs")
            got: list[Any] = []
            waiter = threading.Thread(target=lambda: got.append(b.queue("jobs").pop(wait=60)))
            waiter.start()
            deadline = time.monotonic() + 30
            while _scrape(port)[("qstore_waiting_pops", ())] != 1:  # parked, not timed
                assert time.monotonic() < deadline
            q.push(b"wake")
            waiter.join(30)
            assert got[0].payload == b"wake"
            after = _scrape(port)
        assert after[("qstore_waiting_pops", ())] == 0
        for reason in ("auth", "protocol", "busy"):
            assert after[("qstore_connections_refused_total", (("reason", reason),))] == 1
        assert after[("qstore_space_low", ())] == 0
        assert srv.terminate() == 0
        assert srv.proc.stderr is not None
        log = srv.proc.stderr.read().decode()
    for reason in ("auth", "protocol", "busy"):
        assert log.count(f"connection closed ({reason})") == 1, log


def test_expired_messages_and_a_nearly_full_disk_show_in_the_metrics(tmp_path: Any) -> None:
    from prometheus_client import generate_latest

    from qstore.server._metrics import Metrics

    from ..conftest import FakeClock

    clock = FakeClock()
    with qstore.open(str(tmp_path / "s"), clock=clock, compactor=False) as store:
        q = store.create_queue("jobs", ttl=5.0)
        q.push_many([b"a", b"b", b"c"])
        q.push(b"kept", ttl=100.0)
        metrics = Metrics(store)

        def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            text = generate_latest(metrics.registry).decode()
            return {(x.name, tuple(sorted(x.labels.items()))): x.value
                    for family in text_string_to_metric_families(text)
                    for x in family.samples}

        expired = ("qstore_queue_expired_total", (("queue", "jobs"),))
        assert scrape()[expired] == 0
        clock.advance(6.0)
        assert len(q) == 1  # the TTL ran out for three
        assert scrape()[expired] == 3
        assert scrape()[("qstore_space_low", ())] == 0
        store.core.space_low = True  # what a full disk sets (tests/faults/test_disk_full.py)
        assert scrape()[("qstore_space_low", ())] == 1


def test_a_metrics_port_of_0_is_refused(tmp_path: Any) -> None:
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "s"), "--metrics-port", "0"])
    assert r.exit_code == 2 and "--metrics-port" in r.output
    assert not (tmp_path / "s").exists()


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_idle_connections_to_the_metrics_port_take_a_bounded_number_of_threads(
        tmp_path: Any) -> None:
    # prometheus_client's server kept a thread per open connection: 800 idle
    # connections were 800 threads in the queue server (a security audit). At
    # most MAX_SCRAPERS now; the others are closed at once, and once the idle
    # ones go a scrape works.
    from qstore.server._metrics import MAX_SCRAPERS

    port = _free_port()
    with running(str(tmp_path / "s"), "--metrics-port", str(port)) as srv:
        _scrape(port)
        base = _threads(srv.proc.pid)
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
        try:
            # Those past the limit see their connection closed at once (the others
            # only after SCRAPE_TIMEOUT, 10 s, of silence).
            closed: set[socket.socket] = set()
            deadline = time.monotonic() + 5
            while len(closed) < 100 - MAX_SCRAPERS and time.monotonic() < deadline:
                ready, _, _ = select.select([s for s in idle if s not in closed], [], [], 0.5)
                closed.update(s for s in ready if s.recv(1) == b"")
            assert len(closed) == 100 - MAX_SCRAPERS
            assert _threads(srv.proc.pid) <= base + MAX_SCRAPERS
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 30
        while True:  # the idle ones' threads end as their connections close
            try:
                assert _scrape(port)[("qstore_connections", ())] == 0
                break
            except OSError:
                assert time.monotonic() < deadline
