"""Every bad input of CONTRACT section 2 raises its typed error and changes nothing.

Each case runs against a store holding messages in every state (ready,
delayed, in flight, dead) in three queues, and compares a dump of every
RocksDB key, the counters and the payload segment sizes before and after.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import qstore

from ._support import assert_consistent, dump

MAX_PAYLOAD = 64
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
NAN, INF = float("nan"), float("inf")
HUGE = 10**400  # an int no float can hold
SURROGATE = "\udc80"  # a lone surrogate: a str with no UTF-8 form


@dataclass
class Env:
    store: qstore.Store
    ints: qstore.Queue  # int priorities, max order, max_attempts=2
    strs: qstore.Queue  # str priorities, min order
    dd: qstore.Queue  # dedup=True
    held: qstore.Message  # a live lease in ints
    held_str: qstore.Message  # a live lease in strs
    acked: qstore.Message  # acked from ints
    peeked: qstore.Message  # from peek: no receipt


@pytest.fixture
def env(store_path: str, clock: Any) -> Iterator[Env]:
    store = qstore.open(store_path, clock=clock, compactor=False, max_payload_bytes=MAX_PAYLOAD)
    try:
        ints = store.create_queue("ints", max_attempts=2)
        strs = store.create_queue("strs", order="min", priority_type="str")
        dd = store.create_queue("dd", dedup=True)
        ints.push_many([(b"r1", 1), (b"r2", 2), (b"r3", 3), (b"r4", 4)])
        ints.push(b"later", priority=9, delay=100.0)
        held = ints.pop(lease=60.0)
        acked = ints.pop()
        dying = ints.pop()
        assert held and acked and dying
        ints.ack(acked)
        ints.nack(dying)
        ints.nack(ints.pop())  # second attempt of max_attempts=2: dead
        strs.push_many([(b"s1", "a"), (b"s2", "b")])
        held_str = strs.pop(lease=60.0)
        dd.push(b"unique")
        assert held_str
        peeked = ints.peek(1)[0]
        stats = ints.stats()
        assert (stats.ready, stats.delayed, stats.in_flight, stats.dead) == (1, 1, 1, 1)
        yield Env(store, ints, strs, dd, held, held_str, acked, peeked)
    finally:
        store.close()


def assert_rejected(env: Env, call: Callable[[], Any], error: type[Exception]) -> None:
    """``call`` raises exactly ``error`` and leaves every key, counter and segment alone."""
    before = dump(env.store)
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error
    if issubclass(error, qstore.InvalidArgument):
        assert isinstance(info.value, ValueError)
    assert str(info.value), "the error must say what was wrong"
    assert dump(env.store) == before
    for q in (env.ints, env.strs, env.dd):
        assert_consistent(env.store, q)
    # The live leases survived the bad call.
    assert env.ints.get(env.held.id).state == "in_flight"
    assert env.strs.get(env.held_str.id).state == "in_flight"


Case = Callable[[Env], Any]
IA, TOO_LARGE = qstore.InvalidArgument, qstore.PayloadTooLarge


def cases(*items: tuple[str, Case, type[Exception]]) -> Any:
    return pytest.mark.parametrize("call,error", [pytest.param(c, e, id=i) for i, c, e in items])


# -- payloads ---------------------------------------------------------------------------


@cases(
    ("str", lambda e: e.ints.push("text"), IA),
    ("int", lambda e: e.ints.push(7), IA),
    ("none", lambda e: e.ints.push(None), IA),
    ("list", lambda e: e.ints.push([b"x"]), IA),
    ("too-large", lambda e: e.ints.push(b"x" * (MAX_PAYLOAD + 1)), TOO_LARGE),
    ("too-large-bytearray", lambda e: e.dd.push(bytearray(MAX_PAYLOAD + 1)), TOO_LARGE),
)
def test_a_payload_that_is_not_bytes_or_too_large_is_rejected(env: Env, call: Case,
                                                              error: type[Exception]) -> None:
    assert_rejected(env, lambda: call(env), error)


def test_a_payload_of_exactly_the_limit_is_accepted(env: Env) -> None:
    mid = env.ints.push(b"x" * MAX_PAYLOAD)
    assert env.ints.get(mid).payload == b"x" * MAX_PAYLOAD


# -- priorities -------------------------------------------------------------------------


@cases(
    ("bool-true", lambda e: e.ints.push(b"x", priority=True), IA),
    ("bool-false", lambda e: e.ints.push(b"x", priority=False), IA),
    ("float", lambda e: e.ints.push(b"x", priority=1.0), IA),
    ("nan", lambda e: e.ints.push(b"x", priority=NAN), IA),
    ("str-on-int", lambda e: e.ints.push(b"x", priority="1"), IA),
    ("bytes-on-int", lambda e: e.ints.push(b"x", priority=b"1"), IA),
    ("int-max-plus-1", lambda e: e.ints.push(b"x", priority=INT_MAX + 1), IA),
    ("int-min-minus-1", lambda e: e.ints.push(b"x", priority=INT_MIN - 1), IA),
    ("2**64", lambda e: e.ints.push(b"x", priority=2**64), IA),
    ("int-on-str", lambda e: e.strs.push(b"x", priority=1), IA),
    ("zero-on-str", lambda e: e.strs.push(b"x", priority=0), IA),
    ("bool-on-str", lambda e: e.strs.push(b"x", priority=True), IA),
    ("bytes-on-str", lambda e: e.strs.push(b"x", priority=b"a"), IA),
    ("surrogate-on-str", lambda e: e.strs.push(b"x", priority="\ud800"), IA),
    ("long-str", lambda e: e.strs.push(b"x", priority="x" * 1025), IA),
)
def test_a_priority_of_the_wrong_type_or_range_is_rejected(env: Env, call: Case,
                                                           error: type[Exception]) -> None:
    assert_rejected(env, lambda: call(env), error)


def test_priorities_at_the_limits_are_accepted(env: Env) -> None:
    for p in (INT_MIN, INT_MAX):
        assert env.ints.get(env.ints.push(b"x", priority=p)).priority == p
    long = "x" * 1024
    assert env.strs.get(env.strs.push(b"x", priority=long)).priority == long


# -- times and counts -------------------------------------------------------------------


@cases(
    ("push-delay-negative", lambda e: e.ints.push(b"x", delay=-1.0), IA),
    ("push-delay-tiny-negative", lambda e: e.ints.push(b"x", delay=-1e-9), IA),
    ("push-delay-nan", lambda e: e.ints.push(b"x", delay=NAN), IA),
    ("push-delay-inf", lambda e: e.ints.push(b"x", delay=INF), IA),
    ("push-delay-str", lambda e: e.ints.push(b"x", delay="1"), IA),
    ("push-delay-none", lambda e: e.ints.push(b"x", delay=None), IA),
    ("push-delay-bool", lambda e: e.ints.push(b"x", delay=True), IA),
    ("push-delay-huge", lambda e: e.ints.push(b"x", delay=1e300), IA),
    ("push-delay-huge-int", lambda e: e.ints.push(b"x", delay=10**30), IA),
    ("push-many-delay", lambda e: e.ints.push_many([b"x"], delay=-1.0), IA),
    ("push-many-empty-delay", lambda e: e.ints.push_many([], delay=-1.0), IA),  # checked too
    ("push-many-empty-ttl", lambda e: e.ints.push_many([], ttl=0), IA),
    ("push-many-delay-huge", lambda e: e.ints.push_many([(b"x", 1, 1e300)]), IA),
    ("pop-lease-zero", lambda e: e.ints.pop(lease=0), IA),
    ("pop-lease-negative", lambda e: e.ints.pop(lease=-1.0), IA),
    ("pop-lease-nan", lambda e: e.ints.pop(lease=NAN), IA),
    ("pop-lease-inf", lambda e: e.ints.pop(lease=INF), IA),
    ("pop-lease-str", lambda e: e.ints.pop(lease="30"), IA),
    ("pop-lease-huge", lambda e: e.ints.pop(lease=1e300), IA),
    ("pop-many-lease", lambda e: e.ints.pop_many(2, lease=-5.0), IA),
    ("pop-wait-negative", lambda e: e.ints.pop(wait=-1.0), IA),
    ("pop-wait-nan", lambda e: e.ints.pop(wait=NAN), IA),
    ("pop-wait-inf", lambda e: e.ints.pop(wait=INF), IA),
    ("pop-wait-huge", lambda e: e.ints.pop(wait=1e13), IA),
    ("pop-many-wait", lambda e: e.ints.pop_many(1, wait=-0.5), IA),
    ("nack-delay-negative", lambda e: e.ints.nack(e.held, delay=-1.0), IA),
    ("nack-delay-nan", lambda e: e.ints.nack(e.held, delay=NAN), IA),
    ("nack-delay-inf", lambda e: e.ints.nack(e.held, delay=INF), IA),
    ("nack-delay-huge", lambda e: e.ints.nack(e.held, delay=1e300), IA),
    ("extend-lease-zero", lambda e: e.ints.extend(e.held, lease=0.0), IA),
    ("extend-lease-negative", lambda e: e.ints.extend(e.held, lease=-1.0), IA),
    ("extend-lease-nan", lambda e: e.ints.extend(e.held, lease=NAN), IA),
    ("extend-lease-inf", lambda e: e.ints.extend(e.held, lease=INF), IA),
    ("extend-lease-huge", lambda e: e.ints.extend(e.held, lease=1e300), IA),
    ("pop-many-zero", lambda e: e.ints.pop_many(0), IA),
    ("pop-many-negative", lambda e: e.ints.pop_many(-1), IA),
    ("pop-many-bool", lambda e: e.ints.pop_many(True), IA),
    ("pop-many-float", lambda e: e.ints.pop_many(2.0), IA),
    ("peek-zero", lambda e: e.ints.peek(0), IA),
    ("dead-letters-zero", lambda e: e.ints.dead_letters(0), IA),
    ("redrive-zero", lambda e: e.ints.redrive(0), IA),
    ("redrive-negative", lambda e: e.ints.redrive(-3), IA),
    # Ints too large for a float: math.isfinite() raised OverflowError (issue 11 case 13).
    ("push-delay-beyond-float", lambda e: e.ints.push(b"x", delay=HUGE), IA),
    ("push-dedup-delay-beyond-float", lambda e: e.dd.push(b"x", delay=HUGE), IA),
    ("push-ttl-beyond-float", lambda e: e.ints.push(b"x", ttl=HUGE), IA),
    ("push-many-delay-beyond-float", lambda e: e.ints.push_many([b"x"], delay=HUGE), IA),
    ("push-many-item-delay-beyond-float", lambda e: e.ints.push_many([(b"x", 1, HUGE)]), IA),
    ("push-many-ttl-beyond-float", lambda e: e.ints.push_many([b"x"], ttl=HUGE), IA),
    ("push-many-item-ttl-beyond-float",
     lambda e: e.ints.push_many([(b"x", 1, 0.0, None, HUGE)]), IA),
    ("pop-lease-beyond-float", lambda e: e.ints.pop(lease=HUGE), IA),
    ("pop-wait-beyond-float", lambda e: e.ints.pop(wait=HUGE), IA),
    ("pop-many-lease-beyond-float", lambda e: e.ints.pop_many(2, lease=HUGE), IA),
    ("pop-many-wait-beyond-float", lambda e: e.ints.pop_many(2, wait=HUGE), IA),
    ("nack-delay-beyond-float", lambda e: e.ints.nack(e.held, delay=HUGE), IA),
    ("extend-lease-beyond-float", lambda e: e.ints.extend(e.held, lease=HUGE), IA),
    ("queue-ttl-beyond-float", lambda e: e.store.create_queue("n", ttl=HUGE), IA),
    ("queue-aging-beyond-float", lambda e: e.store.create_queue("n", aging=HUGE), IA),
    ("queue-rate-per-beyond-float", lambda e: e.store.create_queue("n", rate=(1, HUGE)), IA),
    ("configure-ttl-beyond-float", lambda e: e.store.configure_queue("ints", ttl=HUGE), IA),
    # Ints that msgpack cannot store: OverflowError when the queue record was encoded.
    ("max-attempts-beyond-u32", lambda e: e.store.create_queue("n", max_attempts=HUGE), IA),
    ("aging-cap-beyond-u32", lambda e: e.store.create_queue("n", aging=1.0, aging_cap=HUGE),
     IA),
    ("rate-n-beyond-u32", lambda e: e.store.create_queue("n", rate=(2**64, 1.0)), IA),
)
def test_a_bad_time_or_count_is_rejected(env: Env, call: Case, error: type[Exception]) -> None:
    assert_rejected(env, lambda: call(env), error)


def test_a_delay_or_lease_of_a_century_is_accepted(env: Env, clock: Any) -> None:
    century = 100 * 365 * 86400.0
    mid = env.dd.push(b"patient", delay=century)
    assert env.dd.get(mid).state == "delayed"
    msg = env.ints.pop(lease=century)
    assert msg is not None and msg.lease_deadline == clock() + century


# -- receipts and ids -------------------------------------------------------------------


def _receipt_variants(e: Env) -> list[Any]:
    r = e.held.receipt
    assert r is not None
    qid, mid, delivery = r.split("-")
    return ["", "abc", "1-2", f"{r}-1", "x-y-z", f"{qid}--{delivery}", f" {r}", f"{r}\n",
            f"{qid}-0x{mid}-{delivery}", f"{qid}-+{mid}-{delivery}", f"{qid}-{mid}-{delivery}_0",
            f"{qid}-{mid}-{delivery}".upper() + "G", f"{qid}-{'f' * 17}-1",
            f"{'f' * 9}-{mid}-1", f"{qid}-{mid}-{'f' * 17}", 42, None, 1.5, r.encode(),
            e.peeked]  # 20 variants


@pytest.mark.parametrize("op", ["ack", "nack", "extend", "ack_many"])
@pytest.mark.parametrize("index", range(20))
def test_a_malformed_receipt_is_rejected(env: Env, op: str, index: int) -> None:
    item = _receipt_variants(env)[index]
    call = getattr(env.ints, op)
    assert_rejected(env, lambda: call([item] if op == "ack_many" else item),
                    qstore.InvalidArgument)


@pytest.mark.parametrize("op", ["ack", "nack", "extend", "ack_many"])
def test_a_receipt_from_another_queue_is_rejected(env: Env, op: str) -> None:
    call = getattr(env.ints, op)
    for item in (env.held_str, env.held_str.receipt):
        assert_rejected(env, lambda: call([item] if op == "ack_many" else item),  # noqa: B023
                        qstore.InvalidArgument)


@pytest.mark.parametrize("op", ["ack", "nack", "extend", "ack_many"])
def test_a_receipt_of_an_unknown_message_raises_message_not_found(env: Env, op: str) -> None:
    qid = env.held.receipt.split("-")[0]  # type: ignore[union-attr]
    call = getattr(env.ints, op)
    for item in (f"{qid}-ffffff-1", env.acked, env.acked.receipt):
        assert_rejected(env, lambda: call([item] if op == "ack_many" else item),  # noqa: B023
                        qstore.MessageNotFound)


@pytest.mark.parametrize("op", ["ack", "nack", "extend", "ack_many"])
def test_a_forged_delivery_count_raises_lease_expired(env: Env, op: str) -> None:
    qid, mid, delivery = env.held.receipt.split("-")  # type: ignore[union-attr]
    call = getattr(env.ints, op)
    for d in (int(delivery, 16) + 1, int(delivery, 16) - 1):
        item = f"{qid}-{mid}-{d:x}"
        assert_rejected(env, lambda: call([item] if op == "ack_many" else item),  # noqa: B023
                        qstore.LeaseExpired)


@cases(
    ("valid-then-garbage", lambda e: e.ints.ack_many([e.held, "garbage"]), IA),
    ("valid-then-foreign", lambda e: e.ints.ack_many([e.held, e.held_str]), IA),
    ("valid-twice", lambda e: e.ints.ack_many([e.held, e.held.receipt]), IA),
    ("valid-then-acked", lambda e: e.ints.ack_many([e.held, e.acked]), qstore.MessageNotFound),
    ("not-iterable", lambda e: e.ints.ack_many(5), IA),
    ("none", lambda e: e.ints.ack_many(None), IA),
)
def test_ack_many_with_one_bad_item_acks_nothing(env: Env, call: Case,
                                                 error: type[Exception]) -> None:
    assert_rejected(env, lambda: call(env), error)


@cases(
    ("negative", lambda e: e.ints.get(-1), IA),
    ("str", lambda e: e.ints.get("1"), IA),
    ("bool", lambda e: e.ints.get(True), IA),
    ("float", lambda e: e.ints.get(1.0), IA),
    ("over-64-bits", lambda e: e.ints.get(2**64), IA),
    ("unknown", lambda e: e.ints.get(2**64 - 1), qstore.MessageNotFound),
    ("acked", lambda e: e.ints.get(e.acked.id), qstore.MessageNotFound),
    ("other-queue", lambda e: e.strs.get(e.held.id), qstore.MessageNotFound),
)
def test_a_bad_or_unknown_message_id_is_rejected(env: Env, call: Case,
                                                 error: type[Exception]) -> None:
    assert_rejected(env, lambda: call(env), error)


# -- dedup keys -------------------------------------------------------------------------


@cases(
    ("key-on-plain-queue", lambda e: e.ints.push(b"x", dedup_key="k"), IA),
    ("int-key", lambda e: e.dd.push(b"x", dedup_key=5), IA),
    ("list-key", lambda e: e.dd.push(b"x", dedup_key=[1, 2]), IA),  # (bytearray is bytes-like)
    ("surrogate-key", lambda e: e.dd.push(b"x", dedup_key=SURROGATE), IA),
    ("surrogate-key-in-batch", lambda e: e.dd.push_many([b"ok", (b"x", 1, 0.0, "a" + SURROGATE)]),
     IA),
)
def test_a_bad_dedup_key_is_rejected(env: Env, call: Case, error: type[Exception]) -> None:
    assert_rejected(env, lambda: call(env), error)


# -- push_many --------------------------------------------------------------------------


@cases(
    ("str-item", lambda e: e.ints.push_many([b"ok", "text"]), IA),
    ("none-item", lambda e: e.ints.push_many([b"ok", None]), IA),
    ("dict-item", lambda e: e.ints.push_many([b"ok", {"payload": b"x"}]), IA),
    ("empty-tuple", lambda e: e.ints.push_many([b"ok", ()]), IA),
    ("six-tuple", lambda e: e.ints.push_many([b"ok", (b"x", 1, 0.0, None, 1, 2)]), IA),
    ("bad-ttl", lambda e: e.ints.push_many([b"ok", (b"x", 1, 0.0, None, -1)]), IA),
    ("zero-ttl", lambda e: e.ints.push_many([b"ok"], ttl=0), IA),
    ("bad-payload", lambda e: e.ints.push_many([b"ok", ("text", 1)]), IA),
    ("bad-priority", lambda e: e.ints.push_many([b"ok", (b"x", "high")]), IA),
    ("out-of-range", lambda e: e.ints.push_many([b"ok", (b"x", INT_MAX + 1)]), IA),
    ("bad-delay", lambda e: e.ints.push_many([b"ok", (b"x", 1, -1.0)]), IA),
    ("bad-dedup-key", lambda e: e.dd.push_many([b"ok", (b"x", 1, 0.0, 5)]), IA),
    ("key-on-plain", lambda e: e.ints.push_many([b"ok", (b"x", 1, 0.0, "k")]), IA),
    ("str-priority-int", lambda e: e.strs.push_many([(b"ok", "a"), (b"x", 3)]), IA),
    ("too-large", lambda e: e.ints.push_many([b"ok", b"x" * (MAX_PAYLOAD + 1)]), TOO_LARGE),
    ("not-iterable", lambda e: e.ints.push_many(5), IA),
    ("none", lambda e: e.ints.push_many(None), IA),
    ("bytes-not-list", lambda e: e.ints.push_many(b"abc"), IA),
)
def test_a_push_many_with_one_bad_item_enqueues_nothing(env: Env, call: Case,
                                                        error: type[Exception]) -> None:
    assert_rejected(env, lambda: call(env), error)


# -- queues -----------------------------------------------------------------------------


@cases(
    ("queue", lambda e: e.store.queue("nope"), qstore.QueueNotFound),
    ("queue-prefix", lambda e: e.store.queue("int"), qstore.QueueNotFound),
    ("delete", lambda e: e.store.delete_queue("nope"), qstore.QueueNotFound),
    ("name-empty", lambda e: e.store.create_queue(""), IA),
    ("name-int", lambda e: e.store.create_queue(5), IA),
    ("name-none", lambda e: e.store.create_queue(None), IA),
    ("name-256-bytes", lambda e: e.store.create_queue("x" * 256), IA),
    ("name-256-utf8-bytes", lambda e: e.store.create_queue("é" * 128), IA),
    ("name-surrogate", lambda e: e.store.create_queue("q" + SURROGATE), IA),
    ("queue-surrogate", lambda e: e.store.queue(SURROGATE), IA),  # no queue can have it
    ("queue-int", lambda e: e.store.queue(5), IA),  # not a name at all, not "not found"
    ("queue-empty", lambda e: e.store.queue(""), IA),
    ("delete-none", lambda e: e.store.delete_queue(None), IA),
    ("delete-surrogate", lambda e: e.store.delete_queue(SURROGATE), IA),
    ("queue-unhashable", lambda e: e.store.queue(["q"]), IA),
    ("delete-unhashable", lambda e: e.store.delete_queue({}), IA),
    ("configure-unhashable", lambda e: e.store.configure_queue(["q"], ttl=5.0), IA),
    ("configure-surrogate", lambda e: e.store.configure_queue(SURROGATE, ttl=5.0), IA),
    ("order", lambda e: e.store.create_queue("n", order="random"), IA),
    ("priority-type", lambda e: e.store.create_queue("n", priority_type="float"), IA),
    ("max-attempts-zero", lambda e: e.store.create_queue("n", max_attempts=0), IA),
    ("max-attempts-bool", lambda e: e.store.create_queue("n", max_attempts=True), IA),
    ("max-attempts-float", lambda e: e.store.create_queue("n", max_attempts=2.0), IA),
    ("dedup-int", lambda e: e.store.create_queue("n", dedup=1), IA),
    ("exists", lambda e: e.store.create_queue("ints"), qstore.QueueExists),
    ("exists-other-config", lambda e: e.store.create_queue("ints", order="min",
                                                           exist_ok=True), IA),
)
def test_a_bad_queue_call_is_rejected(env: Env, call: Case, error: type[Exception]) -> None:
    assert_rejected(env, lambda: call(env), error)


def test_a_queue_name_of_255_utf8_bytes_is_accepted(env: Env) -> None:
    name = "é" * 127 + "x"
    assert len(name.encode()) == 255
    env.store.create_queue(name).push(b"x")
    assert name in env.store.queues()


# -- open options -----------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    {"durabilty": "none"},
    {"durability": "sometimes"},
    {"durability": None},
    {"durability": "ALWAYS"},
    {"sync_interval": 0},
    {"sync_interval": -1.0},
    {"sync_interval": "0.05"},
    {"segment_max_bytes": 0},
    {"segment_max_bytes": 1.5},
    {"max_payload_bytes": -1},
    {"readonly": "yes"},
    {"compactor": 1},
    {"clock": 5},
    {"sweep_interval": 0},
    {"compact_threshold": 0.0},
    {"compact_threshold": 1.5},
    {"compact_threshold": HUGE},
    {"segment_max_bytes": 2**64},
], ids=lambda o: repr(o)[:60])
def test_a_bad_open_option_raises_invalid_argument_and_creates_nothing(
        tmp_path: Any, options: dict[str, Any]) -> None:
    path = os.path.join(str(tmp_path), "store")
    with pytest.raises(qstore.InvalidArgument) as info:
        qstore.open(path, **options)
    assert isinstance(info.value, ValueError)
    assert not os.path.exists(path)


def test_an_unknown_option_is_named_in_the_error(tmp_path: Any) -> None:
    with pytest.raises(qstore.InvalidArgument, match="durabilty"):
        qstore.open(tmp_path / "s", durabilty="none")


def test_a_bad_option_on_an_existing_store_leaves_it_intact(store_path: str, clock: Any) -> None:
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        store.create_queue("q").push(b"kept")
    with pytest.raises(qstore.InvalidArgument):
        qstore.open(store_path, durability="never")
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        assert store.queue("q").pop().payload == b"kept"  # type: ignore[union-attr]


def test_opening_a_missing_store_readonly_raises_a_typed_error(tmp_path: Any) -> None:
    path = os.path.join(str(tmp_path), "missing")
    with pytest.raises(qstore.QStoreError):
        qstore.open(path, readonly=True)
    assert not os.path.exists(path)


# -- the clock ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [NAN, INF, -INF, -1.0, "1700000000", None, HUGE, 1e300],
                         ids=lambda v: repr(v)[:20])
def test_a_clock_returning_a_bad_time_is_refused_and_nothing_is_stored(
        store_path: str, bad: Any) -> None:
    now: list[Any] = [1_700_000_000.0]
    with qstore.open(store_path, clock=lambda: now[0], compactor=False) as store:
        plain = store.create_queue("plain")
        dd = store.create_queue("dd", dedup=True)
        kept = plain.push(b"kept")
        before = dump(store)
        now[0] = bad
        for call in (lambda: plain.push(b"x"), lambda: dd.push(b"y"),
                     lambda: plain.push_many([b"a", b"b"]), plain.pop,
                     lambda: plain.pop_many(2), lambda: store.create_queue("new")):
            with pytest.raises(qstore.InvalidArgument, match="clock returned"):
                call()
        now[0] = 1_700_000_001.0
        assert dump(store) == before
        msg = plain.pop()
        assert msg is not None and msg.id == kept and msg.lease_deadline == 1_700_000_031.0
        assert store.check().ok
