"""A sync client shared by threads: one connection per thread calling at the same
moment, reused by a thread calling alone, all closed by ``close()`` (after which
a call raises StoreClosed, as a closed embedded store's do); and one
inherited across a fork, which the child must not share with its parent.

The counts are the server's own (its Prometheus ``qstore_connections`` gauge).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

import qstore
from qstore import _client

from ._support import ServerProcess, running
from .test_metrics import _free_port, _scrape


def _connections(port: int) -> float:
    return _scrape(port)[("qstore_connections", ())]


def _until(port: int, count: float) -> None:
    """Until the server counts ``count`` connections (it counts a close when it sees it)."""
    deadline = time.monotonic() + 30
    while _connections(port) != count:
        assert time.monotonic() < deadline, f"{_connections(port)} connections, not {count}"


def _waiting_pops(q: Any, n: int, port: int) -> tuple[list[threading.Thread], list[Any]]:
    """``n`` threads each waiting in a pop on ``q``, so each holds a connection of
    the shared client; their results (a Message, or the error raised) in ``got``."""
    got: list[Any] = []

    def pop() -> None:
        try:
            got.append(q.pop(wait=30.0))
        except Exception as exc:
            got.append(exc)
    threads = [threading.Thread(target=pop) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, got


def test_a_shared_client_opens_a_connection_per_concurrent_call_and_closes_them_all(
        tmp_path: Any) -> None:
    port = _free_port()
    with running(str(tmp_path / "store"), "--metrics-port", str(port)) as srv:
        def connections() -> float:
            return _connections(port)

        def until(count: float) -> None:
            _until(port, count)

        client = qstore.connect(srv.address)
        q = client.create_queue("w")
        for i in range(20):  # one thread, many calls: one connection throughout
            q.push(b"%d" % i)
            q.ack(q.pop())
        assert connections() == 1

        waiters, got = _waiting_pops(q, 3, port)
        until(3)  # each waiting pop holds a connection of its own
        q.push_many([b"a", b"b", b"c"])  # from this thread: a fourth
        for t in waiters:
            t.join(60)
        assert sorted(m.payload for m in got) == [b"a", b"b", b"c"]
        assert client.queue("w").ack_many(got) == 3
        assert connections() == 4  # kept for reuse

        client.close()
        until(0)
        with pytest.raises(qstore.StoreClosed):  # as a closed embedded store
            q.stats()
        assert connections() == 0


def test_a_client_inherited_across_fork_opens_its_own_connection(server: Any) -> None:
    """A client made before a fork (a pre-forking web server importing the app) is
    used by parent and child at once: each must get its own answers."""
    client = qstore.connect(server.address)
    q = client.create_queue("f", order="fifo")
    q.push_many([b"%d" % i for i in range(400)])
    pid = os.fork()
    if pid == 0:  # the child: half the messages, through the inherited client
        code = 1
        try:
            mine = [q.pop() for _ in range(200)]
            q.ack_many([m for m in mine if m is not None])
            code = 0 if all(m is not None for m in mine) else 2
        finally:
            os._exit(code)
    try:
        mine = [q.pop() for _ in range(200)]
        q.ack_many([m for m in mine if m is not None])
    finally:
        _, status = os.waitpid(pid, 0)
    assert all(m is not None for m in mine)
    assert os.waitstatus_to_exitcode(status) == 0
    assert q.stats().total == 0  # each message taken once, by one of the two
    client.close()


def test_a_shared_client_carries_on_after_a_server_restart(tmp_path: Any) -> None:
    """Its idle connections to the old server are not used: no call raises
    ConnectionLost for a request that never left the client."""
    path, port = str(tmp_path / "store"), _free_port()
    srv = ServerProcess(path, "--metrics-port", str(port))
    try:
        client = qstore.connect(srv.address)
        q = client.create_queue("w")
        waiters, got = _waiting_pops(q, 3, port)
        _until(port, 3)
        q.push_many([b"a", b"b", b"c"])  # a fourth connection
        for t in waiters:
            t.join(60)
        assert q.ack_many(got) == 3
        assert _connections(port) == 4  # all four idle in the client now
    finally:
        srv.kill()  # SIGKILL: the client's four connections are dead
    with running(path, "--metrics-port", str(port)):
        waiters, got = _waiting_pops(q, 4, port)  # each takes one of the dead four
        _until(port, 4)
        q.push_many([b"%d" % i for i in range(4)])
        for t in waiters:
            t.join(60)
        assert sorted(m.payload for m in got) == [b"0", b"1", b"2", b"3"]
        assert q.ack_many(got) == 4
        assert q.stats().total == 0
        client.close()


def test_a_call_interrupted_while_waiting_leaves_no_answer_for_the_next(
        server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    # A KeyboardInterrupt (or an exception from a signal handler) in a parked
    # pop(wait) put the connection back with that pop's answer still owed: the
    # parked pop took the next push's message, and the pushes after it read
    # each other's answers ("response to request 3, expected 5") although
    # every one of them had run.
    read = _client._Link._read
    armed = [True]

    def interrupted(self: Any) -> Any:
        if armed[0]:  # the request went out; its answer never read
            armed[0] = False
            raise KeyboardInterrupt
        return read(self)

    with qstore.connect(server.address) as client:
        q = client.create_queue("i")
        monkeypatch.setattr(_client._Link, "_read", interrupted)
        with pytest.raises(KeyboardInterrupt):
            q.pop(wait=30.0)
        ids = [q.push(b"job%d" % i) for i in range(4)]
        assert ids == sorted(set(ids))
        stats = q.stats()
        assert (stats.ready, stats.in_flight) == (4, 0)
        assert [m.payload for m in q.pop_many(4)] == [b"job0", b"job1", b"job2", b"job3"]


def test_closing_a_shared_client_ends_the_pops_other_threads_wait_in(tmp_path: Any) -> None:
    """At once, with StoreClosed, as a closed embedded store's waiting pop: they
    waited out their whole ``wait`` (an API audit); their leases, had any been
    taken, go back with the connection."""
    port = _free_port()
    with running(str(tmp_path / "store"), "--metrics-port", str(port)) as srv:
        client = qstore.connect(srv.address)
        q = client.create_queue("w")
        waiters, got = _waiting_pops(q, 3, port)  # wait=30
        _until(port, 3)
        client.close()
        for t in waiters:
            t.join(20)  # under the pops' wait: only the close can have ended them
            assert not t.is_alive()
        assert [type(e) for e in got] == [qstore.StoreClosed] * 3
        assert "was closed during" in str(got[0])
        _until(port, 0)
        with qstore.connect(srv.address) as other:
            assert other.queue("w").stats().total == 0


def test_a_forked_child_closing_its_copy_of_a_client_ends_no_call_of_its_parent(
        tmp_path: Any) -> None:
    # close() shut down the sockets of calls in flight, the parent's too when a
    # forked child closed the client it inherited: the parent's waiting pop
    # failed with ConnectionLost at once (a review).
    port = _free_port()
    with running(str(tmp_path / "store"), "--metrics-port", str(port)) as srv:
        client = qstore.connect(srv.address)
        q = client.create_queue("w")
        waiters, got = _waiting_pops(q, 1, port)
        _until(port, 1)
        pid = os.fork()
        if pid == 0:
            try:
                client.close()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with qstore.connect(srv.address) as other:
            other.queue("w").push(b"for the parent")
        waiters[0].join(60)
        assert [m.payload for m in got] == [b"for the parent"]
        client.close()
