"""Threads sharing one store: exactly-once delivery to ackers, and group commit."""

from __future__ import annotations

import itertools
import random
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import qstore

from ._support import assert_consistent


@dataclass
class Delivery:
    id: int
    receipt: str
    attempts: int
    popped: int  # event number taken after pop returned
    released: int  # event number taken before ack/nack was called
    outcome: str  # "ack", "nack" or "expired" (LeaseExpired or MessageNotFound)


def run_threads(targets: list[Callable[[], None]], timeout: float = 120.0) -> None:
    """Run each target in a thread; re-raise the first failure."""
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by the test thread below
                errors.append(exc)
        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]


def produce_and_consume(store: qstore.Store, clock: Any, *, producers: int, per_producer: int,
                        consumers: int, slow: float) -> tuple[list[int], list[Delivery]]:
    """Producers push while consumers pop, sometimes nack, extend or stall past the lease."""
    q = store.create_queue("q", max_attempts=1000)
    total = producers * per_producer
    tick = itertools.count()  # next() is atomic: a global order of events
    pushed: list[int] = []
    deliveries: list[Delivery] = []
    acked = [0]
    lock = threading.Lock()
    all_acked = threading.Event()

    def producer(seed: int) -> None:
        rng = random.Random(seed)
        left = per_producer
        while left:
            n = min(left, rng.choice([1, 1, 5]))
            bodies = [b"%d-%d" % (seed, left - i) for i in range(n)]
            ids = [q.push(bodies[0], priority=rng.randrange(3))] if n == 1 else q.push_many(bodies)
            pushed.extend(ids)
            left -= n

    def release_waiters() -> None:
        # Waits are measured by the injected clock, which moves only by hand: once
        # the work is done (or a consumer failed) the clock jumps to every deadline.
        clock.autojump = True
        clock.advance(0.0)

    def consumer(seed: int) -> None:
        try:
            consume(seed)
        finally:
            release_waiters()

    def consume(seed: int) -> None:
        rng = random.Random(seed)
        while not all_acked.is_set():
            for msg in q.pop_many(rng.randint(1, 3), lease=10.0, wait=0.02):
                popped = next(tick)
                assert msg.receipt is not None
                outcome = "nack" if msg.attempts == 1 and rng.random() < 0.2 else "ack"
                released = -1
                try:
                    if rng.random() < 0.1:
                        q.extend(msg, lease=10.0)
                    if rng.random() < slow:
                        clock.advance(10.0)  # this consumer stalls past its lease
                    released = next(tick)
                    (q.nack if outcome == "nack" else q.ack)(msg)
                except (qstore.LeaseExpired, qstore.MessageNotFound):
                    # Expired, or expired and since acked by its next holder.
                    outcome = "expired"
                    released = next(tick) if released < 0 else released
                with lock:
                    deliveries.append(Delivery(msg.id, msg.receipt, msg.attempts, popped,
                                               released, outcome))
                    if outcome == "ack":
                        acked[0] += 1
                        if acked[0] == total:
                            all_acked.set()

    run_threads([lambda s=s: producer(s) for s in range(producers)]
                + [lambda s=s: consumer(100 + s) for s in range(consumers)])
    assert_consistent(store, q)
    assert q.stats().total == 0, "every message was acked: nothing may be left"
    return pushed, deliveries


def test_each_message_is_acked_exactly_once_by_concurrent_consumers(store: qstore.Store,
                                                                    clock: Any) -> None:
    pushed, deliveries = produce_and_consume(store, clock, producers=3, per_producer=150,
                                             consumers=4, slow=0.0)
    assert len(pushed) == len(set(pushed)) == 450
    acks = [d.id for d in deliveries if d.outcome == "ack"]
    assert sorted(acks) == sorted(pushed), "every message delivered to exactly one acker"
    assert not [d for d in deliveries if d.outcome == "expired"], "the clock never moved"
    by_id: dict[int, list[Delivery]] = defaultdict(list)
    for d in deliveries:
        by_id[d.id].append(d)
    assert any(len(ds) > 1 for ds in by_id.values()), "some nacked message came back"
    for mid, ds in by_id.items():
        ds.sort(key=lambda d: d.attempts)
        assert [d.attempts for d in ds] == list(range(1, len(ds) + 1)), mid
        assert len({d.receipt for d in ds}) == len(ds), "each delivery has its own receipt"
        assert [d.outcome for d in ds] == ["nack"] * (len(ds) - 1) + ["ack"]
        for before, after in itertools.pairwise(ds):
            # No two holders at once: a re-delivery returns only after the previous
            # holder began to give the message back.
            assert after.popped > before.released, f"message {mid} was held twice at once"


def test_a_consumer_whose_lease_ran_out_cannot_ack_another_delivery(store: qstore.Store,
                                                                    clock: Any) -> None:
    pushed, deliveries = produce_and_consume(store, clock, producers=2, per_producer=100,
                                             consumers=4, slow=0.15)
    acks = [d.id for d in deliveries if d.outcome == "ack"]
    assert sorted(acks) == sorted(pushed), "exactly one successful ack per message"
    expired = [d for d in deliveries if d.outcome == "expired"]
    assert expired, "some consumer stalled past its lease"
    receipts = [d.receipt for d in deliveries]
    assert len(receipts) == len(set(receipts))


def test_always_mode_with_eight_threads_groups_commits(store_path: str, clock: Any) -> None:
    threads, per_thread = 8, 40
    with qstore.open(store_path, durability="always", clock=clock, compactor=False) as store:
        q = store.create_queue("q")
        # One thread alone: every push waits for its own sync.
        base = store.core.syncer.syncs
        for i in range(10):
            q.push(b"alone %d" % i)
        assert store.core.syncer.syncs - base == 10

        base = store.core.syncer.syncs
        barrier = threading.Barrier(threads)
        ids: list[int] = []

        def producer(t: int) -> None:
            barrier.wait()
            for i in range(per_thread):
                ids.append(q.push(b"%d:%d" % (t, i), priority=t))

        run_threads([lambda t=t: producer(t) for t in range(threads)])
        syncs = store.core.syncer.syncs - base
        pushes = threads * per_thread
        assert len(set(ids)) == pushes
        assert 0 < syncs < pushes, f"{syncs} syncs for {pushes} pushes: no group commit"
        assert q.stats().ready == pushes + 10
        got = {m.payload for m in q.peek(10_000)}
        assert got >= {b"%d:%d" % (t, i) for t in range(threads) for i in range(per_thread)}
        assert_consistent(store, q)


def test_interval_and_none_modes_do_not_sync_on_each_push(store_path: str, clock: Any) -> None:
    with qstore.open(store_path, durability="none", clock=clock, compactor=False) as store:
        q = store.create_queue("q")
        base = store.core.syncer.syncs
        for i in range(50):
            q.push(b"%d" % i)
        assert store.core.syncer.syncs == base
