"""The server against beanstalkd (CONTRACT.md sections 7 and 8), for ``make bench``.

Both servers run as child processes on loopback TCP ports picked here:
``qstore serve`` (durability "interval") and beanstalkd with a binlog and
``-f 50`` (fsync at most every 50 ms: the same durability class). Four client
processes drive each: qstore through ``qstore.connect``, beanstalkd through
``greenstalk``. Measured, in messages per second over all four clients:

- single ops: qstore push and pop+ack, beanstalkd put and reserve+delete;
- batches of 100 through the client: push_many, and pop_many + ack_many;
- one client's single-op round trip (a push, a put), p50 and p99 in ms;
- CPU per message of the single ops, in us: the server process's (user and
  system time around the run, ``psutil``) and the four clients' (each
  client's ``process_time`` over its own loop). On two shared cores the
  rates follow CPU per message, and these move far less from run to run;
- the framing floor (``_floor.py``: the server's transport with canned
  answers and no store) under the same pop+ack clients, and the qstore
  server's CPU per pop+ack less the floor's: what the store and the dispatch
  cost under load, the part of the gap to beanstalkd the server's own code
  can still close.

A client process connects before the clock starts and waits on a barrier,
so connection and start-up costs are not counted. The rate is all
messages over the span from the first client's start to the last's end.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from ._plan import KiB, Params
from ._results import Metric

CLIENTS = 4
BATCH = 100
TUBE = "bench"
QUEUE = "bench"


# -- the two servers ---------------------------------------------------------------


def beanstalkd_path() -> str | None:
    return shutil.which("beanstalkd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _await_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"beanstalkd exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.02)  # a bench polls a starting server; tests never do this
    raise RuntimeError("beanstalkd did not start listening")


class Served:
    """A server child process: where clients reach it, and its pid."""

    def __init__(self, address: Any, pid: int) -> None:
        self.address = address
        self.pid = pid

    def cpu(self) -> float:
        """Seconds of CPU (user and system) the server has used so far."""
        import psutil

        t = psutil.Process(self.pid).cpu_times()
        return float(t.user + t.system)


@contextmanager
def beanstalkd(workdir: str) -> Iterator[Served]:
    binary = beanstalkd_path()
    assert binary is not None
    binlog = os.path.join(workdir, "binlog")
    os.makedirs(binlog, exist_ok=True)
    port = _free_port()
    proc = subprocess.Popen([binary, "-l", "127.0.0.1", "-p", str(port), "-b", binlog,
                             "-f", "50", "-z", str(2 * 1024 * 1024)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _await_port(port, proc)
        yield Served(("127.0.0.1", port), proc.pid)
    finally:
        proc.kill()
        proc.wait(30)


@contextmanager
def qstore_server(store: str) -> Iterator[Served]:
    with _child(["-m", "qstore.cli", "serve", store, "--listen", "tcp://127.0.0.1:0"],
                "qstore serve") as served:
        yield served


@contextmanager
def floor_server() -> Iterator[Served]:
    """The framing floor (_floor.py): the server's transport with canned answers."""
    with _child(["-m", "bench._floor"], "the framing floor") as served:
        yield served


@contextmanager
def _child(args: list[str], what: str) -> Iterator[Served]:
    """A Python child that prints ``listening on ADDRESS`` once it serves."""
    env = dict(os.environ)
    tools = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(tools)
    env["PYTHONPATH"] = os.pathsep.join([root, tools, env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"{what} did not start: {line!r}")
        yield Served(line[len("listening on "):], proc.pid)
    finally:
        proc.kill()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()


# -- client processes --------------------------------------------------------------


def _qstore_op(address: str, op: str, n: int, payload: bytes) -> Callable[[], int]:
    import qstore

    q = qstore.connect(address).queue(QUEUE)
    if op == "push":
        def run() -> int:
            q.push(payload, priority=random.randrange(10))
            return 1
    elif op == "pop+ack":
        def run() -> int:
            m = q.pop(lease=60.0)
            if m is None:
                return 0
            q.ack(m)
            return 1
    elif op == "push_many":
        items = [(payload, i % 10) for i in range(BATCH)]

        def run() -> int:
            return len(q.push_many(items))
    elif op == "pop_many+ack_many":
        def run() -> int:
            got = q.pop_many(BATCH, lease=60.0)
            if got:
                q.ack_many(got)
            return len(got)
    else:
        raise AssertionError(op)
    return run


def _beanstalk_op(address: tuple[str, int], op: str, n: int, payload: bytes) -> Callable[[], int]:
    import greenstalk

    c = greenstalk.Client(address, encoding=None, use=TUBE, watch=TUBE)
    if op == "put":
        def run() -> int:
            c.put(payload, priority=random.randrange(10))
            return 1
    elif op == "reserve+delete":
        def run() -> int:
            try:
                job = c.reserve(timeout=0)
            except greenstalk.TimedOutError:
                return 0
            c.delete(job)
            return 1
    else:
        raise AssertionError(op)
    return run


def _client(kind: str, address: Any, op: str, n: int, budget: float, payload: bytes,
            barrier: Any, results: Any, latencies: bool) -> None:
    run = (_qstore_op if kind == "qstore" else _beanstalk_op)(address, op, n, payload)
    barrier.wait()
    done = 0
    lat: list[float] = []
    cpu = time.process_time()
    start = time.perf_counter()
    stop = start + budget
    t = start
    while done < n and t < stop:
        got = run()
        now = time.perf_counter()
        if latencies:
            lat.append(now - t)
        t = now
        if got == 0:
            break  # drained
        done += got
    cpu = time.process_time() - cpu
    # perf_counter is CLOCK_MONOTONIC on Linux: comparable across processes
    results.put((done, start, t, lat, cpu))


class Driven:
    """What one ``_drive`` measured."""

    def __init__(self, rate: float, messages: int, latencies: list[float],
                 client_cpu: float, server_cpu: float) -> None:
        self.rate = rate  # messages/s over all clients
        self.messages = messages
        self.latencies = latencies  # seconds, per call (when asked for)
        self.client_cpu = client_cpu  # seconds, all clients' loops
        self.server_cpu = server_cpu  # seconds, the server process

    def cpu_us(self, seconds: float) -> float:
        return seconds / self.messages * 1e6 if self.messages else 0.0


def _drive(kind: str, server: Served, op: str, n: int, budget: float, clients: int = CLIENTS,
           latencies: bool = False) -> Driven:
    """``clients`` processes doing ``n`` messages in all (or for ``budget`` s)."""
    address = server.address
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(clients)
    results = ctx.Queue()
    payload = os.urandom(KiB)
    procs = [ctx.Process(target=_client, args=(kind, address, op, n // clients, budget,
                                               payload, barrier, results, latencies))
             for _ in range(clients)]
    for p in procs:
        p.start()
    before = server.cpu()  # as the clients start: their handshakes cost it little
    got = [results.get(timeout=budget + 120) for _ in procs]
    server_cpu = server.cpu() - before
    for p in procs:
        p.join(30)
    total = sum(g[0] for g in got)
    span = max(g[2] for g in got) - min(g[1] for g in got)
    lat = [x for g in got for x in g[3]]
    return Driven(total / span if span > 0 else 0.0, total, lat, sum(g[4] for g in got),
                  server_cpu)


def _fill_qstore(address: str, n: int) -> None:
    import qstore

    with qstore.connect(address) as c:
        q = c.queue(QUEUE)
        body = os.urandom(KiB)
        for i in range(0, n, 1000):
            q.push_many([(body, j % 10) for j in range(min(1000, n - i))])


def _drain_qstore(address: str) -> None:
    import qstore

    with qstore.connect(address) as c:
        c.queue(QUEUE).purge()


def _fill_beanstalkd(address: tuple[str, int], n: int) -> None:
    import greenstalk

    with greenstalk.Client(address, encoding=None, use=TUBE, watch=TUBE) as c:
        body = os.urandom(KiB)
        for j in range(n):
            c.put(body, priority=j % 10)


def _drain_beanstalkd(address: tuple[str, int]) -> None:
    import greenstalk

    with greenstalk.Client(address, encoding=None, use=TUBE, watch=TUBE) as c:
        while True:
            try:
                c.delete(c.reserve(timeout=0))
            except greenstalk.TimedOutError:
                return


def _pcts(lat: list[float]) -> tuple[float, float]:
    lat = sorted(lat)
    if not lat:
        return 0.0, 0.0
    return (lat[len(lat) // 2] * 1e3, lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3)


def measure_server(path: str, p: Params, say: Callable[[str], None] = print) -> list[Metric]:
    """The server metrics of one run; beanstalkd's are left out when it is not installed.

    Both servers run at once (an idle one costs nothing) and each qstore figure is
    taken right before its beanstalkd peer, so a burst of load from elsewhere on the
    machine lands on both sides of a ratio rather than on one.
    """
    os.makedirs(path)
    n, budget = p.n, p.budget
    out: list[Metric] = []
    have_peer = beanstalkd_path() is not None
    if not have_peer:
        say("[server] beanstalkd is not installed: its figures are left out")

    def rate(name: str, label: str, d: Driven, cpu: bool = False) -> None:
        out.append(Metric(f"server.{name}", label, d.rate, "msgs/s"))
        if cpu:  # the single ops: where the rates' gap comes from
            who, what = label.split()[:2]  # "qstore push x4"
            out.append(Metric(f"server.{name}.server_cpu_us",
                              f"{who} server CPU per {what} (x{CLIENTS})",
                              d.cpu_us(d.server_cpu), "us"))
            out.append(Metric(f"server.{name}.client_cpu_us",
                              f"{who} clients' CPU per {what} (x{CLIENTS})",
                              d.cpu_us(d.client_cpu), "us"))

    def rtt(who: str, what: str, lat: list[float]) -> None:
        p50, p99 = _pcts(lat)
        out.append(Metric(f"server.{who}.rtt_p50_ms", f"{who} {what} round trip p50 (1 client)",
                          p50, "ms"))
        out.append(Metric(f"server.{who}.rtt_p99_ms", f"{who} {what} round trip p99 (1 client)",
                          p99, "ms"))

    with qstore_server(os.path.join(path, "store")) as srv, floor_server() as fsrv, \
            (beanstalkd(path) if have_peer else nullcontext(None)) as bsrv:
        import qstore

        addr = srv.address
        with qstore.connect(addr) as c:
            c.create_queue(QUEUE)
        rate("qstore.push", f"qstore push x{CLIENTS}", _drive("qstore", srv, "push", n, budget),
             cpu=True)
        _drain_qstore(addr)
        if bsrv is not None:
            rate("beanstalkd.put", f"beanstalkd put x{CLIENTS}",
                 _drive("beanstalkd", bsrv, "put", n, budget), cpu=True)
            _drain_beanstalkd(bsrv.address)
        _fill_qstore(addr, n)
        rate("qstore.pop_ack", f"qstore pop+ack x{CLIENTS}",
             _drive("qstore", srv, "pop+ack", n, budget), cpu=True)
        _drain_qstore(addr)
        if bsrv is not None:
            _fill_beanstalkd(bsrv.address, n)
            rate("beanstalkd.reserve_delete", f"beanstalkd reserve+delete x{CLIENTS}",
                 _drive("beanstalkd", bsrv, "reserve+delete", n, budget), cpu=True)
            _drain_beanstalkd(bsrv.address)
        rate("floor.pop_ack", f"floor pop+ack x{CLIENTS} (the framing floor, canned answers)",
             _drive("qstore", fsrv, "pop+ack", n, budget), cpu=True)
        rate("qstore.push_many", f"qstore push_many(100) x{CLIENTS}",
             _drive("qstore", srv, "push_many", n * 5, budget))
        _drain_qstore(addr)
        _fill_qstore(addr, n * 5)
        rate("qstore.pop_many_ack_many", f"qstore pop_many+ack_many(100) x{CLIENTS}",
             _drive("qstore", srv, "pop_many+ack_many", n * 5, budget))
        _drain_qstore(addr)
        rtt("qstore", "push", _drive("qstore", srv, "push", min(n, 5000), budget, clients=1,
                                     latencies=True).latencies)
        if bsrv is not None:
            rtt("beanstalkd", "put", _drive("beanstalkd", bsrv, "put", min(n, 5000), budget,
                                            clients=1, latencies=True).latencies)
    got = {m.name: m.value for m in out}
    out.append(Metric("server.store_dispatch_cpu_us",
                      f"qstore server CPU per pop+ack less the framing floor's (x{CLIENTS})",
                      got["server.qstore.pop_ack.server_cpu_us"]
                      - got["server.floor.pop_ack.server_cpu_us"], "us"))
    for name, mine, peer in PAIRS:
        if got.get(f"server.{peer}"):
            out.append(Metric(f"server.ratio.{name}", f"ratio {name} (this repeat's pair)",
                              got[f"server.{mine}"] / got[f"server.{peer}"], "x"))
    return out


# The targets' ratios, each taken within one repeat (the report gives their median):
# the two sides of a pair ran back to back, under the same load from elsewhere.
PAIRS = (
    ("push", "qstore.push", "beanstalkd.put"),
    ("pop_ack", "qstore.pop_ack", "beanstalkd.reserve_delete"),
    ("push_many", "qstore.push_many", "beanstalkd.put"),
    ("pop_many_ack_many", "qstore.pop_many_ack_many", "beanstalkd.reserve_delete"),
)
