"""The sync client's pipeline: many requests in one write, results in call order."""

from __future__ import annotations

from typing import Any

import pytest

import qstore

from ._support import ServerProcess, frame, raw_socket, read_frames, running


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


def test_a_pipelined_queue_refuses_len_and_its_options_clearly(server: ServerProcess) -> None:
    # len() recorded a stats call and failed on its None; .order was a bare
    # AttributeError about a private class (an API audit).
    with qstore.connect(server.address) as client:
        client.create_queue("p")
        pipe = client.pipeline()
        q = pipe.queue("p")
        with pytest.raises(TypeError, match="in a pipeline"):
            len(q)
        with pytest.raises(AttributeError, match="only records calls"):
            q.order  # noqa: B018
        assert len(pipe) == 0
        q.push(b"x")
        assert pipe.execute() == [1]


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


@pytest.mark.parametrize("durability", ["interval", "always"])
def test_requests_after_a_snapshot_wait_for_it_and_answer_after_it(
        tmp_path: Any, durability: str) -> None:
    """compact, snapshot and check run in a thread; the connection's later
    requests still take effect, and are answered, after them."""
    path, dest = str(tmp_path / "s"), str(tmp_path / "snap")
    with running(path, "--durability", durability) as srv:
        with qstore.connect(srv.address) as client:
            client.create_queue("q")
        s = raw_socket(srv.address)
        try:
            s.sendall(frame({"qstore": 1}))
            assert isinstance(read_frames(s, 1)[0], dict)
            s.sendall(b"".join([
                frame([10, "push", {"queue": "q", "payload": b"before"}]),
                frame([11, "snapshot", {"dest": dest}]),
                frame([12, "push", {"queue": "q", "payload": b"after"}]),
                frame([13, "check", {}]),
                frame([14, "push", {"queue": "q", "payload": b"last"}]),
                frame([15, "ping", {}]),
            ]))
            got = read_frames(s, 6)
        finally:
            s.close()
        assert [a[0] for a in got] == [10, 11, 12, 13, 14, 15]
        assert all(a[1] == 0 for a in got), got
    with qstore.open(dest, readonly=True) as snap:
        assert [m.payload for m in snap.queue("q").peek(10)] == [b"before"]


def test_unknown_arguments_are_refused_by_every_op_and_a_bad_handshake_closes(
        server: ServerProcess) -> None:
    with qstore.connect(server.address) as client:
        client.create_queue("q")
    s = raw_socket(server.address)
    try:
        s.sendall(frame({"qstore": 1}))
        read_frames(s, 1)
        s.sendall(b"".join([frame([2, "queue", {"queue": "q", "bogus": 1}]),
                            frame([3, "ping", {"bogus": 1}]),
                            frame([4, "queues", {"bogus": 1}]),
                            frame([5, "ping", {}])]))
        got = read_frames(s, 4)
    finally:
        s.close()
    for answer in got[:3]:
        assert answer[1] == 1 and answer[2][0] == "InvalidArgument", answer  # type: ignore[index]
    assert "bogus" in got[0][2][1]  # type: ignore[index]
    assert got[3] == [5, 0, None]
    s = raw_socket(server.address)
    try:
        s.sendall(frame({"qstore": 1, "keep_leases": "yes"}))
        answer = read_frames(s, 1)[0]
        assert answer[0] == 0 and answer[2][0] == "ProtocolError"  # type: ignore[index]
        assert "keep_leases" in answer[2][1]  # type: ignore[index]
        assert s.recv(1) == b""  # and the connection is closed
    finally:
        s.close()


def test_cancel_withdraws_a_waiting_pop_of_its_own_connection_only(
        server: ServerProcess) -> None:
    with qstore.connect(server.address) as client:
        client.create_queue("w")
        s, other = raw_socket(server.address), raw_socket(server.address)
        try:
            for conn in (s, other):
                conn.sendall(frame({"qstore": 1}))
                assert isinstance(read_frames(conn, 1)[0], dict)
            s.sendall(frame([1, "pop", {"queue": "w", "wait": 60.0}]))
            other.sendall(frame([1, "cancel", {"request": 1}]))  # not its request
            assert read_frames(other, 1) == [[1, 0, False]]
            s.sendall(frame([2, "cancel", {"request": 1}]) + frame([3, "cancel", {"request": 1}])
                      + frame([4, "cancel", {"request": "1"}]))
            # The pop is answered empty (before or just after its cancel's answer,
            # when a retry round had it in hand), its cancel true; a second finds
            # nothing.
            got = sorted(read_frames(s, 4), key=lambda a: a[0])
            assert got[:3] == [[1, 0, None], [2, 0, True], [3, 0, False]]
            assert got[3][:2] == [4, 1] and got[3][2][0] == "InvalidArgument"
            client.queue("w").push(b"x")  # no parked pop is left to take it
            assert client.queue("w").stats().ready == 1
        finally:
            s.close()
            other.close()
