"""Real server processes for the server tests: started, awaited, always killed."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

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
        self.address = self._await_listening()

    def _await_listening(self) -> str:
        """The address from the "listening on" line, read within START_TIMEOUT seconds."""
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT
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
        assert text.startswith("listening on "), text
        return text[len("listening on "):]

    def terminate(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
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
