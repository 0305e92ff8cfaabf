"""Parked pops wake when a delayed message or an expired lease becomes ready.

The store's sweeper is set to a minute here, so a waiter that got its message
within the test's bounds was woken by the server's due-time timer, not by a
sweeper pass. The server runs in this process (its loop in a thread) so the
store can be opened with that sweep interval.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import qstore
import qstore.aio
from qstore import _store
from qstore.server import _ops, _server

from ..conftest import FakeClock, wait_blocks
from ._support import frame, frames_until_closed, raw_socket, read_frames, serving, serving_in

SWEEP = 60.0  # seconds: far beyond every wait below


def test_a_parked_pop_wakes_when_a_delay_runs_out_not_at_the_sweep(tmp_path: Any) -> None:
    with serving(str(tmp_path / "s"), sweep_interval=SWEEP) as address, \
            qstore.connect(address) as client:
        q = client.create_queue("d")
        q.push(b"later", delay=0.3)
        started = time.monotonic()
        got = q.pop(wait=SWEEP / 2)  # the sweeper would promote it only after SWEEP
        waited = time.monotonic() - started
        assert got is not None and got.payload == b"later"
        assert 0.25 <= waited < SWEEP / 4


def test_a_delayed_push_after_the_pop_parked_moves_the_wake_up(tmp_path: Any) -> None:
    async def main(address: str) -> tuple[qstore.Message | None, float]:
        async with qstore.aio.connect(address) as a, qstore.aio.connect(address) as b:
            qa = await a.create_queue("d2")
            qb = await b.queue("d2")
            started = time.monotonic()
            waiter = asyncio.ensure_future(qa.pop(wait=SWEEP / 2))
            await a.ping()  # answered after the pop before it on this connection parked
            await qb.push(b"soon", delay=0.2)  # parked before this push: its timer must move
            got = await asyncio.wait_for(waiter, SWEEP)
            return got, time.monotonic() - started

    with serving(str(tmp_path / "s"), sweep_interval=SWEEP) as address:
        got, waited = asyncio.run(main(address))
    assert got is not None and got.payload == b"soon"
    assert waited < SWEEP / 4


def test_a_parked_pop_gets_a_message_whose_lease_ran_out(tmp_path: Any) -> None:
    with serving(str(tmp_path / "s"), sweep_interval=SWEEP) as address, \
            qstore.connect(address, keep_leases=True) as holder, \
            qstore.connect(address) as waiter:
        q = holder.create_queue("l")
        q.push(b"job")
        first = q.pop(lease=0.3)
        assert first is not None
        started = time.monotonic()
        again = waiter.queue("l").pop(wait=SWEEP / 2)
        assert again is not None and again.id == first.id and again.attempts == 2
        assert time.monotonic() - started < SWEEP / 4


# -- a clock injected into the store decides a parked pop's wait, as an embedded one's


@contextmanager
def _autojump_queue(tmp_path: Any) -> Iterator[tuple[Any, FakeClock, float]]:
    """A queue of an in-process server whose store has an autojump clock; the clock
    and the time it read at the start."""
    clock = FakeClock(autojump=True)
    start = clock.now
    with serving(str(tmp_path / "s"), sweep_interval=SWEEP, clock=clock) as address, \
            qstore.connect(address) as client:
        yield client.create_queue("q"), clock, start


def test_an_autojump_clock_ends_a_parked_pop_at_once_at_its_deadline(tmp_path: Any) -> None:
    with _autojump_queue(tmp_path) as (q, clock, start):
        assert q.pop(wait=30.0) is None  # no real wait: the clock jumped to the deadline
        assert clock.now == start + 30.0
        assert q.pop_many(5, wait=45.0) == []
        assert clock.now == start + 75.0


def test_an_autojump_clock_jumps_to_a_due_message_before_the_deadline(tmp_path: Any) -> None:
    with _autojump_queue(tmp_path) as (q, clock, start):
        q.push(b"in five seconds", delay=5.0)
        got = q.pop(wait=30.0)
        assert got is not None and got.payload == b"in five seconds"
        assert clock.now == start + 5.0  # not the deadline: the message came first


def test_an_autojump_clock_jumps_to_the_next_rate_token(tmp_path: Any) -> None:
    # The due time was now + wait_time(now), which can fall a rounding error short
    # of a whole token: the clock jumped there, the retry found no token, and the
    # pop stayed parked for good on a clock that no longer moved (features audit).
    clock = FakeClock(autojump=True)
    start = clock.now
    with serving(str(tmp_path / "s"), sweep_interval=SWEEP, clock=clock) as address, \
            qstore.connect(address) as client:
        q = client.create_queue("r", rate=(3, 1.0))
        q.push_many([b"m%d" % i for i in range(5)])
        assert len(q.pop_many(5)) == 3  # the bucket's three tokens
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append(q.pop(wait=5.0)), daemon=True)
        waiter.start()
        waiter.join(30)
        assert not waiter.is_alive(), "the pop never got its token"
        assert got[0] is not None and got[0].payload == b"m3"
        assert 1 / 3 <= clock.now - start < 1 / 3 + 1e-3  # the token's time, not the deadline


def _waiting_pop(address: str, queue: str, wait: float) -> tuple[threading.Thread, list[Any]]:
    """A ``pop(wait=...)`` on a connection of its own, in a thread; the list gets
    what it returned, or the qstore error it raised."""
    got: list[Any] = []

    def pop() -> None:
        with qstore.connect(address) as other:
            try:
                got.append(other.queue(queue).pop(wait=wait))
            except qstore.QStoreError as exc:
                got.append(exc)

    waiter = threading.Thread(target=pop, daemon=True)
    waiter.start()
    return waiter, got


def test_a_parked_pop_ends_when_a_hand_moved_clock_passes_its_deadline(
        tmp_path: Any) -> None:
    clock = FakeClock()
    with serving(str(tmp_path / "s"), sweep_interval=SWEEP, clock=clock) as address, \
            qstore.connect(address) as client:
        client.create_queue("empty")
        waiter, got = _waiting_pop(address, "empty", 10.0)
        wait_blocks(clock, 1)  # parked: the server asked the clock how long to wait
        clock.advance(9.0)
        # A request after the move is answered only once the move was handled
        # (one loop): the pop is still parked, its deadline not reached.
        client.ping()
        assert waiter.is_alive() and got == []
        clock.advance(2.0)
        waiter.join(30)
        assert not waiter.is_alive() and got == [None]


@pytest.mark.parametrize("durability", ["interval", "always"])  # on the loop; store thread
def test_a_parked_pop_whose_deadline_passes_as_its_message_falls_due_gets_it(
        tmp_path: Any, durability: str) -> None:
    # The server answered a waiter whose time ran out empty without looking again,
    # where the embedded pop makes one last attempt: with the wall clock stepping
    # forward past a delay, a pop(wait=3) came back None with the message ready
    # (a time audit; here the store's clock moves by hand, past both at once).
    clock = FakeClock()
    with serving(str(tmp_path / "s"), sweep_interval=SWEEP, clock=clock,
                 durability=durability) as address, qstore.connect(address) as client:
        client.create_queue("d").push(b"tomorrow", delay=86_400.0)
        waiter, got = _waiting_pop(address, "d", 10.0)
        wait_blocks(clock, 1)  # parked
        clock.advance(86_400.0)
        waiter.join(30)
        assert not waiter.is_alive()
        assert got[0] is not None and got[0].payload == b"tomorrow" and got[0].attempts == 1


def test_a_parked_pop_raises_queue_not_found_when_its_queue_is_deleted(
        tmp_path: Any) -> None:
    clock = FakeClock()  # never moved: only the delete can end the wait
    with serving(str(tmp_path / "s"), sweep_interval=SWEEP, clock=clock) as address, \
            qstore.connect(address) as client:
        client.create_queue("d")
        waiter, got = _waiting_pop(address, "d", 10.0)
        wait_blocks(clock, 1)  # parked
        client.delete_queue("d")
        waiter.join(30)
        assert not waiter.is_alive() and isinstance(got[0], qstore.QueueNotFound)


def test_a_push_tries_only_the_pops_waiting_on_its_queue(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every commit that added ready keys woke a retry round over every parked pop
    # of every queue: with 10,000 parked on one queue, a push to another took
    # 3.5 ms (resource audit). And a round took a whole line, however long.
    tries: list[str] = []
    real = _server.queue_op

    def counted(store: Any, leases: Any, op: str, args: dict[str, Any], **kw: Any) -> Any:
        if kw.get("parked"):
            tries.append(args["queue"])
        return real(store, leases, op, args, **kw)

    monkeypatch.setattr(_server, "queue_op", counted)

    async def main(address: str) -> None:
        async with qstore.aio.connect(address) as client:
            empty, many = await client.create_queue("empty"), await client.create_queue("many")
            await client.create_queue("busy")
            idle = [asyncio.ensure_future(empty.pop(wait=SWEEP)) for _ in range(200)]
            waiting = [asyncio.ensure_future(many.pop(wait=SWEEP)) for _ in range(100)]
            for _ in range(3):  # every pop before it is parked, the rounds parking
                await client.ping()  # them woke have run
            tries.clear()
            with qstore.connect(address) as other:  # another connection pushes
                for i in range(50):
                    other.queue("busy").push(b"%d" % i)
                assert tries == []  # no parked pop was tried for them
                other.queue("many").push_many([b"%d" % i for i in range(80)])
            got = await asyncio.gather(*waiting[:80])  # served in the order they came
            assert [m.payload for m in got] == [b"%d" % i for i in range(80)]
            await client.ping()
            assert not any(t.done() for t in waiting[80:] + idle)
            # Rounds of at most ROUND_MAX waiters: a line longer than that is tried in
            # turns, never all at once.
            assert tries.count("many") <= 80 + 2 * 64 and "empty" not in tries
            for t in idle + waiting[80:]:
                t.cancel()
            await asyncio.gather(*idle, *waiting[80:], return_exceptions=True)

    with serving(str(tmp_path / "s")) as address:
        asyncio.run(main(address))


def test_a_request_looks_only_at_the_due_times_of_the_queues_it_names(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # After every request the server looked for the next due time of every queue
    # with a parked pop: 5,000 queues with one each made other clients' pushes 12
    # times slower and parking them took 0.8 s (a security audit).
    looked: list[int] = []
    real = _server.Server._arm_due

    def counted(self: _server.Server, queues: Any = None) -> None:
        names = list(self._waiting.lines) if queues is None else list(queues)
        looked.append(sum(1 for n in names if n in self._waiting.lines))
        real(self, queues)

    monkeypatch.setattr(_server.Server, "_arm_due", counted)

    async def main(address: str) -> None:
        async with qstore.aio.connect(address) as client:
            queues = [await client.create_queue(f"w{i}") for i in range(300)]
            await client.create_queue("busy")
            parked = [asyncio.ensure_future(q.pop(wait=SWEEP)) for q in queues]
            for _ in range(3):
                await client.ping()
            looked.clear()
            with qstore.connect(address) as other:
                for i in range(100):
                    other.queue("busy").push(b"%d" % i, delay=SWEEP)
            assert sum(looked) == 0  # none of them names a queue with a parked pop
            with qstore.connect(address) as other:
                other.queue("w7").push(b"for w7")
            got = await parked[7]
            assert got is not None and got.payload == b"for w7"
            # Nor does the retry round that delivered it: it looked at every queue
            # with a parked pop after each delivery (1.4 ms a push at 16,000 such
            # queues; a scale audit).
            await client.ping()
            assert sum(looked) <= 3, looked
            for t in parked:
                t.cancel()
            await asyncio.gather(*parked, return_exceptions=True)

    with serving(str(tmp_path / "s")) as address:
        asyncio.run(main(address))


def held_check(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make ``Store.check`` hold the writer lock until the second event is set (the
    first is set once it holds it): a check of a big store, on demand."""
    in_check, release = threading.Event(), threading.Event()
    real_check = _store.Store.check

    def long_check(self: Any, *, repair: bool = False) -> Any:
        with self.core.lock:
            in_check.set()
            assert release.wait(60)
        return real_check(self, repair=repair)

    monkeypatch.setattr(_store.Store, "check", long_check)
    return in_check, release


def push_started(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event the server sets when it starts a push (which then waits for the
    writer lock, while a check holds it)."""
    pushing = threading.Event()
    real_op = _server.queue_op

    def noticed(store: Any, leases: Any, op: str, args: dict[str, Any], **kw: Any) -> Any:
        if op == "push":
            pushing.set()
        return real_op(store, leases, op, args, **kw)

    monkeypatch.setattr(_server, "queue_op", noticed)
    return pushing


def test_a_check_holding_the_writer_lock_leaves_the_event_loop_to_others(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # check() holds the writer lock throughout (about 15 s a million messages). A
    # request run inline on the event loop (durability interval) then waited for
    # the lock there, so no other client got even a ping answered until the check
    # ended (a security audit: 2.2 s stalls in a 2.7 s check).
    in_check, release = held_check(monkeypatch)
    pushing = push_started(monkeypatch)
    with serving(str(tmp_path / "s")) as address, qstore.connect(address) as a, \
            qstore.connect(address) as b:
        q = b.create_queue("q")
        reports: list[Any] = []
        checker = threading.Thread(target=lambda: reports.append(a.check()))
        checker.start()
        assert in_check.wait(30)
        ids: list[int] = []
        pusher = threading.Thread(target=lambda: ids.append(q.push(b"x")))
        pusher.start()
        assert pushing.wait(30)  # the push is running, waiting for the lock
        with qstore.connect(address, timeout=5.0) as c:  # ConnectionLost before
            c.ping()  # (its other requests wait, in order, behind the lock)
        release.set()
        checker.join(30)
        pusher.join(30)
        assert reports and reports[0].ok and ids == [1]
        with qstore.connect(address) as c:
            assert c.queue("q").stats().ready == 1


@pytest.mark.parametrize("durability", ["interval", "always"])
def test_a_parked_pop_ends_at_its_deadline_while_a_check_holds_the_store(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, durability: str) -> None:
    # The last try of a pop whose wait ran out queued behind another client's
    # check: the answer came when the check ended, past the client's timeout,
    # which dropped its connection and every lease on it (a review). Behind a
    # held writer lock it is answered empty at its deadline, as before; also
    # with another client's push waiting for the lock meanwhile (the try queued
    # behind it: a second review).
    in_check, release = held_check(monkeypatch)
    pushing = push_started(monkeypatch)

    async def main(address: str) -> tuple[Any, bool]:
        async with qstore.aio.connect(address) as b:
            q = await b.create_queue("w")
            await b.create_queue("other")
            waiter = asyncio.ensure_future(q.pop(wait=1.0))
            await b.ping()  # answered once the pop before it parked
            with qstore.connect(address) as a, qstore.connect(address) as c:
                checker = threading.Thread(target=a.check)
                checker.start()
                assert in_check.wait(30)
                pusher = threading.Thread(target=lambda: c.queue("other").push(b"x"))
                pusher.start()
                assert pushing.wait(30)
                got = await asyncio.wait_for(waiter, 10)  # before: only after release
                still = checker.is_alive()  # the check holds the store all along
                release.set()
                checker.join(30)
                pusher.join(30)
            return got, still

    with serving(str(tmp_path / "s"), durability=durability) as address:
        got, still = asyncio.run(main(address))
    assert got is None and still


@pytest.mark.parametrize("durability", ["interval", "always"])
def test_shutdown_answers_a_pop_that_parks_after_it_began(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, durability: str) -> None:
    # A pop(wait) read before SIGTERM but held behind its connection's check parked
    # after shutdown had answered the parked pops: nobody answered it, and its
    # client got ConnectionLost (a review; docs/server.md "Shutdown").
    in_check, release = held_check(monkeypatch)
    with serving_in(str(tmp_path / "s"), durability=durability) as (server, loop):
        with qstore.connect(server.listening_on) as c:
            c.create_queue("e")
        s = raw_socket(server.listening_on)
        s.sendall(frame({"qstore": 1}))
        read_frames(s, 1)
        s.sendall(frame([2, "check", {}])
                  + frame([3, "pop", {"queue": "e", "lease": 30.0, "wait": 30.0}]))
        assert in_check.wait(30)

        async def stop() -> None:
            stopping = asyncio.ensure_future(server.shutdown())
            await asyncio.sleep(0)  # shutdown runs up to its first wait
            release.set()  # the check ends; the pop behind it runs, finds nothing, parks
            await stopping

        asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
        answers = frames_until_closed(s)
        s.close()
    assert [(a[0], a[1]) for a in answers] == [(2, 0), (3, 0)]
    assert answers[1][2] is None  # the pop: nothing, at once


def test_a_message_a_try_leases_for_a_closed_connection_goes_back(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A retry round (or a last try) still running in the store thread when its
    # waiter's connection closed leased the message into that connection's lease
    # table after the connection had given back its leases: it stayed in flight
    # for its whole lease with no client holding it (a stress test). Only in
    # "always" mode: otherwise a try runs on the event loop, which closes nothing
    # meanwhile.
    in_try, go, released = threading.Event(), threading.Event(), threading.Event()
    real_op = _server.queue_op

    def held_try(store: Any, leases: Any, op: str, args: dict[str, Any], **kw: Any) -> Any:
        if kw.get("parked") and store.core.queues["q"].counts[0]:  # a ready message
            in_try.set()
            assert go.wait(30)  # until the waiting connection has ended
        return real_op(store, leases, op, args, **kw)

    real_forget = _ops.Leases.forget

    def forget(self: Any) -> None:
        real_forget(self)
        released.set()  # the closed connection's leases are given back: none held

    monkeypatch.setattr(_server, "queue_op", held_try)
    monkeypatch.setattr(_ops.Leases, "forget", forget)
    with serving(str(tmp_path / "s"), durability="always") as address, \
            qstore.connect(address) as client:
        q = client.create_queue("q")
        s = raw_socket(address)
        s.sendall(frame({"qstore": 1}))
        read_frames(s, 1)
        s.sendall(frame([1, "pop", {"queue": "q", "lease": 600.0, "wait": 30.0}]))
        client.ping()  # (its request came after the pop's, on another connection)
        pusher = threading.Thread(target=lambda: q.push(b"x"))
        pusher.start()  # its ready signal starts a round for the parked pop
        assert in_try.wait(30)
        s.close()
        assert released.wait(30)
        go.set()
        pusher.join(30)
        for _ in range(200):  # the give-back is a store call after the round's answer
            st = q.stats()
            if st.in_flight == 0:
                break
        assert (st.ready, st.in_flight) == (1, 0)


@pytest.mark.parametrize("durability", ["interval", "always"])
def test_a_pop_whose_round_waits_behind_a_check_is_answered_at_its_deadline(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, durability: str) -> None:
    # A message fell due while a check held the store: the retry round for the
    # parked pop waited for the check's lock, and the pop, busy in that round,
    # was answered only when the check ended, past its client's timeout (a stress
    # test). It is answered empty at its deadline; the message the round then
    # gets goes back.
    in_check, release = held_check(monkeypatch)

    async def main(address: str) -> tuple[Any, bool]:
        async with qstore.aio.connect(address) as b:
            q = await b.create_queue("w")
            waiter = asyncio.ensure_future(q.pop(wait=1.0))
            await b.ping()  # parked
            await q.push(b"soon", delay=0.3)  # due while the check holds the store
            with qstore.connect(address) as a:
                checker = threading.Thread(target=a.check)
                checker.start()
                assert in_check.wait(30)
                got = await asyncio.wait_for(waiter, 10)
                still = checker.is_alive()
                release.set()
                checker.join(30)
            return got, still

    with serving(str(tmp_path / "s"), durability=durability) as address:
        got, still = asyncio.run(main(address))
        with qstore.connect(address) as c:
            for _ in range(200):  # the give-back is a store call after the round
                st = c.queue("w").stats()
                if st.in_flight == 0:
                    break
    assert got is None and still
    assert (st.ready, st.in_flight) == (1, 0)


@pytest.mark.parametrize("new_rate", [None, (1000, 1.0)])
def test_lifting_a_rate_limit_wakes_a_parked_pop_waiting_for_a_token(
        tmp_path: Any, new_rate: Any) -> None:
    # With rate=None the parked pop slept out its wait with the message ready and
    # no longer limited (a configuration audit): its timer was set for the old
    # bucket's next token, an hour away.
    async def main(address: str) -> qstore.Message | None:
        async with qstore.aio.connect(address) as a, qstore.aio.connect(address) as b:
            qa = await a.create_queue("r", rate=(1, 3600.0))
            await qa.push_many([b"a", b"b"])
            assert await qa.pop() is not None  # the only token for an hour
            waiter = asyncio.ensure_future(qa.pop(wait=SWEEP / 2))
            await a.ping()  # answered after the pop before it on this connection parked
            await b.configure_queue("r", rate=new_rate)
            return await asyncio.wait_for(waiter, SWEEP)

    with serving(str(tmp_path / "s"), sweep_interval=SWEEP) as address:
        got = asyncio.run(main(address))
    assert got is not None and got.payload == b"b"
