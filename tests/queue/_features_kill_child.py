"""The child of the TTL/aging SIGKILL test: a workload that journals what returned.

usage: python _features_kill_child.py STORE JOURNAL DURABILITY SEED START

The store runs on a clock of its own that starts at START (seconds) and moves
by half a second (now and then more) before each operation, so the parent knows the exact time
of every push. Two queues: ``ttl`` (a default TTL of 30 s, ``on_expire``
dead) and ``age`` (aging 5 s, at most 3 levels). After each operation
returns, one ``os.write`` on an ``O_APPEND`` descriptor appends its lines:

    open                           the store is open and both queues exist
    time T                         the clock moved to T (before the operation using it)
    push QUEUE ID PRIORITY TIME    a push returned ID, pushed at TIME with PRIORITY
    acking QUEUE ID                an ack is about to be called (it may or may not
                                   happen before a kill)
    ack QUEUE ID                   an ack returned

The parent kills this process with SIGKILL; it never exits by itself.
"""

from __future__ import annotations

import os
import random
import sys

import qstore

TTL = 30.0
AGING = 5.0
AGING_CAP = 3
LEASE = 20.0


class StepClock:
    """Moved by the workload itself: half a second before each operation.

    Not ``tests.conftest.FakeClock``: this file runs as a script, whose
    ``sys.path`` holds tests/queue/ but not the repository root, and
    conftest.py is a pytest plugin (it imports pytest and hypothesis and sets
    hypothesis's profile), which a plain child process should not load.
    """

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def open_queues(store: qstore.Store) -> tuple[qstore.Queue, qstore.Queue]:
    ttl = store.create_queue("ttl", max_attempts=1000, ttl=TTL, on_expire="dead",
                             exist_ok=True)
    age = store.create_queue("age", max_attempts=1000, aging=AGING, aging_cap=AGING_CAP,
                             exist_ok=True)
    return ttl, age


def main() -> None:
    path, journal, durability, seed, start = sys.argv[1:6]
    rng = random.Random(seed)
    clock = StepClock(float(start))
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(*lines: str) -> None:
        os.write(fd, "".join(line + "\n" for line in lines).encode())

    store = qstore.open(path, durability=durability, compactor=False, clock=clock,
                        sweep_interval=3600.0, segment_max_bytes=64 * 1024)
    queues = dict(zip(("ttl", "age"), open_queues(store), strict=True))
    log("open")
    while True:
        clock.now += rng.choice([0.5] * 8 + [5.0, 12.5])
        log(f"time {clock.now!r}")  # before the operation that may use it
        name = rng.choice(("ttl", "age"))
        q = queues[name]
        r = rng.random()
        if r < 0.45:
            prio = rng.randrange(5)
            mid = q.push(rng.randbytes(rng.choice([0, 10, 300])), priority=prio)
            log(f"push {name} {mid} {prio} {clock.now!r}")
        elif r < 0.55:
            rows = [(rng.randbytes(20), rng.randrange(5)) for _ in range(rng.randint(1, 4))]
            ids = q.push_many(rows)
            log(*(f"push {name} {mid} {p} {clock.now!r}"
                  for mid, (_, p) in zip(ids, rows, strict=True)))
        elif r < 0.8:
            got = q.pop(lease=LEASE)
            if got is not None and rng.random() < 0.6:
                log(f"acking {name} {got.id}")
                q.ack(got)
                log(f"ack {name} {got.id}")
            elif got is not None and rng.random() < 0.5:
                q.nack(got)
        else:
            q.stats()  # runs the expiry and aging passes


if __name__ == "__main__":
    main()
