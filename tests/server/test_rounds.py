"""Pops and acks that arrive together run as one batch and answer as if run alone."""

from __future__ import annotations

import asyncio

import pytest

import qstore
import qstore.aio

from ._support import ServerProcess


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
