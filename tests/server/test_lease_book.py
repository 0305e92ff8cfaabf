"""The server's book of leases held by connections (qstore/server/_ops.py), in process."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

import qstore
from qstore.server import _ops
from qstore.server._conn import Connection
from qstore.server._ops import LeaseBook, Leases, queue_op
from qstore.server._waiting import Waiter, WaitingPops

from ..conftest import FakeClock
from ._support import serving


def test_a_message_delivered_again_voids_its_earlier_receipt(tmp_path: Any) -> None:
    clock = FakeClock()
    with qstore.open(str(tmp_path / "s"), clock=clock) as store:
        store.create_queue("q").push(b"x")
        book = LeaseBook()
        first, second = Leases(book), Leases(book)
        old = queue_op(store, first, "pop", {"queue": "q", "lease": 10.0})
        assert list(first.held) == [old[7]]
        clock.advance(11.0)  # the lease runs out; another connection gets it again
        new = queue_op(store, second, "pop", {"queue": "q", "lease": 10.0})
        assert new[0] == old[0] and new[7] != old[7]
        assert first.held == {} and list(second.held) == [new[7]]
        assert book.owner == {new[7]: second} and book.latest == {("q", old[0]): new[7]}
        queue_op(store, first, "ack", {"queue": "q", "receipt": new[7]})  # through another
        assert second.held == {} and book.owner == {} and book.latest == {}


def test_a_purge_or_delete_drops_the_receipts_of_its_queue(tmp_path: Any) -> None:
    # They could never be settled, and stayed until their leases ran out: an hour's
    # worth of pops from short-lived queues on one connection (a resource audit).
    with qstore.open(str(tmp_path / "s")) as store:
        book = LeaseBook()
        conn = Leases(book)
        for name in ("gone", "purged", "kept"):
            store.create_queue(name).push_many([b"a", b"b", b"c"])
            queue_op(store, conn, "pop_many", {"queue": name, "n": 3, "lease": 3600.0})
        assert len(conn.held) == len(book.owner) == len(book.latest) == 9
        _ops.store_op(store, "delete_queue", {"name": "gone"}, book)
        queue_op(store, conn, "purge", {"queue": "purged"})
        assert {q for q, _, _ in conn.held.values()} == {"kept"} and len(book.owner) == 3
        assert {q for q, _ in book.latest} == {"kept"}
        store.create_queue("gone").push(b"new")  # the name again: a queue of its own
        new = queue_op(store, conn, "pop", {"queue": "gone"})
        assert book.latest[("gone", new[0])] == new[7]


def test_release_gives_back_in_slices_and_forget_nacks_nothing(tmp_path: Any) -> None:
    with qstore.open(str(tmp_path / "s")) as store:
        store.create_queue("q").push_many([b"%d" % i for i in range(7)])
        book = LeaseBook()
        mine, kept = Leases(book), Leases(book)
        queue_op(store, mine, "pop_many", {"queue": "q", "n": 5})
        queue_op(store, kept, "pop_many", {"queue": "q", "n": 2})
        assert mine.release(store, 3) == 3 and len(mine.held) == 2
        assert store.queue("q").stats().ready == 3
        assert mine.release(store, 3) == 2 and mine.held == {}
        kept.forget()
        assert kept.held == {} and book.owner == {} and book.latest == {}
        stats = store.queue("q").stats()
        assert (stats.ready, stats.in_flight) == (5, 2)  # forgotten, still leased


def test_release_goes_on_past_a_lease_whose_queue_name_was_reused(tmp_path: Any) -> None:
    # Queue "a" deleted and created again: its old receipt is "of another queue"
    # (InvalidArgument), which stopped the release, so the connection's lease in
    # queue "b" stayed in flight until its deadline instead of going back.
    with qstore.open(str(tmp_path / "s")) as store:
        store.create_queue("a").push(b"a")
        store.create_queue("b").push(b"b")
        mine = Leases(LeaseBook())
        queue_op(store, mine, "pop", {"queue": "a", "lease": 300.0})
        queue_op(store, mine, "pop", {"queue": "b", "lease": 300.0})
        store.delete_queue("a")
        store.create_queue("a")
        assert mine.release(store, 10) == 2 and mine.held == {}
        stats = store.queue("b").stats()
        assert (stats.ready, stats.in_flight) == (1, 0)


def test_receipts_whose_lease_ran_out_unsettled_are_dropped_once_the_book_doubles(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # max_attempts=1: a lease that runs out makes a dead letter, which no
    # settle and no later delivery ever takes off the book. Without the sweep
    # the book grows by every such message for as long as the connection lives.
    monkeypatch.setattr(_ops, "SWEEP_MIN", 8)
    clock = FakeClock()
    with qstore.open(str(tmp_path / "s"), clock=clock) as store:
        q = store.create_queue("q", max_attempts=1)
        book = LeaseBook(clock)
        book.sweep_above = _ops.SWEEP_MIN
        stuck, worker = Leases(book), Leases(book)
        kept = None
        sizes = []
        for i in range(40):
            q.push_many([b"%d" % i] * 5)
            got = queue_op(store, stuck, "pop_many", {"queue": "q", "n": 5, "lease": 10.0})
            if i == 0:  # one lease extended far ahead: live, so never dropped
                kept = got[0][7]
                queue_op(store, worker, "extend", {"queue": "q", "receipt": kept,
                                                   "lease": 10_000.0})
            clock.advance(11.0)  # the others run out, unsettled
            sizes.append(len(book.owner))
        assert q.stats().dead == 39 * 5 + 4  # every lease ran out but the extended one
        assert max(sizes) <= 2 * 9 + 5  # bounded: at most about twice the sweep's floor
        assert kept in book.owner and kept in stuck.held
        live = queue_op(store, worker, "pop_many", {"queue": "q", "n": 5})  # nothing ready
        assert live == []
        before = len(book.owner)
        assert before > 1
        assert book.sweep() == before - 1  # all but the extended one had expired
        assert list(book.owner) == [kept] and list(book.latest.values()) == [kept]


def test_a_connection_reports_its_loss_once_however_it_ends() -> None:
    # The transport's connection_lost and a later close() (an error frame for a
    # connection already gone) each told the server, which started a second
    # release of the same leases racing the first.
    class Owner:
        def __init__(self) -> None:
            self.lost_calls = 0

        def lost(self, conn: Connection) -> None:
            self.lost_calls += 1

    for first_close in (True, False):
        owner = Owner()
        conn = Connection(owner, 1 << 20, LeaseBook())  # type: ignore[arg-type]
        if first_close:
            conn.close()
            conn.connection_lost(None)
        else:
            conn.connection_lost(None)
            conn.close()
        conn.close()
        assert owner.lost_calls == 1


def test_parked_pops_are_found_by_connection_without_walking_every_line() -> None:
    # A cancel or a closed connection looked for its waiters through every line
    # (1,000 cancels among 10,000 waiters took 0.23 s; a security audit). Each
    # connection's waiters are kept apart now; a request id a client reused
    # must not hide one of them (a closed connection must find every one).
    a, b = object(), object()
    pops = WaitingPops(100)
    mine = [Waiter(a, 1, "pop", {}, "x"), Waiter(a, 1, "pop", {}, "y"),
            Waiter(a, 2, "pop", {}, "x")]
    theirs = [Waiter(b, 1, "pop", {}, "x"), Waiter(b, 5, "pop", {}, "y")]
    for w in (mine[0], theirs[0], mine[1], theirs[1], mine[2]):
        pops.park(w)
    assert pops.of(a) == mine and pops.of(b) == theirs
    assert pops.find(a, 1) is mine[0] and pops.find(b, 5) is theirs[1]
    assert pops.find(a, 5) is None
    mine[0].done = True
    assert pops.find(a, 1) is mine[1]
    pops.remove(mine[0])
    pops.remove(mine[1])
    assert pops.of(a) == [mine[2]] and pops.count == 3
    assert [w for line in pops.lines.values() for w in line] == [theirs[0], mine[2],
                                                                  theirs[1]]
    for w in (mine[2], *theirs):
        pops.remove(w)
    assert pops.of(a) == pops.of(b) == [] and pops.lines == {} and pops.count == 0


def test_removing_parked_pops_in_any_order_keeps_lines_short_and_in_order() -> None:
    # A removal walked its line (deque.remove), and a cancel walked its
    # connection's waiters: 10,000 parked pops cancelled newest first held the
    # event loop 1.2 s (a scale audit). Removal now marks the waiter gone and
    # drops it when it reaches the front, or rebuilds a line more than half gone.
    conn = object()
    pops = WaitingPops(100_000)
    ws = [Waiter(conn, i, "pop", {}, "q") for i in range(5_000)]
    for w in ws:
        pops.park(w)
    rng = __import__("random").Random(3)
    order = list(range(5_000))
    rng.shuffle(order)
    removed: set[int] = set()
    for k, i in enumerate(order[:4_000]):
        assert pops.find(conn, i) is ws[i]
        pops.remove(ws[i])
        pops.remove(ws[i])  # twice: nothing more
        removed.add(i)
        assert pops.find(conn, i) is None
        left = 5_000 - k - 1
        assert pops.count == left and len(pops.lines["q"]) <= 2 * left + 16
    live = [w.rid for w in ws if w.rid not in removed]
    assert [w.rid for w in pops.live("q")] == live
    assert [w.rid for w in pops.waiting()] == live
    taken, more = pops.round(None)
    assert [w.rid for w in taken] == live[:64] and more == {"q"}
    for i in order[4_000:]:
        pops.remove(ws[i])
    assert pops.lines == {} and pops.count == 0 and pops.of(conn) == []


def test_the_leases_held_gauge_counts_only_leases_not_run_out(tmp_path: Any) -> None:
    # The book keeps a run-out receipt until its next sweep; the gauge counted
    # them: 300 leases "held" for messages ready again (an observability audit).
    clock = FakeClock()
    with qstore.open(str(tmp_path / "s"), clock=clock) as store:
        store.create_queue("q").push_many([b"%d" % i for i in range(5)])
        book = LeaseBook(clock)
        conn = Leases(book)
        queue_op(store, conn, "pop_many", {"queue": "q", "n": 3, "lease": 1.0})
        long = queue_op(store, conn, "pop", {"queue": "q", "lease": 10.0})
        assert book.live() == 4
        clock.advance(2.0)
        assert book.live() == 1 and len(book.owner) == 4  # kept, not counted
        queue_op(store, conn, "extend", {"queue": "q", "receipt": long[7], "lease": 30.0})
        clock.advance(15.0)
        assert book.live() == 1  # extended past the advance
        queue_op(store, conn, "ack", {"queue": "q", "receipt": long[7]})
        assert book.live() == 0


def test_a_closed_connections_leases_given_back_are_logged_dead_letters_as_a_warning(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    # A message on its last attempt that a dead consumer held goes to the dead
    # letters when its lease is given back: that used to happen with no word
    # anywhere (an observability audit).
    said = threading.Event()

    class Told(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "leases of a closed connection" in record.getMessage():
                said.set()

    told = Told()
    server_log = logging.getLogger("qstore.server")
    server_log.addHandler(told)
    caplog.set_level(logging.INFO, "qstore.server")
    try:
        with serving(str(tmp_path / "s")) as address, qstore.connect(address) as watcher:
            watcher.create_queue("last", max_attempts=1).push(b"a")
            watcher.create_queue("more", max_attempts=5).push(b"b")
            with qstore.connect(address) as consumer:
                assert consumer.queue("last").pop(lease=3600.0) is not None
                assert consumer.queue("more").pop(lease=3600.0) is not None
            assert said.wait(30)
            assert watcher.queue("last").stats().dead == 1
            assert watcher.queue("more").stats().ready == 1
    finally:
        server_log.removeHandler(told)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records
             if "leases of a closed connection" in r.getMessage()]
    assert lines == [(logging.WARNING, "leases of a closed connection given back: 1 ready "
                      "again, 1 moved to the dead letters (that was their last attempt)")]


def test_giving_back_leases_reads_no_body_to_tell_dead_letters(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # It asked get(), which copied each whole body to learn its state: 50 times
    # slower for 16 MiB messages, on the event loop (a review).
    with qstore.open(str(tmp_path / "s")) as store:
        store.create_queue("last", max_attempts=1).push(b"a" * 1000)
        store.create_queue("more", max_attempts=5).push(b"b" * 1000)
        leases = Leases(LeaseBook())
        got = [queue_op(store, leases, "pop", {"queue": name, "lease": 600.0})
               for name in ("last", "more")]

        def no_body(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("a body was read")

        monkeypatch.setattr(qstore.Queue, "get", no_body)
        assert leases.give_back(store, [m[7] for m in got]) == (2, 1)
        monkeypatch.undo()
        assert store.queue("last").stats().dead == 1
        assert store.queue("more").stats().ready == 1
