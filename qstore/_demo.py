"""``qstore demo``: an end-to-end workload on an embedded store in a local folder.

Producers push messages of mixed priorities and sizes, a few delayed and a
few "poison" (always nacked, so they end in the dead letters); the store is
restarted with a backlog; consumers drain it (checking pop order) while more
producers run; a compaction pass reclaims space; a snapshot is audited with
Spark. A second store is served by ``qstore serve`` to producer and consumer
processes, one of them SIGKILLed mid-lease (``_demo_server.py``). Every check
prints PASS or FAIL; the exit code is 1 on any FAIL.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TimeElapsedColumn

from ._demo_server import run_server_part
from ._message import Message
from ._options import StoreOptions
from ._queue import Queue
from ._store import Store, open_store
from ._tables import print_stats

console = Console()
PRODUCERS = 3
CONSUMERS = 3
POISON = b"POISON:"


@dataclass
class Ledger:
    """What the demo's threads did, for the checks at the end."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    pushed: dict[int, bytes] = field(default_factory=dict)  # id -> payload digest
    poison: set[int] = field(default_factory=set)
    delayed: set[int] = field(default_factory=set)
    acked: list[int] = field(default_factory=list)
    bad_payloads: list[int] = field(default_factory=list)
    order_breaks: list[tuple[int, int]] = field(default_factory=list)


def _payload(rng: random.Random, poison: bool) -> bytes:
    size = rng.choice((64, 256, 1024, 1024, 4096, 16384, 65536))
    body = rng.randbytes(size)
    return POISON + body if poison else body


def _produce(q: Queue, ledger: Ledger, count: int, seed: int, delayed_share: float) -> None:
    rng = random.Random(seed)
    done = 0
    while done < count:
        n = min(rng.choice((1, 1, 10, 50)), count - done)
        rows: list[tuple[bytes, int, float]] = []
        for _ in range(n):
            # Each producer's first message is poison: a small run still has some.
            poison = rng.random() < 0.02 or (done == 0 and not rows)
            delay = rng.uniform(0.2, 1.0) if rng.random() < delayed_share else 0.0
            rows.append((_payload(rng, poison), rng.randrange(10), delay))
        ids = [q.push(*rows[0])] if n == 1 else q.push_many(rows)
        with ledger.lock:
            for mid, (body, _, delay) in zip(ids, rows, strict=True):
                ledger.pushed[mid] = hashlib.blake2b(body, digest_size=16).digest()
                if body.startswith(POISON):
                    ledger.poison.add(mid)
                if delay:
                    ledger.delayed.add(mid)
        done += n


def _consume(q: Queue, ledger: Ledger, stop: threading.Event, check_order: bool,
             progress: Progress, task: TaskID) -> None:
    last: tuple[int, int] | None = None
    while not stop.is_set():
        msgs = q.pop_many(20, lease=30.0, wait=0.05)
        good: list[Message] = []
        for m in msgs:
            digest = hashlib.blake2b(m.payload, digest_size=16).digest()
            with ledger.lock:
                expected = ledger.pushed.get(m.id)
                if expected is not None and expected != digest:
                    ledger.bad_payloads.append(m.id)
                ordered = m.attempts == 1 and m.id not in ledger.delayed
            if check_order and ordered:
                key = (-int(m.priority), m.id)
                if last is not None and key < last:
                    ledger.order_breaks.append((last[1], m.id))
                last = key
            if m.payload.startswith(POISON):
                q.nack(m)
                if m.attempts >= q.max_attempts:
                    progress.advance(task)
            else:
                good.append(m)
        if good:
            q.ack_many(good)
            with ledger.lock:
                ledger.acked.extend(m.id for m in good)
            progress.advance(task, len(good))


def _run_consumers(store: Store, ledger: Ledger, progress: Progress, task: TaskID, *,
                   check_order: bool, until_total: int, producers: list[threading.Thread]) -> None:
    q = store.queue("jobs")
    stop = threading.Event()
    threads = [threading.Thread(target=_consume, args=(q, ledger, stop, check_order, progress,
                                                       task)) for _ in range(CONSUMERS)]
    for t in threads:
        t.start()
    for p in producers:
        p.join()
    while True:
        st = q.stats()
        if st.ready + st.delayed + st.in_flight == 0 and st.dead + len(ledger.acked) >= until_total:
            break
        stop.wait(0.05)
    stop.set()
    for t in threads:
        t.join()


def _check(label: str, ok: bool, detail: str = "") -> bool:
    mark = "[green]PASS[/green]" if ok else "[red]FAIL[/red]"
    console.print(f"{mark} {label}{': ' + detail if detail else ''}")
    return ok


def _features(path: str) -> list[bool]:
    """TTL and priority aging on a store whose clock the demo moves by hand."""
    shutil.rmtree(path, ignore_errors=True)
    now = [1_700_000_000.0]
    out = []
    with open_store(path, clock=lambda: now[0], compactor=False) as fs:
        q = fs.create_queue("features", aging=60.0, on_expire="dead")
        old = q.push(b"old low-priority job", priority=1)
        mid = q.push(b"offer valid 5 minutes", priority=5, ttl=300.0)
        now[0] += 301.0  # five minutes pass
        st = q.stats()
        letter = q.get(mid)
        out.append(_check("a message with ttl=300 expired after 301 s",
                          st.expired == 1 and letter.dead_reason == "expired",
                          f"dead letter, reason {letter.dead_reason!r}"))
        q.push(b"new high-priority job", priority=5)
        aged = q.get(old)
        first = q.pop()
        out.append(_check("a priority-1 message aged to 6 after 301 s (aging=60)",
                          aged.priority == 6 and first is not None and first.id == old,
                          "it pops before a newer priority-5 message"))
        print_stats(fs.stats(), console)
    return out


def run_demo(directory: str, *, fresh: bool = False, messages: int = 20_000,
             spark: bool = True, server: bool = True) -> int:
    if fresh and os.path.exists(directory):
        shutil.rmtree(directory)
    store_dir = os.path.join(directory, "store")
    console.rule("qstore demo")
    console.print(f"store: {store_dir}; {messages:,} messages, {PRODUCERS} producers, "
                  f"{CONSUMERS} consumers")
    ledger = Ledger()
    opts: StoreOptions = {"segment_max_bytes": 16 * 1024 * 1024, "compactor": True,
                          "compact_interval": 5.0}
    started = time.perf_counter()
    half = messages // 2
    results: list[bool] = []
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        # 1. A backlog from concurrent producers.
        store = open_store(store_dir, **opts)
        q = store.create_queue("jobs", order="max", max_attempts=3, exist_ok=True)
        per_producer = half // PRODUCERS
        task = progress.add_task("pushing backlog", total=per_producer * PRODUCERS)
        producers = [threading.Thread(target=_produce, args=(q, ledger, per_producer, i, 0.0))
                     for i in range(PRODUCERS)]
        for t in producers:
            t.start()
        for t in producers:
            t.join()
        progress.update(task, completed=per_producer * PRODUCERS)
        before = q.stats()
        # 2. A restart with the backlog in place.
        store.close()
        store = open_store(store_dir, **opts)
        after = store.queue("jobs").stats()
        results.append(_check("restart keeps every message", before == after,
                              f"{after.ready:,} ready"))
        # 3. Consumers drain the backlog in priority order.
        backlog = len(ledger.pushed)
        task = progress.add_task("draining backlog", total=backlog)
        _run_consumers(store, ledger, progress, task, check_order=True, until_total=backlog,
                       producers=[])
        results.append(_check("each consumer saw priority order (then FIFO)",
                              not ledger.order_breaks, f"{len(ledger.order_breaks)} breaks"))
        # 4. Live traffic: producers (some delayed messages) and consumers together.
        q = store.queue("jobs")
        per_producer = (messages - backlog) // PRODUCERS
        task = progress.add_task("live traffic", total=per_producer * PRODUCERS)
        producers = [threading.Thread(target=_produce,
                                      args=(q, ledger, per_producer, 100 + i, 0.05))
                     for i in range(PRODUCERS)]
        for t in producers:
            t.start()
        total = backlog + per_producer * PRODUCERS
        _run_consumers(store, ledger, progress, task, check_order=False, until_total=total,
                       producers=producers)
    # 5. Checks.
    st = store.queue("jobs").stats()
    dead = {m.id for m in store.queue("jobs").dead_letters(len(ledger.poison) + 10)}
    acked = ledger.acked
    healthy = set(ledger.pushed) - ledger.poison
    results.append(_check("every healthy message acked exactly once",
                          len(acked) == len(set(acked)) and set(acked) == healthy,
                          f"{len(acked):,} acks for {len(healthy):,} messages"))
    results.append(_check("every poison message is a dead letter",
                          bool(ledger.poison) and dead == ledger.poison,
                          f"{len(dead)} dead letters for {len(ledger.poison)} poison messages"))
    results.append(_check("payloads byte-exact", not ledger.bad_payloads,
                          f"{len(ledger.bad_payloads)} mismatches"))
    results.append(_check("counters match", st.ready == st.in_flight == st.delayed == 0
                          and st.dead == len(ledger.poison)))
    # 6. Compaction reclaims the space of acked messages.
    disk_before = store.stats().disk_bytes
    result = store.compact()
    disk_after = store.stats().disk_bytes
    results.append(_check("compaction reclaims space", disk_after < disk_before,
                          f"{disk_before:,} -> {disk_after:,} bytes on disk "
                          f"({len(result.segments_deleted)} segments deleted)"))

    # 6b. Queue features: a message that expires and one that ages (a hand-moved clock).
    results += _features(os.path.join(directory, "features"))
    # 6c. The server: producer and consumer processes, one consumer killed mid-lease.
    if server:
        console.rule("qstore serve: many processes on one store")
        results += run_server_part(directory, _check, console.print,
                                   per_producer=max(50, messages // 50))
    print_stats(store.stats(), console)
    # 7. The integrity check: every reference, frame, CRC, index, counter and segment record.
    report = store.check()
    results.append(_check("store.check(): integrity check", report.ok, report.summary()))
    # 8. A snapshot, audited with Spark.
    if spark:
        snap = os.path.join(directory, "snapshot")
        shutil.rmtree(snap, ignore_errors=True)
        store.snapshot(snap)
        store.close()
        from .spark.audit import run_audit

        console.rule("Spark audit of the snapshot")
        audit = run_audit(snap)
        results.append(_check("Spark audit of the snapshot is clean", audit.exit_code == 0))
    else:
        store.close()
    elapsed = time.perf_counter() - started
    ok = all(results)
    console.rule(f"{'all checks passed' if ok else 'CHECKS FAILED'} in {elapsed:.1f}s")
    return 0 if ok else 1
