"""``qstore.aio.connect``: the asyncio client of a qstore server.

The same methods, arguments, results and exceptions as :class:`qstore.Client`
(and so as the embedded store), as coroutines; ``queue()`` is awaited too.
Many tasks may share one client: their requests are pipelined on one
connection and answers are matched by request id. A dropped connection fails
every request in flight with :class:`~qstore.ConnectionLost`; the next call
reconnects. Nothing is retried on its own.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import math
import os
import socket
import ssl
from collections.abc import Generator, Iterable, Sequence
from typing import Any, Unpack

from . import _client_base as base
from . import _wire as wire
from ._address import Address, parse_address
from ._check_report import CheckReport
from ._errors import QStoreError, StoreClosed
from ._message import CompactionResult, Message, QueueStats, StoreStats
from ._net_errors import ConnectionLost, ProtocolError
from ._options import QueueOptions

__all__ = ["AsyncClient", "AsyncQueue", "connect"]

_LENGTH = wire.LENGTH


class _Link(base.LinkSettings):
    """One connection to the server, opened on first use and after a drop; every
    task's requests are pipelined on it and answers matched by request id."""

    def __init__(self, address: Address, token: str | None, timeout: float, keep_leases: bool,
                 ssl_context: ssl.SSLContext | None, server_hostname: str | None) -> None:
        super().__init__(address, token, timeout, keep_leases, ssl_context, server_hostname)
        self._proto: _Protocol | None = None
        self._opening = asyncio.Lock()
        self.closed = False

    async def _open(self) -> _Protocol:
        a = self.address
        loop = asyncio.get_running_loop()
        try:
            if a.kind == "unix":
                sock = await _connect_unix(a.path, self.timeout)
                coro = loop.create_unix_connection(
                    lambda: _Protocol(a), sock=sock, ssl=self._ssl,
                    server_hostname=self._hostname if self._ssl else None)
            else:
                coro = loop.create_connection(
                    lambda: _Protocol(a), a.host, a.port, ssl=self._ssl,
                    server_hostname=(self._hostname or a.host) if self._ssl else None)
            _, proto = await asyncio.wait_for(coro, self.timeout)
            proto.orphaned = lambda queue, value: _give_back(self, proto, queue, value)
        except (OSError, TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect to {a}: {_reason(exc)}") from None
        try:
            proto.transport.write(base.hello(self._token, self._keep))
            welcome = await asyncio.wait_for(asyncio.shield(proto.welcome), self.timeout)
            self.welcome = base.check_welcome(welcome)
        except (OSError, TimeoutError, ConnectionLost) as exc:
            await proto.close()
            raise ConnectionLost(f"cannot connect to {a}: {_reason(exc)}") from None
        except BaseException:
            await proto.close()
            raise
        if self.closed:  # close() ran while this connected: it must not outlive it
            await proto.close()
            raise StoreClosed(f"the client of {self.address} is closed")
        self._proto = proto
        return proto

    async def call(self, op: str, args: dict[str, Any], wait: float = 0.0) -> Any:
        proto = self._proto
        if proto is None or proto.gone:
            if self.closed:
                raise StoreClosed(f"the client of {self.address} is closed")
            async with self._opening:
                if self.closed:
                    raise StoreClosed(f"the client of {self.address} is closed")
                proto = self._proto
                if proto is None or proto.gone:
                    proto = await self._open()
            if proto.gone:  # dropped since its handshake: nothing would answer
                raise ConnectionLost(f"connection to {self.address} lost before {op} was "
                                     "sent; it did not run")
        rid = next(self._ids)
        frame = base.request(rid, op, args, self.welcome)
        fut = proto.loop.create_future()
        proto.waiting[rid] = fut
        popping = op in _POPS
        if popping:  # its answer may lease messages: if nobody reads it, give them back
            proto.pops[rid] = args["queue"]
        # A timer, not asyncio.wait_for (which wraps the future in more futures and
        # callbacks): an answer costs the loop two passes, not four.
        timer = proto.loop.call_later(self.timeout + wait, _time_out, fut)
        sent = abandoned = False
        try:
            # Set before the write: an interrupt right after it must find it set.
            sent = True
            proto.transport.write(frame)
            if proto.paused:  # a large request filled the socket: wait, within the time
                await asyncio.wait_for(proto.drained(), self.timeout + wait)
            value = await fut
        except TimeoutError as exc:
            if self._proto is proto:
                self._proto = None
            await proto.close(f"closed after {op} had no answer in time")
            raise ConnectionLost(f"connection to {self.address} lost during {op}: "
                                 f"{_reason(exc)}; it may or may not have run") from None
        except BaseException:
            # A cancelled task, or an interrupt (KeyboardInterrupt under
            # run_until_complete) after the pop went out: what its answer leases
            # is given back, as for a cancellation, else it stayed leased to this
            # live connection with nobody holding it (an interrupt audit).
            if popping and sent and not proto.lost:
                if fut.done() and not fut.cancelled():
                    if fut.exception() is None:  # answered, but the task never resumed
                        _give_back(self, proto, args["queue"], fut.result())
                elif rid in proto.pops:  # no answer yet (_Protocol._frame gives it back)
                    abandoned = True
                    self._fire(proto, "cancel", {"request": rid})
            raise
        finally:
            timer.cancel()
            proto.waiting.pop(rid, None)
            if popping and not abandoned:
                proto.pops.pop(rid, None)
        if type(value) is list and len(value) == 3 and value[1] == wire.OK and value[0] == rid:
            return value[2]  # the usual answer: base.result would return the same
        return base.result(value, rid)

    def _fire(self, proto: _Protocol, op: str, args: dict[str, Any]) -> None:
        """Send a request whose answer nobody waits for (it is dropped on arrival)."""
        if not proto.gone:
            proto.transport.write(base.request(next(self._ids), op, args))

    async def close(self) -> None:
        """Close the connection; every later call raises StoreClosed, as a closed
        embedded store's do."""
        self.closed = True
        proto, self._proto = self._proto, None
        if proto is not None:
            await proto.close(error=StoreClosed(
                f"the client of {self.address} was closed while this call was in flight; "
                "it may or may not have run"))


_POPS = frozenset({"pop", "pop_many"})


def _give_back(link: _Link, proto: _Protocol, queue: str, value: Any) -> None:
    """Nack the messages of an answer to a pop nobody reads any more."""
    if type(value) is not list or len(value) != 3 or value[1] != wire.OK:
        return  # an error, or (a result already unwrapped) nothing to go by
    got = value[2]
    found = [] if got is None else [got] if got and type(got[0]) is int else got
    for m in found:
        receipt = m[7] if type(m) is list and len(m) > 7 else None
        if type(receipt) is str:
            link._fire(proto, "nack", {"queue": queue, "receipt": receipt, "delay": 0.0})


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__  # a TimeoutError's text is empty


def _time_out(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError("no answer within the timeout"))


class _Protocol(asyncio.Protocol):
    """Cuts frames out of what the server sends: the first is the handshake answer,
    each later one resolves the request whose id it carries."""

    def __init__(self, address: Address) -> None:
        self.address = address
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set at once
        self.welcome: asyncio.Future[Any] = self.loop.create_future()
        self.waiting: dict[int, asyncio.Future[Any]] = {}
        # Pops in flight, by request id: their queue. A pop whose caller was
        # cancelled (asyncio.wait_for ran out, the task was cancelled) before its
        # answer came stays here: the link sent ``cancel`` for it, which answers a
        # pop still waiting in the server empty, and what an answer still brings
        # is given back (``orphaned``: a nack each, their delivery counted, as
        # when a connection closes), so no message sits in flight unseen.
        self.pops: dict[int, str] = {}
        self.orphaned: Any = None
        self.lost = False
        self.paused = False
        self._closed: asyncio.Future[None] = self.loop.create_future()
        self._drains: list[asyncio.Future[None]] = []  # tasks waiting for resume_writing
        self._buf = bytearray()
        self._why: BaseException | None = None  # what the server said before it closed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        try:
            if not buf and len(data) >= 4 and _LENGTH.unpack_from(data)[0] + 4 == len(data):
                self._frame(wire.unpack(memoryview(data)[4:]))  # one whole frame: the usual
                return
            buf += data
            pos, end = 0, len(buf)
            with memoryview(buf) as view:
                while end - pos >= 4:
                    (n,) = _LENGTH.unpack_from(view, pos)
                    if end - pos - 4 < n:
                        break
                    value = wire.unpack(view[pos + 4:pos + 4 + n])
                    pos += 4 + n
                    self._frame(value)
            del buf[:pos]
        except Exception as exc:  # a malformed frame: this connection is done
            self._fail(exc)
            self.transport.close()
        except BaseException:
            # An interrupt halfway through: a frame may be lost or read twice, and
            # its caller would wait out the timeout. The connection is closed now
            # (its leases go back, as for any close) and every caller told at once.
            self._fail(ConnectionLost(f"connection to {self.address} closed: interrupted "
                                      "while reading answers; requests in flight may or may "
                                      "not have run"))
            self.transport.close()
            raise

    def _frame(self, value: Any) -> None:
        if not self.welcome.done():
            self.welcome.set_result(value)
            return
        rid = value[0] if type(value) is list and value else None
        if rid == wire.SERVER_ERROR_ID:  # about the connection: the server closes it
            if len(value) != 3:
                raise ProtocolError(f"malformed response {value!r:.80}")
            raise wire.decode_error(value[2])
        fut = self.waiting.pop(rid, None) if type(rid) is int else None
        if fut is not None and not fut.done():
            fut.set_result(value)
        elif self.pops and rid in self.pops and self.orphaned is not None:
            self.orphaned(self.pops.pop(rid), value)  # its caller was cancelled

    def _fail(self, why: BaseException) -> None:
        """Fail every request in flight with ``why`` (the first reason given wins)."""
        if self._why is None:
            self._why = why
        waiting, self.waiting = self.waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(self._why)

    @property
    def gone(self) -> bool:
        """Lost, or its transport is closing: a send that failed closes it at once,
        and the protocol hears of it (``connection_lost``) a pass of the loop later.
        Calls made in between wrote to the dead transport, and asyncio logged
        "socket.send() raised exception." for each past the fifth (a signals
        audit); they reconnect now, or raise ConnectionLost."""
        return self.lost or self.transport.is_closing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        lost = ConnectionLost(f"connection to {self.address} lost"
                              f"{f': {exc}' if exc else ''}; requests in flight may or may "
                              "not have run")
        if not self.welcome.done():
            self.welcome.set_exception(lost)
        self._fail(lost)
        drains, self._drains = self._drains, []
        for fut in drains:
            if not fut.done():
                fut.set_exception(lost)
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        drains, self._drains = self._drains, []
        for fut in drains:
            if not fut.done():
                fut.set_result(None)

    async def drained(self) -> None:
        """Until the transport takes more (flow control for large requests). Each
        caller waits on a future of its own, so cancelling one cancels no other."""
        if not self.paused:
            return
        fut = self.loop.create_future()
        self._drains.append(fut)
        await fut

    async def close(self, why: str = "closed by the client",
                    error: QStoreError | None = None) -> None:
        """Close, failing what is in flight with ``error`` (ConnectionLost by
        default); returns once closed."""
        self._fail(error or ConnectionLost(f"connection to {self.address} {why}; requests "
                                           "in flight may or may not have run"))
        self.transport.close()
        try:
            await asyncio.wait_for(asyncio.shield(self._closed), 5.0)
        except TimeoutError:
            self.transport.abort()
        if not self.welcome.done():
            self.welcome.cancel()


class AsyncQueue(base.QueueInfo):
    """A queue of a server; the methods of :class:`qstore.Queue`, awaitable."""

    def __init__(self, link: _Link, info: dict[str, Any]) -> None:
        super().__init__(info)
        self._link = link

    def __repr__(self) -> str:
        return f"<qstore.aio.AsyncQueue {self.name!r} on {self._link.address}>"

    async def _call(self, op: str, /, **args: Any) -> Any:
        return await self._link.call(op, *base.queue_args(self.name, args, self._qid))

    async def push(self, payload: bytes | bytearray | memoryview,
                   priority: int | str | None = None, delay: float = 0.0,
                   dedup_key: str | bytes | None = None, ttl: float | None = None) -> int:
        return int(await self._call("push", **base.push_args(payload, priority, delay, dedup_key,
                                                             ttl)))

    async def push_many(self, items: Iterable[bytes | Sequence[Any]], *, delay: float = 0.0,
                        ttl: float | None = None) -> list[int]:
        return list(await self._call("push_many", **base.push_many_args(items, delay, ttl)))

    async def pop(self, lease: float = 30.0, wait: float = 0.0) -> Message | None:
        return base.maybe_message(await self._call("pop", lease=lease, wait=wait))

    async def pop_many(self, n: int, lease: float = 30.0, wait: float = 0.0) -> list[Message]:
        return base.messages(await self._call("pop_many", n=base.count(n), lease=lease, wait=wait))

    async def ack(self, item: Message | str) -> None:
        await self._call("ack", receipt=base.receipt_of(item))

    async def ack_many(self, items: Iterable[Message | str]) -> int:
        return int(await self._call("ack_many", receipts=base.receipts_of(items)))

    async def nack(self, item: Message | str, delay: float = 0.0) -> None:
        await self._call("nack", receipt=base.receipt_of(item), delay=delay)

    async def extend(self, item: Message | str, lease: float = 30.0) -> Message:
        return wire.decode_message(await self._call("extend", receipt=base.receipt_of(item),
                                                    lease=lease))

    async def peek(self, n: int = 1) -> list[Message]:
        return base.messages(await self._call("peek", n=base.count(n)))

    async def get(self, message_id: int) -> Message:
        return wire.decode_message(await self._call("get", message_id=message_id))

    async def dead_letters(self, n: int = 10) -> list[Message]:
        return base.messages(await self._call("dead_letters", n=base.count(n)))

    async def redrive(self, n: int = 100) -> int:
        return int(await self._call("redrive", n=base.count(n)))

    async def purge(self) -> int:
        return int(await self._call("purge"))

    async def stats(self) -> QueueStats:
        return wire.decode_stats(await self._call("stats"))


class AsyncClient:
    """The asyncio client; an async context manager."""

    def __init__(self, link: _Link) -> None:
        self._link = link
        self.path = str(link.address)

    async def create_queue(self, name: str, *, order: str = "max", priority_type: str = "int",
                     max_attempts: int = 5, dedup: bool = False, exist_ok: bool = False,
                     ttl: float | None = None, on_expire: str | None = None,
                     aging: float | None = None, aging_cap: int | None = None,
                     rate: tuple[int, float] | None = None) -> AsyncQueue:
        info = await self._link.call("create_queue", base.create_queue_args(
            name, order, priority_type, max_attempts, dedup, exist_ok,
            {"ttl": ttl, "on_expire": on_expire, "aging": aging, "aging_cap": aging_cap,
             "rate": rate}))
        return AsyncQueue(self._link, info)

    async def configure_queue(self, name: str, **options: Unpack[QueueOptions]) -> AsyncQueue:
        """Change options of queue ``name`` (those of :meth:`qstore.Store.configure_queue`)."""
        info = await self._link.call("configure_queue", {**options, "name": name})
        return AsyncQueue(self._link, info)

    async def queue(self, name: str) -> AsyncQueue:
        return AsyncQueue(self._link, await self._link.call("queue", {"queue": name}))

    async def queues(self) -> list[str]:
        return list(await self._link.call("queues", {}))

    async def delete_queue(self, name: str) -> None:
        await self._link.call("delete_queue", {"name": name})

    async def stats(self) -> StoreStats:
        return wire.decode_store_stats(await self._link.call("store_stats", {}))

    async def compact(self, *, threshold: float | None = None,
                      max_bytes: int | None = None) -> CompactionResult:
        return wire.decode_compaction(await self._link.call(
            "compact", base.compact_args(threshold, max_bytes), wait=3600.0))

    async def check(self, *, repair: bool = False) -> CheckReport:
        return wire.decode_check(await self._link.call("check", {"repair": repair},
                                                       wait=3600.0))

    async def snapshot(self, dest: str | os.PathLike[str]) -> str:
        return str(await self._link.call(
            "snapshot", base.snapshot_args(self._link.address, dest), wait=3600.0))

    async def ping(self) -> None:
        """One round trip to the server (a client's own call: the embedded store has none)."""
        await self._link.call("ping", {})

    async def close(self) -> None:
        """Close this client's connection (the server and its store go on); later
        calls raise StoreClosed, as a closed embedded store's do."""
        await self._link.close()

    async def __aenter__(self) -> AsyncClient:
        await self.ping()
        return self

    def __await__(self) -> Generator[Any, None, AsyncClient]:
        """``client = await qstore.aio.connect(...)`` connects at once, as ``async
        with`` does (it raised TypeError: an API audit)."""
        return self.__aenter__().__await__()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


base.point_docs(AsyncQueue, "qstore.Queue")
base.point_docs(AsyncClient, "qstore.Store")


def connect(address: str | os.PathLike[str], *, token: str | None = None,
            timeout: float = base.DEFAULT_TIMEOUT, keep_leases: bool = False,
            tls: bool | ssl.SSLContext = False, cafile: str | None = None,
            server_hostname: str | None = None) -> AsyncClient:
    """An asyncio client of the server at ``address``; connects on first use.

    Use as ``async with qstore.aio.connect(...) as client:`` or ``client =
    await qstore.aio.connect(...)`` (both connect at once), or call its methods
    (the first connects) and ``await client.close()``.
    """
    ctx = tls if isinstance(tls, ssl.SSLContext) else (
        base.client_tls(cafile) if tls or cafile else None)
    return AsyncClient(_Link(parse_address(address), token, timeout, keep_leases, ctx,
                             server_hostname))


async def _connect_unix(path: str, timeout: float | None) -> socket.socket:
    """A connected, non-blocking unix socket, trying again within ``timeout`` while the
    server's accept backlog is full (:func:`base.unix_connect_once`): asyncio's own
    connect turned that EAGAIN into a broken connection (EINVAL) at once."""
    loop = asyncio.get_running_loop()
    deadline = math.inf if timeout is None else loop.time() + timeout
    for pause in itertools.chain(base.CONNECT_PAUSES, itertools.repeat(0.05)):
        sock = base.unix_connect_once(path, None)
        if sock is not None:
            return sock
        if loop.time() + pause > deadline:
            raise BlockingIOError(errno.EAGAIN, "the server's accept backlog is full")
        await asyncio.sleep(pause)
    raise AssertionError("unreachable")
