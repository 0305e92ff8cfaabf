"""The asyncio server: one event loop, one store thread, many connections.

Each connection is one task reading frames (docs/protocol.md). The first
frame is the handshake (version, token, lease policy); every later frame is
a request, handed to the store thread (_worker.py) in arrival order; its
response is written when it completes, so requests can be pipelined and a
parked pop (_waiting.py) does not hold up later requests. A frame that
breaks the protocol gets an error frame with id 0 and closes only its own
connection. ``compact`` and ``snapshot`` run in a thread of their own: they
take seconds and must not stall the store thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import os
import ssl
import time
from dataclasses import dataclass
from typing import Any

from .. import __version__
from .. import _wire as wire
from .._address import Address
from .._errors import InvalidArgument, QStoreError
from .._net_errors import AuthenticationFailed, ProtocolError, ServerBusy
from .._store import Store
from ._metrics import Metrics
from ._ops import PARK, Leases, queue_op, store_op
from ._waiting import Waiter, WaitingPops, try_round
from ._worker import InlineStore, StoreThread

log = logging.getLogger("qstore.server")

SLOW_OPS = frozenset({"compact", "snapshot"})
MAX_PIPELINE = 1024  # requests of one connection in progress before it stops reading


@dataclass(frozen=True)
class Limits:
    """Server limits (``qstore serve --help``)."""

    max_frame: int = wire.DEFAULT_MAX_FRAME
    max_connections: int = 1024
    max_waiting: int = 10_000
    handshake_timeout: float = 10.0


class _Conn:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.leases = Leases()
        self.keep_leases = False
        self.closed = False
        self.pending = 0
        self.room = asyncio.Event()
        self.room.set()
        self.idle = asyncio.Event()  # set when nothing is pending
        self.idle.set()

    def send(self, frame: bytes) -> None:
        if not self.closed:
            self.writer.write(frame)


class Server:
    def __init__(self, store: Store, address: Address, *, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, limits: Limits | None = None,
                 metrics: Metrics | None = None) -> None:
        if address.kind == "tcp" and not address.is_loopback and not token:
            raise InvalidArgument(f"refusing to listen on {address} without a token: "
                                  "give --token-file (any non-loopback TCP address needs one)")
        if (limits or Limits()).max_frame <= store.config.max_payload_bytes:
            raise InvalidArgument("max_frame must be above the store's max_payload_bytes")
        self.store = store
        self.address = address
        self._token = token.encode() if token else None
        self._ssl = ssl_context
        self.limits = limits = limits or Limits()
        self.metrics = metrics
        self._conns: dict[_Conn, asyncio.Task[None]] = {}
        self._waiting = WaitingPops(limits.max_waiting)
        self._listening = False
        self._wake_pending = False
        self._round_running = False  # a retry round of parked pops is in the store thread
        self._again = False  # a wake came while it ran: run another round after it
        self._server: asyncio.base_events.Server | None = None
        self._thread: StoreThread | InlineStore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = (StoreThread(self._loop) if self.store.config.durability == "always"
                        else InlineStore(self._loop))
        a = self.address
        if a.kind == "unix":
            old = os.umask(0o177)  # the socket is born mode 0600: no window where others connect
            try:
                self._server = await asyncio.start_unix_server(self._handle, a.path,
                                                               ssl=self._ssl)
            finally:
                os.umask(old)
        else:
            self._server = await asyncio.start_server(self._handle, a.host, a.port,
                                                      ssl=self._ssl, reuse_address=True)
        log.info("qstore server listening on %s", self.listening_on)

    @property
    def listening_on(self) -> str:
        """The address clients use (the real port when asked for port 0)."""
        a = self.address
        if a.kind == "tcp" and self._server is not None and self._server.sockets:
            host, port = self._server.sockets[0].getsockname()[:2]
            return f"tcp://{host}:{port}"
        return str(a)

    async def shutdown(self) -> None:
        """Stop accepting, answer parked pops, finish in-flight requests, close the store."""
        if self._server is not None:
            self._server.close()
        for w in [w for line in self._waiting.lines.values() for w in line]:
            self._answer_empty(w)
        tasks = list(self._conns.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.stop)
        if self.address.kind == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address.path)
        await asyncio.to_thread(self.store.close)

    # -- one connection -------------------------------------------------------------

    async def _read(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readexactly(4)
        (n,) = wire.LENGTH.unpack(head)
        if n > self.limits.max_frame:
            raise ProtocolError(f"frame of {n} bytes is over the limit of "
                                f"{self.limits.max_frame}")
        return await reader.readexactly(n)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer)
        task = asyncio.current_task()
        assert task is not None
        if len(self._conns) >= self.limits.max_connections:
            writer.write(wire.pack([wire.SERVER_ERROR_ID, wire.ERR, wire.encode_error(
                ServerBusy(f"over the limit of {self.limits.max_connections} connections"))]))
            with contextlib.suppress(Exception):
                await writer.drain()
            writer.close()
            return
        self._conns[conn] = task
        if self.metrics:
            self.metrics.connections.inc()
        try:
            await self._session(conn, reader)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ssl.SSLError):
            pass  # the peer went away or stalled: nothing to answer
        except QStoreError as exc:  # protocol, auth: say why, then close
            conn.send(wire.pack([wire.SERVER_ERROR_ID, wire.ERR, wire.encode_error(exc)]))
        except asyncio.CancelledError:
            pass  # shutdown
        finally:
            await self._end(conn)

    async def _session(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        hello = wire.unpack(await asyncio.wait_for(self._read(reader),
                                                   self.limits.handshake_timeout))
        self._check_hello(hello)
        conn.keep_leases = bool(hello.get("keep_leases", False))
        conn.send(wire.pack({"qstore": wire.PROTOCOL_VERSION, "server": __version__,
                             "max_frame": self.limits.max_frame,
                             "max_payload": self.store.config.max_payload_bytes}))
        while True:
            req = wire.unpack(await self._read(reader))
            if not (isinstance(req, list) and len(req) == 3 and type(req[0]) is int
                    and req[0] > 0 and isinstance(req[1], str) and isinstance(req[2], dict)):
                raise ProtocolError("a request is [id > 0, op, {args}]")
            self._dispatch(conn, req[0], req[1], req[2])
            await conn.writer.drain()
            if conn.pending >= MAX_PIPELINE:
                conn.room.clear()
                await conn.room.wait()

    def _check_hello(self, hello: Any) -> None:
        if not isinstance(hello, dict) or "qstore" not in hello:
            raise ProtocolError("the first frame must be the handshake map")
        if hello["qstore"] != wire.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {hello['qstore']!r} is not supported; "
                                f"this server speaks {wire.PROTOCOL_VERSION}")
        if self._token is not None:
            given = hello.get("token")
            if not isinstance(given, str) or not hmac.compare_digest(
                    given.encode("utf-8", "surrogateescape"), self._token):
                raise AuthenticationFailed("wrong or missing token")

    async def _end(self, conn: _Conn) -> None:
        conn.closed = True
        for w in self._waiting.of(conn):
            self._waiting.remove(w)
            w.done = True
        self._update_listening()
        with contextlib.suppress(Exception):
            await conn.idle.wait()  # in-flight requests finish (their answers are dropped)
        if not conn.keep_leases and conn.leases.held and self._thread is not None:
            store, leases = self.store, conn.leases
            with contextlib.suppress(Exception):
                await self._thread.submit(lambda: leases.release(store))
        self._conns.pop(conn, None)
        if self.metrics:
            self.metrics.connections.dec()
        conn.writer.close()
        with contextlib.suppress(Exception):
            await conn.writer.wait_closed()

    # -- requests -----------------------------------------------------------------

    def _dispatch(self, conn: _Conn, rid: int, op: str, args: dict[str, Any]) -> None:
        store = self.store
        started = time.perf_counter()
        fut: asyncio.Future[Any]
        assert self._thread is not None
        if op in wire.QUEUE_OPS:
            kept = dict(args)
            fut = self._thread.submit(lambda: queue_op(store, conn.leases, op, args))
        elif op in SLOW_OPS:
            kept = args
            fut = asyncio.ensure_future(asyncio.to_thread(store_op, store, op, args))
        elif op in wire.STORE_OPS:
            kept = args
            fut = self._thread.submit(lambda: store_op(store, op, args))
        else:
            self._reply_error(conn, rid, op, started,
                              InvalidArgument(f"unknown operation {op!r}"))
            return
        conn.pending += 1
        conn.idle.clear()
        fut.add_done_callback(lambda f: self._done(conn, rid, op, kept, started, f))

    def _settled(self, conn: _Conn) -> None:
        conn.pending -= 1
        if conn.pending < MAX_PIPELINE:
            conn.room.set()
        if conn.pending == 0:
            conn.idle.set()

    def _done(self, conn: _Conn, rid: int, op: str, args: dict[str, Any], started: float,
              fut: asyncio.Future[Any]) -> None:
        self._settled(conn)
        exc = fut.exception()
        if exc is not None:
            self._reply_error(conn, rid, op, started, exc)
            return
        result = fut.result()
        if result is PARK:
            self._park(conn, rid, op, args, started)
            return
        conn.send(wire.pack([rid, wire.OK, result]))
        if self.metrics:
            self.metrics.request(op, time.perf_counter() - started, True)

    def _reply_error(self, conn: _Conn, rid: int, op: str, started: float,
                     exc: BaseException) -> None:
        if not isinstance(exc, QStoreError):
            log.error("request %s failed", op, exc_info=exc)
        conn.send(wire.pack([rid, wire.ERR, wire.encode_error(exc)]))
        if self.metrics:
            self.metrics.request(op, time.perf_counter() - started, False)

    # -- waiting pops -----------------------------------------------------------------

    def _park(self, conn: _Conn, rid: int, op: str, args: dict[str, Any],
              started: float) -> None:
        if conn.closed:
            return
        if self._waiting.count >= self._waiting.limit:
            self._reply_error(conn, rid, op, started, ServerBusy(
                f"over the limit of {self._waiting.limit} waiting pops"))
            return
        w = Waiter(conn, rid, op, args, args["queue"], started=started)
        wait = float(args.get("wait", 0.0))
        assert self._loop is not None and math.isfinite(wait)
        w.timer = self._loop.call_later(max(0.0, wait - (time.perf_counter() - started)),
                                        self._expire, w)
        self._waiting.park(w)
        self._update_listening()
        self._wake()  # a push may have landed between the empty pop and now

    def _expire(self, w: Waiter) -> None:
        if w.done:
            return
        if w.busy:
            w.expired = True  # the round in progress answers it
            return
        self._answer_empty(w)

    def _answer_empty(self, w: Waiter) -> None:
        self._waiting.remove(w)
        w.done = True
        w.conn.send(wire.pack([w.rid, wire.OK, [] if w.op == "pop_many" else None]))
        if self.metrics:
            self.metrics.request(w.op, time.perf_counter() - w.started, True)
        self._update_listening()

    def _update_listening(self) -> None:
        want = self._waiting.count > 0
        if want == self._listening or self._thread is None:
            return
        self._listening = want
        core, loop = self.store.core, self._loop
        assert loop is not None

        def listener() -> None:  # store thread or sweeper, writer lock held: only schedule
            if not self._wake_pending:
                self._wake_pending = True
                loop.call_soon_threadsafe(self._retry)

        def switch() -> None:
            with core.lock:
                core.waiters += 1 if want else -1
                core.ready.listener = listener if want else None

        self._thread.submit(switch)

    def _wake(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            assert self._loop is not None
            self._loop.call_soon(self._retry)

    def _retry(self) -> None:
        self._wake_pending = False
        if self._round_running:
            # A wake while a round runs: that round may have tried its queues
            # before the push that woke us, so run another once it ends.
            self._again = True
            return
        waiters = self._waiting.round()
        if not waiters or self._thread is None:
            return
        self._round_running = True
        store = self.store

        def attempt(w: Waiter) -> Any:
            return queue_op(store, w.conn.leases, w.op, dict(w.args), parked=True)

        fut = self._thread.submit(
            lambda: try_round(waiters, attempt, lambda got: got is None or got == []))
        fut.add_done_callback(self._retried)

    def _retried(self, fut: asyncio.Future[Any]) -> None:
        self._round_running = False
        if self._again:
            self._again = False
            self._wake()
        if fut.cancelled() or fut.exception() is not None:
            return
        for w, ok, got in fut.result():
            w.busy = False
            if w.done:
                continue
            if not ok:
                self._waiting.remove(w)
                w.done = True
                self._reply_error(w.conn, w.rid, w.op, w.started, got)
            elif got is not None:
                self._waiting.remove(w)
                w.done = True
                w.conn.send(wire.pack([w.rid, wire.OK, got]))
                if self.metrics:
                    self.metrics.request(w.op, time.perf_counter() - w.started, True)
            elif w.expired:
                self._answer_empty(w)
        self._update_listening()
