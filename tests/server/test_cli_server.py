"""`qstore` commands given a store whose server runs go through the server
(contract section 6), or through an address given as STORE; a real server
process each time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import pytest
from click.testing import CliRunner

import qstore
from qstore._address import served_address
from qstore.cli import main

from ._support import ServerProcess, env, running


def _run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def test_commands_on_a_served_store_go_through_the_server(server: ServerProcess,
                                                          tmp_path: Any) -> None:
    store = server.store
    r = _run("push", store, "jobs", "hello", "-p", "7", "--create")
    assert r.exit_code == 0, r.output
    mid = int(r.output)
    assert _run("push", store, "jobs", "later", "--ttl", "60").exit_code == 0
    stats = json.loads(_run("stats", store, "--json").output)
    assert stats["queues"][0]["queue"] == "jobs" and stats["queues"][0]["ready"] == 2
    r = _run("peek", store, "jobs")
    assert r.exit_code == 0 and "hello" in r.output
    r = _run("pop", store, "jobs")
    assert r.exit_code == 0 and r.output.startswith(f"{mid}\t") and "hello" in r.output
    r = _run("pop", store, "jobs", "--no-ack")
    assert r.exit_code == 0 and "receipt=" in r.output
    with qstore.connect(store) as client:  # --no-ack leases outlive the command
        assert client.queue("jobs").stats().in_flight == 1
    assert _run("pop", store, "jobs").exit_code == 1  # nothing ready
    r = _run("compact", store)
    assert r.exit_code == 0 and "freed" in r.output, r.output
    dest = str(tmp_path / "snap")
    assert _run("snapshot", store, dest).exit_code == 0
    assert os.path.isdir(dest)
    r = _run("check", store)
    assert r.exit_code == 0, r.output
    assert _run("check", dest).exit_code == 0


def test_receipts_from_pop_no_ack_are_acked_nacked_and_extended_through_the_server(
        server: ServerProcess) -> None:
    # The command line had no ack: a --no-ack receipt was for code only.
    store = server.store
    with qstore.connect(store) as client:
        client.create_queue("jobs", max_attempts=1).push_many([b"a", b"b", b"c"])
    r = _run("pop", store, "jobs", "-n", "3", "--no-ack", "--lease", "600")
    assert r.exit_code == 0, r.output
    receipts = [field[len("receipt="):] for line in r.output.splitlines()
                for field in line.split("\t") if field.startswith("receipt=")]
    assert len(receipts) == 3
    r = _run("extend", store, "jobs", receipts[0], "--lease", "900")
    assert r.exit_code == 0 and "lease_deadline=" in r.output, r.output
    assert _run("ack", store, "jobs", receipts[0], receipts[1]).output.strip() == "2"
    assert _run("ack", store, "jobs", receipts[0]).exit_code == 4  # gone
    assert _run("nack", store, "jobs", receipts[2]).output.strip() == "1"  # its last attempt
    with qstore.connect(store) as client:
        assert client.queue("jobs").stats().dead == 1
    assert _run("redrive", store, "jobs").output.strip() == "1"
    with qstore.connect(store) as client:
        st = client.queue("jobs").stats()
        assert (st.ready, st.in_flight, st.dead) == (1, 0, 0)
        assert client.queue("jobs").pop().payload == b"c"


def test_a_served_store_opened_embedded_names_its_server(server: ServerProcess) -> None:
    # (A backfill goes through the server: tests/spark/test_backfill_served.py.)
    store = server.store
    with pytest.raises(qstore.StoreLocked) as info:  # another process: the server holds it
        qstore.open(store, compactor=False)
    assert info.value.served is True and info.value.path == store
    assert f"qstore.connect({store!r})" in str(info.value)


def test_a_tcp_server_with_a_token(tmp_path: Any) -> None:
    tok = tmp_path / "tok"
    tok.write_text("s3cret\n")
    with running(str(tmp_path / "store"), "--listen", "tcp://127.0.0.1:0",
                 "--token-file", str(tok)) as srv:
        r = _run("push", srv.address, "q", "x", "--create", "--token-file", str(tok))
        assert r.exit_code == 0, r.output
        r = _run("stats", srv.address, "--json", "--token-file", str(tok))
        assert json.loads(r.output)["queues"][0]["ready"] == 1
        r = _run("stats", srv.address)
        assert r.exit_code == 5 and "AuthenticationFailed" not in r.output


def test_a_stale_socket_file_is_ignored(tmp_path: Any) -> None:
    store = str(tmp_path / "store")
    with running(store) as srv:
        assert _run("push", store, "q", "x", "--create").exit_code == 0
        srv.kill()  # SIGKILL: the socket file stays, nothing answers
    assert os.path.exists(os.path.join(store, "qstore.sock"))
    r = _run("pop", store, "q")
    assert r.exit_code == 0 and "x" in r.output, r.output


def test_check_and_repair_of_a_served_store_go_through_its_server(server: ServerProcess) -> None:
    store = server.store
    with qstore.connect(store) as client:
        q = client.create_queue("jobs")
        q.push_many([b"fine %02d " % i * 8 for i in range(5)])
        bad = q.push(b"DAMAGE-ME " * 8)
        assert client.check().ok
    for name in os.listdir(os.path.join(store, "payload")):  # flip a byte of its body
        path = os.path.join(store, "payload", name)
        with open(path, "r+b") as f:
            data = f.read()
            at = data.find(b"DAMAGE-ME")
            if at >= 0:
                f.seek(at)
                f.write(b"X")
    r = _run("check", store)  # plain: a read-only view beside the server
    assert r.exit_code == 1 and "crc_mismatch" in r.output, r.output
    with qstore.connect(store) as client:
        report = client.check()  # the server's own check, over the wire
        assert [(f.kind, f.queue, f.message_id) for f in report.findings] == [
            ("crc_mismatch", "jobs", bad)]
    r = _run("check", "--repair", store)  # through the server: the store stays served
    assert r.exit_code == 0, r.output
    assert f"repaired: moved_aside: message {bad} in 'jobs'" in r.output
    assert "note: damaged_set_aside" in r.output
    with qstore.connect(store) as client:
        report = client.check()
        assert report.ok and [n.message_id for n in report.notes] == [bad]
        assert client.queue("jobs").stats().dead == 1
    r = _run("check", server.address)  # an address: the server checks its store
    assert r.exit_code == 0 and "note: damaged_set_aside" in r.output, r.output


def test_the_event_loop_is_uvloop_by_default_and_can_be_chosen(tmp_path: Any,
                                                                monkeypatch: Any) -> None:
    from qstore import server

    with running(str(tmp_path / "a")) as srv:
        assert srv.loop == "uvloop"
    with running(str(tmp_path / "b"), "--loop", "asyncio") as srv, \
            qstore.connect(srv.address) as client:
        assert srv.loop == "asyncio"
        q = client.create_queue("q")
        q.push(b"on asyncio's loop")
        m = q.pop()
        assert m is not None and m.payload == b"on asyncio's loop"
        q.ack(m)
    r = _run("serve", str(tmp_path / "c"), "--loop", "trio")
    assert r.exit_code == 2 and "trio" in r.output
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as where it is not built
    assert server.loop_factory("auto") is None
    r = _run("serve", str(tmp_path / "c"), "--loop", "uvloop")
    assert r.exit_code == 2 and "uvloop event loop is not installed" in r.output
    assert not os.path.exists(tmp_path / "c")  # refused before the store was made


def test_serve_on_a_taken_port_says_so_and_leaves_nothing_behind(tmp_path: Any) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    store, empty = str(tmp_path / "s"), tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("mine")
    with qstore.open(store) as s:
        s.create_queue("kept").push(b"x")

    def serve(path: Any, *args: str) -> None:
        r = subprocess.run([sys.executable, "-m", "qstore.cli", "serve", str(path), *args],
                           capture_output=True, text=True, timeout=60, env=env())
        assert r.returncode == 5, r.stderr  # an error, not "found something" (1)
        assert "Traceback" not in r.stderr
        assert "address already in use" in r.stderr.lower()
        # It never served: no "listening" line (one came before the metrics port
        # was taken; a docs audit).
        assert "listening" not in r.stderr and "listening" not in r.stdout

    try:
        for args in (["--listen", f"tcp://127.0.0.1:{port}"], ["--metrics-port", str(port)]):
            serve(store, *args)
            assert "qstore.sock" not in os.listdir(store)  # no stale socket file
            # A store the failed serve created is taken away again, as a mistyped
            # path creates nothing; what was in a directory before stays.
            serve(tmp_path / "new", *args)
            assert not os.path.exists(tmp_path / "new")
            serve(empty, *args)
            assert os.listdir(empty) == ["notes.txt"]
    finally:
        taken.close()
    with qstore.open(store) as s:  # closed cleanly: it opens, its messages kept
        assert s.queues() == ["kept"] and s.queue("kept").pop().payload == b"x"


def test_serve_on_the_socket_of_a_running_server_is_refused(tmp_path: Any) -> None:
    # asyncio replaces a socket file: a second server listening at a running one's
    # socket took it over, and that server's clients reached the other store (an
    # operations audit). A stale socket file (a killed server's) is still replaced.
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    with running(first) as srv:
        with qstore.connect(srv.address) as client:
            client.create_queue("a")
        r = subprocess.run([sys.executable, "-m", "qstore.cli", "serve", second,
                            "--listen", srv.address], capture_output=True, text=True,
                           timeout=60, env=env())
        assert r.returncode == 5, r.stderr
        assert "another server listens there" in r.stderr and "Traceback" not in r.stderr
        with qstore.connect(srv.address) as client:
            assert client.queues() == ["a"]  # still the first server's store
        srv.proc.kill()
        srv.proc.wait(30)
    assert os.path.exists(os.path.join(first, "qstore.sock"))  # stale now
    stale = "unix://" + os.path.join(first, "qstore.sock")
    with running(second, "--listen", stale) as srv2, qstore.connect(srv2.address) as client:
        assert client.queues() == []


def test_python_dash_m_qstore_is_the_command_line(tmp_path: Any) -> None:
    r = subprocess.run([sys.executable, "-m", "qstore", "push", str(tmp_path / "s"), "jobs",
                        "hello", "--create"], capture_output=True, text=True, timeout=60,
                       env=env())
    assert r.returncode == 0, r.stderr
    with qstore.open(str(tmp_path / "s")) as s:
        assert [m.payload for m in s.queue("jobs").peek(5)] == [b"hello"]


def test_serve_on_a_served_store_says_it_is_served(tmp_path: Any) -> None:
    # It said "locked by another writer (a process that opened it with qstore.open)
    # ... let a server own the store": a server owns it already (operations audit).
    path = str(tmp_path / "s")
    with running(path):
        r = subprocess.run([sys.executable, "-m", "qstore.cli", "serve", path],
                           capture_output=True, text=True, timeout=60, env=env())
    assert r.returncode == 3, r.stderr
    assert "is served already" in r.stderr and "qstore.open" not in r.stderr


def test_a_store_served_over_tcp_only_names_its_server(tmp_path: Any) -> None:
    # A TCP-only server leaves no socket in the store: commands said it was
    # "locked by another writer (a process that opened it with qstore.open)",
    # a second serve did too, and qstore.open raised StoreLocked(served=False)
    # (a newcomer's audit). The server now writes STORE/qstore.server.
    path = str(tmp_path / "s")
    with running(path, "--listen", "tcp://127.0.0.1:0") as srv:
        assert srv.address.startswith("tcp://127.0.0.1:")
        with open(os.path.join(path, "qstore.server"), encoding="utf-8") as f:
            assert json.load(f) == {"address": srv.address, "pid": srv.proc.pid}
        with pytest.raises(qstore.StoreLocked) as info:
            qstore.open(path)
        assert info.value.served and info.value.address == srv.address
        assert f"qstore.connect({srv.address!r})" in str(info.value)
        for args in (["push", path, "q", "x", "--create"], ["serve", path]):
            r = subprocess.run([sys.executable, "-m", "qstore.cli", *args],
                               capture_output=True, text=True, timeout=60, env=env())
            assert r.returncode == 3, r.stderr
            assert "is served already" in r.stderr and srv.address in r.stderr, r.stderr
            assert "qstore.open" not in r.stderr
        assert srv.terminate() == 0
    assert not os.path.exists(os.path.join(path, "qstore.server"))  # gone with its server
    with qstore.open(path) as store:  # and a killed server's file says nothing
        assert store.queues() == []
    with open(os.path.join(path, "qstore.server"), "w", encoding="utf-8") as f:
        json.dump({"address": "tcp://127.0.0.1:1", "pid": 2**22 + 1}, f)
    assert served_address(path) is None


def test_the_server_file_holds_an_absolute_address_and_goes_at_the_next_open(
        tmp_path: Any, monkeypatch: Any) -> None:
    # A store served by a relative path wrote "unix://s/qstore.sock", which named
    # nothing from another directory; and a file left by a killed server was
    # believed whenever its pid existed (a container's pid 1, a reused pid).
    monkeypatch.chdir(tmp_path)
    with running("s") as srv:
        with open(os.path.join("s", "qstore.server"), encoding="utf-8") as f:
            address = json.load(f)["address"]
        assert address == f"unix://{tmp_path / 's' / 'qstore.sock'}"
        srv.proc.kill()  # SIGKILL: the file stays
        srv.proc.wait(30)
    with open(os.path.join("s", "qstore.server"), "w", encoding="utf-8") as f:
        json.dump({"address": "tcp://127.0.0.1:1", "pid": os.getpid()}, f)  # a live pid
    with qstore.open("s", compactor=False):
        assert not os.path.exists(os.path.join("s", "qstore.server"))  # not a server's


def test_queues_lists_through_a_server_address(tmp_path: Any) -> None:
    # Every other reading command took a server address; queues said "no store".
    with running(str(tmp_path / "s")) as srv:
        with qstore.connect(srv.address) as client:
            client.create_queue("b")
            client.create_queue("a")
        r = CliRunner().invoke(main, ["queues", srv.address])
    assert r.exit_code == 0, r.output
    assert r.output.split() == ["a", "b"]


def test_serve_logs_to_stderr_with_time_and_level(tmp_path: Any) -> None:
    # Without a handler, Python printed only warnings and errors, bare (no time,
    # no level), and dropped every INFO line (an audit of what operators see).
    import re

    store = str(tmp_path / "s")
    srv = ServerProcess(store)
    try:
        assert srv.terminate() == 0
        assert srv.proc.stderr is not None
        lines = srv.proc.stderr.read().decode().splitlines()
    finally:
        srv.kill()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    # unix:///PATH, absolute, as docs/server.md gives it (a relative STORE printed
    # unix://s/qstore.sock; a docs audit)
    assert re.fullmatch(stamp + r" INFO qstore\.server: qstore server listening on unix://"
                        + re.escape(os.path.join(os.path.abspath(store), "qstore.sock")),
                        lines[0]), lines
    assert re.fullmatch(stamp + r" INFO qstore: qstore server stopped; store .* closed",
                        lines[-1]), lines
    quiet = ServerProcess(store, "--log-level", "warning")
    try:
        assert quiet.terminate() == 0
        assert quiet.proc.stderr is not None
        assert quiet.proc.stderr.read() == b""
    finally:
        quiet.kill()


def test_a_relative_store_is_served_at_its_absolute_address(tmp_path: Any) -> None:
    # It printed unix://s/qstore.sock: not the unix:///PATH form docs/server.md
    # gives, and usable only from the server's own directory (a docs audit).
    proc = subprocess.Popen([sys.executable, "-m", "qstore.cli", "serve", "s"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env())
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().decode().strip()
        assert address == f"listening on unix://{tmp_path}/s/qstore.sock"
        with qstore.connect(address[len("listening on "):]) as client:  # from elsewhere
            assert client.queues() == []
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
        if proc.stdout is not None:
            proc.stdout.close()
