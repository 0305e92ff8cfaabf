"""Focused examples of each rule of the queue semantics (CONTRACT section 2)."""

from __future__ import annotations

import contextlib
import pickle
import random
import threading
import time
from typing import Any

import pytest

import qstore
from qstore import _core, _txn
from qstore.meta import keys, new_batch
from tests.conftest import FakeClock, wait_blocks

from ._support import Counts, assert_consistent, dump

INT_MIN, INT_MAX = -(2**63), 2**63 - 1


def pop1(q: qstore.Queue, lease: float = 30.0) -> qstore.Message:
    msg = q.pop(lease=lease)
    assert msg is not None
    return msg


def drain_ids(q: qstore.Queue) -> list[int]:
    """Pop and ack everything ready; the ids in pop order."""
    out = []
    while (msg := q.pop()) is not None:
        q.ack(msg)
        out.append(msg.id)
    return out


def counts(q: qstore.Queue) -> Counts:
    s = q.stats()
    return Counts(s.ready, s.delayed, s.in_flight, s.dead, s.bytes)


# -- order ------------------------------------------------------------------------------


def test_max_order_pops_the_highest_priority_first(store: qstore.Store) -> None:
    q = store.create_queue("q", order="max")
    ids = {p: q.push(b"%d" % p, priority=p) for p in (3, -7, 9, 0, 5)}
    assert drain_ids(q) == [ids[p] for p in (9, 5, 3, 0, -7)]


def test_min_order_pops_the_lowest_priority_first(store: qstore.Store) -> None:
    q = store.create_queue("q", order="min")
    ids = {p: q.push(b"%d" % p, priority=p) for p in (3, -7, 9, 0, 5)}
    assert drain_ids(q) == [ids[p] for p in (-7, 0, 3, 5, 9)]


def test_fifo_order_ignores_priority(store: qstore.Store) -> None:
    q = store.create_queue("q", order="fifo")
    ids = [q.push(b"x", priority=p) for p in (3, -7, 9, 0, 5)]
    assert drain_ids(q) == ids


def test_default_order_is_max(store: qstore.Store) -> None:
    q = store.create_queue("q")
    assert q.order == "max"
    low, high = q.push(b"l", priority=1), q.push(b"h", priority=2)
    assert drain_ids(q) == [high, low]


@pytest.mark.parametrize("order", ["max", "min", "fifo"])
@pytest.mark.parametrize("ptype,prio", [("int", 4), ("str", "m")])
def test_equal_priorities_pop_in_push_order(store: qstore.Store, order: str, ptype: str,
                                            prio: Any) -> None:
    q = store.create_queue("q", order=order, priority_type=ptype)
    ids = [q.push(b"%d" % i, priority=prio) for i in range(20)]
    assert ids == sorted(ids)
    assert drain_ids(q) == ids


@pytest.mark.parametrize("order", ["max", "min"])
def test_str_priorities_order_by_utf8_bytes(store: qstore.Store, order: str) -> None:
    prios = ["", "\x00", "\x00\x00", "\x00a", "\x01", "a", "a\x00", "a\x00b", "a\x01", "ab",
             "b", "\x7f", "\x80", "é", "z" * 1024, "\u07ff", "\u0800", "\uffff", "\U0001d11e",
             "\U0010ffff"]
    shuffled = prios[:]
    random.Random(7).shuffle(shuffled)
    q = store.create_queue("q", order=order, priority_type="str")
    by_prio = {p: q.push(p.encode("utf-8"), priority=p) for p in shuffled}
    want = sorted(prios, key=lambda p: p.encode("utf-8"), reverse=order == "max")
    got = []
    while (msg := q.pop()) is not None:
        got.append(msg.priority)
        assert msg.id == by_prio[msg.priority] and msg.payload == msg.priority.encode("utf-8")
    assert got == want


@pytest.mark.parametrize("order", ["max", "min"])
def test_int_priorities_span_the_signed_64_bit_range(store: qstore.Store, order: str) -> None:
    prios = [INT_MIN, INT_MIN + 1, -(2**32), -1, 0, 1, 2**32, INT_MAX - 1, INT_MAX]
    shuffled = prios[:]
    random.Random(3).shuffle(shuffled)
    q = store.create_queue("q", order=order)
    for p in shuffled:
        q.push(b"", priority=p)
    got = [pop1(q).priority for _ in prios]
    assert got == sorted(prios, reverse=order == "max")


def test_default_priority_is_zero_or_empty_string(store: qstore.Store) -> None:
    qi = store.create_queue("i", order="min")
    qi.push(b"neg", priority=-1)
    qi.push(b"default")
    qi.push(b"pos", priority=1)
    assert [m.payload for m in qi.peek(3)] == [b"neg", b"default", b"pos"]
    assert qi.peek(3)[1].priority == 0
    qs = store.create_queue("s", order="min", priority_type="str")
    qs.push(b"a", priority="a")
    qs.push(b"default")
    assert [m.payload for m in qs.peek(2)] == [b"default", b"a"]
    assert qs.peek(1)[0].priority == ""


# -- delay ------------------------------------------------------------------------------


def test_delayed_message_never_blocks_messages_behind_it(store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q", order="max")
    urgent = q.push(b"urgent-later", priority=100, delay=10.0)
    low = q.push(b"low-now", priority=1)
    assert counts(q) == Counts(1, 1, 0, 0, len(b"urgent-later") + len(b"low-now"))
    assert [m.id for m in q.peek(5)] == [low]
    first = pop1(q)
    assert first.id == low
    assert q.pop() is None
    clock.advance(10.0)
    assert pop1(q).id == urgent


def test_delayed_message_becomes_ready_exactly_at_its_due_time(store: qstore.Store,
                                                               clock: Any) -> None:
    q = store.create_queue("q")
    mid = q.push(b"x", delay=5.0)
    assert q.get(mid).state == "delayed"
    clock.advance(4.5)
    assert q.pop() is None
    assert q.get(mid).state == "delayed"
    clock.advance(0.5)
    msg = pop1(q)
    assert (msg.id, msg.attempts) == (mid, 1)


def test_push_many_delay_applies_to_items_without_their_own(store: qstore.Store,
                                                           clock: Any) -> None:
    q = store.create_queue("q", order="fifo")
    a, b, c = q.push_many([b"a", (b"b", 0, 0.0), (b"c", 0)], delay=3.0)
    assert [m.id for m in q.peek(5)] == [b]
    clock.advance(3.0)
    assert [m.id for m in q.peek(5)] == [a, b, c]


# -- peek, pop, pop_many ------------------------------------------------------------


def test_peek_does_not_lease(store: qstore.Store) -> None:
    q = store.create_queue("q")
    mid = q.push(b"body", priority=2)
    before = counts(q)
    for _ in range(3):
        (seen,) = q.peek(5)
        assert (seen.id, seen.payload, seen.attempts) == (mid, b"body", 0)
        assert seen.receipt is None and seen.lease_deadline is None and seen.state == "ready"
    assert counts(q) == before == Counts(1, 0, 0, 0, 4)
    msg = pop1(q)
    assert (msg.id, msg.attempts) == (mid, 1)
    assert q.peek(5) == []


def test_peek_returns_the_first_n_ready_in_pop_order(store: qstore.Store) -> None:
    q = store.create_queue("q", order="min")
    ids = {p: q.push(b"", priority=p) for p in (5, 1, 4, 2, 3)}
    q.push(b"", priority=0, delay=1.0)
    assert [m.id for m in q.peek(3)] == [ids[1], ids[2], ids[3]]
    assert [m.id for m in q.peek(100)] == [ids[p] for p in (1, 2, 3, 4, 5)]


def test_pop_many_returns_the_head_in_order(store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q", order="max")
    ids = {p: q.push(b"p%d" % p, priority=p) for p in (1, 7, 3, 9, 5, 8)}
    got = q.pop_many(4, lease=10.0)
    assert [m.id for m in got] == [ids[p] for p in (9, 8, 7, 5)]
    assert [m.payload for m in got] == [b"p9", b"p8", b"p7", b"p5"]
    assert all(m.attempts == 1 and m.lease_deadline == clock() + 10.0 for m in got)
    assert len({m.receipt for m in got}) == 4
    assert [m.id for m in q.pop_many(10)] == [ids[3], ids[1]]
    assert q.pop_many(10) == []
    assert counts(q).in_flight == 6


def test_pop_on_an_empty_queue_returns_none(store: qstore.Store) -> None:
    q = store.create_queue("q")
    assert q.pop() is None
    assert q.pop(wait=0.0) is None


def test_each_pop_gives_a_new_receipt(store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q", max_attempts=100)
    q.push(b"x")
    receipts = []
    for n in range(1, 6):
        msg = pop1(q, lease=1.0)
        assert msg.attempts == n
        receipts.append(msg.receipt)
        if n % 2:
            q.nack(msg)
        else:
            clock.advance(1.0)
    assert len(set(receipts)) == 5


# -- leases -----------------------------------------------------------------------------


def test_lease_hides_the_message_until_its_deadline(store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q")
    mid = q.push(b"x")
    msg = pop1(q, lease=10.0)
    assert msg.lease_deadline == clock() + 10.0
    clock.advance(9.5)
    assert q.pop() is None
    assert q.get(mid).state == "in_flight"
    clock.advance(0.5)  # clock() == deadline: expired
    assert q.get(mid).state == "ready"
    again = pop1(q)
    assert (again.id, again.attempts) == (mid, 2)
    assert again.receipt != msg.receipt


def test_ack_at_the_deadline_is_too_late(store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q")
    q.push(b"x")
    msg = pop1(q, lease=10.0)
    clock.advance(10.0)
    with pytest.raises(qstore.LeaseExpired):
        q.ack(msg)
    assert counts(q) == Counts(1, 0, 0, 0, 1)


def test_ack_just_before_the_deadline_succeeds(store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q")
    q.push(b"x")
    msg = pop1(q, lease=10.0)
    clock.advance(9.5)
    q.ack(msg)
    assert counts(q) == Counts(0, 0, 0, 0, 0)


def test_ack_accepts_the_message_or_its_receipt_string(store: qstore.Store) -> None:
    q = store.create_queue("q")
    a, b = q.push(b"a"), q.push(b"b")
    ma, mb = pop1(q), pop1(q)
    q.ack(ma)
    assert isinstance(mb.receipt, str)
    q.ack(mb.receipt)
    for mid in (a, b):
        with pytest.raises(qstore.MessageNotFound):
            q.get(mid)
    assert counts(q) == Counts(0, 0, 0, 0, 0)


def test_ack_many_takes_messages_and_receipts(store: qstore.Store) -> None:
    q = store.create_queue("q")
    q.push_many([b"a", b"b", b"c"])
    msgs = q.pop_many(3)
    assert q.ack_many([msgs[0], msgs[1].receipt, msgs[2]]) == 3
    assert counts(q) == Counts(0, 0, 0, 0, 0)
    assert q.ack_many([]) == 0


def test_a_popped_message_equals_its_fields_with_the_receipt_written_out(
        store: qstore.Store) -> None:
    # A pop writes the receipt string only when it is read (qstore/_message.py).
    q = store.create_queue("q")
    q.push_many([b"a", b"b"])
    first, second = q.pop_many(2)
    fields = (first.id, first.queue, first.priority, first.payload, first.attempts,
              first.enqueued_at, first.lease_deadline, first.receipt, first.state)
    qid = int(first.receipt.split("-")[0], 16)
    assert first.receipt == f"{qid:x}-{first.id:x}-1"
    rebuilt = qstore.Message(*fields)
    assert rebuilt == first and hash(rebuilt) == hash(first)
    # Compared, hashed and pickled before anything read its receipt: the same.
    assert second == pickle.loads(pickle.dumps(second))
    assert hash(second) == hash(qstore.Message(*pickle.loads(pickle.dumps(second))._fields()))
    assert pickle.loads(pickle.dumps(second)).receipt == f"{qid:x}-{second.id:x}-1"
    assert second != first


def test_ack_many_that_fails_changes_nothing_and_the_good_leases_still_ack(
        store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q", max_attempts=5)
    q.push_many([b"a", b"b", b"c"])
    short = pop1(q, lease=1.0)
    rest = q.pop_many(2, lease=30.0)
    clock.advance(1.0)  # the first lease has run out
    before = dump(store)
    with pytest.raises(qstore.LeaseExpired):
        q.ack_many([rest[0], short, rest[1]])
    with pytest.raises(qstore.InvalidArgument, match=f"message {rest[1].id} appears twice"):
        q.ack_many([rest[0], rest[1], rest[1].receipt])
    assert dump(store) == before
    assert q.ack_many(rest) == 2  # their records come back from RocksDB
    assert counts(q) == Counts(1, 0, 0, 0, 1)
    assert_consistent(store, q)


def test_ack_many_refuses_one_popped_message_named_twice(store: qstore.Store) -> None:
    # Both items are live leases this process popped: the first hands its record
    # over, so the second must still be found out as the same message.
    q = store.create_queue("q")
    q.push_many([b"a", b"b"])
    popped = q.pop_many(2)
    before = dump(store)
    with pytest.raises(qstore.InvalidArgument, match=f"message {popped[1].id} appears twice"):
        q.ack_many([popped[1], popped[0], popped[1]])
    assert dump(store) == before
    assert q.ack_many(popped) == 2
    assert counts(q) == Counts(0, 0, 0, 0, 0)
    assert_consistent(store, q)


def test_nack_and_extend_take_the_receipt_string(store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q")
    mid = q.push(b"x")
    msg = pop1(q, lease=5.0)
    extended = q.extend(msg.receipt, lease=20.0)
    assert extended.lease_deadline == clock() + 20.0
    q.nack(msg.receipt)
    assert q.get(mid).state == "ready"


def test_attempts_count_deliveries(store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q", max_attempts=10)
    mid = q.push(b"x")
    assert q.get(mid).attempts == 0
    assert pop1(q).attempts == 1
    clock.advance(30.0)
    msg = pop1(q)
    assert msg.attempts == 2
    q.nack(msg)
    assert q.get(mid).attempts == 2
    assert pop1(q).attempts == 3


def test_extend_keeps_the_receipt_and_moves_the_deadline(store: qstore.Store,
                                                         clock: Any) -> None:
    q = store.create_queue("q")
    mid = q.push(b"x")
    msg = pop1(q, lease=10.0)
    clock.advance(8.0)
    ext = q.extend(msg, lease=10.0)
    assert ext.receipt == msg.receipt
    assert ext.lease_deadline == clock() + 10.0
    assert (ext.id, ext.payload, ext.attempts) == (mid, b"x", 1)
    clock.advance(5.0)  # past the first deadline, before the new one
    assert q.pop() is None
    assert q.get(mid).lease_deadline == ext.lease_deadline
    q.ack(msg)  # the original receipt is still the live one
    assert counts(q) == Counts(0, 0, 0, 0, 0)


def test_extend_can_shorten_a_lease(store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q")
    mid = q.push(b"x")
    msg = pop1(q, lease=100.0)
    q.extend(msg, lease=1.0)
    clock.advance(1.0)
    assert q.get(mid).state == "ready"
    with pytest.raises(qstore.LeaseExpired):
        q.ack(msg)


def _lease_ops(q: qstore.Queue, item: Any) -> list[Any]:
    return [lambda: q.ack(item), lambda: q.nack(item), lambda: q.nack(item, delay=5.0),
            lambda: q.extend(item, lease=50.0), lambda: q.ack_many([item])]


@pytest.mark.parametrize("as_receipt", [False, True])
def test_an_expired_receipt_raises_lease_expired_and_changes_nothing(
        store: qstore.Store, clock: Any, as_receipt: bool) -> None:
    q = store.create_queue("q")
    mid = q.push(b"x")
    q.push(b"other")
    msg = pop1(q, lease=10.0)
    clock.advance(10.0)
    before = dump(store)
    assert q.get(mid).state == "ready"
    for op in _lease_ops(q, msg.receipt if as_receipt else msg):
        with pytest.raises(qstore.LeaseExpired):
            op()
        assert dump(store) == before
    got = q.get(mid)
    assert (got.state, got.attempts) == ("ready", 1)
    assert_consistent(store, q)


@pytest.mark.parametrize("as_receipt", [False, True])
def test_a_superseded_receipt_raises_lease_expired_and_changes_nothing(
        store: qstore.Store, clock: Any, as_receipt: bool) -> None:
    q = store.create_queue("q")
    mid = q.push(b"x")
    old = pop1(q, lease=10.0)
    clock.advance(10.0)
    new = pop1(q, lease=10.0)
    assert new.id == mid and new.receipt != old.receipt
    before = dump(store)
    for op in _lease_ops(q, old.receipt if as_receipt else old):
        with pytest.raises(qstore.LeaseExpired):
            op()
        assert dump(store) == before
    got = q.get(mid)
    assert (got.state, got.attempts, got.lease_deadline) == ("in_flight", 2, new.lease_deadline)
    q.ack(new)  # the slow consumer did not disturb the current holder
    assert counts(q) == Counts(0, 0, 0, 0, 0)


def test_a_receipt_is_dead_once_the_message_was_nacked(store: qstore.Store) -> None:
    q = store.create_queue("q")
    mid = q.push(b"x")
    msg = pop1(q)
    q.nack(msg)
    with pytest.raises(qstore.LeaseExpired):
        q.ack(msg)
    assert q.get(mid).state == "ready"


def test_double_ack_raises_message_not_found(store: qstore.Store) -> None:
    q = store.create_queue("q")
    q.push(b"x")
    msg = pop1(q)
    q.ack(msg)
    before = dump(store)
    for op in (lambda: q.ack(msg), lambda: q.ack(msg.receipt), lambda: q.nack(msg),
               lambda: q.extend(msg)):
        with pytest.raises(qstore.MessageNotFound):
            op()
    assert dump(store) == before


def test_ack_many_acks_nothing_if_one_lease_is_not_live(store: qstore.Store,
                                                       clock: Any) -> None:
    q = store.create_queue("q")
    q.push_many([b"a", b"b"])
    short = pop1(q, lease=1.0)
    long = pop1(q, lease=100.0)
    clock.advance(1.0)
    with pytest.raises(qstore.LeaseExpired):
        q.ack_many([long, short])
    assert q.get(long.id).state == "in_flight"
    assert counts(q) == Counts(1, 0, 1, 0, 2)
    with pytest.raises(qstore.InvalidArgument):
        q.ack_many([long, long.receipt])
    assert q.get(long.id).state == "in_flight"
    assert q.ack_many([long]) == 1


# -- returning to its own place ---------------------------------------------------------


def _three(q: qstore.Queue) -> tuple[int, int, int]:
    """Two equal high priorities and a low one."""
    return q.push(b"h1", priority=5), q.push(b"h2", priority=5), q.push(b"low", priority=1)


def test_a_nacked_message_returns_to_its_own_place(store: qstore.Store) -> None:
    q = store.create_queue("q", order="max")
    h1, h2, low = _three(q)
    q.nack(pop1(q))
    assert drain_ids(q) == [h1, h2, low]


def test_an_expired_message_returns_to_its_own_place(store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q", order="max")
    h1, h2, low = _three(q)
    pop1(q, lease=5.0)
    clock.advance(5.0)
    assert drain_ids(q) == [h1, h2, low]


def test_a_redriven_message_returns_to_its_own_place(store: qstore.Store) -> None:
    q = store.create_queue("q", order="max", max_attempts=1)
    h1, h2, low = _three(q)
    q.nack(pop1(q))
    assert [m.id for m in q.dead_letters()] == [h1]
    assert q.redrive() == 1
    assert drain_ids(q) == [h1, h2, low]


def test_a_nacked_fifo_message_goes_to_the_front_not_the_back(store: qstore.Store) -> None:
    q = store.create_queue("q", order="fifo")
    ids = [q.push(b"%d" % i) for i in range(4)]
    q.nack(pop1(q))
    assert drain_ids(q) == ids


def test_nack_with_delay_delays_the_message(store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q", order="fifo")
    first, second = q.push(b"1"), q.push(b"2")
    q.nack(pop1(q), delay=5.0)
    assert q.get(first).state == "delayed"
    assert counts(q) == Counts(1, 1, 0, 0, 2)
    assert pop1(q).id == second
    assert q.pop() is None
    clock.advance(5.0)
    msg = pop1(q)
    assert (msg.id, msg.attempts) == (first, 2)


# -- dead letters -----------------------------------------------------------------------


@pytest.mark.parametrize("delay", [0.0, 5.0])
def test_a_nack_after_the_last_attempt_moves_the_message_to_dead(store: qstore.Store,
                                                                 delay: float) -> None:
    q = store.create_queue("q", max_attempts=2)
    mid = q.push(b"x")
    q.nack(pop1(q), delay=0.0)
    assert q.get(mid).state == "ready"
    last = pop1(q)
    assert last.attempts == 2
    q.nack(last, delay=delay)
    got = q.get(mid)
    assert (got.state, got.attempts, got.payload) == ("dead", 2, b"x")
    assert counts(q) == Counts(0, 0, 0, 1, 1)
    assert q.pop() is None


def test_a_lease_expiring_after_the_last_attempt_moves_the_message_to_dead(
        store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q", max_attempts=2)
    mid = q.push(b"x")
    for _ in range(2):
        pop1(q, lease=3.0)
        clock.advance(3.0)
    assert q.pop() is None
    assert q.get(mid).state == "dead"
    assert counts(q) == Counts(0, 0, 0, 1, 1)


def test_dead_letters_lists_oldest_first_with_payload(store: qstore.Store) -> None:
    q = store.create_queue("q", order="min", max_attempts=1)
    ids = [q.push(b"body-%d" % p, priority=p) for p in (9, 1, 5)]
    for _ in ids:
        q.nack(pop1(q))
    dead = q.dead_letters(10)
    assert [m.id for m in dead] == sorted(ids)
    assert [m.payload for m in dead] == [b"body-9", b"body-1", b"body-5"]
    assert all(m.state == "dead" and m.attempts == 1 and m.receipt is None for m in dead)
    assert [m.id for m in q.dead_letters(2)] == sorted(ids)[:2]


def test_redrive_moves_up_to_n_dead_letters_back_with_attempts_reset(store: qstore.Store,
                                                                     clock: Any) -> None:
    q = store.create_queue("q", order="fifo", max_attempts=1)
    ids = q.push_many([b"a", b"b", b"c"])
    for _ in ids:
        q.nack(pop1(q))
    assert q.redrive(2) == 2
    assert counts(q) == Counts(2, 0, 0, 1, 3)
    assert [m.attempts for m in q.peek(5)] == [0, 0]
    assert [m.id for m in q.dead_letters()] == [ids[2]]
    msg = pop1(q)
    assert (msg.id, msg.attempts) == (ids[0], 1)
    assert q.redrive(100) == 1
    assert q.redrive(100) == 0


def test_dead_letters_are_read_past_those_redriven_before_and_none_is_missed(
        store: qstore.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # dead_letters(n) and redrive(n) read the index from its start, stepping over
    # the tombstone of every dead letter redriven before: draining 200,000 in
    # batches took 4.6 ms a batch at first and 32 ms at the end (resource audit).
    q = store.create_queue("q", max_attempts=1, order="fifo")
    first = q.push(b"late")  # the lowest id: it dies after the others are redriven
    q.push_many([b"%d" % i for i in range(30)])
    late = pop1(q)
    assert late.id == first
    for _ in range(30):
        q.nack(pop1(q))
    starts: list[bytes] = []
    real = store.core.meta.scan_keys

    def scan(lo: bytes, hi: bytes, limit: int | None = None) -> list[bytes]:
        if lo[:1] == keys.DEAD:
            starts.append(lo)
        return real(lo, hi, limit)

    monkeypatch.setattr(store.core.meta, "scan_keys", scan)
    assert q.redrive(10) == 10
    assert [m.payload for m in q.dead_letters(3)] == [b"10", b"11", b"12"]
    assert keys.trailing_id(starts[-1]) == first + 11  # past the ten redriven
    q.nack(late)  # a dead letter below the others
    assert [m.payload for m in q.dead_letters(2)] == [b"late", b"10"]
    assert q.redrive(100) == 21
    assert q.dead_letters() == [] and q.stats().ready == 31
    assert q.purge() == 31
    q.push(b"after")
    q.nack(pop1(q))
    assert [m.payload for m in q.dead_letters()] == [b"after"]


def test_redrive_sees_a_lease_that_expired_since_the_last_call(store: qstore.Store,
                                                              clock: Any) -> None:
    q = store.create_queue("q", max_attempts=1)
    mid = q.push(b"x")
    pop1(q, lease=5.0)
    clock.advance(5.0)  # the message is dead now, though nothing has looked yet
    assert q.redrive(10) == 1
    got = q.get(mid)
    assert (got.state, got.attempts) == ("ready", 0)


def test_a_redriven_message_gets_fresh_attempts_and_new_receipts(store: qstore.Store) -> None:
    q = store.create_queue("q", max_attempts=1)
    q.push(b"x")
    first = pop1(q)
    q.nack(first)
    q.redrive()
    second = pop1(q)
    assert second.attempts == 1 and second.receipt != first.receipt
    with pytest.raises(qstore.LeaseExpired):
        q.ack(first)
    q.nack(second)
    assert counts(q).dead == 1


# -- dedup ------------------------------------------------------------------------------


def test_dedup_returns_the_live_message_in_any_state(store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q", dedup=True, max_attempts=1)
    ready = q.push(b"ready")
    delayed = q.push(b"delayed", delay=50.0)
    leased = q.push(b"leased", priority=9)
    assert pop1(q).id == leased
    before = counts(q)
    for body, mid in ((b"ready", ready), (b"delayed", delayed), (b"leased", leased)):
        assert q.push(body, priority=3) == mid
        assert q.push_many([body]) == [mid]
    assert counts(q) == before


def _dead_letter(store: qstore.Store, clock: Any, how: str,
                 keyed: bool) -> tuple[qstore.Queue, str | None, int]:
    """A dedup queue whose one message (key "job-7", or its payload's hash) became a
    dead letter ``how``; (the queue, the key, the message id)."""
    q = store.create_queue("q", dedup=True, max_attempts=1,
                           on_expire="dead" if how == "ttl-expiry" else "drop")
    key = "job-7" if keyed else None
    first = q.push(b"body", dedup_key=key, ttl=5.0 if how == "ttl-expiry" else None)
    if how == "nack":
        q.nack(pop1(q))
    elif how == "lease-expiry":
        pop1(q, lease=1.0)
        clock.advance(2.0)
    elif how == "ttl-expiry":
        clock.advance(6.0)
    else:  # its payload bytes are damaged: the pop moves it to the dead letters
        state = store.core.queues["q"]
        ref = store.core.records_of(state, [keys.message_key(state.qid, first)])[0]
        with open(store.core.payload.path_of(ref.file_id), "r+b") as f:
            f.seek(ref.offset + 8)
            f.write(b"X")
        assert q.pop() is None
    assert [m.id for m in q.dead_letters()] == [first]
    return q, key, first


@pytest.mark.parametrize("how", ["nack", "lease-expiry", "ttl-expiry", "damaged"])
@pytest.mark.parametrize("keyed", [False, True], ids=["payload-hash", "explicit-key"])
def test_a_dead_letter_releases_its_dedup_key(store: qstore.Store, clock: Any, how: str,
                                               keyed: bool) -> None:
    """Contract section 2: a dead letter does not dedup, however it became one."""
    q, key, first = _dead_letter(store, clock, how, keyed)
    second = q.push(b"body", dedup_key=key)
    assert second > first, "a push matching only a dead letter makes a new message"
    assert q.push(b"body", dedup_key=key) == second, "and the new one dedups"
    assert q.stats().dead == 1 and q.stats().ready == 1
    # The check agrees; the damaged payload of a message set aside is a note.
    report = store.check()
    assert report.findings == ()
    assert [f.kind for f in report.notes] == (["damaged_set_aside"] if how == "damaged" else [])
    if how == "damaged":
        return
    # A redriven letter whose key has a new owner comes back as a plain message.
    assert q.redrive() == 1
    assert q.push(b"body", dedup_key=key) == second
    q.ack(pop1(q))  # the older, redriven one pops first...
    assert q.push(b"body", dedup_key=key) == second  # ...and its ack frees no key
    assert store.check().ok


@pytest.mark.parametrize("how", ["nack", "lease-expiry", "ttl-expiry"])
@pytest.mark.parametrize("keyed", [False, True], ids=["payload-hash", "explicit-key"])
def test_a_redriven_letter_dedups_again_when_no_one_holds_its_key(
        store: qstore.Store, clock: Any, how: str, keyed: bool) -> None:
    """Contract section 2: a push matching a live message (a redriven letter is
    ready again) enqueues nothing and returns its id."""
    q, key, first = _dead_letter(store, clock, how, keyed)
    assert q.stats().dead == 1
    assert store.check().ok  # a dead letter's digest owns no key: not a finding
    assert q.redrive() == 1
    assert q.push(b"body", dedup_key=key) == first, "the redriven letter dedups again"
    assert q.stats().ready == 1
    assert store.check().ok
    q.ack(pop1(q))
    assert q.push(b"body", dedup_key=key) > first  # its ack released the key


def test_of_two_dead_letters_with_one_key_the_first_redriven_takes_it(
        store: qstore.Store) -> None:
    q = store.create_queue("q", dedup=True, max_attempts=1)
    a = q.push(b"body", dedup_key="k")
    q.nack(pop1(q))
    b = q.push(b"body", dedup_key="k")  # a dead letter does not count: a new message
    assert b > a
    q.nack(pop1(q))
    assert q.stats().dead == 2
    assert q.redrive() == 2
    assert q.push(b"body", dedup_key="k") == a
    q.ack(pop1(q))  # a: the key is free again; b came back without one
    assert q.push(b"body", dedup_key="k") not in (a, b)
    assert store.check().ok


def test_a_payload_hash_and_an_explicit_key_never_collide(store: qstore.Store) -> None:
    """Format 1 hashed b"k" + key and the bare payload: push(b"kfoo") was key "foo"."""
    q = store.create_queue("q", dedup=True)
    by_payload = q.push(b"kfoo")
    by_key = q.push(b"other", dedup_key="foo")
    assert by_key != by_payload
    assert q.push_many([(b"x", 0, 0.0, b"foo"), b"kfoo"]) == [by_key, by_payload]
    keyed_first = q.push(b"payload-2", dedup_key=b"kbar")
    assert q.push(b"kkbar") != keyed_first
    assert counts(q).ready == 4
    assert store.check().ok


def test_dedup_forgets_a_message_once_acked_or_purged(store: qstore.Store) -> None:
    q = store.create_queue("q", dedup=True)
    first = q.push(b"x")
    q.ack(pop1(q))
    second = q.push(b"x")
    assert second > first
    assert q.purge() == 1
    third = q.push(b"x")
    assert third > second
    assert q.push(b"x") == third


def test_dedup_key_replaces_the_payload_hash(store: qstore.Store) -> None:
    q = store.create_queue("q", dedup=True)
    a = q.push(b"one", dedup_key="job-1")
    assert q.push(b"two", dedup_key="job-1") == a
    assert q.push(b"three", dedup_key=b"job-1") == a  # str keys are their UTF-8 bytes
    b = q.push(b"one", dedup_key="job-2")
    c = q.push(b"one")  # the payload hash is another key
    assert len({a, b, c}) == 3
    assert q.get(a).payload == b"one"
    assert counts(q).ready == 3


def test_dedup_within_one_push_many(store: qstore.Store) -> None:
    q = store.create_queue("q", dedup=True)
    ids = q.push_many([b"a", b"b", b"a", (b"c", 0, 0.0, "k"), (b"d", 0, 0.0, "k")])
    assert ids[0] == ids[2] and ids[3] == ids[4]
    assert len(set(ids)) == 3
    assert counts(q).ready == 3


def test_without_dedup_equal_payloads_are_separate_messages(store: qstore.Store) -> None:
    q = store.create_queue("q")
    assert q.push(b"x") != q.push(b"x")
    assert counts(q).ready == 2


# -- queues -----------------------------------------------------------------------------


def test_store_lists_and_deletes_queues(store: qstore.Store) -> None:
    assert store.queues() == []
    b = store.create_queue("b")
    store.create_queue("a")
    assert store.queues() == ["a", "b"]
    b.push(b"x")
    b.push(b"y", delay=5.0)
    b.pop()
    store.delete_queue("b")
    assert store.queues() == ["a"]
    with pytest.raises(qstore.QueueNotFound):
        store.queue("b")
    with pytest.raises(qstore.QueueNotFound):
        store.delete_queue("b")
    assert [s.queue for s in store.stats().queues] == ["a"]


def test_a_deleted_queue_handle_raises_queue_not_found(store: qstore.Store) -> None:
    q = store.create_queue("q")
    q.push(b"x")
    msg = pop1(q)
    store.delete_queue("q")
    for op in (lambda: q.push(b"y"), lambda: q.push_many([b"y"]), q.pop,
               lambda: q.pop_many(2), lambda: q.ack(msg), lambda: q.nack(msg),
               lambda: q.extend(msg), q.peek, lambda: q.get(msg.id), q.stats, q.purge,
               q.dead_letters, q.redrive):
        with pytest.raises(qstore.QueueNotFound):
            op()


def test_a_recreated_queue_starts_empty_and_rejects_old_receipts(store: qstore.Store) -> None:
    old = store.create_queue("q")
    mid = old.push(b"x")
    msg = pop1(old)
    store.delete_queue("q")
    new = store.create_queue("q")
    assert counts(new) == Counts(0, 0, 0, 0, 0)
    with pytest.raises(qstore.MessageNotFound):
        new.get(mid)
    with pytest.raises(qstore.InvalidArgument):
        new.ack(msg)
    assert_consistent(store, new)


def test_create_queue_exist_ok_returns_the_same_queue(store: qstore.Store) -> None:
    q = store.create_queue("q", order="min", priority_type="str", max_attempts=3, dedup=True)
    mid = q.push(b"x", priority="p")
    again = store.create_queue("q", order="min", priority_type="str", max_attempts=3,
                               dedup=True, exist_ok=True)
    assert again.get(mid).payload == b"x"
    assert (again.order, again.priority_type, again.max_attempts, again.dedup) == (
        "min", "str", 3, True)


@pytest.mark.parametrize("change", [{"order": "max"}, {"priority_type": "int"},
                                    {"max_attempts": 4}, {"dedup": False}])
def test_create_queue_exist_ok_with_another_config_raises_invalid_argument(
        store: qstore.Store, change: dict[str, Any]) -> None:
    config: dict[str, Any] = {"order": "min", "priority_type": "str", "max_attempts": 3,
                              "dedup": True}
    store.create_queue("q", **config)
    before = dump(store)
    with pytest.raises(qstore.InvalidArgument):
        store.create_queue("q", **{**config, **change}, exist_ok=True)
    assert dump(store) == before


def test_create_queue_without_exist_ok_raises_queue_exists(store: qstore.Store) -> None:
    store.create_queue("q")
    before = dump(store)
    with pytest.raises(qstore.QueueExists):
        store.create_queue("q")
    with pytest.raises(qstore.QueueExists):
        store.create_queue("q", order="fifo")
    assert dump(store) == before


def test_queue_a_and_ab_never_see_each_others_messages(store: qstore.Store,
                                                      clock: Any) -> None:
    a = store.create_queue("a", order="fifo", max_attempts=1)
    ab = store.create_queue("ab", order="fifo", max_attempts=1)
    a_ids = [a.push(b"a%d" % i) for i in range(3)]
    ab_ids = [ab.push(b"ab%d" % i) for i in range(4)]
    a.push(b"a-delayed", delay=5.0)
    ab.nack(pop1(ab))  # a dead letter in ab
    assert [m.id for m in a.peek(10)] == a_ids
    assert [m.id for m in ab.peek(10)] == ab_ids[1:]
    assert a.dead_letters() == [] and [m.id for m in ab.dead_letters()] == [ab_ids[0]]
    with pytest.raises(qstore.MessageNotFound):
        a.get(ab_ids[1])
    with pytest.raises(qstore.MessageNotFound):
        ab.get(a_ids[0])
    assert counts(a) == Counts(3, 1, 0, 0, 6 + 9)
    assert counts(ab) == Counts(3, 0, 0, 1, 12)
    assert a.purge() == 4
    assert counts(ab) == Counts(3, 0, 0, 1, 12)
    assert [m.payload for m in ab.pop_many(10)] == [b"ab1", b"ab2", b"ab3"]
    store.delete_queue("a")
    assert ab.redrive() == 1
    assert counts(ab) == Counts(1, 0, 3, 0, 12)
    assert_consistent(store, ab)


def test_purge_deletes_messages_in_every_state(store: qstore.Store) -> None:
    q = store.create_queue("q", max_attempts=1)
    q.push_many([b"a", b"b", b"c"])
    q.push(b"d", delay=9.0)
    q.nack(pop1(q))
    leased = pop1(q)
    assert counts(q) == Counts(1, 1, 1, 1, 4)
    assert q.purge() == 4
    assert counts(q) == Counts(0, 0, 0, 0, 0)
    with pytest.raises(qstore.MessageNotFound):
        q.ack(leased)
    assert q.pop() is None and q.dead_letters() == []
    mid = q.push(b"after")
    assert pop1(q).id == mid
    assert_consistent(store, q)


@pytest.mark.parametrize("point_deletes", [4096, 3])
def test_purge_and_delete_leave_no_key_of_the_queue_and_small_ones_no_range(
        store: qstore.Store, monkeypatch: pytest.MonkeyPatch, point_deletes: int) -> None:
    # A purge or delete_queue wrote seven range deletions whatever the queue held;
    # they stay in the memtable, and every new iterator works through all of them,
    # so each purge made the next slower (28 us an iterator after 8,000 deleted
    # queues). A small queue's keys now go one by one; a large one's by range.
    monkeypatch.setattr(_core, "POINT_DELETES", point_deletes)
    ranges: list[bytes] = []
    real = _txn.Txn.delete_range

    def counted(self: _txn.Txn, start: bytes, end: bytes) -> None:
        ranges.append(start)
        real(self, start, end)

    monkeypatch.setattr(_txn.Txn, "delete_range", counted)
    keep = store.create_queue("keep")
    keep.push(b"kept")
    for purge in (True, False):
        q = store.create_queue("q", dedup=True, max_attempts=1)
        q.push_many([(b"a", 1, 0.0, "ka"), (b"b", 2, 0.0, None, 60.0)])
        q.push(b"d", delay=9.0)
        q.nack(pop1(q))  # a dead letter
        pop1(q)  # in flight
        qid = store.core.queues["q"].qid
        stray = keys.prefix(keys.READY, qid) + bytes(16)  # a key no message explains
        batch = new_batch()
        batch.put(stray, b"")
        store.core.meta.write(batch)
        if purge:
            assert q.purge() == 3
        else:
            store.delete_queue("q")
        left = [k for kind in keys.PER_QUEUE_KINDS
                for k in store.core.meta.scan_keys(keys.prefix(kind, qid),
                                                   keys.prefix_end(keys.prefix(kind, qid)))]
        assert left == []
        assert len(ranges) == (0 if point_deletes > 100 else 7)
        ranges.clear()
        if purge:
            store.delete_queue("q")
            ranges.clear()
    assert pop1(keep).payload == b"kept"


def test_get_reports_each_state(store: qstore.Store, clock: Any) -> None:
    q = store.create_queue("q", max_attempts=1, order="fifo")
    dead = q.push(b"x")
    q.nack(pop1(q))
    leased = q.push(b"l")
    assert pop1(q, lease=7.0).id == leased
    ready = q.push(b"r")
    delayed = q.push(b"d", delay=3.0)
    got = {mid: q.get(mid) for mid in (dead, leased, ready, delayed)}
    assert {mid: m.state for mid, m in got.items()} == {
        dead: "dead", leased: "in_flight", ready: "ready", delayed: "delayed"}
    assert got[leased].lease_deadline == clock() + 7.0
    assert all(m.receipt is None for m in got.values())
    assert [got[m].lease_deadline for m in (dead, ready, delayed)] == [None] * 3
    assert all(m.enqueued_at == clock() for m in got.values())
    with pytest.raises(qstore.MessageNotFound):
        q.get(max(got) + 1)


def test_len_is_the_total_of_every_state(store: qstore.Store) -> None:
    q = store.create_queue("q", max_attempts=1)
    q.push_many([b"a", b"b", b"c"])
    q.push(b"d", delay=1.0)
    q.nack(pop1(q))
    pop1(q)
    assert len(q) == 4 == q.stats().total


# -- waiting --------------------------------------------------------------------------


class _SignallingClock:
    """Delegates to the fake clock; tells the test when the consumer thread reads it."""

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self.consumer: threading.Thread | None = None
        self.consumer_inside = threading.Event()

    def __call__(self) -> float:
        if threading.current_thread() is self.consumer:
            self.consumer_inside.set()
        return float(self._clock())


def test_pop_wait_wakes_when_another_thread_pushes(store_path: str, clock: Any) -> None:
    sclock = _SignallingClock(clock)
    result: dict[str, Any] = {}

    def consume() -> None:
        start = time.monotonic()
        result["msg"] = q.pop(lease=10.0, wait=30.0)
        result["waited"] = time.monotonic() - start

    with qstore.open(store_path, clock=sclock, compactor=False) as store:
        q = store.create_queue("q")
        consumer = threading.Thread(target=consume)
        sclock.consumer = consumer
        consumer.start()
        # The consumer reads the clock only inside pop, with the writer lock held:
        # from here on, our push cannot commit before the consumer is waiting.
        assert sclock.consumer_inside.wait(10.0)
        mid = q.push(b"wake up")
        consumer.join(30.0)
        assert not consumer.is_alive()
        msg = result["msg"]
        assert msg is not None and (msg.id, msg.payload, msg.attempts) == (mid, b"wake up", 1)
        assert result["waited"] < 10.0, "the push must wake the waiter, not the timeout"
        assert counts(q) == Counts(0, 0, 1, 0, 7)


def test_closing_the_store_wakes_a_waiting_pop(tmp_path: Any, clock: Any) -> None:
    # The waiter and close() race for the writer lock after the wake-up: run it
    # several times so that the waiter sometimes loses (the database is closed).
    for i in range(50):
        sclock = _SignallingClock(clock)
        result: dict[str, Any] = {}

        def consume(q: qstore.Queue, result: dict[str, Any]) -> None:
            start = time.monotonic()
            try:
                result["got"] = q.pop(wait=30.0)
            except qstore.StoreClosed as exc:
                result["got"] = exc
            result["waited"] = time.monotonic() - start

        store = qstore.open(tmp_path / str(i), clock=sclock, compactor=False)
        consumer = threading.Thread(target=consume, args=(store.create_queue("q"), result))
        sclock.consumer = consumer
        consumer.start()
        assert sclock.consumer_inside.wait(10.0)
        store.close()
        consumer.join(30.0)
        assert not consumer.is_alive()
        # StoreClosed, as through a client and as any call after close(); it
        # returned None when the waiter won the race (an API audit).
        assert isinstance(result["got"], qstore.StoreClosed)
        assert result["waited"] < 10.0


def test_pop_wait_returns_none_when_nothing_comes_by_the_default_clock(store_path: str) -> None:
    # The default clock is time.time: the wait is real (the injected-clock form of
    # this rule is in test_clock_waits.py).
    with qstore.open(store_path, compactor=False) as store:
        q = store.create_queue("q")
        start = time.monotonic()
        assert q.pop(wait=0.2) is None
        waited = time.monotonic() - start
        assert 0.19 <= waited < 10.0
        assert q.pop_many(3, wait=0.05) == []


def test_a_push_to_another_queue_does_not_satisfy_a_waiter(store: qstore.Store,
                                                            clock: FakeClock) -> None:
    a, b = store.create_queue("a"), store.create_queue("b")
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.update(got=a.pop(wait=5.0)))
    t.start()
    wait_blocks(clock, 1)
    b.push(b"not for a")  # wakes the waiter, which finds nothing in a and blocks again
    wait_blocks(clock, 2)
    assert t.is_alive()
    clock.advance(5.0)  # its deadline, by the store's clock
    t.join(30.0)
    assert not t.is_alive() and result == {"got": None}
    assert counts(b).ready == 1 and counts(a).ready == 0


# -- counters ---------------------------------------------------------------------------


def test_store_stats_lets_writers_in_between_queues(store: qstore.Store,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # It held the writer lock across every queue's counts: a metrics scrape of
    # 5,000 queues stalled every push for up to 200 ms (an observability audit).
    for name in ("a", "b", "c"):
        store.create_queue(name).push(b"x")
    real = qstore.Queue.stats
    got_in: list[bool] = []

    def stats(self: qstore.Queue) -> qstore.QueueStats:
        out = real(self)
        if self.name == "a":  # between two queues: another thread takes the lock
            lock = store.core.lock

            def take() -> None:
                if lock.acquire(timeout=5):
                    got_in.append(True)
                    lock.release()
            t = threading.Thread(target=take)
            t.start()
            t.join(30)
        return out

    monkeypatch.setattr(qstore.Queue, "stats", stats)
    assert [q.queue for q in store.stats().queues] == ["a", "b", "c"]
    assert got_in == [True]


def test_stats_equal_a_full_recount_after_a_mixed_workload(store: qstore.Store,
                                                           clock: Any) -> None:
    rng = random.Random(11)
    q = store.create_queue("q", max_attempts=2, dedup=True)
    other = store.create_queue("q2", order="min", priority_type="str")
    held: list[qstore.Message] = []
    for step in range(400):
        r = rng.random()
        if r < 0.3:
            q.push(rng.randbytes(rng.randrange(0, 200)), priority=rng.randrange(-3, 3),
                   delay=rng.choice([0.0, 0.0, 2.0]))
        elif r < 0.4:
            other.push_many([(rng.randbytes(5), rng.choice(["", "a", "b"])) for _ in range(3)])
        elif r < 0.6:
            held.extend(q.pop_many(rng.randrange(1, 4), lease=rng.choice([1.0, 5.0])))
        elif r < 0.75 and held:
            msg = held.pop(rng.randrange(len(held)))
            with contextlib.suppress(qstore.LeaseExpired):  # a lease may have run out
                rng.choice([q.ack, q.nack])(msg)
        elif r < 0.8:
            q.redrive(rng.randrange(1, 3))
        elif r < 0.85:
            (m := other.pop()) and other.ack(m)
        else:
            clock.advance(rng.choice([0.5, 1.0, 3.0]))
        if step % 50 == 0:
            assert_consistent(store, q)
    assert_consistent(store, q)
    assert_consistent(store, other)
    s = q.stats()
    assert s.ready + s.delayed + s.in_flight + s.dead > 0
    total = store.stats()
    assert [x.queue for x in total.queues] == ["q", "q2"]
    assert total.queues[0] == q.stats()


@pytest.mark.parametrize("n", [300, 3_000])
def test_purge_and_delete_release_every_segments_bytes_in_small_and_bulk_reads(
        store_path: str, n: int) -> None:
    # Below 512 records the totals are added up one by one, above in bulk with
    # numpy (records.message_refs): both must release exactly what each segment
    # held, over several segments, whatever state the messages are in.
    with qstore.open(store_path, compactor=False, segment_max_bytes=64 * 1024) as s:
        keep = s.create_queue("keep")
        for drop in (False, True):
            q = s.create_queue("q")
            for i in range(n):
                if i % 7 == 0:
                    keep.push(b"k" * 50)
                q.push(b"p" * (200 + i % 300), priority=i % 5)
            q.pop_many(n // 3)  # some in flight
            assert len({seg.file_id for seg in s.stats().segments}) >= 2
            if drop:
                s.delete_queue("q")
            else:
                assert q.purge() == n
                s.delete_queue("q")
            live = {seg.file_id: seg.live_count for seg in s.stats().segments}
            assert sum(live.values()) == keep.stats().total
            assert s.check().ok
