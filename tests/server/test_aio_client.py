"""The asyncio client's edges: dropped and silent servers, errors the server sends
about the connection, large frames, cancelled tasks, tokens and TLS.

The same promises as the synchronous client (docs/server.md): a request in
flight when the connection drops raises ConnectionLost, the next call
reconnects, nothing is retried on its own.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import socket
import struct
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

import qstore
import qstore.aio
from qstore._address import parse_address

from ._support import ServerProcess, frame, running
from .test_security import _make_cert, _token_file

Run = Callable[[Any], Any]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: Any) -> Run:
    """Runs a coroutine to the end on the event loop named by the parameter: the
    client runs on whichever loop its user chose, and the two differ in their
    transports (TLS included)."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else asyncio.new_event_loop

    def run(coro: Any) -> Any:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(asyncio.wait_for(coro, 60.0))
    return run


def test_a_killed_server_fails_what_is_in_flight_and_the_next_call_reconnects(
        tmp_path: Any, run: Run) -> None:
    path = str(tmp_path / "store")
    holder: dict[str, ServerProcess] = {"srv": ServerProcess(path)}

    async def main() -> None:
        client = qstore.aio.connect(holder["srv"].address)
        q = await client.create_queue("k")
        first = await q.push(b"before")
        parked = [asyncio.ensure_future(q.pop(wait=60.0)) for _ in range(3)]
        got = await q.pop()  # answered after the three parked pops were sent
        assert got is not None and got.id == first and not any(p.done() for p in parked)
        holder["srv"].kill()
        for p in parked:  # the error names the server it lost
            with pytest.raises(qstore.ConnectionLost, match=re.escape(holder["srv"].address)):
                await p
        with pytest.raises(qstore.ConnectionLost):
            await q.push(b"nobody listens")
        holder["srv"] = ServerProcess(path)
        assert (await q.stats()).total == 1  # the same client object reconnected
        second = await q.push(b"after")
        again = await q.pop()
        assert again is not None and (again.id, again.payload) == (second, b"after")
        await client.close()

    try:
        run(main())
    finally:
        holder["srv"].kill()


def test_calls_after_a_failed_send_go_to_no_dead_transport(
        tmp_path: Any, run: Run, caplog: pytest.LogCaptureFixture) -> None:
    # Calls made in one pass of the loop after the server died: the first send
    # fails and closes the transport, but the protocol hears of it only on the
    # next pass, so the others wrote to the dead transport, and asyncio logged
    # "socket.send() raised exception." for each past the fifth (about 6 an
    # asyncio client at each server stop; a signals audit). They raise
    # ConnectionLost as before, with nothing written to a closing transport.
    srv = ServerProcess(str(tmp_path / "store"))

    async def main() -> list[Any]:
        client = qstore.aio.connect(srv.address)
        q = await client.create_queue("k")
        await q.push(b"warm")
        srv.kill()
        got = await asyncio.gather(*[q.push(b"x") for _ in range(20)],
                                   return_exceptions=True)
        await client.close()
        return got

    try:
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            got = run(main())
    finally:
        srv.kill()
    assert all(isinstance(g, qstore.ConnectionLost) for g in got), got
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


def test_closing_the_client_ends_a_waiting_pop_with_store_closed(
        server: ServerProcess, run: Run) -> None:
    # As a closed embedded store's waiting pop and the sync client's: it raised
    # ConnectionLost here (an API audit). And `await connect(...)` connects.
    async def main() -> None:
        client = await qstore.aio.connect(server.address)
        assert isinstance(client, qstore.aio.AsyncClient)
        q = await client.create_queue("c")
        waiting = asyncio.ensure_future(q.pop(wait=30.0))
        await asyncio.sleep(0)  # a pass of the loop: its request is sent
        assert not waiting.done()
        await client.close()
        with pytest.raises(qstore.StoreClosed, match="closed while this call"):
            await asyncio.wait_for(waiting, 20)  # under its wait: the close ended it

    run(main())


def test_a_closed_client_raises_store_closed(server: ServerProcess, run: Run) -> None:
    async def main() -> None:
        client = qstore.aio.connect(server.address)
        q = await client.create_queue("c")
        await q.push(b"x")
        await client.close()
        await client.close()  # idempotent
        for call in (lambda: q.push(b"y"), q.pop, q.stats, client.queues):
            with pytest.raises(qstore.StoreClosed):
                await call()

    run(main())


def test_large_frames_and_small_ones_pipelined_on_one_link(server: ServerProcess,
                                                            run: Run) -> None:
    big = bytes(range(256)) * (6 * 4096 + 7)  # about 6 MiB: many reads on the client side

    async def main() -> None:
        async with qstore.aio.connect(server.address) as client:
            q = await client.create_queue("big", order="fifo")
            small = [q.push(b"s%d" % i) for i in range(50)]
            ids = await asyncio.gather(q.push(big), *small)
            got = await q.pop_many(100)
            assert [m.id for m in got] == sorted(ids)
            by_id = {m.id: m.payload for m in got}
            assert by_id[ids[0]] == big
            assert [by_id[i] for i in ids[1:]] == [b"s%d" % i for i in range(50)]
            assert await q.ack_many(got) == 51

    run(main())


def test_a_cancelled_call_leaves_the_link_to_the_others(server: ServerProcess,
                                                         run: Run) -> None:
    async def main() -> None:
        async with qstore.aio.connect(server.address) as client:
            q = await client.create_queue("c")
            parked = asyncio.ensure_future(q.pop(wait=60.0))
            await client.ping()  # the parked pop reached the server before the ping's answer
            parked.cancel()
            with pytest.raises(asyncio.CancelledError):
                await parked
            ids = await asyncio.gather(*(q.push(b"%d" % i) for i in range(20)))
            assert len(set(ids)) == 20
            stats = await q.stats()
            # The cancelled pop took none of them: it was withdrawn in the server.
            # (It took the first push, which sat in flight unseen until its lease
            # ran out, using up an attempt.)
            assert (stats.ready, stats.in_flight) == (20, 0)

    run(main())


def test_a_cancelled_pop_gives_back_what_it_was_answered(server: ServerProcess,
                                                         run: Run) -> None:
    async def main() -> None:
        async with qstore.aio.connect(server.address) as client:
            q = await client.create_queue("g", max_attempts=3)
            await q.push(b"only")
            for _ in range(2):
                popping = asyncio.ensure_future(q.pop(lease=300.0))
                await asyncio.sleep(0)  # sent; its answer (the message) is on its way
                popping.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await popping
                await client.ping()
            stats = await q.stats()
            assert (stats.ready, stats.in_flight, stats.dead) == (1, 0, 0)
            m = await q.pop()
            assert m is not None and m.payload == b"only" and m.attempts == 3  # counted

    run(main())


def test_tokens_and_tls(tmp_path: Any, run: Run) -> None:
    cert, key = _make_cert(tmp_path)
    with running(str(tmp_path / "s"), "--listen", "tcp://127.0.0.1:0", "--tls-cert", cert,
                 "--tls-key", key, "--token-file", _token_file(tmp_path)) as srv:
        async def main() -> None:
            with pytest.raises(qstore.AuthenticationFailed):
                await qstore.aio.connect(srv.address, token="wrong", cafile=cert).ping()
            with pytest.raises(qstore.ConnectionLost):  # plain TCP to a TLS server
                await qstore.aio.connect(srv.address, token="s3cret-token", timeout=5.0).ping()
            async with qstore.aio.connect(srv.address, token="s3cret-token",
                                          cafile=cert) as client:
                q = await client.create_queue("tls")
                await q.push(b"\x00secret\xff")
                m = await q.pop()
                assert m is not None and m.payload == b"\x00secret\xff"

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", ResourceWarning)
            run(main())
            gc.collect()
        assert [str(w.message) for w in seen if w.category is ResourceWarning] == []


def test_payload_and_frame_limits_keep_the_link(tmp_path: Any, run: Run) -> None:
    limit = 256 * 1024
    with running(str(tmp_path / "s"), "--max-payload-bytes", str(limit)) as srv:
        async def main() -> None:
            async with qstore.aio.connect(srv.address) as client:
                q = await client.create_queue("p")
                frame = client._link.welcome["max_frame"]
                with pytest.raises(qstore.PayloadTooLarge) as info:
                    await q.push(b"x" * (limit + 1))
                assert (info.value.size, info.value.limit) == (limit + 1, limit)
                with pytest.raises(qstore.PayloadTooLarge):  # refused by the client
                    await q.push(b"x" * frame)  # (nothing is sent), as embedded
                await q.push(b"y" * limit)
                m = await q.pop()
                assert m is not None and m.payload == b"y" * limit

        run(main())


# -- a fake server, for what a real one does only when something is wrong -------


def _read_frame(conn: socket.socket) -> Any:
    (n,) = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))
    return msgpack.unpackb(conn.recv(n, socket.MSG_WAITALL), raw=False)


@contextmanager
def _fake_server(after_hello: Callable[[socket.socket], None]) -> Iterator[str]:
    """A loopback server that answers the handshake, then hands the connection to
    ``after_hello``; yields its address."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            _read_frame(conn)
            conn.sendall(frame({"qstore": 1, "server": "fake"}))
            after_hello(conn)
            done.wait(30)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        done.set()
        thread.join(30)
        listener.close()


def test_a_server_that_never_answers_times_out_as_connection_lost(run: Run) -> None:
    with _fake_server(lambda conn: _read_frame(conn)) as address:
        async def main() -> None:
            client = qstore.aio.connect(address, timeout=0.2)
            with pytest.raises(qstore.ConnectionLost, match="ping"):
                await client.ping()
            await client.close()

        run(main())


def test_an_error_about_the_connection_fails_every_request_in_flight(run: Run) -> None:
    def refuse(conn: socket.socket) -> None:
        _read_frame(conn)
        _read_frame(conn)
        conn.sendall(frame([0, 1, ["ServerBusy", "too many waiting pops", {}]]))

    with _fake_server(refuse) as address:
        async def main() -> None:
            client = qstore.aio.connect(address)
            calls = [asyncio.ensure_future(client.ping()) for _ in range(2)]
            for c in calls:
                with pytest.raises(qstore.ServerBusy, match="too many waiting pops"):
                    await c
            await client.close()

        run(main())


def test_a_malformed_answer_is_a_protocol_error(run: Run) -> None:
    def garble(conn: socket.socket) -> None:
        _read_frame(conn)
        conn.sendall(struct.pack(">I", 3) + b"\xc1\xc1\xc1")  # 0xc1: never used by msgpack

    with _fake_server(garble) as address:
        async def main() -> None:
            client = qstore.aio.connect(address)
            with pytest.raises(qstore.ProtocolError):
                await client.ping()
            await client.close()

        run(main())


# -- the frame cutter alone, against any way the bytes may be split into reads ---


class _Transport:
    """What the protocol calls on its transport, recorded."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


_VALUES = st.one_of(st.binary(max_size=3000), st.text(max_size=50),
                   st.integers(-2**63, 2**64 - 1), st.none())  # what msgpack carries


@given(answers=st.lists(_VALUES, min_size=1, max_size=12),
       cuts=st.lists(st.integers(min_value=0, max_value=40_000), max_size=20))
@settings(max_examples=150)
def test_answers_come_out_whole_however_the_reads_split_them(answers: list[Any],
                                                             cuts: list[int]) -> None:
    async def main() -> None:
        proto = qstore.aio._Protocol(parse_address("tcp://127.0.0.1:1"))
        transport = _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        futs = {rid: proto.loop.create_future() for rid in range(1, len(answers) + 1)}
        proto.waiting.update(futs)
        stream = frame({"qstore": 1}) + b"".join(
            frame([rid, 0, value]) for rid, value in zip(futs, answers, strict=True))
        edges = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
        for a, b in zip(edges, edges[1:], strict=False):
            proto.data_received(stream[a:b])
        assert proto.welcome.result() == {"qstore": 1}
        assert [f.result()[2] for f in futs.values()] == answers
        assert not transport.closed and proto.waiting == {}

    asyncio.run(main())


@given(cut=st.integers(min_value=1, max_value=20))
@settings(max_examples=20)
def test_a_truncated_answer_waits_and_a_garbled_one_fails_everything(cut: int) -> None:
    async def main() -> None:
        proto = qstore.aio._Protocol(parse_address("tcp://127.0.0.1:1"))
        transport = _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        proto.data_received(frame({"qstore": 1}))
        first, second = proto.loop.create_future(), proto.loop.create_future()
        proto.waiting.update({1: first, 2: second})
        whole = frame([1, 0, b"x" * 20])
        proto.data_received(whole[:cut])  # not all of it yet: nothing happens
        assert not first.done() and not transport.closed
        proto.data_received(whole[cut:] + struct.pack(">I", 2) + b"\xc1\xc1")
        assert first.result() == [1, 0, b"x" * 20]
        with pytest.raises(qstore.ProtocolError):
            second.result()
        assert transport.closed

    asyncio.run(main())
