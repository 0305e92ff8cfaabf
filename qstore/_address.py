"""Server addresses: ``unix:///path``, ``tcp://host:port``, or a store directory.

A store directory stands for the unix socket the server makes in it by
default (``STORE/qstore.sock``). Used by ``qstore serve`` and both clients.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import stat
from dataclasses import dataclass

from ._errors import InvalidArgument

SOCKET_NAME = "qstore.sock"
# Written by ``qstore serve`` into the store it owns, removed when it stops:
# {"address": the address it listens on, "pid": its process id}. A store served
# over TCP only has no socket file to tell it is served (served_address).
SERVER_FILE = "qstore.server"
# The event loops ``qstore serve`` runs on (qstore.server.loop_factory); here,
# not in the server package, so that the command line lists them without
# importing the server.
LOOPS = ("auto", "uvloop", "asyncio")


def served_address(store_path: str) -> str | None:
    """The address of the server that owns the store at ``store_path``, from its
    :data:`SERVER_FILE`; None if there is none, or its process is gone (a
    killed server leaves the file behind)."""
    try:
        with open(os.path.join(store_path, SERVER_FILE), encoding="utf-8") as f:
            info = json.load(f)
        address, pid = info["address"], info["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(address, str) or isinstance(pid, bool) or not isinstance(pid, int) \
            or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        pass  # alive, another user's
    return address


def checked_path(value: object, what: str) -> str:
    """``value`` as a text path, or ``InvalidArgument`` saying what it is instead
    (``os.fspath`` raised a bare TypeError for None, and bytes paths met str
    ones later in a TypeError of their own; an API audit)."""
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidArgument(f"{what} must be a str or os.PathLike path, not {value!r:.60}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise InvalidArgument(f"{what} must be a text path, not {path!r:.60}")
    if not path or "\0" in path:
        raise InvalidArgument(f"{what} {path!r:.60} is not a usable path")
    return path


def unix_socket_answers(path: str, timeout: float) -> bool:
    """True when a server accepts connections on the unix socket ``path`` (a connect
    succeeds; no handshake, so no token is needed to tell), or may: a socket this
    user may not connect to (EACCES: another user's server, mode 0600) counts as
    one. False for no file or a stale one, left by a server that was killed.

    EACCES counted as stale: a second server run by another user replaced a live
    server's socket (its clients' pushes went to the other store), and a command
    said the store was locked by an embedding application (a non-root audit).
    """
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except PermissionError:
            return True
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class Address:
    kind: str  # "unix" or "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    def __str__(self) -> str:
        return f"unix://{self.path}" if self.kind == "unix" else f"tcp://{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.kind == "unix":
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False  # a host name: it may resolve to anything


def parse_address(text: str | os.PathLike[str]) -> Address:
    """An Address from ``unix:///p``, ``tcp://h:p``, a store directory path (its
    ``qstore.sock``) or the path of a unix socket."""
    text = checked_path(text, "address")
    if text.startswith("unix://"):
        path = text[len("unix://"):]
        if not path:
            raise InvalidArgument(f"no socket path in {text!r}")
        return Address("unix", path=path)
    if text.startswith("tcp://"):
        host, sep, port = text[len("tcp://"):].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise InvalidArgument(f"expected tcp://HOST:PORT, not {text!r}")
        return Address("tcp", host=host.strip("[]"), port=int(port))
    if "://" in text:
        raise InvalidArgument(f"unknown address scheme in {text!r}; use unix:// or tcp://")
    with contextlib.suppress(OSError):  # no such path: a store the connect names as missing
        if stat.S_ISSOCK(os.stat(text).st_mode):  # the socket itself, not a store
            return Address("unix", path=text)
    return Address("unix", path=os.path.join(text, SOCKET_NAME))
