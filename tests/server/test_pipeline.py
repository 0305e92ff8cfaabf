"""The sync client's pipeline: many requests in one write, results in call order."""

from __future__ import annotations

import pytest

import qstore

from ._support import ServerProcess


def test_a_pipeline_returns_each_result_as_the_direct_call_would(
        server: ServerProcess) -> None:
    with qstore.connect(server.address) as client:
        client.create_queue("p")
        with client.pipeline() as pipe:
            q = pipe.queue("p")
            assert q.push(b"a", priority=1) is None  # recorded, not run yet
            q.push(b"b", priority=2)
            q.push_many([(b"c", 0)])
            q.pop()
            q.pop()
            q.stats()
            pipe.ping()
            assert len(pipe) == 7
        ids, ids2, ids3, first, second, stats, pong = pipe.results
        assert (ids, ids2, ids3, pong) == (1, 2, [3], None)
        assert isinstance(first, qstore.Message) and first.payload == b"b"
        assert second.payload == b"a" and second.receipt != first.receipt
        assert isinstance(stats, qstore.QueueStats) and stats.in_flight == 2
        acks = client.pipeline()
        for m in (first, second):
            acks.queue("p").ack(m)
        assert acks.execute() == [None, None]
        assert client.queue("p").stats().in_flight == 0


def test_errors_come_back_in_place_or_as_the_first_error_raised(
        server: ServerProcess) -> None:
    with qstore.connect(server.address) as client:
        client.create_queue("e").push(b"x")
        pipe = client.pipeline()
        pipe.queue("e").ack("zz")
        pipe.queue("missing").pop()
        pipe.queue("e").pop()
        got = pipe.execute(raise_errors=False)
        assert isinstance(got[0], qstore.InvalidArgument)
        assert isinstance(got[1], qstore.QueueNotFound)
        assert got[2].payload == b"x"
        pipe.queue("missing").purge()
        pipe.ping()
        with pytest.raises(qstore.QueueNotFound):
            pipe.execute()
        assert pipe.results[1] is None  # the rest still ran and answered
        with pytest.raises(qstore.InvalidArgument):  # cannot be sent: refused when recorded
            pipe.queue("e").push(object())  # type: ignore[arg-type]
        assert len(pipe) == 0
        client.ping()  # the connection is fine


def test_a_thousand_pipelined_pops_and_acks_consume_each_message_once(
        server: ServerProcess) -> None:
    with qstore.connect(server.address) as client:
        q = client.create_queue("m", order="fifo")
        q.push_many([b"%d" % i for i in range(1000)])
        pipe = client.pipeline()
        for _ in range(1000):
            pipe.queue("m").pop()
        popped = pipe.execute()
        assert [m.payload for m in popped] == [b"%d" % i for i in range(1000)]
        for m in popped:
            pipe.queue("m").ack(m)
        assert pipe.execute() == [None] * 1000
        assert q.stats().total == 0


def test_answers_larger_than_the_read_buffer_arrive_whole_between_small_ones(
        server: ServerProcess) -> None:
    # The sync client reads into one reusable 256 KiB buffer: a bigger frame grows
    # it while it is read, small frames before and after share a read with it.
    big = bytes(range(256)) * (3 * 1024 + 7)  # about 769 KiB, no repeating 256 KiB block
    with qstore.connect(server.address) as client:
        q = client.create_queue("big")
        small_id = q.push(b"small")
        big_id = q.push(big)
        with client.pipeline() as pipe:
            p = pipe.queue("big")
            p.get(small_id)
            p.get(big_id)
            p.get(small_id)
            p.get(big_id)
        got = [m.payload for m in pipe.results]
        assert got == [b"small", big, b"small", big]
        assert q.get(big_id).payload == big  # a direct call after the buffer shrank back
        assert q.get(small_id).payload == b"small"
