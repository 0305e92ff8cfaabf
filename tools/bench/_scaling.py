"""qstore-only measurements: churn, open time and memory, and compaction.

- churn: the pop rate of a fresh queue, then again after N push/pop/ack cycles
  on the same queue (the tombstones those leave at the head of the ready and
  in-flight indexes must not slow pops down).
- open: a store with an N-message backlog is built once; each probe opens it
  in a fresh child process and reports the open time and the child's RSS.
- compaction: the disk's sequential write rate (write + fsync a file) next to
  the rate at which ``store.compact(threshold=0.0)`` rewrites live payload,
  and the push/pop/ack rate while a pass runs vs without one.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qstore._config import Durability

from ._peers import Item
from ._plan import KiB, MiB, Params
from ._results import Metric
from ._workloads import make_items

LEASE = 3600.0


def _open(path: str, durability: Durability = "interval") -> Any:
    import qstore

    return qstore.open(path, durability=durability, compactor=False)


def _push_all(q: Any, items: Sequence[Item], total: int, chunk: int = 1000) -> None:
    """Push ``total`` messages in batches, cycling through ``items``."""
    done = 0
    while done < total:
        take = min(chunk, total - done)
        start = done % len(items)
        batch = list(items[start : start + take])
        if len(batch) < take:
            batch += items[: take - len(batch)]
        q.push_many(batch)
        done += take


def _drain(q: Any) -> None:
    while True:
        got = q.pop_many(1000, lease=LEASE)
        if not got:
            return
        q.ack_many(got)


# -- churn ----------------------------------------------------------------------


def _pop_rate(q: Any, items: Sequence[Item], budget: float) -> float:
    """Pops per second from a backlog of ``items`` (the acks are untimed)."""
    _push_all(q, items, len(items))
    gc.collect()
    popped = []
    start = time.perf_counter()
    deadline = start + budget
    for _ in range(len(items)):
        msg = q.pop(lease=LEASE)
        if msg is None:
            break
        popped.append(msg)
        if time.perf_counter() > deadline:
            break
    seconds = time.perf_counter() - start
    for i in range(0, len(popped), 1000):
        q.ack_many(popped[i : i + 1000])
    _drain(q)
    return len(popped) / seconds


def _steady_pop_rate(q: Any, items: Sequence[Item], budget: float) -> float:
    """Pops per second in single push, pop, ack cycles (only the pops are timed).

    The queue holds one message at a time, so every pop lands on whatever the
    earlier cycles left in the index around it: the steady state of a queue
    that keeps up with its producers.
    """
    gc.collect()
    popped = 0.0
    n = 0
    deadline = time.perf_counter() + budget
    clock = time.perf_counter
    for body, priority in items:
        q.push(body, priority)
        t0 = clock()
        msg = q.pop(lease=LEASE)
        t1 = clock()
        q.ack(msg)
        popped += t1 - t0
        n += 1
        if t1 > deadline:
            break
    return n / popped


def measure_churn(path: str, p: Params) -> list[Metric]:
    """Pop rates before and after ``p.cycles`` push/pop/ack cycles (batched, untimed).

    The cycles stop early after ``p.cycle_cap`` seconds; the metrics name the
    number actually done.
    """
    items = make_items(p.n, KiB, p.seed)
    window = items[: max(p.batch, min(len(items), 5000))]
    store = _open(path)
    try:
        q = store.create_queue("bench")
        # The same order before and after the cycles: steady first, then backlog.
        fresh_steady = _steady_pop_rate(q, window, p.budget / 2)
        fresh_backlog = _pop_rate(q, items, p.budget)
        cycle = items[: p.batch]
        done = 0
        start = time.perf_counter()
        stop_at = start + p.cycle_cap
        while done < p.cycles and time.perf_counter() < stop_at:
            q.push_many(cycle)
            q.ack_many(q.pop_many(p.batch, lease=LEASE))
            done += len(cycle)
        cycle_seconds = time.perf_counter() - start
        after_steady = _steady_pop_rate(q, window, p.budget / 2)
        after_backlog = _pop_rate(q, items, p.budget)
    finally:
        store.close()
    cut = "" if done >= p.cycles else f", stopped at the {p.cycle_cap:.0f} s cap"
    after = "after the cycles"
    return [
        Metric("churn.cycles_done", f"push/pop/ack cycles done (of {p.cycles:,}, batches of "
               f"{p.batch}{cut})", done, "msgs"),
        Metric("churn.cycle_rate", "cycle rate over all of them", done / cycle_seconds,
               "msgs/s"),
        Metric("churn.steady_fresh", "pop rate in single push/pop/ack cycles, fresh queue",
               fresh_steady, "ops/s"),
        Metric("churn.steady_after", f"pop rate in single push/pop/ack cycles, {after}",
               after_steady, "ops/s"),
        Metric("churn.backlog_fresh", f"pop rate from a {len(items):,} backlog, fresh queue",
               fresh_backlog, "ops/s"),
        Metric("churn.backlog_after", f"pop rate from a {len(items):,} backlog, {after}",
               after_backlog, "ops/s"),
        Metric("churn.ratio", "pop rate after cycles / fresh (the worse of the two)",
               min(after_steady / fresh_steady, after_backlog / fresh_backlog), "x"),
    ]


# -- open -----------------------------------------------------------------------


def build_backlog(path: str, p: Params) -> list[Metric]:
    """A store holding ``p.backlog`` ready 1 KiB messages; returns how fast it was built."""
    items = make_items(min(p.backlog, 10_000), KiB, p.seed)
    store = _open(path, durability="none")
    try:
        q = store.create_queue("bench")
        start = time.perf_counter()
        _push_all(q, items, p.backlog)
        seconds = time.perf_counter() - start
    finally:
        store.close()
    return [Metric("open.build_rate", "backlog build rate (push_many of 1000)",
                   p.backlog / seconds, "msgs/s")]


def _peak_rss() -> int | None:
    """This process's peak RSS (VmHWM), or None off Linux.

    Not ``getrusage().ru_maxrss``: Linux carries that over from the parent
    across fork and exec, so a child would report the benchmark's own peak.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def open_probe(path: str) -> None:
    """Run in a fresh child: open the store at ``path``, print what it cost as JSON."""
    import psutil

    import qstore

    # Read before the clock starts: the package imports the embedded store on
    # first use (qstore/_lazy.py), and that import is not the open's cost.
    open_store = qstore.open
    proc = psutil.Process()
    before = proc.memory_info().rss
    start = time.perf_counter()
    store = open_store(path, compactor=False)
    seconds = time.perf_counter() - start
    ready = store.queue("bench").stats().ready
    after = proc.memory_info().rss
    peak = _peak_rss()
    store.close()
    print(json.dumps({"seconds": seconds, "rss_before": before, "rss_after": after,
                      "rss_peak": peak, "ready": ready}))


def _probe_command(path: str) -> list[str]:
    """The child's command line: it imports this harness and the qstore this process runs.

    The harness lives outside the installed package (``tools`` is on this
    process's path, perhaps not in the child's environment), so the child is
    given both import roots explicitly.
    """
    import qstore

    roots = [os.path.dirname(os.path.dirname(os.path.abspath(f)))
             for f in (__file__, qstore.__file__)]
    code = f"import sys; sys.path[:0] = sys.argv[2:]; from {__name__} import open_probe; " \
        "open_probe(sys.argv[1])"
    return [sys.executable, "-c", code, path, *roots]


def measure_open(path: str, p: Params) -> list[Metric]:
    done = subprocess.run(_probe_command(path), capture_output=True, text=True,
                          timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"open probe failed (exit {done.returncode}): {done.stderr.strip()}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got["ready"] != p.backlog:
        raise RuntimeError(f"open probe saw {got['ready']} ready messages, not {p.backlog}")
    backlog = f"backlog {p.backlog:,}"
    return [
        Metric("open.seconds", f"open time, {backlog}", got["seconds"], "s"),
        Metric("open.rss_mb", f"RSS after open (whole process), {backlog}",
               got["rss_after"] / MiB, "MB"),
        Metric("open.rss_open_mb", "RSS added by the open", (got["rss_after"] - got["rss_before"])
               / MiB, "MB"),
    ] + ([] if got["rss_peak"] is None else [
        Metric("open.peak_rss_mb", "peak RSS of the process (VmHWM)", got["rss_peak"] / MiB,
               "MB")])


# -- compaction -----------------------------------------------------------------


def disk_write_rate(directory: str, nbytes: int) -> float:
    """MiB/s of writing ``nbytes`` sequentially in 4 MiB writes, the final fsync included."""
    chunk = os.urandom(4 * MiB)
    path = os.path.join(directory, "disk-probe.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, chunk)
        os.fsync(fd)
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
    return written / MiB / seconds


def _fragmented(path: str, p: Params) -> tuple[Any, Any]:
    """A store whose sealed payload is half garbage: every other message acked, the rest leased."""
    store = _open(path)
    q = store.create_queue("bench")
    _push_all(q, make_items(1000, KiB, p.seed), p.compact_messages)
    while True:
        got = q.pop_many(1000, lease=LEASE)
        if not got:
            break
        q.ack_many(got[::2])  # the other half stays leased: live payload to copy
    return store, q


def _cycles(q: Any, body: bytes, until: Any) -> tuple[int, float]:
    """Single push, pop, ack cycles until ``until()`` is true; (cycles, seconds)."""
    n = 0
    start = time.perf_counter()
    while not until():
        q.push(body, 5)
        q.ack(q.pop(lease=LEASE))
        n += 1
    return n, time.perf_counter() - start


def measure_compaction(path: str, p: Params) -> list[Metric]:
    disk = disk_write_rate(path, p.disk_bytes)
    metrics = [Metric("disk.write_mib_s", f"disk sequential write + fsync "
                      f"({p.disk_bytes // MiB} MiB)", disk, "MiB/s")]

    store, _ = _fragmented(os.path.join(path, "a"), p)
    try:
        gc.collect()
        result = store.compact(threshold=0.0)
    finally:
        store.close()
    rate = result.bytes_copied / MiB / result.seconds
    metrics += [
        Metric("compaction.mib_s", f"compaction: live payload rewritten / pass time "
               f"({result.bytes_copied / MiB:.0f} MiB, {result.messages_moved:,} msgs)",
               rate, "MiB/s"),
        Metric("compaction.ratio", "compaction rate / disk write rate", rate / disk, "x"),
        Metric("compaction.msgs_s", "compaction: messages moved per second",
               result.messages_moved / result.seconds, "msgs/s"),
    ]

    # The same pass with a producer/consumer running beside it (best effort:
    # both share the writer lock and the GIL).
    store, _ = _fragmented(os.path.join(path, "b"), p)
    try:
        live = store.create_queue("live")
        body = os.urandom(KiB)
        stop_at = time.perf_counter() + min(p.budget, 1.0)
        base_n, base_s = _cycles(live, body, lambda: time.perf_counter() > stop_at)
        passed: list[Any] = []
        worker = threading.Thread(target=lambda: passed.append(store.compact(threshold=0.0)))
        gc.collect()
        worker.start()
        during_n, during_s = _cycles(live, body, lambda: not worker.is_alive())
        worker.join()
    finally:
        store.close()
    if not passed:
        raise RuntimeError("the compaction pass beside the live queue failed")
    without, during = base_n / base_s, during_n / during_s if during_s else 0.0
    metrics += [
        Metric("compaction.ops_without", "push+pop+ack cycles/s, no compaction", without,
               "ops/s"),
        Metric("compaction.ops_during", f"push+pop+ack cycles/s during a pass "
               f"({during_s:.2f} s, {during_n:,} cycles)", during, "ops/s"),
        Metric("compaction.ops_ratio", "cycle rate during a pass / without", during / without,
               "x"),
    ]
    return metrics
