"""The server's framing floor: ``qstore serve``'s transport with canned answers, no store.

Run as ``python -m bench._floor`` (``make bench`` starts it as a child, as it
does ``qstore serve``). It listens on a loopback TCP port, prints ``listening
on tcp://HOST:PORT`` and serves the protocol of docs/protocol.md through the
server's own :class:`~qstore.server._conn.Connection` (framing, flow control)
on the same event loop (uvloop where installed), with msgpack frames packed
and unpacked by :mod:`qstore._wire`, the requests of one read gathered into
a round and the round's answers written once per connection, as the server
does. What it leaves out is everything behind a request: no store, no
dispatch, no leases. ``queue`` answers a fixed queue, ``pop`` one fixed
1 KiB message, ``ack`` and ``ping`` nothing; anything else is refused.

Driven by the same client processes as the server, its CPU per pop+ack is
what the transport costs on this machine (the kernel's loopback TCP, the
event loop, framing, msgpack, the client library); the server's CPU per
pop+ack less this is what the store and the dispatch cost under the same
load (docs/benchmarks.md, "fourth look: the framing floor").
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from qstore import _wire as wire
from qstore._errors import InvalidArgument
from qstore._message import Message
from qstore.server import loop_factory
from qstore.server._conn import Connection
from qstore.server._ops import LeaseBook

_MESSAGE = wire.encode_message(Message(1, "bench", 5, b"x" * 1024, 1, 1.7e9, 1.7e9 + 60,
                                       "r1.1.1"))
_QUEUE = {"name": "bench", "order": "max", "priority_type": "int", "max_attempts": 5,
          "dedup": False}


class FloorOwner:
    """What :class:`Connection` calls on its server: canned answers, in rounds."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.inbox: list[tuple[Connection, Any]] = []
        self.due = False

    def hello(self, conn: Connection, body: bytes | memoryview) -> None:
        conn.greeted = True
        conn.write(wire.pack({"qstore": wire.PROTOCOL_VERSION, "server": "floor",
                              "max_frame": conn.max_frame, "max_payload": conn.max_frame}))

    def request(self, conn: Connection, body: bytes | memoryview) -> None:
        self.inbox.append((conn, wire.unpack(body)))
        conn.started()

    def read_done(self, conn: Connection) -> None:
        if self.inbox and not self.due:
            self.due = True
            self.loop.call_soon(self.round)

    def round(self) -> None:
        self.due = False
        reqs, self.inbox = self.inbox, []
        for conn, (rid, op, _) in reqs:
            conn.settled()
            if op == "pop":
                frame = wire.pack([rid, wire.OK, _MESSAGE])
            elif op == "ack" or op == "ping":  # connect() pings
                frame = wire.pack([rid, wire.OK, None])
            elif op == "queue":
                frame = wire.pack([rid, wire.OK, _QUEUE])
            else:
                refused = InvalidArgument(
                    f"the framing floor answers ping, queue, pop and ack, not {op!r}")
                frame = wire.pack([rid, wire.ERR, wire.encode_error(refused)])
            conn.out.append(frame)
        for conn, _ in reqs:
            conn.flush()

    def lost(self, conn: Connection) -> None:
        return None

    def writable(self, conn: Connection) -> None:
        return None  # it holds no request back: answers are a few bytes

    def failed(self, conn: Connection, exc: BaseException) -> None:
        conn.close()


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    owner = FloorOwner(loop)
    book = LeaseBook()
    server = await loop.create_server(
        lambda: Connection(owner, wire.DEFAULT_MAX_FRAME, book), "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"listening on tcp://{host}:{port}", flush=True)
    await asyncio.Event().wait()  # until the bench kills it


def main() -> int:
    with asyncio.Runner(loop_factory=loop_factory()) as runner:  # as `qstore serve`
        runner.run(_serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
