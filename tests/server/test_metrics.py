"""The Prometheus endpoint of a real server process, scraped over loopback."""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import qstore

from ._support import running


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
