"""The asyncio client when its user closes it mid-connect, when the server drops
the connection right after the handshake, and when an interrupt lands inside
it (an asyncio-client audit).

A ``KeyboardInterrupt`` reaches the client's code when the loop is driven by
``run_until_complete`` (``asyncio.run`` turns Ctrl-C into a cancellation
instead). The tests raise it from a trace hook at one chosen line, then run the
same loop on, as a program that catches it would.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest

import qstore
import qstore.aio
from qstore import _wire as wire

from ._support import ServerProcess

AIO = qstore.aio.__file__


def _line_of(text: str) -> int:
    with open(AIO, encoding="utf-8") as f:
        found = [i for i, line in enumerate(f, 1) if line.strip() == text]
    assert len(found) == 1, (text, found)
    return found[0]


@contextmanager
def interrupt_at(fire: Callable[[FrameType, str], bool], filename: str = AIO
                 ) -> Iterator[list[str]]:
    """Raise KeyboardInterrupt once, at the first trace event in ``filename``
    that ``fire(frame, event)`` picks; yields a list that says whether it fired."""
    fired: list[str] = []

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if not fired and fire(frame, event):
            fired.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
            sys.settrace(None)
            raise KeyboardInterrupt("injected")
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != filename:
            return None
        return local(frame, event, arg)

    sys.settrace(tracer)
    try:
        yield fired
    finally:
        sys.settrace(None)


async def _stats(address: str, name: str) -> qstore.QueueStats:
    other = qstore.aio.connect(address)
    try:
        return await (await other.queue(name)).stats()
    finally:
        await other.close()


def test_close_while_a_call_connects_leaves_no_connection_open(server: ServerProcess) -> None:
    # The call connected after close() and kept the connection: later calls ran
    # on a closed client, and what it popped stayed leased until it was collected.
    async def main() -> None:
        setup = qstore.aio.connect(server.address)
        await (await setup.create_queue("q")).push(b"job")
        await setup.close()
        client = qstore.aio.connect(server.address)
        q = qstore.aio.AsyncQueue(client._link, {"name": "q", "order": "max",
                                                 "priority_type": "int", "max_attempts": 5,
                                                 "dedup": False})
        popping = asyncio.ensure_future(q.pop(lease=600.0))  # connects on first use
        await asyncio.sleep(0)  # it is connecting now
        await client.close()
        with pytest.raises(qstore.StoreClosed):
            await popping
        with pytest.raises(qstore.StoreClosed):
            await q.stats()
        stats = await _stats(server.address, "q")
        assert (stats.ready, stats.in_flight) == (1, 0)

    asyncio.run(asyncio.wait_for(main(), 60.0))


def test_a_connection_dropped_right_after_its_handshake_fails_the_call_at_once(
        tmp_path: Any) -> None:
    # A server that greets and goes away: the call registered its answer after
    # the connection was already lost, and waited out its whole timeout.
    path = str(tmp_path / "s.sock")

    async def greet_and_close(reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> None:
        (n,) = wire.LENGTH.unpack(await reader.readexactly(4))
        await reader.readexactly(n)
        writer.write(wire.pack({"qstore": 1, "max_frame": 1 << 20,
                                "ops": sorted(wire.QUEUE_OPS | wire.STORE_OPS)}))
        await writer.drain()
        writer.close()

    async def main() -> None:
        srv = await asyncio.start_unix_server(greet_and_close, path)
        try:
            for _ in range(3):
                client = qstore.aio.connect(f"unix://{path}", timeout=600.0)
                # Bounded far below the client's timeout: the call must not wait it out.
                with pytest.raises(qstore.ConnectionLost):
                    await asyncio.wait_for(client.ping(), 20.0)
                await client.close()
        finally:
            srv.close()

    asyncio.run(main())


@pytest.mark.parametrize("line", ["value = await fut", "proto.transport.write(frame)",
                                  "if proto.paused:  # a large request filled the socket: "
                                  "wait, within the time"])
def test_an_interrupt_in_a_pop_gives_its_message_back(server: ServerProcess,
                                                      line: str) -> None:
    # Only a cancellation gave back what an abandoned pop's answer leased: after
    # a KeyboardInterrupt the message stayed in flight on the live connection,
    # held by no one, until its lease ran out.
    target = _line_of(line)
    loop = asyncio.new_event_loop()
    try:
        client = qstore.aio.connect(server.address)
        q = loop.run_until_complete(client.create_queue("q"))
        loop.run_until_complete(q.push(b"job"))
        with interrupt_at(lambda f, e: e == "line" and f.f_lineno == target) as fired, \
                pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(q.pop(lease=600.0))
        assert fired

        async def back() -> qstore.Message | None:
            while True:  # the answer, given back, or the pop that never went out
                got = await q.pop(lease=600.0)
                if got is not None:
                    return got
                await asyncio.sleep(0.01)

        again = loop.run_until_complete(asyncio.wait_for(back(), 30.0))
        assert again is not None and again.payload == b"job"
        loop.run_until_complete(q.ack(again))
        assert loop.run_until_complete(q.stats()).total == 0
        loop.run_until_complete(client.close())
    finally:
        loop.close()


@pytest.mark.parametrize("where", ["_frame", "unpack"])
def test_an_interrupt_while_reading_answers_fails_every_caller_at_once(
        server: ServerProcess, where: str) -> None:
    # An interrupt inside data_received lost a frame (or left it to be read
    # twice): its caller waited out the client's timeout, which then closed the
    # connection anyway. Now the connection closes at once and every caller
    # hears so; nothing is lost (the server gives the leases back).
    loop = asyncio.new_event_loop()
    try:
        client = qstore.aio.connect(server.address, timeout=600.0)
        q = loop.run_until_complete(client.create_queue("q"))
        loop.run_until_complete(q.push_many([b"m%d" % i for i in range(8)]))
        pops = [loop.create_task(q.pop(lease=600.0)) for _ in range(8)]
        armed = {"on": False}

        def pick(frame: FrameType, event: str) -> bool:
            return armed["on"] and event == "call" and frame.f_code.co_name == where

        filename = wire.__file__ if where == "unpack" else AIO
        with interrupt_at(pick, filename) as fired, pytest.raises(KeyboardInterrupt):
            armed["on"] = True
            loop.run_until_complete(asyncio.gather(*pops))
        assert fired
        done = loop.run_until_complete(asyncio.wait_for(
            asyncio.gather(*pops, return_exceptions=True), 60.0))
        failed = [r for r in done if isinstance(r, qstore.ConnectionLost)]
        got = [r for r in done if isinstance(r, qstore.Message)]
        assert len(failed) + len(got) == 8 and failed, done
        # The next call reconnects; every message is there, none in flight.
        stats = loop.run_until_complete(q.stats())
        assert (stats.ready, stats.in_flight) == (8, 0)
        loop.run_until_complete(client.close())
    finally:
        loop.close()

