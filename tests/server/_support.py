"""Real server processes for the server tests (started, awaited, always killed), and
a server in this process on a thread of its own (:func:`serving`)."""

from __future__ import annotations

import asyncio
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack

import qstore
from qstore._address import parse_address
from qstore.server import Limits, Server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT = 30.0


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return e


class ServerProcess:
    def __init__(self, store: str, *args: str) -> None:
        self.store = store
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qstore.cli", "serve", store, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env())
        deadline = time.monotonic() + START_TIMEOUT
        self.address = self._expect("listening on ", deadline)
        self.loop = self._expect("event loop: ", deadline)  # "uvloop" or "asyncio"

    def _expect(self, prefix: str, deadline: float) -> str:
        """The rest of the server's next line, which starts with ``prefix``,
        read by ``deadline`` (the two lines it prints once it listens)."""
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                self.kill()
                raise AssertionError("server did not start in time")
            chunk = os.read(self.proc.stdout.fileno(), 1)
            if not chunk:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                self.kill()
                raise AssertionError(f"server exited: {err}")
            line += chunk
        sel.close()
        text = line.decode().strip()
        assert text.startswith(prefix), text
        return text[len(prefix):]

    def terminate(self, timeout: float = 30.0, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@contextmanager
def running(store: str, *args: str) -> Iterator[ServerProcess]:
    server = ServerProcess(store, *args)
    try:
        yield server
    finally:
        server.kill()


def raw_socket(address: str) -> socket.socket:
    """A plain connection to a unix-socket server, for sending bytes by hand."""
    s = socket.socket(socket.AF_UNIX)
    # Blocking, no timeout: a unix socket with a timeout fails with EAGAIN at
    # once when the server's accept backlog is full, instead of waiting.
    s.connect(address[len("unix://"):])
    s.settimeout(10)
    return s


def frame(value: Any) -> bytes:
    """``value`` as one protocol frame (docs/protocol.md), for raw connections."""
    body: bytes = msgpack.packb(value, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def _cut(data: bytes) -> tuple[list[Any], bytes]:
    """The whole frames at the front of ``data``, decoded, and what is left."""
    out = []
    while len(data) >= 4 and len(data) >= 4 + struct.unpack(">I", data[:4])[0]:
        (n,) = struct.unpack(">I", data[:4])
        out.append(msgpack.unpackb(data[4:4 + n], raw=False))
        data = data[4 + n:]
    return out, data


def read_frames(s: socket.socket, n: int) -> list[Any]:
    """The next ``n`` frames on raw connection ``s``, in the order they came."""
    data, got = b"", []
    while len(got) < n:
        chunk = s.recv(65536)
        assert chunk, "the server closed the connection"
        more, data = _cut(data + chunk)
        got += more
    assert len(got) == n and not data, "more arrived than was asked for"
    return got


def frames_until_closed(s: socket.socket) -> list[Any]:
    """Every frame the server sends on ``s`` until it closes the connection."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    frames, rest = _cut(data)
    assert not rest, "the server closed in the middle of a frame"
    return frames


def send_junk(address: str, data: bytes) -> None:
    """Send ``data`` on a connection of its own, close the sending side, and
    read whatever the server answers until it closes (its errors included)."""
    s = raw_socket(address)
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):
            pass
    except OSError:
        pass
    finally:
        s.close()


@contextmanager
def serving(path: str, limits: Limits | None = None, *, sweep_interval: float = 60.0,
            **options: Any) -> Iterator[str]:
    """A server in this process (on a thread of its own) on the store at ``path``."""
    with serving_in(path, limits, sweep_interval=sweep_interval, **options) as (server, _):
        yield server.listening_on


@contextmanager
def serving_in(path: str, limits: Limits | None = None, *, sweep_interval: float = 60.0,
               **options: Any) -> Iterator[tuple[Server, asyncio.AbstractEventLoop]]:
    """:func:`serving`, giving the server and its loop (to call shutdown on it)."""
    store = qstore.open(path, sweep_interval=sweep_interval, **options)
    server = Server(store, parse_address(path), limits=limits)
    loop = asyncio.new_event_loop()
    up = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        up.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert up.wait(30)
    try:
        yield server, loop
    finally:
        asyncio.run_coroutine_threadsafe(server.shutdown(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
