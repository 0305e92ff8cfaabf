"""Expiry and aging of a large backlog (issue 13): the rate of the passes, and how long
a push waits while they run.

- ``features.expiry_rate``: ``p.backlog`` messages pushed with a TTL, the
  store's clock moved past it, then ``stats()``, which runs the expiry pass
  to the end (in bounded calls, letting go of the writer lock between them);
- ``features.push_wait_max``: the longest single push into another queue,
  made by a thread that pushes in a loop while that pass runs: it stays near
  the time of one call of the pass, not the time of the whole pass;
- ``features.aging_rate``: ``p.backlog`` messages on an aging queue, the clock
  moved one aging period on, then ``stats()``: every message gains a level.

The clock is the store's injectable one, moved by hand: nothing sleeps.
"""

from __future__ import annotations

import threading
import time

import qstore

from ._plan import Params
from ._results import Metric

BATCH = 10_000
BODY = b"x" * 100


class HandClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def _fill(q: qstore.Queue, n: int, ttl: float | None) -> None:
    for i in range(0, n, BATCH):
        q.push_many([(BODY, 0)] * min(BATCH, n - i), ttl=ttl)


def measure_features(path: str, p: Params) -> list[Metric]:
    n = p.backlog
    clock = HandClock()
    with qstore.open(path, clock=clock, compactor=False, durability="none",
                     sweep_interval=3600.0) as store:
        ttl_q = store.create_queue("ttl")
        age_q = store.create_queue("age", aging=10.0)
        side = store.create_queue("side")
        _fill(ttl_q, n, 60.0)

        clock.now += 60.0  # every TTL ran out
        waits: list[float] = []
        stop = threading.Event()

        def pusher() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                side.push(BODY)
                waits.append(time.perf_counter() - t0)

        t = threading.Thread(target=pusher)
        t.start()
        t0 = time.perf_counter()
        stats = ttl_q.stats()
        expiry_s = time.perf_counter() - t0
        stop.set()
        t.join()
        assert stats.expired == n and stats.ready == 0, stats

        _fill(age_q, n, None)
        clock.now += 10.0  # one aging period: the whole backlog gains a level
        t0 = time.perf_counter()
        age_q.stats()
        aging_s = time.perf_counter() - t0
        head = age_q.peek(1)
        assert head and head[0].priority == 1, head
    return [
        Metric("features.expiry_rate", f"expiry of {n:,} messages (TTL ran out)",
               n / expiry_s, "msgs/s"),
        Metric("features.push_wait_max", f"longest push while that expiry ran "
               f"({len(waits):,} pushes)", max(waits, default=0.0) * 1e3, "ms"),
        Metric("features.push_wait_p99", "p99 push latency while that expiry ran",
               sorted(waits)[int(len(waits) * 0.99)] * 1e3 if waits else 0.0, "ms"),
        Metric("features.aging_rate", f"aging of {n:,} messages by one level",
               n / aging_s, "msgs/s"),
    ]
