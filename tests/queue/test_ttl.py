"""TTL (contract section 10): expiry in every state, through the expiry index.

The injected clock drives every expiry; ``store.check()`` (through
``assert_consistent``) verifies the expiry index and the counters after each
scenario, and a damaged expiry index is reported.
"""

from __future__ import annotations

from typing import Any

import pytest

import qstore
from qstore.meta import keys, new_batch
from tests.conftest import FakeClock

from ._support import assert_consistent


def test_a_ready_message_is_dropped_at_its_ttl(store: qstore.Store, clock: FakeClock) -> None:
    q = store.create_queue("q")
    keep = q.push(b"keep")
    gone = q.push(b"gone", ttl=10)
    assert q.get(gone).expires_at == clock.now + 10
    clock.advance(9.5)
    assert q.stats().ready == 2
    clock.advance(0.5)
    st = q.stats()
    assert (st.ready, st.expired) == (1, 1)
    with pytest.raises(qstore.MessageNotFound):
        q.get(gone)
    assert q.pop().id == keep  # type: ignore[union-attr]
    assert_consistent(store, q)


def test_delayed_and_in_flight_messages_expire(store: qstore.Store, clock: FakeClock) -> None:
    q = store.create_queue("q", max_attempts=9)
    delayed = q.push(b"d", delay=100, ttl=5)
    q.push(b"f", ttl=5)
    leased = q.pop(lease=60)
    assert leased is not None
    clock.advance(5)
    # The pop itself sees the expiry: nothing is delivered, the receipt is dead.
    assert q.pop() is None
    with pytest.raises(qstore.MessageNotFound):  # dropped (on_expire="drop")
        q.ack(leased)
    with pytest.raises(qstore.MessageNotFound):
        q.extend(leased, 10)
    for mid in (delayed, leased.id):
        with pytest.raises(qstore.MessageNotFound):
            q.get(mid)
    st = q.stats()
    assert (st.total, st.expired) == (0, 2)
    assert_consistent(store, q)


@pytest.mark.parametrize(("on_expire", "error"), [("drop", qstore.MessageNotFound),
                                                  ("dead", qstore.LeaseExpired)])
def test_a_receipt_stops_working_before_the_sweep_ran(store: qstore.Store, clock: FakeClock,
                                                      on_expire: str, error: type) -> None:
    q = store.create_queue("q", on_expire=on_expire)
    q.push(b"x", ttl=3)
    m = q.pop(lease=30)
    assert m is not None
    clock.advance(3)
    with pytest.raises(error):  # no stats()/pop ran the expiry yet
        q.nack(m)
    with pytest.raises(error):  # and the same once it ran
        q.stats()
        q.ack(m)
    assert q.stats().expired == 1


def test_on_expire_dead_keeps_the_message_with_its_reason(store: qstore.Store,
                                                          clock: FakeClock) -> None:
    q = store.create_queue("q", ttl=10, on_expire="dead")
    mid = q.push(b"x")
    plain = q.push(b"y", ttl=1000)
    clock.advance(10)
    st = q.stats()
    assert (st.ready, st.dead, st.expired, st.ttl, st.on_expire) == (1, 1, 1, 10.0, "dead")
    (letter,) = q.dead_letters()
    assert (letter.id, letter.dead_reason, letter.expires_at) == (mid, "expired", None)
    assert q.redrive() == 1  # a redriven letter is ready again, without its reason or TTL
    m = q.get(mid)
    assert (m.state, m.dead_reason, m.expires_at) == ("ready", None, None)
    clock.advance(10_000)
    assert q.stats().expired == 2  # the other message's own TTL still runs out
    assert q.get(plain).dead_reason == "expired"
    assert_consistent(store, q)


def test_dead_letters_by_attempts_do_not_expire(store: qstore.Store, clock: FakeClock) -> None:
    q = store.create_queue("q", max_attempts=1, ttl=20)
    mid = q.push(b"x")
    m = q.pop(lease=1)
    assert m is not None
    q.nack(m)
    clock.advance(100)
    st = q.stats()
    assert (st.dead, st.expired) == (1, 0)
    assert q.get(mid).state == "dead"
    assert_consistent(store, q)


@pytest.mark.parametrize("on_expire", ["drop", "dead"])
@pytest.mark.parametrize("looked", [True, False], ids=["looked-between", "looked-after"])
def test_a_last_lease_that_ran_out_before_the_ttl_makes_a_dead_letter_whenever_one_looks(
        store_path: str, on_expire: str, looked: bool) -> None:
    # The lease (5 s) on the last attempt ends before the TTL (10 s): the
    # message died of its attempts at 5 s. Whether anything looked between the
    # two times, or the store was closed across both, must not matter.
    clock = FakeClock()
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.create_queue("q", max_attempts=1, on_expire=on_expire)
        mid = q.push(b"job", ttl=10.0)
        m = q.pop(lease=5.0)
        assert m is not None
        clock.advance(6)
        if looked:
            assert q.stats().dead == 1
        clock.advance(14)
        with pytest.raises(qstore.LeaseExpired):
            q.ack(m)
        st = q.stats()
        assert (st.dead, st.expired) == (1, 0)
        (dead,) = q.dead_letters(5)
        assert (dead.id, dead.dead_reason, dead.expires_at) == (mid, None, None)
        assert_consistent(s, q)
    # Across a restart: popped, closed at once, reopened after both times.
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.queue("q")
        mid = q.push(b"again", ttl=10.0)
        assert q.pop(lease=5.0) is not None
    clock.advance(20)
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.queue("q")
        st = q.stats()
        assert (st.dead, st.expired) == (2, 0)
        assert q.get(mid).state == "dead"
        assert_consistent(s, q)


def test_a_ttl_that_runs_out_before_the_lease_still_expires(store: qstore.Store,
                                                            clock: FakeClock) -> None:
    q = store.create_queue("q", max_attempts=1)
    mid = q.push(b"x", ttl=5.0)
    m = q.pop(lease=10.0)
    assert m is not None
    clock.advance(20)
    st = q.stats()
    assert (st.dead, st.expired) == (0, 1)
    with pytest.raises(qstore.MessageNotFound):
        q.get(mid)
    assert_consistent(store, q)


@pytest.mark.parametrize("looked", [True, False], ids=["looked-first", "purged-at-once"])
def test_purge_counts_messages_whose_ttl_ran_out_as_expired_not_purged(
        store: qstore.Store, clock: FakeClock, looked: bool) -> None:
    q = store.create_queue("q", ttl=1.0)
    q.push_many([b"a", b"b", b"c"])
    q.push(b"lives", ttl=100.0)
    clock.advance(5)
    if looked:
        q.stats()
    assert q.purge() == 1
    st = q.stats()
    assert (st.ready, st.expired) == (0, 3)
    assert_consistent(store, q)


def test_push_many_takes_a_batch_ttl_and_per_item_ttls(store: qstore.Store,
                                                       clock: FakeClock) -> None:
    q = store.create_queue("q", ttl=50)
    ids = q.push_many([b"batch", (b"own", 0, 0.0, None, 5), (b"long", 0, 0.0, None, 500)],
                      ttl=20)
    default = q.push(b"default")
    assert [q.get(i).expires_at for i in (*ids, default)] == [
        clock.now + 20, clock.now + 5, clock.now + 500, clock.now + 50]
    for step, left in ((5, 3), (15, 2), (30, 1), (450, 0)):
        clock.advance(step)
        assert q.stats().ready == left
    assert q.stats().expired == 4
    assert_consistent(store, q)


def test_ttl_keeps_its_wall_clock_meaning_across_a_restart(store_path: str) -> None:
    clock = FakeClock()
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.create_queue("q", on_expire="dead")
        q.push(b"a", ttl=10)
        q.push(b"b", ttl=100)
    clock.advance(50)  # the store was closed while the first TTL ran out
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        q = s.queue("q")
        st = q.stats()
        assert (st.ready, st.dead, st.expired, st.on_expire) == (1, 1, 1, "dead")
        assert_consistent(s, q)
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        assert s.queue("q").stats().expired == 1  # the total is durable


def test_the_sweeper_expires_without_any_call(store_path: str) -> None:
    clock = FakeClock()
    with qstore.open(store_path, clock=clock, compactor=False, sweep_interval=0.01) as s:
        q = s.create_queue("q")
        q.push(b"x", ttl=1)
        clock.advance(1)
        state = s.core.queues["q"]
        for _ in range(2000):  # waits for the sweeper thread, not for time to pass
            if state.expired:
                break
            s.core.ready.acquire()
            s.core.ready.wait(0.005)
            s.core.ready.release()
        assert state.expired == 1 and state.counts[0] == 0


def test_expiry_reads_only_its_index(store: qstore.Store, clock: FakeClock) -> None:
    """A backlog without TTLs is never read to find the messages that expire."""
    q = store.create_queue("q")
    q.push_many([b"x"] * 500)
    q.push(b"t", ttl=1)
    clock.advance(1)
    meta = store.core.meta
    read: list[bytes] = []
    scan_keys = meta.scan_keys

    def logged(lo: bytes, hi: bytes, limit: int | None = None) -> list[bytes]:
        found = scan_keys(lo, hi, limit)
        read.extend(found)
        return found

    meta.scan_keys = logged  # type: ignore[method-assign]
    assert q.stats().expired == 1
    assert read == [keys.expiry_key(store.core.queues["q"].qid, keys.to_us(clock.now), 501)]


def test_the_check_reports_a_damaged_expiry_index(store: qstore.Store) -> None:
    q = store.create_queue("q")
    mid = q.push(b"x", ttl=60)
    state = store.core.queues["q"]
    (key,) = store.core.meta.scan_keys(keys.prefix(keys.EXPIRY, state.qid),
                                       keys.prefix_end(keys.prefix(keys.EXPIRY, state.qid)))
    batch = new_batch()
    batch.delete(key)
    batch.put(keys.expiry_key(state.qid, 5, mid), b"")  # the wrong time
    store.core.meta.write(batch)
    kinds = sorted(f.kind for f in store.check().findings)
    assert kinds == ["index_missing", "stray_index_key"]


@pytest.mark.parametrize("bad", [{"ttl": -1}, {"ttl": 0}, {"ttl": float("nan")},
                                 {"on_expire": "keep"}, {"aging": 0}, {"aging": -2},
                                 {"rate": (0, 1)}, {"rate": (-1, 1)}, {"rate": (5, 0)},
                                 {"rate": 5}, {"aging_cap": 0}])
def test_bad_options_are_rejected(store: qstore.Store, bad: dict[str, Any]) -> None:
    with pytest.raises(qstore.InvalidArgument):
        store.create_queue("q", **bad)
    assert store.queues() == []
    q = store.create_queue("q")
    with pytest.raises(qstore.InvalidArgument):
        store.configure_queue("q", **bad)
    assert q.stats() == store.create_queue("q2").stats().__class__("q", 0, 0, 0, 0, 0)


def test_bad_ttls_are_rejected(store: qstore.Store) -> None:
    q = store.create_queue("q")
    for ttl in (-1, 0, "5", float("inf"), True):
        with pytest.raises(qstore.InvalidArgument):
            q.push(b"x", ttl=ttl)  # type: ignore[arg-type]
    assert q.stats().total == 0
    with pytest.raises(qstore.InvalidArgument):
        store.create_queue("s", priority_type="str", aging=5)
    with pytest.raises(qstore.InvalidArgument):
        store.create_queue("f", order="fifo", aging=5)
    with pytest.raises(qstore.InvalidArgument):
        store.configure_queue("q", colour="red")


@pytest.mark.parametrize("kind", [{"order": "fifo"}, {"priority_type": "str"}])
def test_aging_cap_is_refused_where_aging_is(store: qstore.Store, kind: dict[str, Any]) -> None:
    # It was accepted and kept on queues that can never age (a configuration audit).
    with pytest.raises(qstore.InvalidArgument, match="aging_cap needs"):
        store.create_queue("q", aging_cap=3, **kind)
    assert store.queues() == []
    q = store.create_queue("q", **kind)
    with pytest.raises(qstore.InvalidArgument, match="aging_cap needs"):
        store.configure_queue("q", aging_cap=3)
    # A cap such a queue was given before this check does not block other options:
    # it never applied, and goes.
    core = store.core
    with core.writing:
        state = core.queues["q"]
        old = {f: getattr(state.rec, f) for f in ("ttl", "on_expire", "aging", "aging_cap",
                                                   "rate")}
        core.configure_queue(state, {**old, "aging_cap": 3})
    assert q.stats().aging_cap == 3
    store.configure_queue("q", ttl=60)
    assert (q.stats().ttl, q.stats().aging_cap) == (60, None)


def test_options_persist_and_can_be_changed(store_path: str, clock: FakeClock) -> None:
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        s.create_queue("q", ttl=30, on_expire="dead", aging=60, aging_cap=3, rate=(10, 1.5))
        s.create_queue("plain")
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        st = s.queue("q").stats()
        assert (st.ttl, st.on_expire, st.aging, st.aging_cap, st.rate) == (
            30.0, "dead", 60.0, 3, (10, 1.5))
        s.create_queue("q", ttl=30, on_expire="dead", aging=60, aging_cap=3, rate=(10, 1.5),
                       exist_ok=True)
        # Options not given are the queue's own (configure_queue changes them): a
        # worker's create_queue(name, exist_ok=True) failed once an operator had
        # changed its TTL (an API audit). One given that differs is named.
        assert s.create_queue("q", exist_ok=True).name == "q"
        with pytest.raises(qstore.InvalidArgument,
                           match=r"exists with ttl=30\.0, rate=\(10, 1\.5\), not ttl=31\.0, "
                                 r"rate=\(10, 2\.0\)$"):
            s.create_queue("q", ttl=31, rate=(10, 2), aging=60, exist_ok=True)
        with pytest.raises(qstore.InvalidArgument, match="exists with max_attempts=5, not "):
            s.create_queue("q", max_attempts=3, exist_ok=True)
        with pytest.raises(qstore.InvalidArgument, match="exist_ok must be a bool"):
            s.create_queue("q", exist_ok="yes")  # type: ignore[arg-type]
        s.configure_queue("q", ttl=None, rate=None)
        s.configure_queue("plain", ttl=5)
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        st = s.queue("q").stats()
        assert (st.ttl, st.on_expire, st.aging, st.aging_cap, st.rate) == (
            None, "dead", 60.0, 3, None)
        assert s.queue("plain").stats().ttl == 5.0
        assert s.check().ok


def test_a_push_does_not_dedup_against_a_message_whose_ttl_ran_out(store: qstore.Store,
                                                                   clock: FakeClock) -> None:
    q = store.create_queue("q", dedup=True)
    old = q.push(b"x", dedup_key="k", ttl=1, delay=5)
    clock.advance(1)  # no pass has run: the push itself must see the expiry
    new = q.push(b"x", dedup_key="k")
    assert new != old
    with pytest.raises(qstore.MessageNotFound):
        q.get(old)
    st = q.stats()
    assert (st.ready, st.delayed, st.expired) == (1, 0, 1)
    assert_consistent(store, q)


@pytest.mark.parametrize("leased", [False, True])
@pytest.mark.parametrize(("before", "after"), [("drop", "dead"), ("dead", "drop")])
def test_a_changed_on_expire_leaves_what_expired_before_the_change(
        store: qstore.Store, clock: FakeClock, before: str, after: str, leased: bool) -> None:
    """The outcome of an expiry never depends on when a pass looked: a TTL that ran
    out before configure_queue took the queue's on_expire of that time."""
    q = store.create_queue("q", on_expire=before)
    mid = q.push(b"x", ttl=5)
    msg = q.pop(lease=60) if leased else None
    clock.advance(10)  # ran out under `before`; no call looked since
    store.configure_queue("q", on_expire=after)
    st = q.stats()
    assert (st.expired, st.dead, st.on_expire) == (1, int(before == "dead"), after)
    if before == "drop":
        with pytest.raises(qstore.MessageNotFound):
            q.get(mid)
    else:
        assert (q.get(mid).state, q.get(mid).dead_reason) == ("dead", "expired")
    if msg is not None:
        with pytest.raises(qstore.MessageNotFound if before == "drop" else qstore.LeaseExpired):
            q.ack(msg)
    assert_consistent(store, q)


def test_configure_after_a_restart_first_expires_what_ran_out_while_closed(
        store_path: str, clock: FakeClock) -> None:
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        s.create_queue("q", on_expire="dead").push_many([(b"m%d" % i, 0, 0.0, None, 5.0)
                                                         for i in range(3)])
    clock.advance(3600)
    with qstore.open(store_path, clock=clock, compactor=False) as s:
        s.configure_queue("q", on_expire="drop")  # at start-up, before any other call
        st = s.queue("q").stats()
        assert (st.dead, st.expired) == (3, 3)
        assert [m.dead_reason for m in s.queue("q").dead_letters()] == ["expired"] * 3
