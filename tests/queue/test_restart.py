"""Reopening a store: every message, lease, counter and id high-water mark survives."""

from __future__ import annotations

import random
from typing import Any

import pytest

import qstore
from qstore.meta import keys

from ._support import assert_consistent, dump

MODES = ["always", "interval", "none"]


def reopen(path: str, clock: Any, **options: Any) -> qstore.Store:
    return qstore.open(path, clock=clock, compactor=False, **options)


def queue_keys(snapshot: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """The queue records, counters, messages and indexes of a dump, byte for byte."""
    kinds = {keys.QUEUE, keys.COUNTS, *keys.PER_QUEUE_KINDS}
    return [(k, v) for k, v in snapshot["db"] if k[:1] in kinds]


@pytest.fixture
def populated(store_path: str, clock: Any) -> dict[str, Any]:
    """A closed store with queue "q" (max_attempts=1) holding a message in each state."""
    with reopen(store_path, clock, segment_max_bytes=4096) as store:
        q = store.create_queue("q", order="min", max_attempts=1)
        ids = {"dead": q.push(b"dead body", priority=0)}
        q.nack(q.pop(lease=5.0))  # type: ignore[arg-type]
        ids["in_flight"] = q.push(b"leased", priority=1)
        held = q.pop(lease=10.0)
        assert held is not None and held.id == ids["in_flight"]
        ids["delayed"] = q.push(b"later", priority=-5, delay=20.0)
        ids["ready"] = q.push(b"ready " * 10, priority=2)
        ids["ready2"] = q.push(bytes(range(256)) * 20, priority=2)  # its own segment
        views = {name: q.get(mid) for name, mid in ids.items()}
        stats = q.stats()
        before = dump(store)
    return {"ids": ids, "views": views, "stats": stats, "held": held, "dump": before}


@pytest.mark.parametrize("mode", MODES)
def test_reopen_returns_every_message_in_its_state(store_path: str, clock: Any,
                                                   populated: dict[str, Any], mode: str) -> None:
    with reopen(store_path, clock, durability=mode) as store:
        q = store.queue("q")
        for name, mid in populated["ids"].items():
            assert q.get(mid) == populated["views"][name], name
        assert q.stats() == populated["stats"]
        assert queue_keys(dump(store)) == queue_keys(populated["dump"])
        assert assert_consistent(store, q).in_flight == 1
        assert [m.id for m in q.peek(10)] == [populated["ids"]["ready"],
                                             populated["ids"]["ready2"]]
        (dead,) = q.dead_letters()
        assert (dead.id, dead.payload, dead.attempts) == (populated["ids"]["dead"],
                                                          b"dead body", 1)
        q.ack(populated["held"])  # the lease taken before the reopen is still live


def test_a_lease_keeps_its_deadline_across_reopen(store_path: str, clock: Any,
                                                  populated: dict[str, Any]) -> None:
    held = populated["held"]
    clock.advance(9.5)
    with reopen(store_path, clock) as store:
        q = store.queue("q")
        assert q.get(held.id).lease_deadline == held.lease_deadline
        assert q.stats().in_flight == 1
        assert [m.id for m in q.pop_many(10)] == [populated["ids"]["ready"],
                                                 populated["ids"]["ready2"]]
    clock.advance(0.5)  # the deadline passes while the store is closed
    with reopen(store_path, clock) as store:
        q = store.queue("q")
        with pytest.raises(qstore.LeaseExpired):
            q.ack(held)
        # max_attempts=1: an expired last attempt is a dead letter.
        assert q.get(held.id).state == "dead"
        assert [m.id for m in q.dead_letters()] == sorted([populated["ids"]["dead"], held.id])
        assert_consistent(store, q)


def test_an_expired_lease_returns_to_ready_after_reopen(store_path: str, clock: Any) -> None:
    with reopen(store_path, clock) as store:
        q = store.create_queue("q", max_attempts=3)
        mid = q.push(b"x")
        held = q.pop(lease=10.0)
    clock.advance(100.0)
    with reopen(store_path, clock) as store:
        q = store.queue("q")
        assert q.stats().ready == 1
        again = q.pop()
        assert again is not None and (again.id, again.attempts) == (mid, 2)
        assert held is not None and again.receipt != held.receipt
        with pytest.raises(qstore.LeaseExpired):
            q.ack(held)
        q.ack(again)


def test_a_delay_keeps_its_due_time_across_reopen(store_path: str, clock: Any,
                                                  populated: dict[str, Any]) -> None:
    delayed = populated["ids"]["delayed"]
    clock.advance(19.5)
    with reopen(store_path, clock) as store:
        assert store.queue("q").get(delayed).state == "delayed"
    clock.advance(0.5)
    with reopen(store_path, clock) as store:
        q = store.queue("q")
        msg = q.pop()
        assert msg is not None and msg.id == delayed  # priority -5 on a min queue
        assert msg.payload == b"later"


def test_message_ids_never_repeat_across_reopens(store_path: str, clock: Any) -> None:
    seen: list[int] = []
    for round_ in range(6):
        with reopen(store_path, clock) as store:
            q = store.create_queue("q", exist_ok=True)
            ids = q.push_many([b"%d" % round_] * 3)
            ids.append(q.push(b"single"))
            for msg in q.pop_many(10):  # ack everything, the newest ids included
                q.ack(msg)
            assert q.stats().total == 0
        assert min(ids) > max(seen, default=0)
        seen.extend(ids)
    assert len(set(seen)) == len(seen)


def test_message_ids_never_repeat_past_an_id_block(store_path: str, clock: Any) -> None:
    """Ids are reserved in blocks; crossing a block boundary must persist the new one."""
    with reopen(store_path, clock) as store:
        q = store.create_queue("q")
        first = q.push_many([b""] * 4500)
        q.ack_many(q.pop_many(4500))
    with reopen(store_path, clock) as store:
        q = store.queue("q")
        second = q.push_many([b""] * 10)
    assert min(second) > max(first)
    assert len(set(first)) == 4500


def test_ids_go_on_from_the_last_one_after_a_clean_close(store_path: str, clock: Any) -> None:
    """A clean close gives back the unused rest of its id block (a crash skips it)."""
    with reopen(store_path, clock) as store:
        q = store.create_queue("q")
        first = [q.push(b"a"), *q.push_many([b"b", b"c"])]
    with reopen(store_path, clock) as store:
        pass  # an open and close that hands out nothing moves nothing
    with reopen(store_path, clock) as store:
        q = store.queue("q")
        second = [q.push(b"d"), *q.push_many([b"e"] * 4500)]  # crosses a block
    with reopen(store_path, clock) as store:
        third = store.queue("q").push(b"f")
    assert first == [1, 2, 3]
    assert second == list(range(4, 4505))
    assert third == 4505


def test_counters_survive_reopen(store_path: str, clock: Any) -> None:
    rng = random.Random(5)
    with reopen(store_path, clock, segment_max_bytes=4096) as store:
        queues = [store.create_queue(n, max_attempts=2) for n in ("a", "b", "c")]
        for _ in range(200):
            q = rng.choice(queues)
            r = rng.random()
            if r < 0.5:
                q.push(rng.randbytes(rng.randrange(300)), priority=rng.randrange(5),
                       delay=rng.choice([0.0, 0.0, 30.0]))
            elif r < 0.8:
                msg = q.pop(lease=rng.choice([1.0, 100.0]))
                if msg is not None and rng.random() < 0.5:
                    rng.choice([q.ack, q.nack])(msg)
            else:
                clock.advance(1.0)
        stats = [q.stats() for q in queues]
        segments = store.stats().segments
        assert any(s.dead for s in stats) and any(s.in_flight for s in stats)
    with reopen(store_path, clock) as store:
        assert [store.queue(n).stats() for n in ("a", "b", "c")] == stats
        for n in ("a", "b", "c"):
            assert_consistent(store, store.queue(n))
        reopened = {s.file_id: (s.live_bytes, s.live_count) for s in store.stats().segments}
        assert {s.file_id: (s.live_bytes, s.live_count) for s in segments} == reopened


@pytest.mark.parametrize("mode", MODES)
def test_each_durability_mode_round_trips(store_path: str, clock: Any, mode: str) -> None:
    rng = random.Random(mode)
    bodies = [rng.randbytes(rng.choice([0, 1, 100, 1000, 5000])) for _ in range(60)]
    with reopen(store_path, clock, durability=mode, segment_max_bytes=4096) as store:
        assert store.config.durability == mode
        q = store.create_queue("q", order="fifo")
        ids = [q.push(b) for b in bodies[:30]] + q.push_many(bodies[30:])
        gone = q.pop_many(10)
        q.ack_many(gone)
        assert len(store.stats().segments) > 2  # rotation happened
    with reopen(store_path, clock, durability=mode) as store:
        q = store.queue("q")
        assert q.stats().ready == 50
        assert [m.id for m in q.peek(100)] == ids[10:]
        assert [m.payload for m in q.peek(100)] == bodies[10:]
        for mid in ids[:10]:
            with pytest.raises(qstore.MessageNotFound):
                q.get(mid)
        assert_consistent(store, q)


@pytest.mark.parametrize("first,second", [("always", "none"), ("none", "always"),
                                          ("interval", "always")])
def test_a_store_reopens_in_another_durability_mode(store_path: str, clock: Any, first: str,
                                                    second: str) -> None:
    with reopen(store_path, clock, durability=first) as store:
        store.create_queue("q").push(b"x")
    with reopen(store_path, clock, durability=second) as store:
        q = store.queue("q")
        q.push(b"y")
        assert sorted(m.payload for m in q.peek(5)) == [b"x", b"y"]


def test_queue_config_and_dedup_index_survive_reopen(store_path: str, clock: Any) -> None:
    with reopen(store_path, clock) as store:
        q = store.create_queue("q", order="min", priority_type="str", max_attempts=4,
                               dedup=True)
        mid = q.push(b"once", priority="p")
        keyed = q.push(b"other", dedup_key="job")
    with reopen(store_path, clock) as store:
        q = store.queue("q")
        assert (q.order, q.priority_type, q.max_attempts, q.dedup) == ("min", "str", 4, True)
        assert q.push(b"once") == mid
        assert q.push(b"different", dedup_key="job") == keyed
        assert q.stats().ready == 2
        assert store.create_queue("q", order="min", priority_type="str", max_attempts=4,
                                  dedup=True, exist_ok=True).get(mid).priority == "p"


def test_deleted_and_purged_queues_stay_so_after_reopen(store_path: str, clock: Any) -> None:
    with reopen(store_path, clock) as store:
        store.create_queue("gone").push(b"x")
        store.delete_queue("gone")
        kept = store.create_queue("purged")
        kept.push_many([b"a", b"b"])
        kept.purge()
    with reopen(store_path, clock) as store:
        assert store.queues() == ["purged"]
        with pytest.raises(qstore.QueueNotFound):
            store.queue("gone")
        q = store.queue("purged")
        assert q.stats().total == 0 and q.pop() is None
        assert_consistent(store, q)


def test_receipts_stay_unique_across_reopens(store_path: str, clock: Any) -> None:
    receipts = set()
    for _ in range(4):
        with reopen(store_path, clock) as store:
            q = store.create_queue("q", max_attempts=100, exist_ok=True)
            if q.stats().total == 0:
                q.push(b"x")
            msg = q.pop()
            assert msg is not None
            receipts.add(msg.receipt)
            q.nack(msg)
    assert len(receipts) == 4


def test_a_closed_store_refuses_every_operation(store_path: str, clock: Any) -> None:
    store = reopen(store_path, clock)
    q = store.create_queue("q")
    q.push(b"x")
    store.close()
    store.close()  # closing twice is harmless
    for op in (lambda: q.push(b"y"), q.pop, store.queues, lambda: store.queue("q"),
               lambda: store.create_queue("r"), store.stats, q.stats, q.peek,
               lambda: q.get(1), q.dead_letters, q.purge, q.redrive):
        with pytest.raises(qstore.StoreClosed):
            op()
