"""The asyncio client, pipelining, and pops that wait in the server without a thread."""

from __future__ import annotations

import asyncio
import time

import pytest

import qstore
import qstore.aio

from ._support import ServerProcess


def test_aio_client_pipelines_many_tasks_on_one_connection(server: ServerProcess) -> None:
    async def main() -> None:
        async with qstore.aio.connect(server.address) as client:
            q = await client.create_queue("a", order="fifo")
            ids = await asyncio.gather(*(q.push(b"%d" % i) for i in range(200)))
            assert sorted(ids) == list(range(1, 201))
            waiter = asyncio.ensure_future(q.pop(wait=30.0))  # parked: others go on
            got = await q.pop_many(200)
            assert len(got) == 200 and await q.ack_many(got) == 200
            assert not waiter.done()
            await q.push(b"wake")
            msg = await asyncio.wait_for(waiter, 30.0)
            assert msg is not None and msg.payload == b"wake"
            with pytest.raises(qstore.QueueNotFound):
                await client.queue("missing")
            assert (await q.stats()).in_flight == 1
    asyncio.run(main())


def test_a_waiting_pop_wakes_on_a_push_from_another_client(server: ServerProcess) -> None:
    async def main() -> float:
        async with qstore.aio.connect(server.address) as a, \
                qstore.aio.connect(server.address) as b:
            qa = await a.create_queue("w")
            qb = await b.queue("w")
            started = time.monotonic()
            pops = [asyncio.ensure_future(qa.pop(wait=60.0)) for _ in range(3)]
            await qb.push_many([b"1", b"2", b"3"])
            got = await asyncio.wait_for(asyncio.gather(*pops), 60.0)
            assert sorted(m.payload for m in got if m) == [b"1", b"2", b"3"]
            return time.monotonic() - started
    assert asyncio.run(main()) < 60.0  # woken by the push, not by the end of the wait


def test_a_wait_that_ends_returns_none_and_the_connection_stays(server: ServerProcess) -> None:
    with qstore.connect(server.address) as client:
        q = client.create_queue("e")
        assert q.pop(wait=0.05) is None and q.pop_many(3, wait=0.05) == []
        q.push(b"x")
        assert q.pop().payload == b"x"
