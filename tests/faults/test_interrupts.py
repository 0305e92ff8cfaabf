"""KeyboardInterrupt at every point after a metadata write: memory follows the database.

A write's in-memory changes (counters, heads, segment accounting, the record
cache) follow it in Python, and Ctrl-C (or a signal handler raising) lands at
whatever point runs when it arrives. CPython delivers it where it checks for
signals: at a function's entry and after a call returns (and at loops). Here a
profile hook raises KeyboardInterrupt at the k-th such point of the store's
code after a metadata write, for every k until the operation completes; after
each interrupt the store must be what its database says (``Core.settle``): the
check clean, the in-memory counters and segment accounting equal to the stored
ones, no message handed out twice while its lease runs (every lease outlasts
the test), and the writer lock free.

Not tried: the entry of the writer lock's own ``__enter__``/``__exit__``. A signal
landing exactly there still leaves the lock taken (a window of a few bytecodes
that no Python context manager can close; see docs/faults.md).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

import qstore
from qstore.meta import _db, keys
from tests.queue._support import assert_consistent

_QSTORE = "/qstore/"
LEASE = 3600.0  # no lease ends while a test runs, though one moves the clock
_POINTS = ("call", "return", "c_return")  # where CPython checks for a pending signal


class InterruptAfterWrite:
    """Raise KeyboardInterrupt at the ``k``-th signal point of qstore code after the
    next metadata write."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.k: int | None = None
        self.fired = False
        self._points = 0
        real = _db.MetaDB.write

        def write(db: Any, batch: Any, *, sync: bool = False) -> None:
            real(db, batch, sync=sync)
            # Signals reach the main thread only (not the syncer's checkpoints).
            if (self.k is not None and not self.fired and sys.getprofile() is None
                    and threading.current_thread() is threading.main_thread()):
                sys.setprofile(self._profile)

        monkeypatch.setattr(_db.MetaDB, "write", write)

    def arm(self, k: int) -> None:
        self.k, self.fired, self._points = k, False, 0

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if (event not in _POINTS or _QSTORE not in code.co_filename
                or code.co_name in ("__enter__", "__exit__")):
            return
        if self._points == self.k:
            self.fired = True
            sys.setprofile(None)
            raise KeyboardInterrupt
        self._points += 1

    def disarm(self) -> None:
        self.k = None
        sys.setprofile(None)


def _push(q: qstore.Queue, held: list[qstore.Message]) -> None:
    q.push(b"one", priority=3)


def _push_many(q: qstore.Queue, held: list[qstore.Message]) -> None:
    q.push_many([(b"a", 1), (b"b", 5), (b"c", 9)])


def _delayed(q: qstore.Queue, held: list[qstore.Message]) -> None:
    q.push(b"later", priority=4, delay=5.0)


def _promote_and_pop(q: qstore.Queue, held: list[qstore.Message]) -> None:
    # A message pushed with a delay fell due (set up below): the pop's first write
    # promotes it, the second delivers.
    _pop(q, held)


def _pop(q: qstore.Queue, held: list[qstore.Message]) -> None:
    m = q.pop(lease=LEASE)
    if m is not None:
        held.append(m)


def _pop_many(q: qstore.Queue, held: list[qstore.Message]) -> None:
    held.extend(q.pop_many(3, lease=LEASE))


def _ack(q: qstore.Queue, held: list[qstore.Message]) -> None:
    if held:
        q.ack(held.pop())


def _ack_many(q: qstore.Queue, held: list[qstore.Message]) -> None:
    if held:
        batch, held[:] = held[-3:], held[:-3]
        q.ack_many(batch)


def _nack(q: qstore.Queue, held: list[qstore.Message]) -> None:
    if held:
        q.nack(held.pop())


def _extend(q: qstore.Queue, held: list[qstore.Message]) -> None:
    if held:
        held[-1] = q.extend(held[-1], lease=LEASE)


OPS = [_push, _push_many, _delayed, _promote_and_pop, _pop, _pop_many, _ack, _ack_many, _nack,
       _extend]


@pytest.mark.parametrize("durability", ["interval", "always"])
@pytest.mark.parametrize("op", OPS, ids=lambda f: f.__name__.strip("_"))
def test_an_interrupt_after_a_write_leaves_memory_as_the_database_says(
        tmp_path: Any, clock: Any, monkeypatch: pytest.MonkeyPatch,
        op: Callable[[qstore.Queue, list[qstore.Message]], None], durability: str) -> None:
    store = qstore.open(str(tmp_path / "s"), clock=clock, durability=durability,
                        compactor=False)
    try:
        _interrupt_each_point(store, clock, monkeypatch, op)
    finally:
        store.close()
    with qstore.open(store.path, clock=clock, compactor=False) as again:
        assert again.check().ok
        assert_consistent(again, again.queue("q"))


def _interrupt_each_point(store: qstore.Store, clock: Any, monkeypatch: pytest.MonkeyPatch,
                          op: Callable[[qstore.Queue, list[qstore.Message]], None]) -> None:
    q = store.create_queue("q")
    interrupt = InterruptAfterWrite(monkeypatch)
    held: list[qstore.Message] = []  # popped here, leases live (the clock stands still)
    interrupted = 0
    for k in range(400):
        q.push_many([b"x%d" % i for i in range(6)])  # something to pop and to ack
        held.extend(q.pop_many(3, lease=LEASE))
        if op is _promote_and_pop:
            q.push(b"due", priority=9, delay=1.0)
            clock.advance(2.0)
        interrupt.arm(k)
        try:
            op(q, held)
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            interrupt.disarm()
        assert not store.core.lock._is_owned(), "the writer lock was left taken"  # type: ignore[attr-defined]
        assert_consistent(store, q)
        assert len({m.id for m in held}) == len(held), "a message handed out twice"
        if not interrupt.fired:
            break  # k is past the operation's last line: every point was tried
    else:
        pytest.fail("the operation passed more than 400 points after its write")
    assert interrupted == k and interrupted > 0
    # What the interrupted pops delivered stays in flight; the rest drains whole.
    q.ack_many(held)
    while got := q.pop_many(100):
        q.ack_many(got)
    assert_consistent(store, q)


@pytest.mark.parametrize("op", [_push, _push_many], ids=["push", "push_many"])
def test_an_interrupted_push_in_always_mode_leaves_its_journal_keys_tracked(
        tmp_path: Any, clock: Any, monkeypatch: pytest.MonkeyPatch,
        op: Callable[[qstore.Queue, list[qstore.Message]], None]) -> None:
    """durability="always" carries small bodies in journal keys, which the next
    checkpoint deletes once their segment is synced: an interrupted push's keys
    must be among those it knows of, or they stay until the store is reopened."""
    with qstore.open(str(tmp_path / "s"), durability="always", clock=clock,
                     compactor=False) as store:
        core = store.core
        assert core.journaling
        q = store.create_queue("q")
        interrupt = InterruptAfterWrite(monkeypatch)
        for k in range(400):
            interrupt.arm(k)
            try:
                op(q, [])
            except KeyboardInterrupt:
                pass
            finally:
                interrupt.disarm()
            assert not core.lock._is_owned(), "the writer lock was left taken"  # type: ignore[attr-defined]
            with core.lock:  # the syncer's checkpoints change both under it
                stored = [key for key, _ in core.meta.scan(keys.JOURNAL,
                                                           keys.prefix_end(keys.JOURNAL))]
                assert [key for _, _, key in core._awaiting_sync] == stored
            if not interrupt.fired:
                break
        core.syncer.checkpoint()  # the segment synced: every journal key is covered now
        assert list(core.meta.scan(keys.JOURNAL, keys.prefix_end(keys.JOURNAL))) == []
        assert_consistent(store, q)
