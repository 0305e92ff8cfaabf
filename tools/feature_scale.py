"""Expiry and aging of many messages: the rate of the passes and their peak memory.

    PYTHONPATH=. python tools/feature_scale.py [--n 1000000] [--dir DIR]

Pushes ``n`` messages (push_many, 10,000 a batch) with a TTL on one queue
and ``n`` on an aging queue, on a clock the script moves by hand, then:

- expiry: moves the clock past every TTL and calls ``stats()``, which runs
  the expiry pass to the end (bounded calls, the writer lock let go between
  them) until the queue is empty;
- aging: moves the clock one aging period on and calls ``stats()`` until
  every message has gained its level (one ``stats()`` runs the whole round).

``make bench`` has the same figures (workload ``features``).

For each it prints messages per second and the peak resident memory during
the pass over the resident memory before it (Linux: the peak is reset
through ``/proc/self/clear_refs`` before each pass), so a pass that held
the backlog in memory would show here. Not a test: it takes minutes.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import qstore

BATCH = 10_000


class HandClock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def _status(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


last: dict[str, int] = {}  # the last id pushed, per queue


def _fill(q: qstore.Queue, n: int, ttl: float | None) -> float:
    body = b"x" * 100
    t0 = time.perf_counter()
    for i in range(0, n, BATCH):
        last[q.name] = q.push_many([(body, 0)] * min(BATCH, n - i), ttl=ttl)[-1]
    return time.perf_counter() - t0


def _measure(what: str, n: int, run: object) -> None:
    assert callable(run)
    rss0 = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    passes = run()
    dt = time.perf_counter() - t0
    peak = _status("VmHWM")
    print(f"{what}: {n:,} messages in {dt:.1f} s = {n / dt:,.0f}/s over {passes} pass(es); "
          f"RSS before {rss0 / 1024:.0f} MiB, peak during {peak / 1024:.0f} MiB "
          f"(+{(peak - rss0) / 1024:.0f} MiB)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--dir", default=None, help="where the store goes (default: a temp dir)")
    args = ap.parse_args()
    n = args.n
    base = args.dir or tempfile.mkdtemp(prefix="qstore-scale-")
    clock = HandClock(1_700_000_000.0)
    try:
        with qstore.open(f"{base}/store", clock=clock, compactor=False, durability="none",
                         sweep_interval=3600.0) as store:
            ttl_q = store.create_queue("ttl")
            age_q = store.create_queue("age", aging=10.0)
            print(f"push {n:,} with a TTL: {_fill(ttl_q, n, 60.0):.1f} s", flush=True)
            print(f"push {n:,} on the aging queue: {_fill(age_q, n, None):.1f} s", flush=True)

            clock.now += 60.0  # every TTL ran out

            def expire() -> int:
                ttl_q.stats()
                assert ttl_q.stats().ready == 0 and ttl_q.stats().expired == n
                return 1

            _measure("expiry", n, expire)

            clock.now += 10.0  # one more aging period: the whole backlog is due
            youngest = last[age_q.name]

            def age() -> int:
                passes = 0
                # One stats() runs the whole aging round; the loop is a safeguard.
                while age_q.get(youngest).priority != 7:
                    passes += 1
                    clock.now += 0.001
                    age_q.stats()
                return passes

            _measure("aging", n, age)
            assert store.check().ok
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
