"""Pops that wait, parked without a thread (docs/server.md, "Waiting pops").

A ``pop(wait=...)`` that finds its queue empty becomes a :class:`Waiter` in
its queue's FIFO line. While any waiter is parked the server is counted in
``Core.waiters`` and listens on ``Core.ready``: every commit that adds ready
keys (a push, a nack, a redrive, a promoted delay or lease) calls the
listener, which schedules one retry round on the event loop. A round runs
in the store thread and tries each line's waiters in order, stopping at the
first that gets nothing, so a push to one queue costs one pop attempt per
non-empty line, not one per waiter: only the lines of the queues that got
ready keys (the listener is told which), at most ``ROUND_MAX`` waiters of
each. A timer answers a waiter whose time ran
out with the empty result: a real-time timer with the default clock; with a
clock injected into the store, the waiter's deadline is a time of that clock
(``deadline``), woken for by the server's due-time timer or by the clock's
moves, as an embedded pop's (qstore/_waits.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Waiters of one queue a retry round tries at most. A round stops trying a queue
# at its first waiter that gets nothing, but took (and marked, and went through
# again after) every waiter of the line: with thousands waiting, each push paid
# for all of them. A line whose every tried waiter got a message is tried again.
ROUND_MAX = 64


@dataclass(eq=False)
class Waiter:
    conn: Any  # the server's connection object
    rid: int
    op: str
    args: dict[str, Any]
    queue: str
    timer: asyncio.TimerHandle | None = None
    busy: bool = False  # in a retry round now
    expired: bool = False  # its time ran out while busy
    final: bool = False  # the try under way is its last: empty if it gets nothing
    cancelled: bool = False  # a cancel found it (a second one answers false)
    done: bool = False
    started: float = field(default=0.0)
    deadline: float = 0.0  # an injected store clock's time at which it gives up
    gone: bool = False  # removed from the waiting pops (may still sit in its line)


class WaitingPops:
    """Every parked pop, by queue, in arrival order.

    Removal is O(1): a removed waiter is marked ``gone`` and left in its line
    until it reaches the front or the line is more than half gone, when the
    line is rebuilt. (Taking it out of the deque at once cost a walk of the
    line: 10,000 parked pops cancelled one by one held the event loop 1.2 s;
    a scale audit.) :meth:`live` and :meth:`waiting` skip gone waiters.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lines: dict[str, deque[Waiter]] = {}  # a line with a live waiter
        self._live: dict[str, int] = {}  # live waiters of each line
        self.count = 0
        # Each connection's waiters, in the order they parked, and by request id
        # (a list: a client may reuse an id): a cancel or a closed connection
        # finds its own without walking every line.
        self._of: dict[object, dict[Waiter, None]] = {}
        self._rids: dict[object, dict[int, list[Waiter]]] = {}

    def park(self, w: Waiter) -> None:
        line = self.lines.get(w.queue)
        if line is None:
            line = self.lines[w.queue] = deque()
            self._live[w.queue] = 0
        line.append(w)
        self._live[w.queue] += 1
        self._of.setdefault(w.conn, {})[w] = None
        self._rids.setdefault(w.conn, {}).setdefault(w.rid, []).append(w)
        self.count += 1

    def remove(self, w: Waiter) -> None:
        if w.timer is not None:
            w.timer.cancel()
        if w.gone:
            return
        w.gone = True
        self.count -= 1
        name = w.queue
        left = self._live[name] - 1
        line = self.lines[name]
        if not left:
            del self.lines[name], self._live[name]
        else:
            self._live[name] = left
            while line[0].gone:
                line.popleft()
            if len(line) > 2 * left + 16:
                self.lines[name] = deque(x for x in line if not x.gone)
        mine = self._of[w.conn]
        del mine[w]
        if not mine:
            del self._of[w.conn]
        rids = self._rids[w.conn]
        same = rids[w.rid]
        same.remove(w)  # (one, unless the client reused the id)
        if not same:
            del rids[w.rid]
            if not rids:
                del self._rids[w.conn]

    def find(self, conn: object, rid: int) -> Waiter | None:
        """The first waiter of request ``rid`` of ``conn`` still to be answered (also one
        whose time ran out while a try of it runs: it is answered after that try)."""
        for w in self._rids.get(conn, {}).get(rid, ()):
            if not w.done:
                return w
        return None

    def live(self, name: str) -> list[Waiter]:
        """The waiters of queue ``name``'s line, in order."""
        return [w for w in self.lines.get(name, ()) if not w.gone]

    def waiting(self) -> list[Waiter]:
        """Every waiter, line by line."""
        return [w for line in self.lines.values() for w in line if not w.gone]

    def round(self, queues: set[str] | None) -> tuple[list[Waiter], set[str]]:
        """The waiters one retry round tries, marked busy, queue by queue in order:
        of ``queues`` (None: every queue), at most :data:`ROUND_MAX` of each line.
        Also the queues whose line has more waiters than it took: if every one
        taken gets a message, their queue may have more (another round then).
        """
        out: list[Waiter] = []
        more: set[str] = set()
        lines = self.lines
        names = list(lines) if queues is None else [n for n in queues if n in lines]
        for name in names:
            taken = 0
            for w in lines[name]:
                if not w.busy and not w.gone:
                    if taken == ROUND_MAX:
                        more.add(name)
                        break
                    w.busy = True
                    out.append(w)
                    taken += 1
        return out, more

    def of(self, conn: object) -> list[Waiter]:
        return list(self._of.get(conn, ()))


def try_round(waiters: list[Waiter], attempt: Callable[[Waiter], Any],
              empty: Callable[[Any], bool]) -> list[tuple[Waiter, bool, Any]]:
    """Store thread: try waiters in order; after a queue comes up empty, skip its others."""
    dry: set[str] = set()
    out: list[tuple[Waiter, bool, Any]] = []
    for w in waiters:
        if w.queue in dry:
            out.append((w, True, None))
            continue
        try:
            got = attempt(w)
        except Exception as exc:  # the waiter's own error (queue deleted, ...)
            out.append((w, False, exc))
            continue
        if empty(got):
            dry.add(w.queue)
            out.append((w, True, None))
        else:
            out.append((w, True, got))
    return out
