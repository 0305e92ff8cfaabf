"""The asyncio server: one event loop, many connections, requests run in rounds.

Each connection is a protocol object (_conn.py) that cuts frames out of what
it reads. The first frame is the handshake (version, token, lease policy);
every later frame is a request, put in the server's inbox. Once the loop has
read everything that arrived (at once, inside the read, when no other read
is waiting in the same pass), one round runs the inbox in arrival order
(:meth:`Server._round`): consecutive single pops of one queue, from any
connections, run as one ``pop_many``, and consecutive acks of one queue as
one ``ack_many`` (all or nothing; on an error each runs alone, so each gets
its own answer); then each connection's answers go out in one write. Every
connection's requests still take effect in the order they arrived.

With ``durability="always"`` the store calls run in the store thread
(_worker.py) instead, answered as they complete. A pop that finds nothing
and may wait is parked (_waiting.py) and does not hold up later requests. A
frame that breaks the protocol gets an error frame with id 0 and closes only
its own connection. ``compact``, ``snapshot``, ``check`` and ``backfill`` run in a thread
of their own: they take seconds and must not stall the store; the requests
their connection sent after them wait for them (``Connection.backlog``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import math
import os
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass
from typing import Any

from .. import __version__
from .. import _wire as wire
from .._address import SERVER_FILE, Address, unix_socket_answers
from .._auth import check_tls, check_token
from .._errors import InvalidArgument, QStoreError
from .._fs import FDS_PER_SEGMENT, make_room_for_files, write_json_durably
from .._net_errors import AuthenticationFailed, ProtocolError, ServerBusy
from .._store import Store
from .._txn import NO_EVENT_US, READY
from ._conn import MAX_PIPELINE, Connection
from ._metrics import Metrics
from ._ops import (
    PARK,
    LeaseBook,
    ack_group,
    group_key,
    pop_group,
    queue_op,
    store_op,
)
from ._waiting import Waiter, WaitingPops, try_round
from ._worker import InlineStore, StoreThread

log = logging.getLogger("qstore.server")

RELEASE_SLICE = 500  # leases of a closed connection given back per store call
REFUSAL_LOG_SECONDS = 60.0  # a line per reason of connections closed with an error
SLOW_OPS = frozenset({"compact", "snapshot", "check", "backfill"})
# Named in the handshake: protocol version 1 gained ops over time (cancel, check,
# backfill), and a client could not tell which a server takes (a cross-version
# audit: a cancel sent to an older server was refused, its pop left waiting).
SERVED_OPS = sorted(wire.QUEUE_OPS | wire.STORE_OPS | {"cancel"})
_POPS = frozenset({"pop", "pop_many"})
# Descriptors a server keeps besides its connections and the store's segments:
# RocksDB's table and log files, its listening socket, the process's own.
FDS_SERVER = 256
MIN_CONNECTIONS = 16  # served whatever the descriptor limit says
_Request = tuple[Connection, int, str, dict[str, Any], float]


def default_max_frame(max_payload_bytes: int) -> int:
    """The frame limit that goes with a payload limit: a quarter more, at least 1 MiB more
    (80 MiB for the default 64 MiB), so a payload and its request always fit."""
    return min(max_payload_bytes + max(max_payload_bytes // 4, 1024 * 1024), 2**32 - 1)


# Room a frame keeps around the largest payload for the rest of its request (the
# request id, op and argument names, the msgpack headers).
REQUEST_ROOM = 64 * 1024


def _check_frame_room(max_frame: int, max_payload: int) -> None:
    """A push of a payload at the limit must fit in a frame: refused at start, not per
    push (a frame limit a few bytes above the payload limit made such a push fail
    with a message about batches; a limits audit)."""
    if max_frame > 2**32 - 1:  # the frame's length is a u32
        raise InvalidArgument(f"max_frame={max_frame} is over what a frame's length can "
                              f"say, {2**32 - 1}")
    if max_payload + REQUEST_ROOM > 2**32 - 1:
        raise InvalidArgument(
            f"max_payload_bytes={max_payload} is too large to serve: a request carrying such "
            f"a payload would not fit in a frame (at most {2**32 - 1 - REQUEST_ROOM})")
    if max_frame < max_payload + REQUEST_ROOM:
        raise InvalidArgument(
            f"max_frame={max_frame} leaves no room for a request around a payload of "
            f"max_payload_bytes={max_payload}: give at least {max_payload + REQUEST_ROOM}")


# An error's message is cut to this many characters in its answer: some quote the
# argument they refuse, which a client may make megabytes long (a 16 MiB rate
# list answered 48 MiB; a security audit).
ERROR_TEXT_MAX = 4096
# Seconds a shutdown waits for the requests already read to be answered before
# it closes the connections (a request still running then finishes unanswered).
SHUTDOWN_ANSWER_WAIT = 10.0
UNIX_PROBE_TIMEOUT = 5.0  # seconds to tell a live server's socket from a stale file


@dataclass(frozen=True)
class Limits:
    """Server limits (``qstore serve --help``)."""

    max_frame: int = wire.DEFAULT_MAX_FRAME
    max_connections: int = 1024
    max_waiting: int = 10_000
    handshake_timeout: float = 10.0
    # A connection that stops sending mid-way through a frame of 64 KiB or more
    # for this long is closed (ProtocolError): the part holds up to max_frame.
    frame_stall_timeout: float = 60.0
    # Connections that have not finished their handshake, at most: a new one
    # beyond it closes the oldest of them. They do not count against
    # max_connections, so sockets that never say hello cannot lock clients out.
    max_ungreeted: int = 256


class Server:
    def __init__(self, store: Store, address: Address, *, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, limits: Limits | None = None,
                 metrics: Metrics | None = None) -> None:
        if address.kind == "tcp" and not address.is_loopback and not token:
            raise InvalidArgument(f"refusing to listen on {address} without a token: "
                                  "give --token-file (any non-loopback TCP address needs one)")
        if token:
            check_token(token)  # one a client could not send in its handshake is refused
        check_tls(address, ssl_context)
        _check_frame_room((limits or Limits()).max_frame, store.config.max_payload_bytes)
        self.store = store
        self.address = address
        self._token = token.encode() if token else None
        self._ssl = ssl_context
        self.limits = limits = limits or Limits()
        self._max_connections = limits.max_connections  # what fits: set by start()
        self.metrics = metrics
        self._conns: set[Connection] = set()
        self._ungreeted: dict[Connection, None] = {}  # in arrival order
        self._leases = book = LeaseBook(store.core.clock)
        if metrics is not None:
            metrics.leases_held.set_function(book.live)
        self._ending: set[asyncio.Task[None]] = set()
        self._inbox: list[_Request] = []
        self._round_due = False
        self._in_round = False
        self._dirty: list[Connection] = []  # connections with answers gathered this round
        self._waiting = waiting = WaitingPops(limits.max_waiting)
        if metrics is not None:
            metrics.waiting_pops.set_function(lambda: waiting.count)
        # reason -> (when its last line was logged, refusals since): one line a
        # minute at most, so a flood of bad clients cannot fill the log.
        self._refusals: dict[str, tuple[float, int]] = {}
        self._listening = False
        self._stopping = False  # shutdown() began
        self._checking = 0  # checks running (each holds the writer lock throughout)
        self._wake_pending = False
        self._round_running = False  # a retry round of parked pops is in the store thread
        self._again = False  # a wake came while it ran: run another round after it
        # The queues the running round tried (None: every queue with a waiter, as
        # after the due-time timer fired): only their due times may have moved.
        self._round_queues: set[str] | None = None
        self._woken: list[str | None] = []  # queues named since the last round (None: all)
        self._more: set[str] = set()  # lines the running round did not take whole
        self._due_timer: asyncio.TimerHandle | None = None
        self._due_at = math.inf  # store-clock time the due timer is set for
        # The default clock runs at the speed of real time: a waiter's time runs
        # out by a real-time timer. An injected clock decides waits (_waits.py).
        self._real_clock = store.config.clock is time.time
        self._server: asyncio.base_events.Server | None = None
        self._socket_id: tuple[int, int] | None = None  # (dev, inode) of our unix socket
        self._thread: StoreThread | InlineStore | None = None
        self._inline = False
        self._loop: asyncio.AbstractEventLoop | None = None
        # The loop's queue of ready callbacks: a private attribute of asyncio's
        # own loops (None on a loop without it, which then always defers).
        self._loop_ready: Sized | None = None

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        self._max_connections = self._connections_that_fit()
        self._loop = loop = asyncio.get_running_loop()
        ready = getattr(loop, "_ready", None)
        self._loop_ready = ready if isinstance(ready, Sized) else None
        self._inline = self.store.config.durability != "always"
        self._thread = InlineStore(loop) if self._inline else StoreThread(loop)
        a = self.address
        # A TLS handshake that does not finish (a socket that never sends its hello)
        # holds a descriptor until this, not asyncio's default of 60 s.
        tls_timeout = self.limits.handshake_timeout if self._ssl is not None else None
        # Connections waiting to be accepted while the loop is busy (asyncio's default
        # of 100 turned a burst of clients away with EAGAIN; the kernel caps it).
        backlog = max(100, self._max_connections)
        if a.kind == "unix":
            # asyncio replaces a socket file at the path: one left by a killed server
            # is fine to replace, but one another server listens on is not (its
            # clients then reached this server's store; an operations audit).
            if unix_socket_answers(a.path, UNIX_PROBE_TIMEOUT):
                raise OSError(errno.EADDRINUSE, "another server listens there (or a socket "
                              "this user may not connect to)")
            old = os.umask(0o177)  # the socket is born mode 0600: no window where others connect
            try:
                self._server = await loop.create_unix_server(
                    self._accept, a.path, ssl=self._ssl, ssl_handshake_timeout=tls_timeout,
                    backlog=backlog)
            finally:
                os.umask(old)
            self._socket_id = _file_id(a.path)
        else:
            self._server = await loop.create_server(self._accept, a.host, a.port,
                                                    ssl=self._ssl, reuse_address=True,
                                                    ssl_handshake_timeout=tls_timeout,
                                                    backlog=backlog)
        # Tells a process that finds the store locked which server owns it, and
        # where to reach it: a TCP-only server leaves no socket in the store.
        try:
            write_json_durably(self._server_file, {"address": self.listening_on,
                                                   "pid": os.getpid()})
        except OSError as exc:  # a full disk: serve all the same, the file only helps
            log.warning("cannot write %s: %s", self._server_file, exc)

    @property
    def _server_file(self) -> str:
        return os.path.join(self.store.path, SERVER_FILE)

    def _connections_that_fit(self) -> int:
        """``--max-connections``, or fewer if the process's descriptor limit (raised
        toward the hard one first) cannot hold that many beside the store's files:
        idle connections used every descriptor at 999 under a limit of 1,024, and
        then the store's own writes and syncs failed with EMFILE (a limits audit)."""
        limits = self.limits
        segments = len(self.store.core.payload.file_ids())
        soft = make_room_for_files(segments, limits.max_connections + limits.max_ungreeted
                                   + FDS_SERVER)
        if soft is None:
            return limits.max_connections
        fit = soft - segments * FDS_PER_SEGMENT - FDS_SERVER - limits.max_ungreeted
        if fit >= limits.max_connections:
            return limits.max_connections
        fit = max(MIN_CONNECTIONS, fit)
        log.warning("serving at most %d connections, not %d: the limit on open files is %d "
                    "(raise it, e.g. ulimit -n, to serve more)", fit, limits.max_connections,
                    soft)
        return fit

    @property
    def listening_on(self) -> str:
        """The address clients use (the real port when asked for port 0)."""
        a = self.address
        if a.kind == "tcp" and self._server is not None and self._server.sockets:
            host, port = self._server.sockets[0].getsockname()[:2]
            return f"tcp://{host}:{port}"
        if a.kind == "unix":  # absolute, as docs/server.md gives it: usable from anywhere
            return f"unix://{os.path.abspath(a.path)}"
        return str(a)

    async def shutdown(self) -> None:
        """Stop accepting, answer parked pops, finish in-flight requests, close the store."""
        self._stopping = True  # a pop that parks from now on is answered empty (_park)
        if self._server is not None:
            self._server.close()
        for conn in self._conns:
            conn.stop_reading()
        for w in self._waiting.waiting():
            self._answer_empty(w)
        if self._inbox:
            self._round()  # requests already read are answered, not dropped
        # Answered before their connections close: with durability "always" the
        # store thread still had requests to run, which committed, and their
        # clients saw ConnectionLost for work that was done (an operations audit:
        # 0 of 300 pipelined pushes answered, all 300 in the store).
        busy = [asyncio.ensure_future(c.wait_idle()) for c in self._conns if c.pending]
        if busy:
            _, late = await asyncio.wait(busy, timeout=SHUTDOWN_ANSWER_WAIT)
            for f in late:  # (a client that reads no answers; a long check goes on)
                f.cancel()
        for conn in list(self._conns):
            conn.close()
        while self._ending:
            await asyncio.gather(*list(self._ending), return_exceptions=True)
        if self._due_timer is not None:
            self._due_timer.cancel()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.stop)
        if self.address.kind == "unix" and self._server is not None \
                and _file_id(self.address.path) == self._socket_id:  # still ours to remove
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address.path)
        if self._server is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._server_file)
        await asyncio.to_thread(self.store.close)

    # -- connections (called by _conn.Connection) -------------------------------------

    def _accept(self) -> Connection:
        conn = Connection(self, self.limits.max_frame, self._leases,
                          self.limits.frame_stall_timeout)
        ungreeted = self._ungreeted
        if len(self._conns) - len(ungreeted) >= self._max_connections:
            # Told why and closed once made (before that it has no transport).
            busy = f"over the limit of {self._max_connections} connections"
            conn.refusal = _error_frame(ServerBusy(busy))
            self._refused("busy", busy)
            return conn
        while len(ungreeted) >= self.limits.max_ungreeted:
            # The oldest connection still without a handshake makes room: a client
            # that connects to work says hello within a round trip, so a flood of
            # silent sockets evicts its own, not the clients (before, 1,024 silent
            # sockets refused every new client; a security audit).
            oldest = next(iter(ungreeted))
            del ungreeted[oldest]
            oldest.close()
            self._refused("evicted", f"a connection with no handshake yet closed: "
                          f"{self.limits.max_ungreeted} were waiting for theirs")
        ungreeted[conn] = None
        self._conns.add(conn)
        if self.metrics:
            self.metrics.connections.inc()
        conn.hello_timer = self.loop.call_later(self.limits.handshake_timeout,
                                                self._hello_late, conn)
        return conn

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    def _hello_late(self, conn: Connection) -> None:
        if not conn.greeted and not conn.closed:
            conn.close()
            self._refused("no_handshake", f"no handshake within "
                          f"{self.limits.handshake_timeout:g} s")

    def hello(self, conn: Connection, body: bytes | memoryview) -> None:
        hello = wire.unpack(body)
        self._check_hello(hello)
        if conn.hello_timer is not None:
            conn.hello_timer.cancel()
        self._ungreeted.pop(conn, None)
        conn.greeted = True
        conn.keep_leases = hello.get("keep_leases", False)
        conn.write(wire.pack({"qstore": wire.PROTOCOL_VERSION, "server": __version__,
                              "max_frame": self.limits.max_frame,
                              "max_payload": self.store.config.max_payload_bytes,
                              "ops": SERVED_OPS}))

    def request(self, conn: Connection, body: bytes | memoryview) -> None:
        req = wire.unpack(body)
        if not (type(req) is list and len(req) == 3 and type(req[0]) is int
                and req[0] > 0 and type(req[1]) is str and type(req[2]) is dict):
            raise ProtocolError("a request is [id > 0, op, {args}]")
        self._inbox.append((conn, req[0], req[1], req[2], time.perf_counter()))
        conn.started()

    def read_done(self, conn: Connection) -> None:
        """After a read's frames went to :meth:`request`: run the round now, or soon.

        Now when the loop has no other callback ready to run in this iteration
        (no other connection's read is waiting): nothing could join the round,
        and deferring it would cost another pass of the loop, a poll of the
        selector included, per request. Otherwise after the other callbacks, so
        that the requests they read join the round.
        """
        if not self._inbox or self._round_due:
            return
        ready = self._loop_ready
        if ready is not None and not ready:
            self._round()
        else:
            self._round_due = True
            self.loop.call_soon(self._round)

    def failed(self, conn: Connection, exc: BaseException) -> None:
        if not isinstance(exc, QStoreError):
            log.error("connection failed", exc_info=exc)
        reason = ("auth" if isinstance(exc, AuthenticationFailed)
                  else "protocol" if isinstance(exc, ProtocolError) else "error")
        self._refused(reason, str(exc))
        conn.close(_error_frame(exc))

    def _refused(self, reason: str, why: str) -> None:
        """Count a connection closed with an error, and log it: the first of each
        reason at once, then one line a minute with how many came since. Before,
        wrong tokens, bad frames and refusals over the limit were counted and
        logged nowhere (an observability audit)."""
        if self.metrics:
            self.metrics.refused.labels(reason).inc()
        now = time.monotonic()
        last, since = self._refusals.get(reason, (-REFUSAL_LOG_SECONDS, 0))
        if now - last < REFUSAL_LOG_SECONDS:
            self._refusals[reason] = (last, since + 1)
            return
        self._refusals[reason] = (now, 0)
        more = f" ({since} more since the last line)" if since else ""
        log.warning("connection closed (%s): %s%s", reason, why, more)

    def lost(self, conn: Connection) -> None:
        if conn.hello_timer is not None:
            conn.hello_timer.cancel()
        self._ungreeted.pop(conn, None)
        if conn in self._conns:
            task = self.loop.create_task(self._end(conn))
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)

    def _check_hello(self, hello: Any) -> None:
        if not isinstance(hello, dict) or "qstore" not in hello:
            raise ProtocolError("the first frame must be the handshake map")
        if type(hello["qstore"]) is not int or hello["qstore"] != wire.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {hello['qstore']!r} is not supported; "
                                f"this server speaks {wire.PROTOCOL_VERSION}")
        if type(hello.get("keep_leases", False)) is not bool:
            raise ProtocolError("keep_leases in the handshake must be a bool")
        if self._token is not None:
            given = hello.get("token")
            if not isinstance(given, str) or not hmac.compare_digest(
                    given.encode("utf-8", "surrogateescape"), self._token):
                raise AuthenticationFailed("wrong or missing token")

    async def _end(self, conn: Connection) -> None:
        for w in self._waiting.of(conn):
            self._waiting.remove(w)
            w.done = True
        self._update_listening()
        self._drop_backlog(conn)
        if conn.pending:  # in the store thread or the inbox: let them finish (answers dropped)
            with contextlib.suppress(Exception):
                await conn.wait_idle()
        if not conn.keep_leases and self._thread is not None:
            store, leases = self.store, conn.leases
            # In slices, each its own store call: with the store on the loop
            # (interval, none), a consumer that dies holding many leases must not
            # stall every other connection while they all go back.
            while leases.held:
                try:
                    await self._thread.submit(lambda: leases.release(store, RELEASE_SLICE))
                except Exception:  # those left run out as leases do
                    log.exception("giving back the leases of a closed connection failed")
                    break
                await asyncio.sleep(0)  # let other connections' requests run
            _log_given_back("leases of a closed connection", leases.given_back, leases.buried)
        conn.leases.forget()  # kept leases, or those a failed release left
        self._conns.discard(conn)
        if self.metrics:
            self.metrics.connections.dec()

    # -- requests -----------------------------------------------------------------

    def _round(self) -> None:
        """Run every request read since the last round, then write the answers."""
        self._round_due = False
        reqs, self._inbox = self._inbox, []
        touched = _touched(reqs) if self._waiting.count else None
        if len(reqs) == 1:  # the common case under light load: nothing to group or gather
            self._dispatch(*reqs[0])
            if self._waiting.count:
                self._arm_due(touched)
            return
        if any(r[0].closed for r in reqs):  # read, never started: those clients see
            for r in reqs:                    # ConnectionLost; no lease goes to a dead link
                if r[0].closed:
                    r[0].settled()
            reqs = [r for r in reqs if not r[0].closed]
        if len(reqs) > 2:
            reqs = _layered(reqs)
        self._in_round = True
        try:
            i, n = 0, len(reqs)
            while i < n:
                conn, rid, op, args, started = reqs[i]
                if (op == "pop" or op == "ack") and i + 1 < n and not conn.held:
                    key = group_key(op, args)
                    j = i + 1
                    if key is not None:
                        # A pop's answer may be max_payload_bytes: one pop per
                        # connection in a group, none for a connection whose unsent
                        # answers are over ANSWERS_MAX (it goes to _dispatch, which
                        # holds it back). A pipeline of N unread pops was popped as
                        # one group and its N answers queued at once: 1.1 GB for
                        # 1,500 of 256 KiB (a security audit).
                        seen = {conn} if op == "pop" else None
                        while (j < n and reqs[j][2] == op and not reqs[j][0].held
                               and group_key(op, reqs[j][3]) == key):
                            if seen is not None:
                                other = reqs[j][0]
                                if other in seen or other.answers_backed_up():
                                    break
                                seen.add(other)
                            j += 1
                    if op == "pop" and conn.answers_backed_up():
                        j = i + 1  # not grouped: _dispatch holds it back
                    if j > i + 1:
                        self._group(key, reqs[i:j])  # type: ignore[arg-type]
                        i = j
                        continue
                self._dispatch(conn, rid, op, args, started)
                i += 1
        finally:
            self._in_round = False
            dirty, self._dirty = self._dirty, []
            for conn in dirty:
                conn.flush()
                if conn.write_blocked and not conn.answers_backed_up():
                    self.writable(conn)  # the socket took them all: go on
        if self._waiting.count:
            self._arm_due(touched)  # a delayed push or a lease may have moved a due time

    def _send(self, conn: Connection, frame: bytes) -> None:
        if self._in_round:
            if not conn.out:
                self._dirty.append(conn)
            conn.out.append(frame)
            conn.out_bytes += len(frame)
        else:
            conn.write(frame)

    def _send_parts(self, conn: Connection, parts: list[bytes]) -> None:
        """:meth:`_send` of one frame in parts (``wire.pack_parts``)."""
        if self._in_round:
            if not conn.out:
                self._dirty.append(conn)
            conn.out.extend(parts)
            conn.out_bytes += sum(map(len, parts))
        else:
            conn.write_parts(parts)

    def writable(self, conn: Connection) -> None:
        """The transport wrote out what held ``conn``'s requests back: run them."""
        if conn.answers_backed_up():
            return  # resume_writing comes again once more is written
        conn.write_blocked = False
        self._release_backlog(conn)

    def _release_backlog(self, conn: Connection) -> None:
        """Run the requests ``conn`` read while it was held, before any it reads later."""
        if conn.closed:
            self._drop_backlog(conn)
            return
        if conn.held:
            return
        backlog, conn.backlog = conn.backlog, []
        if backlog:
            self._inbox[:0] = backlog
            if not self._round_due:
                self._round_due = True
                self.loop.call_soon(self._round)

    def _drop_backlog(self, conn: Connection) -> None:
        """A closed connection's held requests never run: settled, unanswered (its
        client saw ConnectionLost). Left pending, they kept its leases held and
        a SIGTERM waiting for them for good (an operations audit)."""
        backlog, conn.backlog = conn.backlog, []
        for _ in backlog:
            conn.settled()

    def _group(self, key: tuple[Any, ...], reqs: list[_Request]) -> None:
        """Consecutive pops (acks) of one queue as one pop_many (ack_many)."""
        store = self.store
        takers = [r[0].leases for r in reqs]
        if key[0] == "pop":
            def run() -> Any:
                return pop_group(store, key[1], key[2], key[3], takers)
        else:
            receipts = [r[3]["receipt"] for r in reqs]

            def run() -> Any:
                ack_group(store, key[1], key[2], receipts, takers)
                return [None] * len(reqs)
        if self._inline_now():
            try:
                results = run()
            except Exception:  # nothing was done: each alone gets its own answer
                for r in reqs:
                    self._dispatch(*r)
                return
            self._group_done(reqs, results)
            return
        fut = self._submit(run)
        fut.add_done_callback(lambda f: self._group_settled(reqs, f))

    def _group_settled(self, reqs: list[_Request], fut: asyncio.Future[Any]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            for r in reqs:
                self._dispatch(*r)
        else:
            self._group_done(reqs, fut.result())

    def _group_done(self, reqs: list[_Request], results: list[Any]) -> None:
        for (conn, rid, op, args, started), result in zip(reqs, results, strict=True):
            conn.settled()
            if conn.closed:
                continue
            if result is None and op == "pop" and args.get("wait"):
                self._park(conn, rid, op, args, started)
                continue
            if self.metrics:
                self.metrics.request(op, time.perf_counter() - started, True)
            self._send(conn, wire.pack([rid, wire.OK, result]))

    def _submit(self, fn: Any) -> asyncio.Future[Any]:
        assert self._thread is not None
        return self._thread.submit(fn)

    def _dispatch(self, conn: Connection, rid: int, op: str, args: dict[str, Any],
                  started: float) -> None:
        if conn.closed:  # read, never started: the client sees ConnectionLost
            conn.settled()
            return
        if conn.held or conn.answers_backed_up():
            # Behind its own compact/snapshot/check, or behind answers its client has
            # not read yet (memory): runs after them, in order.
            conn.write_blocked = conn.write_blocked or not conn.blocked
            conn.backlog.append((conn, rid, op, args, started))
            return
        store = self.store
        kept = args
        if op in wire.QUEUE_OPS:
            leases = conn.leases
            if op in _POPS and args.get("wait"):
                kept = dict(args)  # queue_op consumes its args; a parked pop needs them
            if self._inline_now():  # no closure, no future: the call is microseconds
                self._run_inline(conn, rid, op, kept, started, queue_op, store, leases, op, args)
                return

            def run() -> Any:
                return queue_op(store, leases, op, args)
        elif op in SLOW_OPS:
            # In a thread of its own (it takes seconds); the connection's later
            # requests wait for it, other connections go on.
            conn.blocked = True
            slow = asyncio.ensure_future(self._run_slow(op, args))
            slow.add_done_callback(lambda f: self._slow_done(conn, rid, op, kept, started, f))
            return
        elif op in wire.STORE_OPS:
            def run() -> Any:
                return store_op(store, op, args, self._leases)
        elif op == "cancel":
            conn.settled()
            self._cancel(conn, rid, op, args, started)
            return
        else:
            conn.settled()
            self._reply_error(conn, rid, op, started,
                              InvalidArgument(f"unknown operation {op!r}"))
            return
        # A ping touches no store: answered at once, even while a check holds the
        # writer lock, unless its connection waits for an earlier answer.
        if self._inline_now() or (op == "ping" and conn.pending == 1):
            self._run_inline(conn, rid, op, kept, started, run)
            return
        fut = self._submit(run)
        queue = kept.get("queue") if op in wire.QUEUE_OPS else None
        fut.add_done_callback(lambda f: self._settled(conn, rid, op, kept, started, f, queue))

    def _run_inline(self, conn: Connection, rid: int, op: str, kept: dict[str, Any],
                    started: float, fn: Callable[..., Any], *fn_args: Any) -> None:
        """Run a store call on the loop's thread and answer it (durability interval/none)."""
        try:
            result = fn(*fn_args)
        except Exception as exc:  # the request's own error
            conn.settled()
            self._reply_error(conn, rid, op, started, exc)
            return
        conn.settled()
        self._answer(conn, rid, op, kept, started, result)

    def _settled(self, conn: Connection, rid: int, op: str, args: dict[str, Any],
                 started: float, fut: asyncio.Future[Any], queue: object = None) -> None:
        conn.settled()
        if self._waiting.count:
            self._arm_due([queue] if type(queue) is str else None)
        exc = fut.exception()
        if exc is not None:
            self._reply_error(conn, rid, op, started, exc)
            return
        self._answer(conn, rid, op, args, started, fut.result())

    async def _run_slow(self, op: str, args: dict[str, Any]) -> Any:
        if op != "check":
            return await self._run_slow_now(op, args)
        self._checking += 1
        try:
            return await self._run_slow_now(op, args)
        finally:
            self._checking -= 1

    async def _run_slow_now(self, op: str, args: dict[str, Any]) -> Any:
        if not self._inline:  # after every call the store thread was given before it
            await self._submit(_nothing)
        elif op == "check" and isinstance(self._thread, InlineStore):
            # It holds the writer lock throughout: meanwhile no store call runs on
            # the loop, where it would wait for the lock (_worker.InlineStore).
            with self._thread.holding():
                return await asyncio.to_thread(store_op, self.store, op, args)
        return await asyncio.to_thread(store_op, self.store, op, args)

    def _inline_now(self) -> bool:
        """Whether a store call runs on the loop now (interval, none; not while a
        check holds the writer lock, nor until the calls made meanwhile finished)."""
        t = self._thread
        return self._inline and not (isinstance(t, InlineStore) and t.diverting())

    def _slow_done(self, conn: Connection, rid: int, op: str, args: dict[str, Any],
                   started: float, fut: asyncio.Future[Any]) -> None:
        """A compact/snapshot/check finished: answer it, then run the requests its
        connection sent after it, before any that connection sent later still."""
        conn.blocked = False
        self._settled(conn, rid, op, args, started, fut)
        self._release_backlog(conn)

    def _answer(self, conn: Connection, rid: int, op: str, args: dict[str, Any],
                started: float, result: Any) -> None:
        if result is PARK:
            self._park(conn, rid, op, args, started)
            return
        try:
            parts = wire.pack_parts([rid, wire.OK, result])
        except wire.FrameTooLarge as exc:
            # More than a frame can carry (a pop_many of many large messages past
            # 4 GiB): an error, and what it leased goes back now, attempts
            # counted, as a dropped connection's would (no answer at all left the
            # client waiting out its timeout and the messages leased).
            if op in _POPS and result:
                self._give_back(conn, result if op == "pop_many" else [result])
            self._reply_error(conn, rid, op, started, InvalidArgument(
                f"{op}: the answer, {exc.size} bytes, is over the {wire.MAX_BODY}-byte "
                "limit of a frame; take fewer messages at once"))
            return
        if self.metrics:  # counted before the answer: a client that reads it sees the count
            self.metrics.request(op, time.perf_counter() - started, True)
        if len(parts) == 1:
            self._send(conn, parts[0])
        else:  # a big answer: its body is not copied again to join the prefix
            self._send_parts(conn, parts)

    def _give_back(self, conn: Connection, fields: list[Any]) -> None:
        """Nack the popped messages (wire fields) of an answer that cannot be sent."""
        receipts = [f[7] for f in fields]
        leases, store = conn.leases, self.store

        def give_back() -> None:
            given, buried = leases.give_back(store, receipts)
            if buried:  # only then: an answer too big to send says so itself
                _log_given_back("popped messages whose answer could not be sent", given,
                                buried)

        if self._inline_now():
            give_back()
        else:
            self._submit(give_back)

    def _reply_error(self, conn: Connection, rid: int, op: str, started: float,
                     exc: BaseException) -> None:
        if isinstance(exc, RecursionError):  # an argument nested past repr's limit
            exc = InvalidArgument(f"{op}: an argument is nested too deeply")
        elif not isinstance(exc, QStoreError):
            log.error("request %s failed", op, exc_info=exc)
        if self.metrics:
            self.metrics.request(op, time.perf_counter() - started, False)
        error = wire.encode_error(exc)
        if len(error[1]) > ERROR_TEXT_MAX:  # a message that quotes a huge argument
            error[1] = f"{error[1][:ERROR_TEXT_MAX]}... ({len(error[1])} characters)"
        self._send(conn, wire.pack([rid, wire.ERR, error]))

    # -- waiting pops -----------------------------------------------------------------

    def _park(self, conn: Connection, rid: int, op: str, args: dict[str, Any],
              started: float) -> None:
        if conn.closed:
            return
        if conn.cancelled and rid in conn.cancelled or self._stopping:
            # Its client gave up on it already, or the server shuts down: a pop read
            # before SIGTERM that parks after the waiters were answered (behind a
            # check, in the store thread) was answered by no one (a review).
            conn.cancelled.discard(rid)
            self._send(conn, wire.pack([rid, wire.OK, [] if op == "pop_many" else None]))
            return
        if self._waiting.count >= self._waiting.limit:
            self._reply_error(conn, rid, op, started, ServerBusy(
                f"over the limit of {self._waiting.limit} waiting pops"))
            return
        w = Waiter(conn, rid, op, args, args["queue"], started=started)
        wait = float(args.get("wait", 0.0))
        assert self._loop is not None and math.isfinite(wait)
        if self._real_clock:
            w.timer = self._loop.call_later(max(0.0, wait - (time.perf_counter() - started)),
                                            self._expire, w)
        else:  # a time of the store's clock, armed with the due times (_arm_due)
            w.deadline = self.store.core.wait_clock() + wait
        self._waiting.park(w)
        self._update_listening()
        self._wake(w.queue)  # a push may have landed between the empty pop and now
        self._arm_due((w.queue,))

    def _cancel(self, conn: Connection, rid: int, op: str, args: dict[str, Any],
                started: float) -> None:
        """Withdraw this connection's parked pop ``args["request"]`` (a client that
        gave up on it, e.g. an asyncio task cancelled): it is answered empty now, so
        it takes no message that nobody would read. True if it was still parked
        (answered now, or by the retry round in progress: empty, unless that
        round got it a message); what a pop answered before brings is the
        client's to give back."""
        target = args.get("request")
        if type(target) is not int or set(args) != {"request"}:
            self._reply_error(conn, rid, op, started,
                              InvalidArgument("cancel takes args {'request': id}"))
            return
        withdrawn = found = False
        w = self._waiting.find(conn, target)  # one still to be answered
        if w is not None and not w.cancelled:
            w.cancelled = True
            found = withdrawn = True
            if w.busy:  # answered by the retry round in progress: empty, unless
                w.expired = w.final = True  # it got a message (given back, then)
            else:
                self._answer_empty(w)
        if not found and conn.pending:  # maybe still in the store thread: not to park
            if len(conn.cancelled) >= MAX_PIPELINE:
                conn.cancelled.clear()
            conn.cancelled.add(target)
        self._send(conn, wire.pack([rid, wire.OK, withdrawn]))

    def _expire(self, w: Waiter) -> None:
        if w.done:
            return
        if self._checking:
            # A try (the last, or a round's already under way) would wait for the
            # check's writer lock and answer past the client's timeout: the wait is
            # over, so empty now; what a round gets for it meanwhile goes back (a
            # review and a stress test).
            self._answer_empty(w)
            return
        if w.busy:
            w.expired = True  # the round in progress answers it
            return
        self._last_try(w)

    def _last_try(self, w: Waiter) -> None:
        """A waiter's time ran out: one more try, then a message or empty.

        The embedded pop makes this last attempt at the end of its wait; without
        it, a message that fell due while the due-time timer counted real
        seconds toward a wall-clock time (the clock stepped forward) was missed
        until the sweeper's next pass, and a ``pop(wait=3)`` answered empty
        with the message ready (a time audit).
        """
        if self._checking:  # (a round that ended empty hands its expired waiter here)
            self._answer_empty(w)
            return
        w.busy = w.expired = w.final = True
        store = self.store
        lock = store.core.lock

        def attempt() -> Any:
            # Not behind a check (or anything else holding the writer lock): the
            # wait is over and is answered now, empty, as before the last try. A
            # try that queued behind a check answered only when the check ended,
            # past the client's timeout, which then dropped its connection and
            # with it every lease it held (a review of this change).
            if not lock.acquire(blocking=False):
                return None
            lock.release()
            return queue_op(store, w.conn.leases, w.op, dict(w.args), parked=True)

        if self._inline_now():
            try:
                got = attempt()
            except Exception as exc:  # the waiter's own error (queue deleted, ...)
                self._tried([(w, False, exc)])
                return
            self._tried([(w, True, got)])
            return
        fut = self._submit(attempt)

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled():  # the store thread stopped (shutdown)
                self._tried([(w, True, None)])
                return
            exc = f.exception()
            self._tried([(w, False, exc) if exc is not None else (w, True, f.result())])
        fut.add_done_callback(done)

    def _answer_empty(self, w: Waiter) -> None:
        self._waiting.remove(w)
        w.done = True
        if self.metrics:
            self.metrics.request(w.op, time.perf_counter() - w.started, True)
        self._send(w.conn, wire.pack([w.rid, wire.OK, [] if w.op == "pop_many" else None]))
        self._update_listening()

    def _update_listening(self) -> None:
        want = self._waiting.count > 0
        if want == self._listening or self._thread is None:
            return
        self._listening = want
        core, loop = self.store.core, self._loop
        assert loop is not None

        def listener(queue: str | None) -> None:  # store thread or sweeper, writer lock
            self._woken.append(queue)             # held: only note it and schedule
            if not self._wake_pending:
                self._wake_pending = True
                loop.call_soon_threadsafe(self._retry)

        def switch() -> None:
            with core.lock:
                core.waiters += 1 if want else -1
                core.ready.listener = listener if want else None

        self._thread.submit(switch)

    def _wake(self, queue: str | None = None) -> None:
        """Run a retry round soon for the pops waiting on ``queue`` (None: on all)."""
        self._woken.append(queue)
        if not self._wake_pending:
            self._wake_pending = True
            assert self._loop is not None
            self._loop.call_soon(self._retry)

    def _expire_due(self) -> None:
        """Injected clock: answer the waiters whose deadline that clock has reached."""
        now = self.store.core.wait_clock()
        for w in [w for w in self._waiting.waiting() if w.deadline <= now and not w.done]:
            self._expire(w)

    def _retry(self) -> None:
        self._wake_pending = False
        if not self._real_clock and self._waiting.count:
            self._expire_due()
        if self._round_running:
            # A wake while a round runs: that round may have tried its queues
            # before the push that woke us, so run another once it ends (the
            # queues named since stay in _woken for it).
            self._again = True
            return
        # (Appended to by the listener in the store thread: swap, then read. A name
        # appended after the swap schedules another _retry, as _wake_pending is off.)
        names, self._woken = self._woken, []
        queues = None if None in names else {n for n in names if n is not None}
        waiters, more = self._waiting.round(queues)
        self._more = more
        if not waiters or self._thread is None:
            return
        self._round_running = True
        self._round_queues = queues
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
            self._wake_pending = True  # the names noted meanwhile are in _woken
            self.loop.call_soon(self._retry)
        if fut.cancelled() or fut.exception() is not None:
            return
        results = fut.result()
        # A queue whose line had more waiters than the round took, all of which got
        # a message: it may have more for the rest.
        more = self._more - {w.queue for w, ok, got in results if not ok or got is None}
        for name in more:
            self._wake(name)
        self._tried(results)
        # A round the timer started looks at every queue (the timer is spent); one
        # a push or request started, at the queues it tried: the timer still
        # stands for the others (each delivery looked at every queue with a
        # parked pop: 1.4 ms a push at 16,000 of them, a scale audit).
        self._arm_due(self._round_queues)

    def _tried(self, results: list[tuple[Waiter, bool, Any]]) -> None:
        """Answer the waiters a retry round (or a last try) got a message or an
        error for, and those whose time ran out meanwhile."""
        for w, ok, got in results:
            w.busy = False
            if w.done:
                # Answered already (its connection closed, shutdown) while this try
                # ran: what it leased goes back, or it stayed in flight for its whole
                # lease in a table nobody gives back (a stress test, always mode).
                if ok and got is not None and got != []:
                    self._give_back(w.conn, got if w.op == "pop_many" else [got])
                continue
            if not ok:
                self._waiting.remove(w)
                w.done = True
                self._reply_error(w.conn, w.rid, w.op, w.started, got)
            elif got is not None and got != []:
                self._waiting.remove(w)
                w.done = True
                self._answer(w.conn, w.rid, w.op, w.args, w.started, got)
            elif w.final:
                self._answer_empty(w)
            elif w.expired:  # its time ran out while a round tried it, perhaps before
                self._last_try(w)  # what fell due by then: one more try
        self._update_listening()

    def _arm_due(self, queues: Iterable[str] | None = None) -> None:
        """Wake the parked pops when the next delayed message, lease or rate-limit token
        of their queues is due, instead of at the sweeper's next pass; with an
        injected clock, also when the first waiter's deadline comes.

        ``queues``: only these may have an earlier due time than the timer is set
        for (the queues a round's requests named, or a retry round tried); None:
        look at every queue with a waiter. Looking at every one after every
        request made each request cost as many steps as there were such queues
        (5,000 queues with a parked pop each: other clients' pushes 12 times
        slower; a security audit). A timer left set too early only costs a
        retry round, which looks at every one.
        """
        if not self._waiting.count:
            return
        core = self.store.core
        lines = self._waiting.lines
        looked: Iterable[tuple[str, deque[Waiter]]]
        if queues is None:
            due = math.inf
            looked = lines.items()
        else:
            due = self._due_at
            looked = [(n, lines[n]) for n in queues if n in lines]
            if not looked:
                return
        with core.lock:
            now = core.clock()
            for name, line in looked:
                if not self._real_clock:
                    due = min(due, min(w.deadline for w in line if not w.gone))
                q = core.queues.get(name)
                if q is None:
                    continue
                if q.next_event_us < NO_EVENT_US:
                    due = min(due, q.next_event_us / 1e6)
                bucket = q.bucket
                if bucket is not None and q.counts[READY]:
                    # The next token (now if one is there: a retry is due). Skipping
                    # a bucket with a token let an autojump clock jump past it to a
                    # deadline, and a real one's timer for the token be cancelled.
                    due = min(due, bucket.next_token_at(now))
        if due == self._due_at:
            return
        if self._due_timer is not None:
            self._due_timer.cancel()
            self._due_timer = None
        self._due_at = due
        if due == math.inf:
            return
        # An injected clock says how long to wait for it (None: until it moves,
        # which wakes the waiters through Core.ready; an autojump clock jumps).
        seconds = due - now if self._real_clock else core.sleep_time(due)
        if seconds is not None:
            # at least a millisecond: a due time that a retry cannot clear never spins
            self._due_timer = self.loop.call_later(max(0.001, seconds), self._due)

    def _due(self) -> None:
        self._due_timer = None
        self._due_at = math.inf
        self._wake()


def _touched(reqs: list[_Request]) -> set[str] | None:
    """The queues a round's requests name, read before they run (a queue op consumes
    its args); None when one may move any queue's due time (a store op such as
    configure_queue or delete_queue)."""
    out: set[str] = set()
    for r in reqs:
        op = r[2]
        if op in wire.QUEUE_OPS:
            name = r[3].get("queue")
            if type(name) is str:
                out.add(name)
        elif op != "ping" and op != "cancel":
            return None
    return out


def _file_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of ``path`` itself, or None if there is none: a server
    removes only the socket it made, not one another put at its path since."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _layered(reqs: list[_Request]) -> list[_Request]:
    """A round's requests in an order that puts pops (acks) of one queue side by side.

    Every request of a round was sent before any answer of the round was
    written, so requests of different connections are concurrent and may run in
    any order; one connection's must keep theirs. Layer k holds each
    connection's k-th request; layers run in turn, and within a layer requests
    that can group sit together, in the order their group first appears.
    """
    nth: dict[Connection, int] = {}
    keyed = []
    first: dict[tuple[Any, ...], int] = {}
    for i, r in enumerate(reqs):
        layer = nth.get(r[0], 0)
        nth[r[0]] = layer + 1
        key = group_key(r[2], r[3]) if r[2] == "pop" or r[2] == "ack" else None
        slot = i if key is None else first.setdefault((layer, *key), i)
        keyed.append((layer, slot, i))
    keyed.sort()
    return [reqs[i] for _, _, i in keyed]


def _nothing() -> None:
    return None


def _log_given_back(what: str, given: int, buried: int) -> None:
    """Say what leases given back became: ready again, or, for a message on its last
    attempt, a dead letter. Before, those went to the dead letters with no word
    anywhere (an observability audit)."""
    if buried:
        log.warning("%s given back: %d ready again, %d moved to the dead letters (that was "
                    "their last attempt)", what, given - buried, buried)
    elif given:
        log.info("%s given back: %d ready again", what, given)


def _error_frame(exc: BaseException) -> bytes:
    return wire.pack([wire.SERVER_ERROR_ID, wire.ERR, wire.encode_error(exc)])
