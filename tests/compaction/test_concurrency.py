"""Producers, consumers and back-to-back compaction passes, all at once."""

from __future__ import annotations

import random
import threading
from typing import Any

import qstore

from ._support import dead_sealed_segments, open_store, recount

PRODUCERS = 2
PER_PRODUCER = 300
CONSUMERS = 3


def make_payload(producer: int, i: int) -> bytes:
    rng = random.Random(producer * 100_003 + i)
    return f"{producer}:{i}:".encode() + rng.randbytes(rng.randint(0, 1500))


def check_payload(payload: bytes) -> tuple[int, int]:
    producer, i, _ = payload.split(b":", 2)
    key = (int(producer), int(i))
    assert payload == make_payload(*key), f"payload of {key} damaged"
    return key


def test_nothing_is_lost_duplicated_or_held_twice_while_passes_run_back_to_back(
    store_path: str, clock: Any
) -> None:
    store = open_store(store_path, clock, segment_max_bytes=8192)
    q = store.create_queue("q", max_attempts=10_000)
    total = PRODUCERS * PER_PRODUCER
    lock = threading.Lock()
    held: set[int] = set()
    acked: dict[int, tuple[int, int]] = {}  # id -> (producer, i) of its payload
    pushed: dict[int, tuple[int, int]] = {}
    errors: list[str] = []
    stop = threading.Event()
    backlog = threading.Event()  # consumers start behind, so passes have plenty to move
    passes: list[qstore.CompactionResult] = []

    def release_waiters() -> None:
        # Waits are measured by the injected clock, which moves only by hand: once
        # the work is done (or a thread failed) the clock jumps to every deadline.
        clock.autojump = True
        clock.advance(0.0)

    def guard(work: Any) -> Any:
        def run(*args: Any) -> None:
            try:
                work(*args)
            except BaseException as exc:  # reported by the test, not lost in the thread
                errors.append(f"{work.__name__}: {exc!r}")
                stop.set()
                release_waiters()
        return run

    @guard
    def producer(p: int) -> None:
        for i in range(PER_PRODUCER):
            mid = q.push(make_payload(p, i), priority=i % 10)
            with lock:
                pushed[mid] = (p, i)
                if len(pushed) == total // 3:
                    backlog.set()

    @guard
    def consumer(seed: int) -> None:
        rng = random.Random(seed)
        backlog.wait(timeout=300)
        while not stop.is_set():
            with lock:
                if len(acked) == total:
                    release_waiters()
                    return
            msgs = q.pop_many(rng.randint(1, 5), lease=3600.0, wait=0.01)
            with lock:
                for m in msgs:
                    if m.id in held:
                        errors.append(f"message {m.id} delivered while held")
                    held.add(m.id)
            for m in msgs:
                key = check_payload(m.payload)
                with lock:
                    held.discard(m.id)  # before it is released: the next holder may pop it
                if rng.random() < 0.7:
                    q.ack(m)
                    with lock:
                        if m.id in acked:
                            errors.append(f"message {m.id} acked twice")
                        acked[m.id] = key
                else:
                    q.nack(m)

    @guard
    def compactor() -> None:
        while not stop.is_set():
            passes.append(store.compact(threshold=0.0))

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(PRODUCERS)]
    threads += [threading.Thread(target=consumer, args=(c,)) for c in range(CONSUMERS)]
    background = threading.Thread(target=compactor)
    background.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    stop.set()
    background.join(timeout=300)

    assert errors == []
    assert not any(t.is_alive() for t in [*threads, background])
    assert len(acked) == total
    assert acked == pushed  # every message acked once, with the payload it was pushed with
    assert sorted(acked.values()) == [(p, i) for p in range(PRODUCERS) for i in range(PER_PRODUCER)]
    assert sum(r.messages_moved for r in passes) > 0
    assert q.stats().total == 0
    assert recount(store) == []
    store.compact()
    assert dead_sealed_segments(store) == []
    store.close()
