"""Throughput and latency workloads, run the same way against every peer.

Every measurement opens the peer in a fresh directory, builds what it needs
untimed (a backlog goes in through the peer's fastest path), then times a
loop that stops after ``n`` messages or ``budget`` seconds, whichever comes
first, so slow peers (a sync per op, O(backlog) pops) cost a bounded time.
The rate is messages done / seconds; latencies are of one call of the timed
operation (push, pop, or one batch call), from ``perf_counter_ns``.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Callable, Sequence

from ._peers import Item, Peer, PeerSpec
from ._results import Sample

BODY_VARIANTS = 64  # distinct payloads cycled through, so no store can compress them away


def make_items(n: int, size: int, seed: int) -> list[Item]:
    """``n`` (payload, priority) pairs: random bytes of ``size``, priorities 0..9 at random."""
    rng = random.Random(seed)
    bodies = [rng.randbytes(size) for _ in range(min(n, BODY_VARIANTS))]
    return [(bodies[i % len(bodies)], rng.randrange(10)) for i in range(n)]


def percentiles(lat_ns: list[int]) -> tuple[float | None, float | None]:
    """p50 and p99 of nanosecond latencies, in microseconds."""
    if not lat_ns:
        return None, None
    lat_ns.sort()
    last = len(lat_ns) - 1
    return lat_ns[round(0.50 * last)] / 1e3, lat_ns[round(0.99 * last)] / 1e3


def _note(peer: Peer, batches: bool = False, pops: bool = False) -> str:
    notes = []
    if batches and not peer.native_batches:
        notes.append("loop")
    if pops and peer.ack_note:
        notes.append(peer.ack_note)
    return ", ".join(notes)


def _settle() -> None:
    """Start each timed loop from the same state: no pending garbage."""
    gc.collect()


def measure_push(spec: PeerSpec, path: str, items: Sequence[Item], budget: float) -> Sample:
    peer = spec.make(path, False)
    try:
        _settle()
        clock = time.perf_counter_ns
        push = peer.push
        lat: list[int] = []
        start = clock()
        deadline = start + int(budget * 1e9)
        for body, priority in items:
            t0 = clock()
            push(body, priority)
            t1 = clock()
            lat.append(t1 - t0)
            if t1 > deadline:
                break
        seconds = (clock() - start) / 1e9
    finally:
        peer.close()
    p50, p99 = percentiles(lat)
    return Sample("push", len(items[0][0]), spec.name, 1, len(lat), seconds, p50, p99)


def measure_pop_ack(spec: PeerSpec, path: str, items: Sequence[Item], budget: float) -> Sample:
    """Pop and ack one at a time from a backlog of ``len(items)``; latency is of the pop."""
    peer = spec.make(path, False)
    try:
        peer.fill(items)
        _settle()
        clock = time.perf_counter_ns
        pop, ack = peer.pop, peer.ack
        lat: list[int] = []
        start = clock()
        deadline = start + int(budget * 1e9)
        for _ in range(len(items)):
            t0 = clock()
            handle = pop()
            t1 = clock()
            if handle is None:
                break
            ack(handle)
            lat.append(t1 - t0)
            if t1 > deadline:
                break
        seconds = (clock() - start) / 1e9
        note = _note(peer, pops=True)
    finally:
        peer.close()
    p50, p99 = percentiles(lat)
    return Sample("pop+ack", len(items[0][0]), spec.name, 1, len(lat), seconds, p50, p99, note)


def measure_push_many(spec: PeerSpec, path: str, items: Sequence[Item], batch: int,
                      budget: float) -> Sample:
    peer = spec.make(path, False)
    try:
        chunks = [items[i : i + batch] for i in range(0, len(items), batch)]
        _settle()
        clock = time.perf_counter_ns
        lat: list[int] = []
        done = 0
        start = clock()
        deadline = start + int(budget * 1e9)
        for chunk in chunks:
            t0 = clock()
            peer.push_many(chunk)
            t1 = clock()
            lat.append(t1 - t0)
            done += len(chunk)
            if t1 > deadline:
                break
        seconds = (clock() - start) / 1e9
        note = _note(peer, batches=True)
    finally:
        peer.close()
    p50, p99 = percentiles(lat)
    return Sample("push_many", len(items[0][0]), spec.name, 1, done, seconds, p50, p99, note)


def measure_pop_many_ack_many(spec: PeerSpec, path: str, items: Sequence[Item], batch: int,
                              budget: float) -> Sample:
    """pop_many(batch) then ack_many of what it returned; latency is of pop_many."""
    peer = spec.make(path, False)
    try:
        peer.fill(items)
        _settle()
        clock = time.perf_counter_ns
        lat: list[int] = []
        done = 0
        start = clock()
        deadline = start + int(budget * 1e9)
        while done < len(items):
            t0 = clock()
            handles = peer.pop_many(batch)
            t1 = clock()
            if not handles:
                break
            peer.ack_many(handles)
            lat.append(t1 - t0)
            done += len(handles)
            if t1 > deadline:
                break
        seconds = (clock() - start) / 1e9
        note = _note(peer, batches=True, pops=True)
    finally:
        peer.close()
    p50, p99 = percentiles(lat)
    return Sample("pop_many+ack_many", len(items[0][0]), spec.name, 1, done, seconds, p50, p99,
                  note)


class _Workers:
    """Threads that run until done or told to stop; the first error is re-raised on join."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []

    def spawn(self, target: Callable[..., None], *args: object) -> None:
        def body() -> None:
            try:
                target(*args)
            except BaseException as exc:
                self.errors.append(exc)
                self.stop.set()

        thread = threading.Thread(target=body, daemon=True)
        self._threads.append(thread)

    def run(self, budget: float) -> float:
        """Start every thread, wait until they finish or ``budget`` passes; the seconds taken."""
        start = time.perf_counter()
        for t in self._threads:
            t.start()
        deadline = start + budget
        for t in self._threads:
            t.join(max(0.0, deadline - time.perf_counter()))
        self.stop.set()
        seconds = time.perf_counter() - start
        for t in self._threads:
            t.join()
        if self.errors:
            raise self.errors[0]
        return seconds


def measure_mixed(spec: PeerSpec, path: str, items: Sequence[Item], producers: int,
                  budget: float) -> Sample:
    """``producers`` threads push while as many consumers pop and ack; rate of acks."""
    peer = spec.make(path, True)
    try:
        workers = _Workers()
        stop = workers.stop
        produced_by = [0] * producers
        consumed_by = [0] * producers
        producing = [producers]
        lock = threading.Lock()

        def produce(k: int) -> None:
            try:
                for body, priority in items[k::producers]:
                    if stop.is_set():
                        return
                    peer.push(body, priority)
                    produced_by[k] += 1
            finally:
                with lock:
                    producing[0] -= 1

        def consume(k: int) -> None:
            while not stop.is_set():
                handle = peer.pop()
                if handle is None:
                    if producing[0] == 0:
                        return  # nothing ready and nothing more coming
                    time.sleep(0.0002)
                    continue
                peer.ack(handle)
                consumed_by[k] += 1

        _settle()
        for k in range(producers):
            workers.spawn(produce, k)
            workers.spawn(consume, k)
        seconds = workers.run(budget)
    finally:
        peer.close()
    return Sample("mixed", len(items[0][0]), spec.name, 2 * producers, sum(consumed_by), seconds,
                  note=f"{producers}P/{producers}C")


def measure_group_push(spec: PeerSpec, path: str, items: Sequence[Item], threads: int,
                       budget: float) -> Sample:
    """``threads`` producers push at once: with syncs, shared syncs (group commit) pay off.

    Even one producer runs in a worker thread, so the peer is opened threaded either way.
    """
    peer = spec.make(path, True)
    try:
        workers = _Workers()
        stop = workers.stop
        lat_by: list[list[int]] = [[] for _ in range(threads)]

        def produce(k: int) -> None:
            clock = time.perf_counter_ns
            lat = lat_by[k]
            for body, priority in items[k::threads]:
                if stop.is_set():
                    return
                t0 = clock()
                peer.push(body, priority)
                lat.append(clock() - t0)

        _settle()
        for k in range(threads):
            workers.spawn(produce, k)
        seconds = workers.run(budget)
    finally:
        peer.close()
    lat_all = [x for lat in lat_by for x in lat]
    p50, p99 = percentiles(lat_all)
    return Sample("push (threads)", len(items[0][0]), spec.name, threads, len(lat_all), seconds,
                  p50, p99)
