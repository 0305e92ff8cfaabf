"""The jobs on a real Spark standalone cluster: a master and a worker started here.

The master and the worker are the installed pyspark's own (``bin/spark-class``),
on this machine; the audit and the backfill run as ``qstore`` commands with
``--master spark://...``, as a user would run them. Where the machine allows
it (root and ``ip netns``), a second cluster puts the worker in its own
network namespace, so that executors cannot reach the driver through
loopback: any loopback address handed to them makes the job fail or hang.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import qstore

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT = 120.0  # seconds for a master and a worker to come up
JOB_TIMEOUT = 300.0  # seconds for one command (JVM start, executor start, the job)


def _spark_class() -> str:
    import pyspark

    path = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
    if not os.access(path, os.X_OK):
        pytest.skip(f"the installed pyspark has no runnable bin/spark-class ({path})")
    return path


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class Cluster:
    """A standalone master and one worker; ``url`` is the master's."""

    def __init__(self, base: str, master_host: str, worker_host: str,
                 netns: str | None = None) -> None:
        self.base = base
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[str] = []
        port = _free_port(master_host)
        self.url = f"spark://{master_host}:{port}"
        env = {**os.environ, "PYTHONPATH": REPO, "SPARK_NO_DAEMONIZE": "1"}
        for var in ("SPARK_LOCAL_IP", "PYSPARK_PYTHON", "PYSPARK_SUBMIT_ARGS"):
            env.pop(var, None)
        self._start("master", [_spark_class(), "org.apache.spark.deploy.master.Master",
                               "--host", master_host, "--port", str(port),
                               "--webui-port", str(_free_port(master_host))], env)
        self._wait("master", "Starting Spark master")
        worker = [_spark_class(), "org.apache.spark.deploy.worker.Worker", "--host",
                  worker_host, "--cores", "2", "--memory", "1g", "--webui-port", "0",
                  "--work-dir", os.path.join(base, "work"), self.url]
        if netns is not None:
            worker = ["ip", "netns", "exec", netns, *worker]
        self._start("worker", worker, {**env, "SPARK_LOCAL_IP": worker_host})
        self._wait("master", "Registering worker")

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = os.path.join(self.base, f"{name}.log")
        self.logs.append(log)
        with open(log, "wb") as f:
            self.procs.append(subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                               start_new_session=True))

    def _wait(self, name: str, text: str) -> None:
        log = os.path.join(self.base, f"{name}.log")
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            with open(log, errors="replace") as f:
                if text in f.read():
                    return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.5)
        self.stop()
        with open(log, errors="replace") as f:
            pytest.fail(f"the {name} did not log {text!r}:\n{f.read()[-3000:]}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()


def run_qstore(*args: str, env_extra: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    """A ``qstore`` command as a user runs it; the executors run this Python (same machine)."""
    env = {**os.environ, "PYTHONPATH": REPO, "PYSPARK_PYTHON": sys.executable,
           **(env_extra or {})}
    for var in ("QSTORE_SPARK_MASTER", "PYSPARK_SUBMIT_ARGS"):
        env.pop(var, None)
    if "SPARK_LOCAL_IP" not in (env_extra or {}):
        env.pop("SPARK_LOCAL_IP", None)
    return subprocess.run([sys.executable, "-m", "qstore.cli", *args], env=env, text=True,
                          capture_output=True, timeout=JOB_TIMEOUT)


def _snapshot(base: str) -> tuple[str, int]:
    with qstore.open(os.path.join(base, "store"), compactor=False,
                     segment_max_bytes=4096) as store:
        q = store.create_queue("jobs")
        q.push_many([(b"job %d " % i + b"x" * (i % 50), i % 10) for i in range(500)])
        q.pop_many(7)
        path = store.snapshot(os.path.join(base, "snap"))
    return path, 500  # 7 of them in flight


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(str(tmp_path_factory.mktemp("cluster")), "127.0.0.1", "127.0.0.1")
    try:
        yield c
    finally:
        c.stop()


def _audit_ok(snap: str, out: str, messages: int, master: str,
              env_extra: dict[str, str] | None = None) -> None:
    r = run_qstore("audit", snap, "--master", master, "--out", out, env_extra=env_extra)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["clean"] and summary["messages"]["total"] == messages


def test_audit_on_a_standalone_cluster(cluster: Cluster, tmp_path: Any) -> None:
    snap, messages = _snapshot(str(tmp_path))
    _audit_ok(snap, os.path.join(tmp_path, "out"), messages, cluster.url)
    apps = os.listdir(os.path.join(cluster.base, "work"))
    assert apps, "no application ran on the worker"  # the executors were the cluster's


def test_backfill_on_a_standalone_cluster(cluster: Cluster, tmp_path: Any) -> None:
    src = os.path.join(tmp_path, "rows.parquet")
    n = 3000
    pq.write_table(pa.table({"body": [b"row %d" % i for i in range(n)],
                             "prio": [i % 7 for i in range(n)]}), src)
    into = os.path.join(tmp_path, "store")
    r = run_qstore("backfill", src, "--queue", "q", "--payload-col", "body", "--priority-col",
                   "prio", "--into", into, "--master", cluster.url)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    with qstore.open(into, compactor=False) as store:
        assert store.queue("q").stats().ready == n
        first = store.queue("q").pop()
        assert first is not None and first.priority == 6
    report = qstore.check_path(into) if hasattr(qstore, "check_path") else None
    if report is None:
        from qstore._check import check_path

        report = check_path(into)
    assert report.ok, report.summary()


NETNS = "qstore-test-ns"
HOST_IP, NS_IP = "10.213.77.1", "10.213.77.2"


def _netns_available() -> str | None:
    """Why a worker cannot get its own network namespace here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    r = subprocess.run(["ip", "netns", "add", NETNS + "-probe"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", NETNS + "-probe"], check=False)
    return None


@pytest.fixture()
def netns() -> Iterator[str]:
    why = _netns_available()
    if why is not None:
        pytest.skip(f"a worker in its own network namespace {why}")
    # Left behind by a run that was killed: remove both before making them again.
    subprocess.run(["ip", "link", "del", "qsveth0"], capture_output=True, check=False)
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True, check=False)
    steps = [
        ["ip", "netns", "add", NETNS],
        ["ip", "link", "add", "qsveth0", "type", "veth", "peer", "name", "qsveth1"],
        ["ip", "link", "set", "qsveth1", "netns", NETNS],
        ["ip", "addr", "add", f"{HOST_IP}/30", "dev", "qsveth0"],
        ["ip", "link", "set", "qsveth0", "up"],
        ["ip", "netns", "exec", NETNS, "ip", "addr", "add", f"{NS_IP}/30", "dev", "qsveth1"],
        ["ip", "netns", "exec", NETNS, "ip", "link", "set", "qsveth1", "up"],
        ["ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield NETNS
    finally:
        subprocess.run(["ip", "link", "del", "qsveth0"], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", NETNS], capture_output=True, check=False)


def test_audit_with_a_worker_in_its_own_network_namespace(netns: str, tmp_path: Any) -> None:
    """The worker's loopback is not the driver's: a loopback address given to the
    executors (the old forced SPARK_LOCAL_IP) would fail this run."""
    c = Cluster(str(tmp_path), HOST_IP, NS_IP, netns=netns)
    try:
        snap, messages = _snapshot(str(tmp_path))
        # The driver advertises the address the worker can reach: the user's setting.
        _audit_ok(snap, os.path.join(tmp_path, "out"), messages, c.url,
                  env_extra={"SPARK_LOCAL_IP": HOST_IP})
    finally:
        c.stop()
