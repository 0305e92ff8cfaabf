"""Pops and acks that arrive together run as one batch and answer as if run alone."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import qstore
import qstore.aio

from ._support import ServerProcess, frame, raw_socket, read_frames


def test_pipelined_pops_share_the_messages_in_pop_order(server: ServerProcess) -> None:
    async def main() -> None:
        async with qstore.aio.connect(server.address) as client:
            q = await client.create_queue("p")
            await q.push_many([(b"low", 1), (b"high", 9), (b"mid", 5)])
            got = await asyncio.gather(*(q.pop() for _ in range(5)))
            assert [m.payload if m else None for m in got] == [b"high", b"mid", b"low",
                                                                None, None]
            assert len({m.receipt for m in got if m}) == 3
            assert (await q.stats()).in_flight == 3
    asyncio.run(main())


def test_one_bad_ack_among_pipelined_acks_fails_alone(server: ServerProcess) -> None:
    async def main() -> None:
        async with qstore.aio.connect(server.address) as client:
            q = await client.create_queue("a")
            await q.push_many([b"1", b"2", b"3"])
            a, b, c = await q.pop_many(3)
            await q.ack(b)
            results = await asyncio.gather(q.ack(a), q.ack(b), q.ack(c), q.ack("zz"),
                                           return_exceptions=True)
            assert results[0] is None and results[2] is None
            assert isinstance(results[1], (qstore.LeaseExpired, qstore.MessageNotFound))
            assert isinstance(results[3], qstore.InvalidArgument)
            stats = await q.stats()
            assert (stats.ready, stats.in_flight) == (0, 0)
    asyncio.run(main())


def test_pipelined_pops_from_many_connections_each_get_a_different_message(
        server: ServerProcess) -> None:
    async def main() -> None:
        clients = [qstore.aio.connect(server.address) for _ in range(4)]
        try:
            q0 = await clients[0].create_queue("m")
            await q0.push_many([b"%d" % i for i in range(200)])
            queues = [await c.queue("m") for c in clients]

            async def drain(q: qstore.aio.AsyncQueue) -> list[bytes]:
                out = []
                while (m := await q.pop()) is not None:
                    out.append(m.payload)
                    await q.ack(m)
                return out

            got = await asyncio.gather(*(drain(q) for q in queues for _ in range(3)))
            flat = sorted(p for part in got for p in part)
            assert flat == sorted(b"%d" % i for i in range(200))
        finally:
            for c in clients:
                await c.close()
    asyncio.run(main())


@pytest.mark.parametrize("lease", [0, -1.0, float("nan")])
def test_a_bad_lease_in_a_run_of_pops_is_refused_alone(server: ServerProcess,
                                                     lease: float) -> None:
    async def main() -> None:
        async with qstore.aio.connect(server.address) as client:
            q = await client.create_queue("b")
            await q.push_many([b"x", b"y"])
            got = await asyncio.gather(q.pop(), q.pop(lease=lease), q.pop(),
                                       return_exceptions=True)
            assert isinstance(got[1], qstore.InvalidArgument)
            assert sorted(m.payload for m in (got[0], got[2])) == [b"x", b"y"]
    asyncio.run(main())


class _Transport(asyncio.Transport):
    """Records what the server writes; a connection in memory, no socket."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[bytes] = []
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out.append(bytes(data))

    def is_closing(self) -> bool:
        return False

    def is_reading(self) -> bool:
        return self.reading

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def close(self) -> None:
        pass


def test_a_lone_request_is_answered_within_its_read_and_a_busy_loop_gathers_a_round(
        tmp_path: Any) -> None:
    """With nothing else ready the round runs at once (no extra pass of the loop);
    with another callback ready it waits for it, so that reads join one round."""
    from qstore import _wire as wire
    from qstore._address import parse_address
    from qstore.server import Server

    async def main() -> None:
        with qstore.open(str(tmp_path / "s"), compactor=False) as store:
            store.create_queue("q").push_many([b"a", b"b"])
            srv = Server(store, parse_address("tcp://127.0.0.1:0"))
            await srv.start()
            try:
                conns = []
                for _ in range(2):
                    conn = srv._accept()
                    t = _Transport()
                    conn.connection_made(t)
                    conn.data_received(wire.pack({"qstore": wire.PROTOCOL_VERSION}))
                    t.out.clear()
                    conns.append((conn, t))
                (c1, t1), (c2, t2) = conns
                pop = wire.pack([1, "pop", {"queue": "q"}])
                c1.data_received(pop)
                assert len(t1.out) == 1  # answered before data_received returned
                loop = asyncio.get_running_loop()
                loop.call_soon(c2.data_received, pop)  # another read, ready in this pass
                c1.data_received(wire.pack([2, "pop", {"queue": "q"}]))
                assert len(t1.out) == 1  # deferred: the other read may join the round
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                got = [wire.unpack(t.out[-1][4:]) for t in (t1, t2)]
                assert all(g[1] == wire.OK for g in got)
                payloads = {wire.decode_message(g[2]).payload for g in got
                            if g[2] is not None}
                first = wire.decode_message(wire.unpack(t1.out[0][4:])[2]).payload
                assert {first} | payloads == {b"a", b"b"} and len(payloads) == 1
            finally:
                await srv.shutdown()

    asyncio.run(main())


def test_pops_with_an_int_lease_group_with_float_ones() -> None:
    # pop(lease=30) sends the int 30: such pops ran one by one, never as one
    # pop_many (a protocol audit); 30 and 30.0 are one lease.
    from qstore.server._ops import group_key

    as_int = group_key("pop", {"queue": "q", "lease": 30, "qid": 1})
    assert as_int is not None
    assert as_int == group_key("pop", {"queue": "q", "lease": 30.0, "qid": 1})
    assert group_key("pop", {"queue": "q", "lease": True}) is None  # a bool is no lease
    assert group_key("pop", {"queue": "q", "lease": 0}) is None


def test_create_queue_sends_only_the_options_given() -> None:
    # A server from before on_expire could be left out refused on_expire nil, so a
    # new client's create_queue failed on it (a review): options at None are not
    # sent; the server takes an absent option as not given.
    from qstore._client_base import create_queue_args

    args = create_queue_args("q", "max", "int", 5, False, True,
                             {"ttl": 30.0, "on_expire": None, "aging": None,
                              "aging_cap": None, "rate": None})
    assert args == {"name": "q", "order": "max", "priority_type": "int", "max_attempts": 5,
                    "dedup": False, "exist_ok": True, "ttl": 30.0}


def test_a_cancel_finds_a_pop_whose_last_try_is_running() -> None:
    # Its time ran out and its last try runs: the cancel answered false ("answered
    # already") before the pop's answer came (a review); it is still to be answered.
    from qstore.server._waiting import Waiter, WaitingPops

    waiting = WaitingPops(10)
    conn = object()
    w = Waiter(conn, 7, "pop", {"queue": "q"}, "q")
    waiting.park(w)
    w.busy = w.expired = w.final = True
    assert waiting.find(conn, 7) is w
    w.done = True
    assert waiting.find(conn, 7) is None


def test_the_handshake_names_every_operation_the_server_takes(server: ServerProcess) -> None:
    # Protocol version 1 gained ops over time; a client could not tell which a
    # server takes (a cross-version audit). Each op named is one it knows.
    s = raw_socket(server.address)
    try:
        s.sendall(frame({"qstore": 1}))
        (hello,) = read_frames(s, 1)
        ops = hello["ops"]
        assert ops == sorted(ops) and {"cancel", "check", "backfill", "pop", "ping"} <= set(ops)
        tried = [op for op in ops if op != "backfill"]  # (no Spark run in this test)
        s.sendall(b"".join(frame([i + 1, op, {}]) for i, op in enumerate(tried)))
        answers = read_frames(s, len(tried))
        s.sendall(frame([len(tried) + 1, "made-up", {}]))
        (unknown,) = read_frames(s, 1)
    finally:
        s.close()
    assert [a for a in answers if a[1] == 1 and "unknown operation" in a[2][1]] == []
    assert unknown[1] == 1 and "unknown operation" in unknown[2][1]
