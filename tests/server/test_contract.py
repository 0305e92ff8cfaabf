"""One contract, three ways: the embedded store, and a client of a real server
process over a unix socket and over TCP (fixture ``store`` in conftest.py).

Every test here must pass unchanged against all three, so the client cannot
drift from the embedded API: same results, same exception classes and fields.
"""

from __future__ import annotations

import enum
import os
import pathlib
import threading
from typing import Any

import pytest

import qstore


def test_push_pop_ack_in_priority_order(store: Any) -> None:
    q = store.create_queue("q", order="max")
    ids = [q.push(b"low", priority=1), q.push(b"high", priority=9), q.push(b"mid", priority=5)]
    assert ids == sorted(ids)
    got = [q.pop(lease=30.0) for _ in range(3)]
    assert [m.payload for m in got] == [b"high", b"mid", b"low"]
    assert [m.priority for m in got] == [9, 5, 1]
    assert all(m.state == "in_flight" and m.attempts == 1 and m.receipt for m in got)
    assert q.pop() is None
    for m in got:
        q.ack(m)
    assert q.stats() == qstore.QueueStats("q", 0, 0, 0, 0, 0)


def test_batches_are_one_call_each(store: Any) -> None:
    q = store.create_queue("b", order="fifo")
    ids = q.push_many([b"a", (b"b",), (b"c", None, 0.0)])
    assert len(ids) == 3
    msgs = q.pop_many(10)
    assert [m.payload for m in msgs] == [b"a", b"b", b"c"]
    assert q.ack_many(msgs) == 3
    assert q.stats().total == 0


def test_ack_many_is_all_or_nothing(store: Any) -> None:
    q = store.create_queue("a")
    q.push_many([b"1", b"2"])
    m1, m2 = q.pop_many(2)
    q.ack(m1)
    with pytest.raises(qstore.MessageNotFound) as info:
        q.ack_many([m2, m1])
    assert info.value.queue == "a" and info.value.message_id == m1.id
    assert q.stats().in_flight == 1


def test_nack_extend_and_stale_receipt(store: Any) -> None:
    q = store.create_queue("n", max_attempts=3)
    q.push(b"x")
    first = q.pop(lease=30.0)
    q.nack(first)
    again = q.pop(lease=30.0)
    assert again.id == first.id and again.attempts == 2 and again.receipt != first.receipt
    with pytest.raises(qstore.LeaseExpired):
        q.ack(first.receipt)
    longer = q.extend(again, lease=60.0)
    assert longer.receipt == again.receipt and longer.lease_deadline > again.lease_deadline
    q.ack(again.receipt)
    with pytest.raises(qstore.MessageNotFound):
        q.get(first.id)


def test_dead_letters_and_redrive(store: Any) -> None:
    q = store.create_queue("d", max_attempts=1)
    mid = q.push(b"poison")
    q.nack(q.pop())
    assert q.stats().dead == 1
    [dead] = q.dead_letters(5)
    assert dead.id == mid and dead.state == "dead" and dead.receipt is None
    assert q.redrive(10) == 1
    assert q.pop().attempts == 1
    assert q.purge() == 1


def test_peek_get_and_delayed(store: Any) -> None:
    q = store.create_queue("p", priority_type="str", order="min")
    q.push(b"b", priority="b")
    q.push(b"a", priority="a")
    later = q.push(b"later", priority="0", delay=3600.0)
    assert [m.payload for m in q.peek(5)] == [b"a", b"b"]
    assert q.get(later).state == "delayed"
    assert q.stats().delayed == 1 and len(q) == 3


def test_dedup(store: Any) -> None:
    q = store.create_queue("u", dedup=True)
    a = q.push(b"same")
    assert q.push(b"same") == a
    assert q.push(b"other", dedup_key="k") == q.push(b"third", dedup_key="k")


def test_store_methods(store: Any) -> None:
    store.create_queue("one")
    q = store.create_queue("one", exist_ok=True)
    assert q.name == "one" and q.order == "max" and q.max_attempts == 5
    with pytest.raises(qstore.QueueExists) as exists:
        store.create_queue("one")
    assert exists.value.name == "one"
    with pytest.raises(qstore.InvalidArgument):
        store.create_queue("one", order="min", exist_ok=True)
    store.create_queue("two").push(b"12345")
    assert store.queues() == ["one", "two"]
    stats = store.stats()
    assert [s.queue for s in stats.queues] == ["one", "two"] and stats.queues[1].bytes == 5
    store.delete_queue("two")
    with pytest.raises(qstore.QueueNotFound) as missing:
        store.queue("two")
    assert missing.value.name == "two"
    # The segment now holds the deleted queue's message (garbage) and one live
    # message of "one": more than half garbage, so the pass seals it, copies
    # the one live message out (frame and body) and deletes it.
    keep = q.push(b"k")
    done = store.compact()
    assert (done.messages_moved, done.bytes_copied) == (1, 8 + 1)
    assert done.segments_read == done.segments_deleted == (done.sealed,)
    assert q.get(keep).payload == b"k"
    # A bound past what the wire's ints carry means "no bound", as it does
    # embedded (a client failed with "an argument cannot be sent").
    again = store.compact(threshold=0.01, max_bytes=2**64)
    assert again.messages_moved == 0 and q.get(keep).payload == b"k"


@pytest.mark.parametrize("call", [
    lambda q: q.push("text"),
    lambda q: q.push(b"x", priority=2**63),
    lambda q: q.push(b"x", delay=-1),
    lambda q: q.pop(lease=0),
    lambda q: q.pop(wait=float("nan")),
    lambda q: q.pop_many(0),
    lambda q: q.ack("not-a-receipt"),
    lambda q: q.push_many(5),
    lambda q: q.get(-1),
    # issue 11 case 13: the same inputs, the same error through the server
    lambda q: q.push(b"x", delay=10**400),
    lambda q: q.push(b"x", ttl=10**400),
    lambda q: q.push_many([(b"x", 1, 10**400)]),
    lambda q: q.pop(lease=10**400),
    lambda q: q.pop_many(2, lease=10**400),
    lambda q: q.pop(wait=10**400),
])
def test_bad_arguments_raise_invalid_argument(store: Any, call: Any) -> None:
    q = store.create_queue("bad")
    with pytest.raises(qstore.InvalidArgument):
        call(q)
    mid = q.push(b"still fine")  # the queue (and the connection) still work
    assert len(q) == 1  # and the refused call left nothing in it
    got = q.pop()
    assert (got.id, got.payload) == (mid, b"still fine")


@pytest.mark.parametrize("call", [
    lambda s: s.create_queue("q\udc80"),
    lambda s: s.create_queue("u", dedup=True).push(b"x", dedup_key="\udc80"),
    lambda s: s.create_queue("u", dedup=True).push_many([(b"x", 1, 0.0, "\udc80")]),
    lambda s: s.create_queue("m", max_attempts=10**400),
    lambda s: s.create_queue("t", ttl=10**400),
    lambda s: s.create_queue("n").extend(s.queue("n").pop() or "0-0-0", lease=10**400),
    lambda s: s.create_queue("n").nack("1-1-1", delay=10**400),
], ids=["surrogate-name", "surrogate-key", "surrogate-key-batch", "max-attempts", "queue-ttl",
        "extend", "nack"])
def test_unencodable_and_oversized_arguments_raise_invalid_argument(store: Any,
                                                                    call: Any) -> None:
    with pytest.raises(qstore.InvalidArgument):
        call(store)
    after = store.create_queue("after", exist_ok=True)
    mid = after.push(b"still fine")
    got = after.pop()
    assert (got.id, got.payload) == (mid, b"still fine")
    assert "q\udc80" not in store.queues()


def test_payload_too_large_keeps_the_connection(store: Any) -> None:
    q = store.create_queue("big")
    with pytest.raises(qstore.PayloadTooLarge) as info:
        q.push(b"x" * (64 * 1024 * 1024 + 1))
    assert info.value.size == 64 * 1024 * 1024 + 1 and info.value.limit == 64 * 1024 * 1024
    q.push(b"after")
    assert q.pop().payload == b"after"


def test_ttl_and_queue_options(store: Any) -> None:
    q = store.create_queue("t", ttl=600.0, on_expire="dead", aging=5.0, aging_cap=2,
                           rate=(100, 1.0))
    s = q.stats()
    assert (s.ttl, s.on_expire, s.aging, s.aging_cap, s.rate, s.expired) == \
        (600.0, "dead", 5.0, 2, (100, 1.0), 0)
    assert store.create_queue("t", exist_ok=True, ttl=600.0, on_expire="dead", aging=5.0,
                              aging_cap=2, rate=(100, 1.0)).name == "t"
    own = q.push(b"own", ttl=3600.0)
    default = q.push(b"default")
    ids = q.push_many([b"a", (b"b", 1, 0.0, None, 7200.0)], ttl=1800.0)
    enq = q.get(own).enqueued_at
    assert q.get(own).expires_at == pytest.approx(enq + 3600.0, abs=1.0)
    assert q.get(default).expires_at == pytest.approx(enq + 600.0, abs=1.0)
    assert q.get(ids[0]).expires_at == pytest.approx(enq + 1800.0, abs=1.0)
    assert q.get(ids[1]).expires_at == pytest.approx(enq + 7200.0, abs=1.0)
    assert q.get(own).dead_reason is None
    # A pop and an extend say when the TTL runs out too (they said None: "no TTL").
    popped = q.pop_many(4, lease=60.0)
    assert {m.id: m.expires_at for m in popped} == {i: q.get(i).expires_at
                                                    for i in [own, default, *ids]}
    assert q.extend(popped[0], lease=90.0).expires_at == popped[0].expires_at
    plain = store.create_queue("plain")
    plain.push(b"x")
    assert plain.pop().expires_at is None


def test_configure_queue(store: Any) -> None:
    store.create_queue("c")
    q = store.configure_queue("c", ttl=60.0, rate=(5, 2.0))
    assert q.name == "c"
    s = store.queue("c").stats()
    assert (s.ttl, s.rate, s.on_expire) == (60.0, (5, 2.0), "drop")
    store.configure_queue("c", ttl=None)
    assert store.queue("c").stats().ttl is None and store.queue("c").stats().rate == (5, 2.0)
    with pytest.raises(qstore.InvalidArgument):
        store.configure_queue("c", tll=5.0)
    with pytest.raises(qstore.InvalidArgument):
        store.configure_queue("c", on_expire="explode")
    with pytest.raises(qstore.QueueNotFound):
        store.configure_queue("nope", ttl=1.0)


def test_threads_share_one_store_handle(store: Any) -> None:
    """Threads share a store (or a client) as they would an embedded one: producers
    and consumers in threads, every message taken exactly once with its bytes, and
    a pop waiting in one thread is woken by a push from another thread."""
    q = store.create_queue("t", order="fifo")
    bodies = [b"%d-%d" % (k, i) for k in range(4) for i in range(150)]
    taken: list[bytes] = []
    errors: list[BaseException] = []

    def produce(k: int) -> None:
        try:
            for i in range(0, 150, 3):
                q.push(b"%d-%d" % (k, i))
                q.push_many([b"%d-%d" % (k, i + 1), b"%d-%d" % (k, i + 2)])
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    def consume() -> None:
        try:
            while len(taken) < len(bodies):
                m = q.pop(wait=0.05)
                if m is not None:
                    q.ack(m)
                    taken.append(m.payload)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    threads += [threading.Thread(target=consume) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert sorted(taken) == sorted(bodies)

    # A pop that waits holds up no other thread of the same handle.
    started = threading.Event()
    got: list[Any] = []

    def wait_for_one() -> None:
        started.set()
        got.append(q.pop(wait=30.0))

    waiter = threading.Thread(target=wait_for_one)
    waiter.start()
    started.wait()
    assert q.stats().ready == 0  # answered while the other thread's pop waits
    q.push(b"wake up")
    waiter.join(60)
    assert not waiter.is_alive() and got[0] is not None and got[0].payload == b"wake up"
    q.ack(got[0])
    assert q.stats() == qstore.QueueStats("t", 0, 0, 0, 0, 0)


def test_a_closed_store_or_client_raises_store_closed(store: Any) -> None:
    q = store.create_queue("c")
    q.push(b"x")
    store.close()
    store.close()  # idempotent
    for call in (lambda: q.push(b"y"), q.pop, q.stats, store.queues, lambda: store.queue("c")):
        with pytest.raises(qstore.StoreClosed):
            call()


def test_a_handle_of_a_deleted_queue_never_reaches_a_new_queue_of_its_name(store: Any) -> None:
    # Remote handles were names only: after delete and create again, an old
    # handle's push, pop and stats acted on the new queue (its pop leased the
    # new queue's message), where an embedded handle raises QueueNotFound.
    old = store.create_queue("r", order="min")
    old.push(b"old")
    msg = old.pop()
    store.delete_queue("r")
    new = store.create_queue("r", order="max", max_attempts=2)
    new.push(b"new")
    for op in (lambda: old.push(b"y"), lambda: old.push_many([b"y"]),
               lambda: old.push_many([]), lambda: old.ack_many([]), old.pop,
               lambda: old.pop_many(2), lambda: old.ack(msg), lambda: old.nack(msg),
               lambda: old.extend(msg), old.peek, old.stats, old.purge, old.dead_letters,
               old.redrive):
        with pytest.raises(qstore.QueueNotFound):
            op()
    stats = new.stats()
    assert (stats.ready, stats.in_flight) == (1, 0)
    assert new.pop().payload == b"new"
    assert store.queue("r").max_attempts == 2  # a fresh handle is of the new queue


def test_misused_batches_and_receipts_say_what_is_wrong(store: Any) -> None:
    # A str or bytes where a batch goes was iterated: push_many(b"abc") said "not
    # 97", ack_many(receipt) "malformed receipt '1'"; a tuple of 6 fields was "not a
    # tuple"; a peeked Message "expected a Message from pop()" (an API audit).
    q = store.create_queue("m")
    mid = q.push(b"x")
    for batch in (b"abc", "abc", bytearray(b"abc")):
        with pytest.raises(qstore.InvalidArgument, match="takes an iterable of items, not one"):
            q.push_many(batch)
    popped = q.pop()
    with pytest.raises(qstore.InvalidArgument, match="ack_many takes an iterable of items"):
        q.ack_many(popped.receipt)
    with pytest.raises(qstore.InvalidArgument, match="has 6 fields, not 1 to 5"):
        q.push_many([(b"a", 1, 0.0, None, None, 9)])
    with pytest.raises(qstore.InvalidArgument, match=f"message {mid} has no receipt"):
        q.ack(q.get(mid))
    assert q.stats().in_flight == 1 and q.ack_many([popped]) == 1  # nothing changed before


def test_bytes_like_payloads_and_keys_and_counts_past_any_store_are_taken_alike(
        store: Any) -> None:
    # Embedded refused a bytes subclass payload and a bytearray dedup key that the
    # clients sent as plain bytes, and took pop_many(10**30) that the clients could
    # not send (an API audit).
    class Body(bytes):
        pass

    q = store.create_queue("b", dedup=True)
    first = q.push(Body(b"sub"), dedup_key=bytearray(b"k"))
    assert q.push(b"other", dedup_key=b"k") == first  # the same key
    assert q.get(first).payload == b"sub" and type(q.get(first).payload) is bytes
    assert [m.id for m in q.peek(10**30)] == [first]
    got = q.pop_many(10**30)
    assert [m.payload for m in got] == [b"sub"]
    q.nack(got[0])
    assert q.dead_letters(10**30) == [] and q.redrive(10**30) == 0
    with pytest.raises(qstore.InvalidArgument):
        store.configure_queue(None, ttl=1.0)  # no name at all, as for queue(None)


def test_a_snapshot_destination_that_is_no_path_is_refused(store: Any, tmp_path: Any,
                                                           monkeypatch: Any) -> None:
    # The clients missed the path check: snapshot(None) was a bare TypeError, and
    # snapshot("") through a unix socket wrote the snapshot into the client's
    # working directory (a review).
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for dest in (None, "", 5):
        with pytest.raises(qstore.InvalidArgument, match="snapshot destination"):
            store.snapshot(dest)
    assert list(cwd.iterdir()) == []


def test_a_snapshot_returns_its_absolute_path(store: Any, tmp_path: Any,
                                              monkeypatch: Any) -> None:
    # The embedded store returned the path as given ('snap/'), a client the
    # absolute one (an API audit). A path object is taken too. Over TCP the
    # destination must be absolute (the server may be elsewhere).
    monkeypatch.chdir(tmp_path)
    tcp = str(store.path).startswith("tcp://")
    got = store.snapshot(tmp_path / "snap" if tcp else pathlib.Path("snap/"))
    assert got == str(tmp_path / "snap") and os.path.isabs(got)
    with qstore.open(got, readonly=True) as snap:
        assert snap.queues() == store.queues()


def test_a_str_subclass_queue_name_comes_back_as_a_plain_str(store: Any) -> None:
    # A str Enum's member was kept as given by the embedded store: its name showed
    # as "Name.JOBS" in stats and messages until a reopen, "jobs" through a client.
    class Name(str, enum.Enum):  # noqa: UP042  (the older form users have: str() differs)
        JOBS = "jobs"

    q = store.create_queue(Name.JOBS)
    q.push(b"x")
    msg = q.pop()
    assert msg is not None
    for got in (q.name, store.queues()[0], q.stats().queue, msg.queue,
                store.queue(Name.JOBS).name):
        assert type(got) is str and got == "jobs"


def test_a_deleted_queue_is_named_before_a_bad_argument(store: Any) -> None:
    # A server looks the queue up before the operation checks its arguments; the
    # embedded store does the same (they differed, a differential audit). Only
    # a Message with no receipt is refused first: a client refuses it before sending.
    q = store.create_queue("gone")
    q.push(b"x")
    peeked = q.peek(1)[0]
    store.delete_queue("gone")
    bad_calls = [
        lambda: q.push("not bytes"), lambda: q.push(b"x", priority="a"),
        lambda: q.push_many([(b"x", "a")]), lambda: q.push_many([b"x"], delay=-1.0),
        lambda: q.pop(lease=0), lambda: q.pop_many(0), lambda: q.peek(0), lambda: q.get(-1),
        lambda: q.nack("zz", delay=-1.0), lambda: q.extend("zz", lease=0),
        lambda: q.ack("zz"), lambda: q.ack_many(["zz"]), lambda: q.dead_letters(0),
        lambda: q.redrive(0),
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(qstore.QueueNotFound):
            call()
            pytest.fail(f"call {i} raised nothing")
    for call in (lambda: q.ack(peeked), lambda: q.ack_many(["zz", peeked]),
                 lambda: q.nack(peeked, delay=-1.0), lambda: q.extend(peeked)):
        with pytest.raises(qstore.InvalidArgument, match="has no receipt"):
            call()


def test_a_receiptless_message_in_ack_many_is_refused_before_a_stale_one(store: Any) -> None:
    q = store.create_queue("r")
    q.push_many([b"1", b"2"])
    first, second = q.pop_many(2)
    q.ack(first)
    stale_then_receiptless = [first, q.get(second.id)]  # get: no receipt
    with pytest.raises(qstore.InvalidArgument, match="has no receipt"):
        q.ack_many(stale_then_receiptless)
    assert q.stats().in_flight == 1


def test_a_name_no_queue_can_have_is_an_invalid_argument(store: Any) -> None:
    for call in (lambda: store.queue(["q"]), lambda: store.delete_queue({}),
                 lambda: store.configure_queue(["q"], ttl=5.0), lambda: store.queue("\udc80"),
                 lambda: store.delete_queue("\udc80"),
                 lambda: store.configure_queue("\udc80", ttl=5.0)):
        with pytest.raises(qstore.InvalidArgument):
            call()


@pytest.mark.parametrize("defaults", [{"delay": -1.0}, {"delay": float("nan")},
                                      {"ttl": 0.0}, {"ttl": "x"}])
def test_push_many_checks_its_defaults_when_every_item_gives_its_own(
        store: Any, defaults: dict[str, Any]) -> None:
    q = store.create_queue("p")
    with pytest.raises(qstore.InvalidArgument):
        q.push_many([(b"x", 0, 0.0, None, 5.0)], **defaults)
    assert q.stats().total == 0
