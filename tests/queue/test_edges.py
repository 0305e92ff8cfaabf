"""Edge cases a mutation audit found unchecked: ties and boundaries of the time passes,
the id reservation across a crash, and keys a dead letter or a deleted queue leaves.

Each test names the behaviour it guards; the injected clock drives every time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import qstore
from qstore import _hot, _timers
from qstore._txn import NO_EVENT_US
from qstore.meta import MetaDB, keys, records
from qstore.payload import FRAME_SIZE, segment_name
from tests.conftest import FakeClock

from ._support import assert_consistent

RESERVE_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import qstore
    store = qstore.open(sys.argv[1], compactor=False)
    q = store.create_queue("q")
    pushed = q.push(b"before")
    first = store.core.reserve_ids(int(sys.argv[2]))
    print(json.dumps({"pushed": pushed, "first": first,
                      "below": store.core.ids_reserved_below()}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_reserved_ids_are_never_handed_out_again_after_a_kill(store_path: str) -> None:
    # reserve_ids() must raise M id_hwm past the block, durably: a bulk load
    # writes messages with those ids later, and a push after a crash and
    # reopen must not take one of them. More than a push's own block of ids
    # (ID_BLOCK), so that the push before it does not cover the reservation.
    # A mutation audit found no test of it (a reservation that left the mark
    # alone passed).
    n = 2 * _hot.ID_BLOCK
    r = subprocess.run([sys.executable, "-c", RESERVE_CHILD, store_path, str(n)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    got = json.loads(r.stdout)
    first = got["first"]
    assert first > got["pushed"]
    assert got["below"] >= first + n
    with qstore.open(store_path, compactor=False) as store:
        assert store.core.ids_reserved_below() >= first + n
        after = store.queue("q").push(b"after the kill")
        assert after >= first + n
        assert store.check().ok


def test_a_damaged_message_with_a_ttl_that_a_pop_buries_no_longer_expires(
        store_path: str, clock: FakeClock) -> None:
    # A pop moves a message whose payload is damaged to the dead letters; like
    # any dead letter it must lose its expiry key, or the expiry pass later
    # drops (or re-buries) the evidence and the check finds a stray key.
    # A mutation audit found no test of it.
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        q = store.create_queue("q", ttl=10)
        mid = q.push(b"precious payload " * 8)
        qid = store.core.queues["q"].qid
        raw = store.core.meta.get(keys.message_key(qid, mid))
        assert raw is not None
        rec = records.MessageRecord.decode(raw)
        assert rec.expires_us == keys.to_us(clock.now + 10)
    seg = os.path.join(store_path, "payload", segment_name(rec.file_id))
    with open(seg, "r+b") as f:  # flip a byte of the body: a CRC mismatch
        f.seek(rec.offset + FRAME_SIZE + 5)
        byte = f.read(1)
        f.seek(rec.offset + FRAME_SIZE + 5)
        f.write(bytes([byte[0] ^ 0x01]))
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        q = store.queue("q")
        assert q.pop() is None  # buried, never delivered
        report = store.check()
        assert report.ok, report.findings
        clock.advance(20)  # well past the TTL
        (letter,) = q.dead_letters()
        assert letter.id == mid and letter.expires_at is None
        assert letter.dead_reason is not None
        assert letter.dead_reason.startswith(records.DAMAGED_REASON)
        st = q.stats()
        assert (st.dead, st.expired) == (1, 0)
        assert_consistent(store, q)


@pytest.mark.parametrize("on_expire", ["dead", "drop"])
def test_a_last_lease_that_ends_exactly_at_the_ttl_expires_the_message(
        store: qstore.Store, clock: FakeClock, on_expire: str) -> None:
    # The lease on the last attempt and the TTL end at the same microsecond:
    # the TTL wins the tie (it did not die of its attempts first). A mutation
    # audit found the tie unchecked (lease_ended_it_first with <=).
    q = store.create_queue("q", max_attempts=1, ttl=2.5, on_expire=on_expire)
    mid = q.push(b"x")
    clock.advance(0.5)
    m = q.pop(lease=2.0)
    assert m is not None and m.lease_deadline is not None and m.expires_at is not None
    assert keys.to_us(m.lease_deadline) == keys.to_us(m.expires_at)  # the tie
    clock.advance(3)
    st = q.stats()
    assert st.expired == 1
    if on_expire == "dead":
        (letter,) = q.dead_letters()
        assert (letter.id, letter.dead_reason) == (mid, records.EXPIRED_REASON)
        assert st.dead == 1
    else:
        assert st.total == 0
        with pytest.raises(qstore.MessageNotFound):
            q.get(mid)
    assert_consistent(store, q)


def test_a_pop_exactly_at_the_ttl_with_the_expiry_pass_unfinished_delivers_nothing(
        store: qstore.Store, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    # With a budget of one key a call, the pop's pass expires one message and
    # leaves the rest to expire_head, which must treat a TTL that runs out at
    # this very microsecond as run out. A mutation audit found it unchecked.
    monkeypatch.setattr(_timers, "BUDGET", 1)
    monkeypatch.setattr(_timers, "PROMOTE_BATCH", 1)
    q = store.create_queue("q")
    for i in range(5):
        q.push(b"m%d" % i, ttl=1)
    clock.advance(1.0)
    assert q.pop() is None
    st = q.stats()
    assert (st.total, st.expired) == (0, 5)
    assert_consistent(store, q)


def test_a_delay_one_microsecond_after_a_pass_is_promoted_at_its_time(
        store: qstore.Store, clock: FakeClock) -> None:
    # A pass at time t raises the queue's time floor to t + 1 us: a key due at
    # t + 1 us must still be found (a floor of t + 2 skipped it for good).
    # A mutation audit found the floor's exact value unchecked.
    q = store.create_queue("q")
    a = q.push(b"a", delay=5.0)
    b = q.push(b"b", delay=5.0000015)
    qid = store.core.queues["q"].qid
    due = {}
    for mid in (a, b):
        raw = store.core.meta.get(keys.message_key(qid, mid))
        assert raw is not None
        due[mid] = records.MessageRecord.decode(raw).when_us
    assert due[b] == due[a] + 1
    clock.advance(5.0)
    assert keys.to_us(clock.now) == due[a]
    got = q.pop()
    assert got is not None and got.id == a
    clock.advance(1.5e-6)
    assert keys.to_us(clock.now) == due[b]
    got = q.pop()
    assert got is not None and got.id == b, "the message due 1 us after the pass was skipped"
    assert_consistent(store, q)


def test_delete_queue_leaves_no_expired_totals_key(store: qstore.Store,
                                                   clock: FakeClock) -> None:
    # The E key (expired count) outlives a purge but not the queue: a deleted
    # queue must leave none behind. A mutation audit found it unchecked.
    q = store.create_queue("q", ttl=5)
    q.push(b"x")
    qid = store.core.queues["q"].qid
    clock.advance(6)
    assert q.stats().expired == 1  # the pass wrote the E key
    assert store.core.meta.get(keys.totals_key(qid)) is not None
    store.delete_queue("q")
    report = store.check()
    assert report.ok, report.findings
    left = store.core.meta.scan_keys(keys.totals_key(qid), keys.prefix_end(keys.totals_key(qid)),
                                     10)
    assert left == []


def test_an_open_learns_each_queues_first_due_time_and_steps_over_a_short_key(
        store_path: str, clock: FakeClock) -> None:
    # The open looked for each queue's next due time with three seeks a queue
    # (3.1 s for 160,000 queues, a scale audit); it now walks each timed index
    # once. A timed key too short to hold a time (damage) raised a bare
    # struct.error from the open; it is stepped over (the check names it).
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        for name in ("empty", "delayed", "leased", "ttl"):
            store.create_queue(name)
        store.queue("delayed").push(b"d", delay=50)
        store.queue("delayed").push(b"d2", delay=20)
        store.queue("leased").push(b"l")
        assert store.queue("leased").pop(lease=30) is not None
        store.queue("ttl").push(b"t", ttl=40)
        qid = store.core.queues["delayed"].qid
    meta = MetaDB(os.path.join(store_path, "meta"), readonly=False, store_path=store_path)
    try:
        batch = qstore.meta.new_batch()
        batch.put(keys.prefix(keys.DELAYED, qid) + b"\x00\x01", b"")  # no time, no id
        meta.write(batch, sync=True)
    finally:
        meta.close()
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        due = {n: store.core.queues[n].next_event_us for n in store.queues()}
        now = keys.to_us(clock.now)
        assert due["empty"] == NO_EVENT_US
        assert due["delayed"] == keys.to_us(clock.now + 20)  # the earlier of the two
        assert due["leased"] == keys.to_us(clock.now + 30)
        assert due["ttl"] == keys.to_us(clock.now + 40)
        assert now < min(due.values())
        assert [f.kind for f in store.check().findings] == ["stray_index_key"]
        clock.advance(21)
        got = store.queue("delayed").pop()
        assert got is not None and got.payload == b"d2"


def test_a_truncated_timed_key_above_the_time_floor_is_stepped_over(
        store_path: str, clock: FakeClock) -> None:
    # After a pass, the next due time is looked up from the time floor on: a key
    # of the delayed index cut short but still holding a future time sat there
    # and made the pop that ran the pass raise a bare struct.error (a review).
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        q = store.create_queue("q")
        q.push_many([b"a", b"b"])
        qid = store.core.queues["q"].qid
    meta = MetaDB(os.path.join(store_path, "meta"), readonly=False, store_path=store_path)
    try:
        batch = qstore.meta.new_batch()
        batch.put(keys.prefix(keys.DELAYED, qid) + keys.U64.pack(keys.to_us(clock.now + 86400))
                  + b"\x00\x00\x00\x01", b"")  # an id of 4 bytes, not 8
        meta.write(batch, sync=True)
    finally:
        meta.close()
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        q = store.queue("q")
        first = q.pop(lease=5)
        assert first is not None
        clock.advance(6)  # its lease ran out: the pop's pass requeues it
        again = q.pop(lease=5)
        assert again is not None and again.id == first.id and again.attempts == 2
        assert [f.kind for f in store.check().findings] == ["stray_index_key"]
