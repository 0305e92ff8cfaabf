"""``qstore.connect``: the synchronous client of a qstore server.

:class:`Client` and :class:`RemoteQueue` have the methods, arguments, results
and exceptions of :class:`~qstore.Store` and :class:`~qstore.Queue`; each call
is one request (batches too) on one socket. A dropped connection raises
:class:`~qstore.ConnectionLost` for the call in progress, which may or may
not have taken effect; the next call reconnects. Nothing is retried on its
own. Threads may share a client, as they share an embedded store: each
call runs on a connection no other thread is using at that moment
(:class:`_Links`).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, Unpack

from . import _client_base as base
from . import _wire as wire
from ._address import Address, parse_address
from ._check_report import CheckReport
from ._errors import QStoreError, StoreClosed
from ._message import CompactionResult, Message, QueueStats, StoreStats
from ._net_errors import ConnectionLost, ProtocolError
from ._options import QueueOptions

_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds
_LENGTH = wire.LENGTH
_RECV = 256 * 1024


class _Link(base.LinkSettings):
    """One socket to the server, opened on first use and after a drop."""

    def __init__(self, address: Address, token: str | None, timeout: float, keep_leases: bool,
                 ssl_context: ssl.SSLContext | None, server_hostname: str | None) -> None:
        super().__init__(address, token, timeout, keep_leases, ssl_context, server_hostname)
        self._sock: socket.socket | None = None
        self._in = bytearray(_RECV)  # the read buffer: bytes _start:_end are unread
        self._start = self._end = 0
        self._kernel_timeout = False  # the timeout is SO_RCVTIMEO/SO_SNDTIMEO, not Python's
        self._timeout_now = -1.0
        self._poll: select.poll | None = None  # readable while idle: see dropped()
        # close() of the client from another thread (interrupt) against this
        # link's own thread opening or closing its socket.
        self._sock_lock = threading.Lock()
        self._interrupted = False

    def _open(self) -> None:
        a = self.address
        try:
            if a.kind == "unix":
                sock = _connect_unix(a.path, self.timeout)
            else:
                sock = socket.create_connection((a.host, a.port), timeout=self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=self._hostname or a.host
                                             or None)
            else:
                # A Python socket timeout costs a poll() before every send and recv;
                # the kernel's own timeouts cost nothing per call.
                sock.settimeout(None)
                self._kernel_timeout = True
            with self._sock_lock:
                self._sock = sock
                if self._interrupted:  # the client was closed as this connected
                    _shut(sock)
            self._poll = select.poll()
            self._poll.register(sock, select.POLLIN)
            self._start = self._end = 0
            self._timeout_now = -1.0
            self._set_timeout(self.timeout)
            # A server that refuses the connection (over its limit) sends why and
            # closes at once: if sending fails, the reason is still there to read.
            with contextlib.suppress(OSError):
                sock.sendall(base.hello(self._token, self._keep))
            self.welcome = base.check_welcome(self._read())
        except (OSError, EOFError) as exc:
            self.close()
            raise ConnectionLost(f"cannot connect to {a}: {exc}") from None
        except BaseException:
            self.close()
            raise

    def _set_timeout(self, seconds: float) -> None:
        if seconds == self._timeout_now:
            return
        sock = self._sock
        assert sock is not None
        if self._kernel_timeout:
            # 0 would mean "no timeout" to the kernel: at least a microsecond
            whole, micros = divmod(max(1, round(seconds * 1e6)), 1_000_000)
            tv = _TIMEVAL.pack(whole, micros)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        else:
            sock.settimeout(seconds)
        self._timeout_now = seconds

    def _fill(self, need: int) -> int:
        """Read until the buffer holds ``need`` bytes from ``_start``; returns ``_start``.

        The socket reads straight into one reusable buffer (``recv_into``): no
        new bytes object per read and no copy to cut a frame out. A frame
        larger than the buffer grows it for as long as it is being read.
        """
        buf, sock, start, end = self._in, self._sock, self._start, self._end
        assert sock is not None
        if start + need > len(buf):  # move what is buffered to the front, grow if needed
            size = max(_RECV, need)
            if size != len(buf) or start:
                fresh = bytearray(size)
                fresh[:end - start] = buf[start:end]
                self._in = buf = fresh
                start, end = 0, end - start
                self._start, self._end = start, end
        with memoryview(buf) as view:
            while end - start < need:
                got = sock.recv_into(view[end:])
                if not got:
                    raise EOFError("connection closed by the server")
                end += got
                self._end = end
        return start

    def _read(self) -> Any:
        """The next frame's value."""
        start, end = self._start, self._end
        if end == 0:  # nothing buffered, as after every answer read whole: the usual case
            sock = self._sock
            assert sock is not None
            buf = self._in
            got = sock.recv_into(buf)
            if got >= 4 and _LENGTH.unpack_from(buf)[0] + 4 == got:  # one whole answer
                with memoryview(buf) as view:
                    return wire.unpack(view[4:got])
            if not got:
                raise EOFError("connection closed by the server")
            self._end = end = got  # a part, or more than one answer: as below
        if end - start < 4:
            start = self._fill(4)
        (n,) = _LENGTH.unpack_from(self._in, start)
        if self._end - start < 4 + n:
            start = self._fill(4 + n)
        stop = start + 4 + n
        with memoryview(self._in) as view:
            value = wire.unpack(view[start + 4:stop])
        if stop == self._end:  # the usual case: nothing left over, read from the front
            self._start = self._end = 0
            if len(self._in) > _RECV:
                self._in = bytearray(_RECV)  # a big frame's buffer is not kept
        else:
            self._start = stop
        return value

    def call(self, op: str, args: dict[str, Any], wait: float = 0.0) -> Any:
        if self._sock is None:
            self._open()
        sock = self._sock
        assert sock is not None
        rid = next(self._ids)
        frame = base.request(rid, op, args, self.welcome)
        try:
            if self.timeout + wait != self._timeout_now:
                self._set_timeout(self.timeout + wait)
            sock.sendall(frame)
            value = self._read()
        except (OSError, EOFError) as exc:
            self.close()
            raise ConnectionLost(f"connection to {self.address} lost during {op}: {exc}; "
                                 "it may or may not have run") from None
        except BaseException:
            # A ProtocolError, or the call interrupted (KeyboardInterrupt, an
            # exception from a signal handler) with its answer still owed: the
            # next call on this connection would read that answer as its own.
            self.close()
            raise
        if (type(value) is list and len(value) == 3 and value[1] == wire.OK
                and type(value[0]) is int and value[0] == rid):
            return value[2]  # the usual answer: base.result would return the same
        if isinstance(value, list) and value and value[0] == wire.SERVER_ERROR_ID:
            self.close()  # the server is closing this connection and says why
        try:
            return base.result(value, rid)
        except ProtocolError:  # an answer to another request: out of step, done
            self.close()
            raise

    def call_many(self, calls: list[tuple[str, dict[str, Any], float]]) -> list[Any]:
        """Send ``calls`` in one write and read every answer: each call's result, or
        the error it raised (as a value, in place)."""
        if not calls:
            return []
        if self._sock is None:
            self._open()
        sock = self._sock
        assert sock is not None
        limit = self.welcome
        rids = [next(self._ids) for _ in calls]
        frames = [base.request(rid, op, args, limit) for rid, (op, args, _) in zip(
            rids, calls, strict=True)]
        answers: dict[int, Any] = {}
        try:
            self._set_timeout(self.timeout + max(wait for _, _, wait in calls))
            sock.sendall(b"".join(frames))
            while len(answers) < len(rids):
                value = self._read()
                if isinstance(value, list) and value and value[0] == wire.SERVER_ERROR_ID:
                    self.close()
                    base.result(value, 0)  # raises the server's error
                if not (isinstance(value, list) and len(value) == 3 and value[0] in rids):
                    raise ProtocolError(f"unexpected response {value!r:.80}")
                answers[value[0]] = value
        except (OSError, EOFError) as exc:
            self.close()
            raise ConnectionLost(f"connection to {self.address} lost during a pipeline of "
                                 f"{len(calls)}: {exc}; any of them may or may not have run"
                                 ) from None
        except BaseException:  # as in call: answers owed would be read by the next call
            self.close()
            raise
        out: list[Any] = []
        for rid in rids:
            try:
                out.append(base.result(answers[rid], rid))
            except QStoreError as exc:
                out.append(exc)
        return out

    def dropped(self) -> bool:
        """Whether the server ended this idle connection (closed it, or sent on it
        unasked, which it does only to say why it closes): a restarted or
        stopped server. One ``poll`` with no timeout, about 0.3 us.

        Nothing is sent on a connection found dropped: it is closed, and the
        call connects anew, so a request never goes out on a connection known
        to be dead (where it would fail as "may or may not have run").
        """
        return self._poll is not None and bool(self._poll.poll(0))

    def interrupt(self) -> None:
        """Wake this link's call from another thread (the client is closing): its
        socket is shut down, so a blocked read returns at once and the call
        raises, not after its whole ``wait`` (an API audit)."""
        with self._sock_lock:
            self._interrupted = True
            if self._sock is not None:
                _shut(self._sock)

    def close(self) -> None:
        self._start = self._end = 0
        if len(self._in) > _RECV:
            self._in = bytearray(_RECV)
        self._poll = None
        if self._sock is not None:
            with self._sock_lock:
                self._sock.close()
                self._sock = None


def _shut(sock: socket.socket) -> None:
    # The plain socket's shutdown, also under TLS: SSLSocket.shutdown drops the
    # SSL object a read in another thread is using.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


# Forks of this process so far, as a child counts them: a client made before a
# fork must not talk on the sockets its parent goes on using (_Links._take).
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_forked)


class _Links:
    """The connections of one client: as many as threads call it at the same moment.

    A call takes an idle link, or opens one, and puts it back when it returns,
    so threads sharing a client never share a socket: a request and its answer
    stay on one link, a waiting pop holds only its own, and a thread calling
    alone always gets back the link it used last (the idle list is a stack).
    ``list.pop`` and ``list.append`` are atomic in CPython, so taking and
    giving back a link needs no lock. :meth:`close` closes the idle links and
    shuts down the sockets of those in use, so a call another thread is making
    (a waiting pop) raises :class:`~qstore.StoreClosed` at once; every later
    call raises it too, as a closed embedded store's do. In
    a child process the links its parent made are dropped (the child's copies
    of their sockets closed; the parent's connections stay up) and the child
    connects on its own: a client made before a fork (a pre-forking web
    server loading the app) would otherwise send the child's requests on the
    parent's connections and mix up their answers.
    """

    def __init__(self, address: Address, token: str | None, timeout: float,
                 keep_leases: bool, ssl_context: ssl.SSLContext | None,
                 server_hostname: str | None) -> None:
        self.address = address
        self._settings = (address, token, timeout, keep_leases, ssl_context, server_hostname)
        self._idle: list[_Link] = []
        self._busy: set[_Link] = set()  # links a call is using now (close interrupts them)
        self.closed = False
        self._forks = _forks

    def call(self, op: str, args: dict[str, Any], wait: float = 0.0,
             convert: Callable[[Any], Any] | None = None) -> Any:
        """``op``'s result on a link of its own (``convert``ed, if given)."""
        link = self._take()
        try:
            value = link.call(op, args, wait)
            return value if convert is None else convert(value)
        except ConnectionLost:
            if self.closed:  # close() woke this call: StoreClosed, as embedded
                raise self._closed_in_flight(op) from None
            raise
        except QStoreError:
            raise  # the server's answer, an error: the link is as good as before
        except BaseException:
            # Cut short with the answer read (an interrupt while it was checked or
            # decoded): close the link, so that the server gives back at once what a
            # pop leased, which nobody holds (it stayed leased to the deadline;
            # an interrupt audit).
            link.close()
            raise
        finally:
            self._give_back(link)

    def call_many(self, calls: list[tuple[str, dict[str, Any], float]]) -> list[Any]:
        """:meth:`_Link.call_many` on one link: a pipeline's answers come back on it."""
        link = self._take()
        try:
            return link.call_many(calls)
        except ConnectionLost:
            if self.closed:
                raise self._closed_in_flight(f"a pipeline of {len(calls)}") from None
            raise
        finally:
            self._give_back(link)

    def _closed_in_flight(self, what: str) -> StoreClosed:
        return StoreClosed(f"the client of {self.address} was closed during {what}; "
                           "it may or may not have run")

    def _take(self) -> _Link:
        if self.closed:
            raise StoreClosed(f"the client of {self.address} is closed")
        if self._forks != _forks:  # this process is a child of the one that made them
            self._forget_parents_links()
        try:
            link = self._idle.pop()
        except IndexError:
            link = _Link(*self._settings)
        else:
            if link.dropped():  # the server went away while it was idle (a restart)
                link.close()    # it reconnects on this call
        self._busy.add(link)
        if self.closed:  # close() ran since the check above: it may not have seen it
            self._busy.discard(link)
            link.close()
            raise StoreClosed(f"the client of {self.address} is closed")
        return link

    def _give_back(self, link: _Link) -> None:
        self._busy.discard(link)
        if self.closed:  # while this call ran
            link.close()
        else:
            self._idle.append(link)

    def _forget_parents_links(self) -> None:
        """In a forked child: close this process's copies of the parent's sockets
        (its connections stay up) and forget the ones its threads were using,
        never shutting them down: a shutdown ends the connection for both
        processes, and a child's close() failed the parent's waiting pop (a
        review)."""
        self._forks = _forks
        inherited, self._idle = self._idle, []
        busy, self._busy = self._busy, set()
        for link in [*inherited, *busy]:
            link.close()

    def close(self) -> None:
        self.closed = True
        if self._forks != _forks:
            self._forget_parents_links()
        idle, self._idle = self._idle, []
        for link in idle:
            link.close()
        for link in list(self._busy):  # calls in other threads (a waiting pop) end now
            link.interrupt()


_T = TypeVar("_T")


def _none(value: Any) -> None:
    return None


class RemoteQueue(base.QueueInfo):
    """A queue of a server; the methods of :class:`qstore.Queue`."""

    def __init__(self, link: _Links, info: dict[str, Any]) -> None:
        super().__init__(info)
        self._link = link

    def __repr__(self) -> str:
        return f"<qstore.RemoteQueue {self.name!r} on {self._link.address}>"

    def _call(self, op: str, convert: Callable[[Any], _T], /, **args: Any) -> _T:
        """Run ``op`` and return ``convert`` of its result (a pipeline records it instead)."""
        result: _T = self._link.call(op, *base.queue_args(self.name, args, self._qid), convert)
        return result

    def push(self, payload: bytes | bytearray | memoryview,
             priority: int | str | None = None, delay: float = 0.0,
             dedup_key: str | bytes | None = None, ttl: float | None = None) -> int:
        return self._call("push", int, **base.push_args(payload, priority, delay, dedup_key,
                                                          ttl))

    def push_many(self, items: Iterable[bytes | Sequence[Any]], *, delay: float = 0.0,
                  ttl: float | None = None) -> list[int]:
        return self._call("push_many", list, **base.push_many_args(items, delay, ttl))

    def pop(self, lease: float = 30.0, wait: float = 0.0) -> Message | None:
        return self._call("pop", base.maybe_message, lease=lease, wait=wait)

    def pop_many(self, n: int, lease: float = 30.0, wait: float = 0.0) -> list[Message]:
        return self._call("pop_many", base.messages, n=base.count(n), lease=lease, wait=wait)

    def ack(self, item: Message | str) -> None:
        self._call("ack", _none, receipt=base.receipt_of(item))

    def ack_many(self, items: Iterable[Message | str]) -> int:
        return self._call("ack_many", int, receipts=base.receipts_of(items))

    def nack(self, item: Message | str, delay: float = 0.0) -> None:
        self._call("nack", _none, receipt=base.receipt_of(item), delay=delay)

    def extend(self, item: Message | str, lease: float = 30.0) -> Message:
        return self._call("extend", wire.decode_message, receipt=base.receipt_of(item),
                          lease=lease)

    def peek(self, n: int = 1) -> list[Message]:
        return self._call("peek", base.messages, n=base.count(n))

    def get(self, message_id: int) -> Message:
        return self._call("get", wire.decode_message, message_id=message_id)

    def dead_letters(self, n: int = 10) -> list[Message]:
        return self._call("dead_letters", base.messages, n=base.count(n))

    def redrive(self, n: int = 100) -> int:
        return self._call("redrive", int, n=base.count(n))

    def purge(self) -> int:
        return self._call("purge", int)

    def stats(self) -> QueueStats:
        return self._call("stats", wire.decode_stats)

    def __len__(self) -> int:
        return self.stats().total


class Pipeline:
    """Requests recorded now and sent together, in one write, by :meth:`execute`.

    ``pipeline.queue(name)`` gives a handle with the methods of
    :class:`RemoteQueue`; in a pipeline they return None and only record the
    request (arguments are checked and encoded at once, so a bad one raises
    there). :meth:`execute` sends every recorded request in one write, reads
    every answer, and returns the results in call order, converted as the
    direct calls would. Requests run in order on the server; consecutive pops
    (acks) of one queue run as one batch there. Used as a context manager, the
    pipeline executes on a clean exit (results in :attr:`results`).
    """

    def __init__(self, link: _Links) -> None:
        self._link = link
        self._calls: list[tuple[str, dict[str, Any], float, Callable[[Any], Any]]] = []
        self.results: list[Any] = []

    def queue(self, name: str) -> _PipelinedQueue:
        """A handle on queue ``name`` that records into this pipeline (no round trip)."""
        return _PipelinedQueue(self, name)

    def ping(self) -> None:
        self._calls.append(("ping", {}, 0.0, _none))

    def __len__(self) -> int:
        return len(self._calls)

    def execute(self, raise_errors: bool = True) -> list[Any]:
        """Send every recorded request, read every answer; the results in call order.

        With ``raise_errors`` (the default) the first failed request's error is
        raised once all answers are in; otherwise errors are returned in place.
        A dropped connection raises :class:`~qstore.ConnectionLost`: any of the
        requests may or may not have run.
        """
        calls, self._calls = self._calls, []
        answers = self._link.call_many([(op, args, wait) for op, args, wait, _ in calls])
        out: list[Any] = []
        for (_, _, _, convert), answer in zip(calls, answers, strict=True):
            out.append(answer if isinstance(answer, Exception) else convert(answer))
        self.results = out
        if raise_errors:
            for r in out:
                if isinstance(r, Exception):
                    raise r
        return out

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None and self._calls:
            self.execute()


class _PipelinedQueue(RemoteQueue):
    def __init__(self, pipeline: Pipeline, name: str) -> None:
        self.name = name
        self._pipeline = pipeline

    def __repr__(self) -> str:
        return f"<qstore.RemoteQueue {self.name!r} in a pipeline>"

    def __len__(self) -> int:
        # RemoteQueue's len() is a stats call: here it recorded one and failed on the
        # None it got back (an API audit).
        raise TypeError("len() of a queue in a pipeline: its calls are recorded and run "
                        "by execute(); record stats() and read .total from the results")

    def __getattr__(self, name: str) -> Any:
        # Only for names __init__ did not set: the queue's options (order, dedup...).
        raise AttributeError(f"a queue in a pipeline only records calls; its {name!r} is "
                             "not known here (client.queue(name) has it)")

    def _call(self, op: str, convert: Callable[[Any], _T], /, **args: Any) -> _T:
        args, wait = base.queue_args(self.name, args)
        base.request(0, op, args)  # an argument that cannot be sent fails here, not later
        self._pipeline._calls.append((op, args, wait, convert))
        return None  # type: ignore[return-value]  # recorded: the result comes from execute()


class Client:
    """A client of a qstore server with the methods of :class:`qstore.Store`; threads
    may share it (one connection per thread calling at the same moment)."""

    def __init__(self, link: _Links) -> None:
        self._link = link
        self.path = str(link.address)

    def create_queue(self, name: str, *, order: str = "max", priority_type: str = "int",
                     max_attempts: int = 5, dedup: bool = False, exist_ok: bool = False,
                     ttl: float | None = None, on_expire: str | None = None,
                     aging: float | None = None, aging_cap: int | None = None,
                     rate: tuple[int, float] | None = None) -> RemoteQueue:
        info = self._link.call("create_queue", base.create_queue_args(
            name, order, priority_type, max_attempts, dedup, exist_ok,
            {"ttl": ttl, "on_expire": on_expire, "aging": aging, "aging_cap": aging_cap,
             "rate": rate}))
        return RemoteQueue(self._link, info)

    def configure_queue(self, name: str, **options: Unpack[QueueOptions]) -> RemoteQueue:
        """Change options of queue ``name`` (those of :meth:`qstore.Store.configure_queue`)."""
        info = self._link.call("configure_queue", {**options, "name": name})
        return RemoteQueue(self._link, info)

    def queue(self, name: str) -> RemoteQueue:
        return RemoteQueue(self._link, self._link.call("queue", {"queue": name}))

    def queues(self) -> list[str]:
        return list(self._link.call("queues", {}))

    def delete_queue(self, name: str) -> None:
        self._link.call("delete_queue", {"name": name})

    def stats(self) -> StoreStats:
        return wire.decode_store_stats(self._link.call("store_stats", {}))

    def compact(self, *, threshold: float | None = None,
                max_bytes: int | None = None) -> CompactionResult:
        """One compaction pass in the server (no progress callback over the wire)."""
        return wire.decode_compaction(self._link.call(
            "compact", base.compact_args(threshold, max_bytes), wait=3600.0))

    def snapshot(self, dest: str | os.PathLike[str]) -> str:
        """A snapshot taken by the server at ``dest`` (a path on the server's machine)."""
        return str(self._link.call("snapshot", base.snapshot_args(self._link.address, dest),
                                   wait=3600.0))

    def check(self, *, repair: bool = False) -> CheckReport:
        """The integrity check, run by the server on its store (``Store.check``);
        ``repair=True`` repairs what it can first (docs/check.md)."""
        return wire.decode_check(self._link.call("check", {"repair": repair}, wait=3600.0))

    def ping(self) -> None:
        """One round trip to the server (a client's own call: the embedded store has none)."""
        self._link.call("ping", {})

    def _backfill(self, args: dict[str, Any]) -> dict[str, Any]:
        """``qstore backfill`` through the server: the job runs in the server's process
        (qstore.spark.backfill.serve_backfill); its result as a map. Not part of the
        store's API (the embedded store loads with qstore.spark.backfill.run_backfill)."""
        out: dict[str, Any] = self._link.call("backfill", args, wait=7 * 86400.0)
        return out

    def pipeline(self) -> Pipeline:
        """A :class:`Pipeline`: many requests sent in one write, answers read together."""
        return Pipeline(self._link)

    def close(self) -> None:
        """Close this client's connections (the server and its store go on); later
        calls raise StoreClosed, as a closed embedded store's do."""
        self._link.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<qstore.Client {self._link.address}>"


base.point_docs(RemoteQueue, "qstore.Queue")
base.point_docs(Client, "qstore.Store")


def connect(address: str | os.PathLike[str], *, token: str | None = None,
            timeout: float = base.DEFAULT_TIMEOUT, keep_leases: bool = False,
            tls: bool | ssl.SSLContext = False, cafile: str | None = None,
            server_hostname: str | None = None) -> Client:
    """Connect to the server at ``address`` (``unix:///p``, ``tcp://h:p`` or a store path).

    ``timeout``: seconds to wait for the server to connect and to answer a
    request (a ``pop(wait=...)`` is given its wait on top); ``ConnectionLost``
    after it. ``keep_leases=True`` keeps this client's leases until their
    deadline when a connection of it closes (by default they go back to
    ready at once).
    ``tls=True`` (trusting ``cafile`` or the system's CAs) or an
    ``ssl.SSLContext`` for TLS. Threads may share the client (it opens one
    connection per thread calling at the same moment), and a child process
    forked after this call gets connections of its own on first use.
    """
    ctx = tls if isinstance(tls, ssl.SSLContext) else (
        base.client_tls(cafile) if tls or cafile else None)
    link = _Links(parse_address(address), token, timeout, keep_leases, ctx, server_hostname)
    link.call("ping", {})  # connect now: a wrong address or token fails here, not later
    return Client(link)


def _connect_unix(path: str, timeout: float | None) -> socket.socket:
    """A connected unix socket, trying again within ``timeout`` while the server's
    accept backlog is full (:func:`base.unix_connect_once`). No timeout: a
    blocking connect waits for a place in the backlog itself."""
    if timeout is None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        return sock
    deadline = time.monotonic() + timeout
    for pause in itertools.chain(base.CONNECT_PAUSES, itertools.repeat(0.05)):
        got = base.unix_connect_once(path, timeout)
        if got is not None:
            return got
        if time.monotonic() + pause > deadline:
            raise BlockingIOError(errno.EAGAIN, "the server's accept backlog is full")
        time.sleep(pause)
    raise AssertionError("unreachable")
