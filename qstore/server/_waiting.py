"""Pops that wait, parked without a thread (docs/server.md, "Waiting pops").

A ``pop(wait=...)`` that finds its queue empty becomes a :class:`Waiter` in
its queue's FIFO line. While any waiter is parked the server is counted in
``Core.waiters`` and listens on ``Core.ready``: every commit that adds ready
keys (a push, a nack, a redrive, a promoted delay or lease) calls the
listener, which schedules one retry round on the event loop. A round runs
in the store thread and tries each line's waiters in order, stopping at the
first that gets nothing, so a push to one queue costs one pop attempt per
non-empty line, not one per waiter. A timer answers a waiter whose time ran
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
    done: bool = False
    started: float = field(default=0.0)
    deadline: float = 0.0  # an injected store clock's time at which it gives up


class WaitingPops:
    """Every parked pop, by queue, in arrival order."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lines: dict[str, deque[Waiter]] = {}
        self.count = 0

    def park(self, w: Waiter) -> None:
        self.lines.setdefault(w.queue, deque()).append(w)
        self.count += 1

    def remove(self, w: Waiter) -> None:
        line = self.lines.get(w.queue)
        if line is not None and w in line:
            line.remove(w)
            self.count -= 1
            if not line:
                del self.lines[w.queue]
        if w.timer is not None:
            w.timer.cancel()

    def round(self) -> list[Waiter]:
        """The waiters one retry round tries, marked busy, queue by queue in order."""
        out = []
        for line in self.lines.values():
            for w in line:
                if not w.busy:
                    w.busy = True
                    out.append(w)
        return out

    def of(self, conn: object) -> list[Waiter]:
        return [w for line in self.lines.values() for w in line if w.conn is conn]


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
