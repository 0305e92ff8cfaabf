"""One client connection: frames in, responses out (docs/protocol.md, "Frames").

A :class:`Connection` is an :class:`asyncio.Protocol`, not a stream task:
``data_received`` cuts every complete frame out of what arrived and hands
each to the server at once, so a read costs no coroutine switch, no future
and no ``drain`` per request. Responses made while the server runs a round
are gathered and written with one ``transport.write`` per connection at the
end of the round (:meth:`flush`).

Memory is bounded per connection: before the handshake a frame may be at
most :data:`HELLO_MAX_FRAME` bytes, after it ``max_frame``; a frame is only
buffered as its bytes arrive. Flow control: reading stops while the
connection has ``MAX_PIPELINE`` requests in progress or while the transport
cannot write (the client does not read its answers), and resumes after.
Requests already read do not run while the connection's unsent answers are
over :data:`ANSWERS_MAX` bytes (:meth:`answers_backed_up`): they wait in its
backlog, in order, until the transport has written them out
(``write_blocked``). Without that, a client that pipelines small requests
with large answers (a ``peek(200)`` of 24 bytes answers 200 messages) and
reads none made the server hold every answer: gigabytes.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Protocol, cast

from .._net_errors import ProtocolError
from .._wire import BIG_BODY
from ._ops import LeaseBook, Leases

HELLO_MAX_FRAME = 64 * 1024  # the handshake is a small map: an unauthenticated peer buffers no more
MAX_PIPELINE = 1024  # requests of one connection in progress before it stops reading
ANSWERS_MAX = 4 * 1024 * 1024  # unsent answer bytes after which its requests wait
_LENGTH = struct.Struct(">I")
# A frame this big or bigger that stops coming in mid-way is timed (Limits
# frame_stall_timeout): it holds up to --max-frame of the server's memory.
STALL_MIN_BYTES = 64 * 1024


class Owner(Protocol):
    """What a connection calls on its server."""

    def hello(self, conn: Connection, body: bytes | memoryview) -> None: ...
    def request(self, conn: Connection, body: bytes | memoryview) -> None: ...
    def read_done(self, conn: Connection) -> None: ...
    def lost(self, conn: Connection) -> None: ...
    def writable(self, conn: Connection) -> None: ...
    def failed(self, conn: Connection, exc: BaseException) -> None: ...


class Connection(asyncio.Protocol):
    def __init__(self, owner: Owner, max_frame: int, book: LeaseBook,
                 stall_timeout: float = 60.0) -> None:
        self.owner = owner
        self.max_frame = max_frame
        self.stall_timeout = stall_timeout
        self._stall_timer: asyncio.TimerHandle | None = None
        self._last_data = 0.0  # loop time of the last bytes of a frame being timed
        self.transport: asyncio.Transport | None = None
        self.leases = Leases(book)
        self.keep_leases = False
        self.greeted = False
        self.closed = False
        self.pending = 0  # requests started and not answered yet
        self.out: list[bytes] = []  # responses gathered during a round
        self.idle: asyncio.Event | None = None  # set by the server while it waits for pending
        self.hello_timer: asyncio.TimerHandle | None = None
        # An error frame to send, then close, as soon as the connection is made
        # (the server is over its connection limit).
        self.refusal: bytes | None = None
        # While a compact, snapshot or check of this connection runs in a thread,
        # its later requests wait here, so they take effect and are answered after
        # it, in order (the server's _dispatch and _slow_done).
        self.blocked = False
        # Its unsent answers are over ANSWERS_MAX: its later requests wait in the
        # backlog too, until the transport writes them out (server.writable).
        self.write_blocked = False
        self.out_bytes = 0  # bytes in ``out``
        # Pops a ``cancel`` found in progress, not parked (in the store thread):
        # if they come back to park, they are answered empty instead. Bounded:
        # ids of pops that were answered meanwhile are never looked up again.
        self.cancelled: set[int] = set()
        self.backlog: list[tuple[Connection, int, str, dict[str, Any], float]] = []
        self._buf = bytearray()
        self._need = 4  # bytes the buffer must hold before a frame can be cut
        self._write_paused = False
        self._pipeline_full = False
        self._stopped = False  # the server shuts down: no more reading

    # -- asyncio.Protocol -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if self.closed:  # closed while its TLS handshake ran (evicted, or too late)
            transport.close()
            return
        if self.refusal is not None:
            self.close(self.refusal)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        buf = self._buf
        if buf:
            buf += data
            if len(buf) < self._need:
                if len(buf) >= STALL_MIN_BYTES:
                    self._timing()
                return
            view: bytes | bytearray = buf
        else:
            view = data
        size, pos = len(view), 0
        try:
            while size - pos >= 4:
                (n,) = _LENGTH.unpack_from(view, pos)
                limit = self.max_frame if self.greeted else HELLO_MAX_FRAME
                if n > limit:
                    raise ProtocolError(f"frame of {n} bytes is over the limit of {limit}"
                                        + ("" if self.greeted else " before the handshake"))
                end = pos + 4 + n
                if end > size:
                    break
                if view is buf:  # a frame that came in parts: read in place, not copied
                    with memoryview(buf) as whole, whole[pos + 4:end] as part:
                        self._frame(part)
                elif self.greeted:  # the usual case: a whole frame in one read
                    self.owner.request(self, data[pos + 4:end])
                else:
                    self.owner.hello(self, data[pos + 4:end])
                pos = end
                if self.closed:
                    self.owner.read_done(self)
                    return
        except Exception as exc:  # protocol, auth: the server says why and closes
            self.owner.failed(self, exc)
            # failed() closed the connection: the round settles the requests read
            # before the bad frame unstarted (never run, never answered; the
            # protocol doc says so), so nothing waits for them.
            self.owner.read_done(self)
            return
        if view is buf:
            del buf[:pos]
        elif pos < size:
            buf += view[pos:]
        self._need = _LENGTH.unpack_from(buf)[0] + 4 if len(buf) >= 4 else 4
        if len(buf) >= STALL_MIN_BYTES:
            self._timing()
        elif self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        if pos:
            self.owner.read_done(self)

    def _frame(self, body: bytes | memoryview) -> None:
        if self.greeted:
            self.owner.request(self, body)
        else:
            self.owner.hello(self, body)

    def _timing(self) -> None:
        """A big frame is coming in: note when its last bytes came, and close the
        connection if none come for ``stall_timeout`` (a peer that sends most of
        an 80 MiB frame and stops held that memory for good, each; a limits audit)."""
        loop = asyncio.get_running_loop()
        self._last_data = loop.time()
        if self._stall_timer is None and self.greeted:
            self._stall_timer = loop.call_later(self.stall_timeout, self._stall_check)

    def _stall_check(self) -> None:
        self._stall_timer = None
        if self.closed or len(self._buf) < STALL_MIN_BYTES:
            return
        loop = asyncio.get_running_loop()
        idle = loop.time() - self._last_data
        if idle < self.stall_timeout:
            self._stall_timer = loop.call_later(self.stall_timeout - idle, self._stall_check)
            return
        self._buf.clear()  # its memory goes now, not when the transport is done
        self.owner.failed(self, ProtocolError(
            f"a frame stopped coming in: no byte of it for {self.stall_timeout:g} s"))

    def eof_received(self) -> bool | None:
        return None  # close the transport: a half-closed client gets no more answers

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stall_timer is not None:  # it holds the connection, and its buffer
            self._stall_timer.cancel()
            self._stall_timer = None
        if not self.closed:
            self.closed = True
            self.owner.lost(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._reading()
        if self.write_blocked:
            self.owner.writable(self)

    # -- used by the server -------------------------------------------------------

    def started(self) -> None:
        self.pending += 1
        if self.pending >= MAX_PIPELINE and not self._pipeline_full:
            self._pipeline_full = True
            self._reading()

    def settled(self) -> None:
        self.pending -= 1
        if self._pipeline_full and self.pending < MAX_PIPELINE:
            self._pipeline_full = False
            self._reading()
        if self.pending == 0 and self.idle is not None:
            self.idle.set()

    async def wait_idle(self) -> None:
        """Until no request of this connection is in progress (none started and
        unanswered, none held in its backlog)."""
        if self.pending:
            if self.idle is None or self.idle.is_set():
                self.idle = asyncio.Event()
            await self.idle.wait()

    def stop_reading(self) -> None:
        """Read no more requests (the server shuts down)."""
        self._stopped = True
        self._reading()

    def _reading(self) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if self._write_paused or self._pipeline_full or self._stopped:
            if t.is_reading():
                t.pause_reading()
        elif not t.is_reading():
            t.resume_reading()

    def write(self, frame: bytes) -> None:
        """Send one frame now (outside a round)."""
        if not self.closed and self.transport is not None:
            self.transport.write(frame)

    def write_parts(self, parts: list[bytes]) -> None:
        """Send one frame in parts now (outside a round), not joined."""
        if not self.closed and self.transport is not None:
            self.transport.writelines(parts)

    @property
    def held(self) -> bool:
        """Its requests wait in the backlog (behind a slow op, or its answers)."""
        return self.blocked or self.write_blocked

    def answers_backed_up(self) -> bool:
        """Whether the answers not yet sent (gathered this round, or in the
        transport's buffer) are over :data:`ANSWERS_MAX` bytes."""
        if not self._write_paused:  # the transport holds less than its high-water mark
            return self.out_bytes > ANSWERS_MAX
        t = self.transport
        waiting = self.out_bytes + (t.get_write_buffer_size() if t is not None else 0)
        return waiting > ANSWERS_MAX

    def flush(self) -> None:
        """Write the responses gathered during a round, in one write: joined, unless
        they hold a big answer (``wire.pack_parts``), which the transport takes
        as it is (uvloop writes the buffers without joining them)."""
        size, self.out_bytes = self.out_bytes, 0
        out, self.out = self.out, []
        if out and not self.closed and self.transport is not None:
            if len(out) == 1:
                self.transport.write(out[0])
            elif size > BIG_BODY:
                self.transport.writelines(out)
            else:
                self.transport.write(b"".join(out))

    def close(self, last: bytes | None = None) -> None:
        """Send ``last`` (an error frame) after everything gathered, then close."""
        if self.out:
            self.flush()
        if last is not None:
            self.write(last)
        was_closed, self.closed = self.closed, True
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        if self.transport is not None:
            self.transport.close()
        if not was_closed:  # once: a second lost() would start a second release
            self.owner.lost(self)
