"""What the sync and asyncio clients share: the handshake, request encoding, results.

Both clients speak docs/protocol.md through these functions, so they cannot
encode a request or decode a result differently.
"""

from __future__ import annotations

import itertools
import os
import socket
import ssl
from collections.abc import Iterable
from typing import Any

from . import _wire as wire
from ._address import Address, checked_path
from ._auth import check_tls, check_token
from ._batch import no_receipt, refuse_single_item
from ._errors import InvalidArgument, PayloadTooLarge
from ._fs import absolute
from ._message import Message
from ._net_errors import AuthenticationFailed, ProtocolError

DEFAULT_TIMEOUT = 30.0
MAX_TIMEOUT = 1e9  # seconds: what a socket timeout takes (about 31 years)


class LinkSettings:
    """What a client's connection to the server is opened with (sync and asyncio)."""

    def __init__(self, address: Address, token: str | None, timeout: float, keep_leases: bool,
                 ssl_context: ssl.SSLContext | None, server_hostname: str | None) -> None:
        check_settings(token, timeout, keep_leases)
        check_tls(address, ssl_context)
        self.address = address
        self._token = token
        self.timeout = timeout
        self._keep = keep_leases
        self._ssl = ssl_context
        self._hostname = server_hostname
        self._ids = itertools.count(1)  # request ids
        self.welcome: dict[str, Any] = {}  # the server's handshake answer


def check_settings(token: object, timeout: object, keep_leases: object) -> None:
    """``connect``'s arguments, refused as ``InvalidArgument`` (``timeout=None`` was a
    TypeError from deep in the link, ``-1`` a ValueError of the socket module,
    ``keep_leases="no"`` the server's ProtocolError; an API audit)."""
    if token is not None:
        check_token(token, empty_ok=True)  # "" is sent as it is, as before
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not 0 < timeout <= MAX_TIMEOUT):
        raise InvalidArgument(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}], "
                              f"not {timeout!r:.60}")
    if not isinstance(keep_leases, bool):
        raise InvalidArgument(f"keep_leases must be a bool, not {keep_leases!r:.60}")


def hello(token: str | None, keep_leases: bool) -> bytes:
    return wire.pack({"qstore": wire.PROTOCOL_VERSION, "token": token,
                      "keep_leases": keep_leases})


def check_welcome(value: Any) -> dict[str, Any]:
    """The server's handshake answer, or the error it sent instead."""
    if isinstance(value, list) and len(value) == 3 and value[1] == wire.ERR:
        raise wire.decode_error(value[2])
    if not isinstance(value, dict) or value.get("qstore") != wire.PROTOCOL_VERSION:
        raise ProtocolError(f"unexpected handshake answer {value!r:.80}")
    return value


def request(rid: int, op: str, args: dict[str, Any],
            limits: dict[str, Any] | None = None) -> bytes:
    """The frame of a request; one over the server's ``max_frame`` (in ``limits``, the
    server's handshake answer) is refused here, so the connection stays up (the
    server would close it)."""
    try:
        frame = wire.pack([rid, op, args])
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgument(f"{op}: an argument cannot be sent: {exc}") from None
    max_frame = None if limits is None else limits.get("max_frame")
    if max_frame is not None and len(frame) - 4 > max_frame:
        _too_large(op, args, limits.get("max_payload") if limits else None)
        raise InvalidArgument(f"{op}: a request of {len(frame) - 4} bytes is over the "
                              f"server's frame limit of {max_frame} (a batch that big "
                              "must be sent as several)")
    return frame


def _too_large(op: str, args: dict[str, Any], max_payload: object) -> None:
    """Raise what the store would for a payload over its limit in ``args``, as the
    embedded store does (the request is never sent): a payload over the frame
    limit is over ``max_payload_bytes`` too, whose error is PayloadTooLarge."""
    if type(max_payload) is not int:
        return
    if op == "push":
        bodies = [args.get("payload")]
    elif op == "push_many":
        items = args.get("items")
        bodies = [i if isinstance(i, (bytes, bytearray, memoryview)) else
                  i[0] if isinstance(i, (list, tuple)) and i else None
                  for i in (items if isinstance(items, list) else [])]
    else:
        return
    for body in bodies:
        if isinstance(body, (bytes, bytearray, memoryview)) and len(body) > max_payload:
            raise PayloadTooLarge(len(body), max_payload)


def result(value: Any, rid: int) -> Any:
    """The result of response ``value`` to request ``rid`` (or its error, raised)."""
    if not (isinstance(value, list) and len(value) == 3 and type(value[0]) is int):
        raise ProtocolError(f"malformed response {value!r:.80}")
    if value[1] == wire.ERR:
        raise wire.decode_error(value[2])
    if value[0] != rid:
        raise ProtocolError(f"response to request {value[0]}, expected {rid}")
    return value[2]


def snapshot_args(address: Address, dest: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``snapshot`` request's arguments: ``dest`` is a path on the server's
    machine. Through a unix socket that is this machine, so a relative one is
    this process's; over TCP the server may be elsewhere, so it must be absolute."""
    if isinstance(dest, str) and not dest:  # abspath("") is the cwd: as embedded, refused
        raise InvalidArgument("snapshot destination is empty")
    dest = checked_path(dest, "snapshot destination")
    if os.path.isabs(dest):
        return {"dest": dest}
    if address.kind == "unix":
        # Not os.path.abspath: it collapses link/.. by text, and the server
        # wrote the snapshot where the client did not name.
        return {"dest": absolute(dest)}
    raise InvalidArgument(f"snapshot through {address}: give DEST as an absolute path on the "
                          f"server's machine, not {dest!r}")


COUNT_MAX = 2**63 - 1  # more messages than any store holds; what msgpack's ints carry


def count(n: object) -> object:
    """A count ``n`` as sent: one beyond any store's size means every message, as in
    process (``pop_many(10**30)``; an int of 2**64 or more cannot be sent)."""
    return COUNT_MAX if type(n) is int and n > COUNT_MAX else n


def compact_args(threshold: object, max_bytes: object) -> dict[str, Any]:
    """The ``compact`` request's arguments: those given; a ``max_bytes`` past what the
    wire carries (2**64 and up, which the embedded store takes) sent as the most it
    does, which no store reaches either."""
    args: dict[str, Any] = {}
    if threshold is not None:
        args["threshold"] = threshold
    if max_bytes is not None:
        args["max_bytes"] = count(max_bytes)
    return args


def receipt_of(item: object) -> object:
    if isinstance(item, Message):
        if item.receipt is None:
            raise no_receipt(item.id)
        return item.receipt
    return item


def receipts_of(items: Iterable[object]) -> list[object]:
    refuse_single_item(items, "ack_many")
    try:
        return [receipt_of(i) for i in items]
    except TypeError:
        raise InvalidArgument(f"ack_many takes an iterable, not {type(items).__name__}") \
            from None


def listed(items: object, what: str) -> list[Any]:
    refuse_single_item(items, what)
    try:
        out: list[Any] = list(items)  # type: ignore[call-overload]
        return out
    except TypeError:
        raise InvalidArgument(f"{what} takes an iterable, not {type(items).__name__}") from None


def messages(value: list[Any]) -> list[Message]:
    return [wire.decode_message(v) for v in value]


def maybe_message(value: Any) -> Message | None:
    return None if value is None else wire.decode_message(value)


def client_tls(cafile: str | None) -> ssl.SSLContext:
    """A client TLS context trusting ``cafile`` (or the system's CAs); InvalidArgument
    if ``cafile`` cannot be read as PEM certificates."""
    if cafile is not None and not isinstance(cafile, (str, os.PathLike)):
        raise InvalidArgument(f"cafile must be a path or None, not {cafile!r:.60}")
    try:
        return ssl.create_default_context(cafile=cafile)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise InvalidArgument(f"cafile {cafile}: cannot load CA certificates: {exc}") from None


__all__ = ["AuthenticationFailed", "DEFAULT_TIMEOUT"]


class QueueInfo:
    """What both clients' queue handles hold: the queue's name and settings."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.name: str = info["name"]
        self.order: str = info["order"]
        self.priority_type: str = info["priority_type"]
        self.max_attempts: int = info["max_attempts"]
        self.dedup: bool = info["dedup"]
        # Sent with every request: the queue this handle was made for, so that once
        # it is deleted the handle gets QueueNotFound, not a new queue of its name.
        self._qid: int | None = info.get("qid")


def queue_args(queue: str, args: dict[str, Any],
               qid: int | None = None) -> tuple[dict[str, Any], float]:
    """A queue request's arguments, and how much longer than the timeout it may wait."""
    args["queue"] = queue
    if qid is not None:
        args["qid"] = qid
    wait = args.get("wait", 0.0)
    # The answer may take the wait longer than the timeout (a wait over 1e9 s, 31
    # years, is allowed 1e9: a socket timeout has its bounds).
    return args, (min(wait, 1e9) if isinstance(wait, (int, float)) and wait >= 0 else 0.0)


def create_queue_args(name: str, order: str, priority_type: str, max_attempts: int,
                      dedup: bool, exist_ok: bool, options: dict[str, Any]) -> dict[str, Any]:
    """The ``create_queue`` request: the queue options given (not None) only, so that
    a server from before ``on_expire`` could be left out still takes the request
    (it refused an ``on_expire`` of nil) and a new one compares only those."""
    args = {"name": name, "order": order, "priority_type": priority_type,
            "max_attempts": max_attempts, "dedup": dedup, "exist_ok": exist_ok}
    args.update((k, v) for k, v in options.items() if v is not None)
    return args


def push_args(payload: bytes | bytearray | memoryview, priority: int | str | None, delay: float,
              dedup_key: str | bytes | None, ttl: float | None) -> dict[str, Any]:
    args: dict[str, Any] = {"payload": payload, "priority": priority, "delay": delay,
                            "dedup_key": dedup_key}
    if ttl is not None:
        args["ttl"] = ttl
    return args


def push_many_args(items: Iterable[Any], delay: float, ttl: float | None) -> dict[str, Any]:
    args: dict[str, Any] = {"items": listed(items, "push_many"), "delay": delay}
    if ttl is not None:
        args["ttl"] = ttl
    return args

def unix_connect_once(path: str, timeout: float | None) -> socket.socket | None:
    """A unix socket connected to ``path`` (``timeout`` set on it, None: non-blocking),
    or None when the server's accept backlog is full (EAGAIN: a busy server, not a
    gone one; a unix connect says so at once whatever its timeout). The clients
    try again within their timeout (199 of 300 clients connecting while a
    server's loop was busy failed at once; a limits audit)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if timeout is None:
        sock.setblocking(False)
    else:
        sock.settimeout(timeout)
    try:
        sock.connect(path)
        return sock
    except BlockingIOError:
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise


CONNECT_PAUSES = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032)  # then 0.05 s each


def point_docs(cls: type, embedded: str) -> None:
    """Give each public method of ``cls`` without a docstring one that names the
    embedded method it mirrors (``help(client.queue("q").pop)`` showed nothing;
    an API audit): same arguments, results and exceptions, by the contract."""
    for name, member in vars(cls).items():
        if not name.startswith("_") and callable(member) and not member.__doc__:
            member.__doc__ = (f"As :meth:`{embedded}.{name}` of the embedded store, "
                              "through the server (same arguments, result and errors).")
