"""Many processes on one server: exactly once, dead consumers, dead and stopped servers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

import qstore

from ._consumer import produced
from ._support import (
    ServerProcess,
    env,
    frame,
    frames_until_closed,
    raw_socket,
    read_frames,
    running,
)

HERE = os.path.dirname(os.path.abspath(__file__))


def _consumer(address: str, queue: str, mode: str, count: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, os.path.join(HERE, "_consumer.py"), address,
                             queue, mode, str(count)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env())


def test_producers_and_consumers_each_message_exactly_once(server: ServerProcess) -> None:
    with qstore.connect(server.address) as client:
        q = client.create_queue("work")
        bodies = [os.urandom(16 + i % 700) for i in range(600)]
        for i in range(0, 600, 50):  # several batches and single pushes
            q.push_many(bodies[i:i + 25])
            for b in bodies[i + 25:i + 50]:
                q.push(b)
        procs = [_consumer(server.address, "work", "ack", 600) for _ in range(3)]
        outs = [p.communicate(timeout=60)[0].decode().split() for p in procs]
        assert all(p.returncode == 0 for p in procs)
        got = [bytes.fromhex(h) for out in outs for h in out]
        assert sorted(got) == sorted(bodies)  # every one, exact bytes, none twice
        assert q.stats().total == 0


def test_producer_and_consumer_processes_at_once_each_message_exactly_once(
        server: ServerProcess) -> None:
    with qstore.connect(server.address) as client:
        q = client.create_queue("busy", order="fifo")
        consumers = [_consumer(server.address, "busy", "until-stop", 0) for _ in range(3)]
        producers = [_consumer(server.address, "busy", f"produce:{k}", 400) for k in range(3)]
        for p in producers:
            p.communicate(timeout=120)
        assert all(p.returncode == 0 for p in producers)
        q.push_many([b"STOP"] * 3)  # after every produced message (fifo): one per consumer
        outs = [p.communicate(timeout=120)[0].decode().split() for p in consumers]
        assert all(p.returncode == 0 for p in consumers)
        got = [bytes.fromhex(h) for out in outs for h in out]
        expected = [b for k in range(3) for b in produced(k, 400)]
        assert len(got) == len(expected) == 1200
        assert sorted(got) == sorted(expected)  # every one, exact bytes, none twice
        assert q.stats().total == 0


def test_a_killed_consumers_leases_go_back_at_once(server: ServerProcess) -> None:
    with qstore.connect(server.address) as client:
        q = client.create_queue("jobs")
        q.push_many([b"a", b"b", b"c"])
        holder = _consumer(server.address, "jobs", "hold", 2)
        assert holder.stdout is not None
        assert holder.stdout.readline().split() == [b"held", b"2"]
        assert q.stats().in_flight == 2
        holder.kill()
        holder.wait(30)
        holder.stdout.close()
        holder.stdin.close()  # type: ignore[union-attr]
        # The leases were for an hour: only the closed connection can bring them back.
        got = q.pop_many(3, wait=10.0)
        while len(got) < 3:
            more = q.pop_many(3, wait=10.0)
            assert more, "leases of the dead consumer were not released"
            got += more
        assert sorted(m.payload for m in got) == [b"a", b"b", b"c"]
        assert sorted(m.attempts for m in got) == [1, 2, 2]  # attempts kept


def test_keep_leases_outlive_the_connection(server: ServerProcess) -> None:
    with qstore.connect(server.address) as client:
        client.create_queue("k").push(b"x")
    with qstore.connect(server.address, keep_leases=True) as holder:
        assert holder.queue("k").pop(lease=3600.0) is not None
    with qstore.connect(server.address) as client:
        assert client.queue("k").stats().in_flight == 1


def test_killed_server_loses_nothing_that_returned_and_clients_reconnect(tmp_path: Any) -> None:
    path = str(tmp_path / "store")
    srv = ServerProcess(path)
    try:
        client = qstore.connect(srv.address)
        q = client.create_queue("d")
        ids = q.push_many([b"m%d" % i for i in range(100)]) + [q.push(b"last")]
        srv.kill()
        with pytest.raises(qstore.ConnectionLost):
            q.push(b"lost?")
        srv = ServerProcess(path)
        assert q.stats().ready == 101  # the same client object reconnected
        assert [m.id for m in q.pop_many(200)] == ids
        client.close()
    finally:
        srv.kill()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])  # each loop installs its own handlers
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_shuts_down_cleanly_and_the_store_opens_embedded(tmp_path: Any, loop: str,
                                                                 sig: int) -> None:
    path = str(tmp_path / "store")
    with running(path, "--loop", loop) as srv:
        assert srv.loop == loop
        with qstore.connect(srv.address) as client:
            q = client.create_queue("t")
            q.push_many([b"1", b"2"])
            q.pop()  # leased when the server stops: goes back to ready
        assert srv.terminate(sig=sig) == 0
        assert not os.path.exists(os.path.join(path, "qstore.sock"))
    with qstore.open(path) as store:
        assert store.queue("t").stats().ready == 2
        assert store.check().ok


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
@pytest.mark.parametrize("signals", [(signal.SIGINT, signal.SIGINT),
                                     (signal.SIGTERM, signal.SIGTERM),
                                     (signal.SIGTERM, signal.SIGINT)],
                         ids=["INT-INT", "TERM-TERM", "TERM-INT"])
def test_signals_after_the_first_leave_a_clean_stop_clean(
        tmp_path: Any, loop: str, signals: tuple[int, int]) -> None:
    # Closing the event loop put the default handlers back: a second signal as
    # the process ended (after the "stopped" line) killed it (exit 130 or 143 in
    # a shell) or printed a KeyboardInterrupt traceback, 6 of 6 times for SIGINT
    # (a signals audit). Once stopping, serve ignores them.
    first, second = signals
    srv = ServerProcess(str(tmp_path / "store"), "--loop", loop)
    try:
        srv.proc.send_signal(first)
        assert srv.proc.stderr is not None
        seen = []
        while line := srv.proc.stderr.readline().decode():
            seen.append(line)
            if "qstore server stopped" in line:
                for _ in range(2):
                    with contextlib.suppress(ProcessLookupError):
                        srv.proc.send_signal(second)
                break
        rc = srv.proc.wait(30)
        seen += srv.proc.stderr.read().decode().splitlines(keepends=True)
    finally:
        srv.kill()
    assert rc == 0, seen
    assert any("qstore server stopped" in line for line in seen), seen
    assert not any("Traceback" in line or "Aborted" in line for line in seen), seen


SERVE_THEN_LOOK = """
import os, signal, sys
import qstore
from qstore import server
store = qstore.open(sys.argv[1])
server.serve(store, ready=lambda address: os.kill(os.getpid(), signal.SIGTERM),
             ignore_later_signals=sys.argv[2] == "ignore")
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
      signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
      signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)
"""


@pytest.mark.parametrize("after", ["restore", "ignore"])
def test_serve_in_python_puts_back_the_handlers_it_found(tmp_path: Any, after: str) -> None:
    # A program that serves and then goes on gets its Ctrl-C back; qstore serve
    # keeps ignoring both signals to its end.
    r = subprocess.run([sys.executable, "-c", SERVE_THEN_LOOK, str(tmp_path / "s"), after],
                       capture_output=True, text=True, timeout=60, env=env())
    assert r.returncode == 0, r.stderr
    restored = after == "restore"
    assert r.stdout.split() == [str(restored), str(not restored)] * 2


def test_sigterm_answers_what_the_store_thread_still_runs(tmp_path: Any) -> None:
    # With durability "always" the store thread still had pipelined pushes to run
    # when SIGTERM came; they committed, but the connections were closed first, so
    # their clients saw ConnectionLost for work that was done (an operations
    # audit: 0 of 300 answered, all 300 in the store).
    path = str(tmp_path / "store")
    with qstore.open(path) as store:
        store.create_queue("q")
    with running(path, "--durability", "always") as srv:
        s = raw_socket(srv.address)
        s.sendall(frame({"qstore": 1}))
        read_frames(s, 1)
        s.sendall(b"".join(frame([i, "push", {"queue": "q", "payload": b"%d" % i}])
                           for i in range(1, 301)))
        srv.proc.send_signal(signal.SIGTERM)  # the server is reading and running them
        answers = frames_until_closed(s)
        s.close()
        assert srv.proc.wait(30) == 0
    answered = {a[2] for a in answers if a[1] == 0}  # [id, OK, message id]
    assert len(answered) == len(answers)  # every answer an OK, none an error
    with qstore.open(path) as store:
        held = {m.id for m in store.queue("q").pop_many(1000)}
    assert held == answered  # nothing done unanswered, nothing answered undone


def test_sigterm_after_a_client_left_requests_held_behind_a_check(
        tmp_path: Any) -> None:
    # Requests a connection sent after a check wait in its backlog until the check
    # ends; if the connection closed meanwhile they stayed counted as in progress
    # for good: its leases were never given back, and SIGTERM waited for them
    # forever (a second signal did nothing; an operations audit).
    path = str(tmp_path / "store")
    with qstore.open(path) as store:
        q = store.create_queue("q")
        q.push_many([b"x" * 100] * 20_000)  # a check of some length
    with running(path) as srv:
        s = raw_socket(srv.address)
        s.sendall(frame({"qstore": 1}))
        read_frames(s, 1)
        s.sendall(frame([1, "pop", {"queue": "q", "lease": 600.0}]))
        read_frames(s, 1)
        s.sendall(frame([2, "check", {}]) + frame([3, "push", {"queue": "q", "payload": b"y"}]))
        s.close()  # while the check runs, or before it starts: either way, gone
        with qstore.connect(srv.address) as client:
            client.check()  # runs after the first one: its connection is settled by now
            assert client.queue("q").stats().in_flight == 0  # the lease went back
        assert srv.terminate(timeout=30) == 0
    with qstore.open(path) as store:
        assert store.queue("q").stats().in_flight == 0
