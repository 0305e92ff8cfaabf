"""Tokens, TLS, non-loopback refusal, and frames that break the protocol."""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import struct
import subprocess
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qstore
import qstore.aio
from qstore.cli import main

from ._support import (
    ServerProcess,
    frame,
    frames_until_closed,
    raw_socket,
    read_frames,
    running,
    send_junk,
)


def _token_file(tmp_path: Any) -> str:
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    return str(path)


def test_wrong_token_is_refused_and_right_token_accepted(tmp_path: Any) -> None:
    with running(str(tmp_path / "s"), "--listen", "tcp://127.0.0.1:0",
                 "--token-file", _token_file(tmp_path)) as srv:
        with pytest.raises(qstore.AuthenticationFailed):
            qstore.connect(srv.address, token="wrong")
        with pytest.raises(qstore.AuthenticationFailed):
            qstore.connect(srv.address)
        with qstore.connect(srv.address, token="s3cret-token") as client:
            q = client.create_queue("q")
            mid = q.push(b"x")
            assert q.get(mid).payload == b"x"


def test_non_loopback_tcp_without_token_refuses_to_start(tmp_path: Any) -> None:
    with pytest.raises(AssertionError, match="token"):
        ServerProcess(str(tmp_path / "s"), "--listen", "tcp://0.0.0.0:0")


def test_unix_socket_is_mode_0600(server: ServerProcess) -> None:
    mode = os.stat(server.address[len("unix://"):]).st_mode & 0o777
    assert mode == 0o600


def _make_cert(tmp_path: Any) -> tuple[str, str]:
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])  # each loop has its own TLS layer
def test_tls_round_trip_with_a_throwaway_certificate(tmp_path: Any, loop: str) -> None:
    cert, key = _make_cert(tmp_path)
    with running(str(tmp_path / "s"), "--listen", "tcp://127.0.0.1:0",
                 "--tls-cert", cert, "--tls-key", key, "--loop", loop) as srv:
        assert srv.loop == loop
        with qstore.connect(srv.address, cafile=cert) as client:
            q = client.create_queue("tls")
            q.push(b"\x00secret\xff")
            assert q.pop().payload == b"\x00secret\xff"
        with pytest.raises(qstore.ConnectionLost):  # plain TCP to a TLS server
            qstore.connect(srv.address, timeout=5.0)
        with pytest.raises(qstore.ConnectionLost):  # a certificate nobody vouched for
            qstore.connect(srv.address, tls=ssl.create_default_context(), timeout=5.0)


def test_commands_reach_a_tls_server_with_tls_and_cafile(tmp_path: Any) -> None:
    # docs/server.md: every `qstore` command takes the server's address; a TLS
    # server (the documented setup off loopback) was out of the commands' reach.
    cert, key = _make_cert(tmp_path)
    token = _token_file(tmp_path)
    with running(str(tmp_path / "s"), "--listen", "tcp://127.0.0.1:0", "--token-file", token,
                 "--tls-cert", cert, "--tls-key", key) as srv:
        auth = ["--token-file", token, "--cafile", cert]
        r = _cli("push", srv.address, "jobs", "hello", "-p", "3", "--create", *auth)
        assert r.exit_code == 0, r.output
        r = _cli("stats", srv.address, "--json", "--tls", *auth)
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["queues"][0]["ready"] == 1
        r = _cli("pop", srv.address, "jobs", *auth)
        assert r.exit_code == 0 and "hello" in r.output, r.output
        # Without --tls the server drops the connection; the error names the cause.
        r = _cli("stats", srv.address, "--token-file", token)
        assert r.exit_code == 5
        assert "closed" in r.output and "pass --tls" in r.output
        # --tls alone trusts only the system's CAs: a throwaway certificate is refused.
        r = _cli("stats", srv.address, "--tls", "--token-file", token)
        assert r.exit_code == 5 and "pass --tls" not in r.output


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("case", ["token-not-utf8", "token-too-long", "cert-not-pem",
                                  "tls-on-unix", "frame-over-u32"])
def test_serve_refuses_settings_it_could_not_serve_with(tmp_path: Any, case: str) -> None:
    # Each was a traceback (exit 1) or a server that started and then failed every
    # client: a token longer than the 64 KiB handshake, a --max-frame msgpack could
    # not put in the handshake answer, TLS on the default unix socket that no
    # command could reach (a configuration audit). Now a usage error, and the store
    # the command would have made is not left behind.
    cert, key = _make_cert(tmp_path)
    bad = tmp_path / "bad"
    args: list[str] = []
    if case == "token-not-utf8":
        bad.write_bytes(b"\xff\xfe\x00abc")
        args = ["--token-file", str(bad)]
    elif case == "token-too-long":
        bad.write_text("t" * 70_000)
        args = ["--token-file", str(bad)]
    elif case == "cert-not-pem":
        bad.write_text("not a pem\n")
        args = ["--listen", "tcp://127.0.0.1:0", "--tls-cert", str(bad), "--tls-key", str(bad)]
    elif case == "tls-on-unix":
        args = ["--tls-cert", cert, "--tls-key", key]
    else:
        args = ["--max-frame", str(2**32)]
    r = _cli("serve", str(tmp_path / "s"), *args)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "s").exists()


def test_a_token_file_others_may_read_is_said_and_a_bom_is_no_part_of_it(
        tmp_path: Any, caplog: Any) -> None:
    # Neither was looked at: a world-readable token file started the server
    # without a word, and an editor's byte-order mark became part of the token
    # (a security audit).
    from qstore._auth import read_token_file

    tok = tmp_path / "tok"
    tok.write_bytes(b"\xef\xbb\xbfsecret\n")
    for mode, warned in ((0o600, False), (0o640, True), (0o644, True), (0o400, False)):
        os.chmod(tok, mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qstore.auth"):
            assert read_token_file(str(tok)) == "secret"
        said = [r.getMessage() for r in caplog.records]
        assert bool(said) == warned, (oct(mode), said)
        if warned:
            assert f"has mode {mode:04o}" in said[0] and "chmod 600" in said[0]


def test_a_socket_this_user_may_not_connect_to_counts_as_a_server(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # EACCES on the probe's connect (another user's server, its socket 0600) was
    # taken for a stale socket: a second server replaced the live one's socket
    # and its clients' pushes went to the other store (a non-root audit; tests
    # run as root, who may connect anywhere, so the refusal is simulated).
    from qstore import _address

    path = tmp_path / "s.sock"
    path.write_bytes(b"")

    class Refused(socket.socket):
        def connect(self, address: Any) -> None:
            raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_address.socket, "socket", Refused)
    assert _address.unix_socket_answers(str(path), 1.0)


def test_a_server_removes_only_the_socket_it_made(tmp_path: Any) -> None:
    # At its stop it unlinked whatever was at its path: another server's socket
    # put there since (a non-root audit), which then had no way in.
    sock_path = str(tmp_path / "x.sock")
    srv = ServerProcess(str(tmp_path / "store"), "--listen", f"unix://{sock_path}")
    try:
        with qstore.connect(srv.address) as client:
            client.queues()
        os.rename(sock_path, sock_path + ".moved")
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(sock_path)
        other.listen(1)
        try:
            assert srv.terminate() == 0
            assert os.path.exists(sock_path)  # the other one's, left in place
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.connect(sock_path)
            probe.close()
        finally:
            other.close()
    finally:
        srv.kill()


def test_the_longest_token_the_handshake_carries_works(tmp_path: Any) -> None:
    # Bounded at what the 64 KiB handshake can carry, not lower: a JWT-sized token
    # (6,000 bytes) that worked before must go on working (a review).
    token = "t" * 61440
    path = tmp_path / "token"
    path.write_text(token + "\n")
    with running(str(tmp_path / "s"), "--listen", "tcp://127.0.0.1:0",
                 "--token-file", str(path)) as srv, qstore.connect(srv.address,
                                                                   token=token) as client:
        assert client.create_queue("q").push(b"x") == 1


def test_clients_refuse_tls_and_token_settings_they_could_not_use(tmp_path: Any) -> None:
    cert, _ = _make_cert(tmp_path)
    bad = tmp_path / "bad.pem"
    bad.write_text("not a pem\n")
    for connect in (qstore.connect, qstore.aio.connect):
        with pytest.raises(qstore.InvalidArgument, match="cannot load CA certificates"):
            connect("tcp://127.0.0.1:1", cafile=str(bad))
        with pytest.raises(qstore.InvalidArgument, match="cannot load CA certificates"):
            connect("tcp://127.0.0.1:1", cafile=str(tmp_path / "missing.pem"))
        with pytest.raises(qstore.InvalidArgument, match="TLS is for tcp://"):
            connect(str(tmp_path / "s"), cafile=cert)  # a store path: its unix socket
        with pytest.raises(qstore.InvalidArgument, match="61440"):
            connect("tcp://127.0.0.1:1", token="t" * 61441)
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfe")
    r = _cli("stats", "tcp://127.0.0.1:1", "--token-file", str(token))
    assert r.exit_code == 2 and "UTF-8" in r.output, r.output
    r = _cli("stats", "tcp://127.0.0.1:1", "--cafile", str(bad))
    assert r.exit_code == 2 and "CA certificates" in r.output, r.output


def _closed_with_error(s: socket.socket) -> Any:
    """The last frame the server sent (its error) before it closed the connection."""
    try:
        return frames_until_closed(s)[-1]
    finally:
        s.close()


def test_oversized_malformed_and_unauthenticated_frames_close_only_that_connection(
        server: ServerProcess) -> None:
    with qstore.connect(server.address) as good:
        q = good.create_queue("q")
        bad = raw_socket(server.address)
        bad.sendall(struct.pack(">I", 2**31))  # oversized
        assert _closed_with_error(bad)[2][0] == "ProtocolError"
        bad = raw_socket(server.address)
        bad.sendall(frame([1, "push", {"queue": "q", "payload": b"x"}]))  # no handshake
        assert _closed_with_error(bad)[2][0] == "ProtocolError"
        bad = raw_socket(server.address)
        bad.sendall(frame({"qstore": 1}) + b"\x00\x00\x00\x02\xc1\xc1")  # malformed body
        error = _closed_with_error(bad)
        assert error[0] == 0 and error[2][0] == "ProtocolError"
        bad = raw_socket(server.address)
        bad.sendall(frame({"qstore": 99}))  # unknown version
        assert "version" in _closed_with_error(bad)[2][1]
        bad = raw_socket(server.address)
        bad.sendall(b"\x00\x00\x01\x00abc")  # truncated, then gone
        bad.close()
        q.push(b"fine")
        assert q.pop().payload == b"fine"


def test_many_idle_connections_do_not_block_a_working_client(server: ServerProcess) -> None:
    idle = [raw_socket(server.address) for _ in range(100)]
    try:
        with qstore.connect(server.address) as client:
            q = client.create_queue("q")
            assert q.push_many([b"%d" % i for i in range(10)]) == list(range(1, 11))
    finally:
        for s in idle:
            s.close()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.one_of(
    st.binary(max_size=64),
    st.builds(lambda v: frame(v), st.recursive(
        st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=8)
        | st.binary(max_size=8),
        lambda inner: st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)),
), handshake=st.booleans())
def test_fuzzed_frames_never_harm_the_server(server: ServerProcess, junk: bytes,
                                             handshake: bool) -> None:
    send_junk(server.address, (frame({"qstore": 1}) if handshake else b"") + junk)
    with qstore.connect(server.address) as client:
        q = client.create_queue("fz", exist_ok=True)
        q.push(b"alive")
        assert q.pop().payload == b"alive"
    assert server.proc.poll() is None


def test_hostile_arguments_get_short_errors_and_change_nothing(server: ServerProcess) -> None:
    # Found by a security audit: a 1,000-deep list made the error's repr raise
    # RecursionError ("server error", a traceback per request); a 16 MiB list
    # was quoted whole in its error; check(repair="no") ran a repair; an empty
    # snapshot dest wrote a copy of the store into the server's cwd (and a
    # relative one went there too); version True passed the handshake.
    with qstore.connect(server.address) as client:
        client.create_queue("q").push(b"x")
    s = raw_socket(server.address)
    try:
        s.sendall(frame({"qstore": 1}))
        assert isinstance(read_frames(s, 1)[0], dict)
        deep: Any = []
        for _ in range(900):
            deep = [deep]
        requests = [
            [1, "pop", {"queue": "q", "wait": deep}],
            [2, "configure_queue", {"name": "q", "rate": [0] * 2_000_000}],
            [3, "check", {"repair": "no"}],
            [4, "snapshot", {"dest": ""}],
            [5, "snapshot", {"dest": "relative/snap"}],
        ]
        s.sendall(b"".join(frame(r) for r in requests))
        got = {a[0]: a for a in read_frames(s, len(requests))}
        for rid in range(1, 6):
            assert got[rid][1] == 1 and got[rid][2][0] == "InvalidArgument", got[rid][:2]
            assert len(got[rid][2][1]) < 5000
    finally:
        s.close()
    bad = raw_socket(server.address)
    bad.sendall(frame({"qstore": True}))
    assert _closed_with_error(bad)[2][0] == "ProtocolError"
    with qstore.connect(server.address) as client:
        assert client.queue("q").pop().payload == b"x"  # no repair, nothing changed
