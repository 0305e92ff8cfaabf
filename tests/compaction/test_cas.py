"""The repoint is a compare-and-set: changes racing a pass are never undone.

Each test acts at the "copied" step: the live records are in the output, no
message refers to it yet, and the hook runs outside the writer lock (as
another thread would).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import qstore
from qstore import _compact
from qstore._txn import Txn
from qstore.meta import keys
from qstore.payload import PayloadRef
from qstore.payload._format import HEADER_SIZE

from ._support import body, compaction_record, files_on_disk, open_store, record_of, recount, ref_of

N = 8


def act_at_copied(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> None:
    calls = []

    def hook(step: str) -> None:
        if step == "copied" and not calls:
            calls.append(step)
            action()

    monkeypatch.setattr(_compact, "step_hook", hook)


def setup(store_path: str, clock: Any, max_attempts: int = 5) -> tuple[
        qstore.Store, qstore.Queue, list[int]]:
    store = open_store(store_path, clock)
    q = store.create_queue("q", order="fifo", max_attempts=max_attempts)
    ids = [q.push(body(i, 1000)) for i in range(N)]
    return store, q, ids


def compact_all(store: qstore.Store) -> qstore.CompactionResult:
    result = store.compact(threshold=0.0)
    assert result.output is not None
    assert compaction_record(store) is None
    assert recount(store) == []
    return result


def test_a_message_acked_during_the_pass_is_not_resurrected(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, q, ids = setup(store_path, clock)
    held = q.pop()
    assert held is not None
    act_at_copied(monkeypatch, lambda: q.ack(held))

    result = compact_all(store)

    assert result.messages_moved == N - 1
    with pytest.raises(qstore.MessageNotFound):
        q.get(held.id)
    assert q.stats().total == N - 1
    assert [m.id for m in q.pop_many(N)] == ids[1:]
    store.close()


def test_a_message_nacked_during_the_pass_keeps_its_new_state_and_moves(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, q, ids = setup(store_path, clock)
    held = q.pop()
    assert held is not None
    act_at_copied(monkeypatch, lambda: q.nack(held, delay=60.0))

    result = compact_all(store)

    m = q.get(held.id)
    assert (m.state, m.attempts, m.payload) == ("delayed", 1, body(0, 1000))
    assert ref_of(store, "q", held.id).file_id == result.output
    clock.advance(61)
    assert [m.id for m in q.pop_many(N)] == ids  # back at its own place, at the head
    store.close()


def test_a_message_dead_lettered_during_the_pass_keeps_its_payload(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, q, ids = setup(store_path, clock, max_attempts=1)
    held = q.pop()
    assert held is not None
    act_at_copied(monkeypatch, lambda: q.nack(held))

    result = compact_all(store)

    assert [(m.id, m.payload) for m in q.dead_letters()] == [(held.id, body(0, 1000))]
    assert ref_of(store, "q", held.id).file_id == result.output
    assert q.redrive() == 1
    assert q.get(held.id).state == "ready"
    store.close()


def test_a_lease_extended_during_the_pass_keeps_its_deadline_and_receipt(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, q, ids = setup(store_path, clock)
    held = q.pop(lease=10.0)
    assert held is not None
    extended: list[qstore.Message] = []
    act_at_copied(monkeypatch, lambda: extended.append(q.extend(held, lease=500.0)))

    result = compact_all(store)

    assert q.get(held.id).lease_deadline == extended[0].lease_deadline == clock() + 500.0
    assert ref_of(store, "q", held.id).file_id == result.output
    clock.advance(100)  # past the first deadline, inside the extended one
    assert q.pop_many(N)[0].id == ids[1]
    q.ack(held)  # the receipt is still the live one
    store.close()


def test_a_message_popped_during_the_pass_stays_leased(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, q, ids = setup(store_path, clock)
    popped: list[qstore.Message] = []
    act_at_copied(monkeypatch, lambda: popped.extend(q.pop_many(3)))

    compact_all(store)

    assert [m.id for m in popped] == ids[:3]
    assert all(q.get(mid).state == "in_flight" for mid in ids[:3])
    assert [m.id for m in q.pop_many(N)] == ids[3:]
    q.ack_many(popped)
    store.close()


def test_a_queue_purged_during_the_pass_stays_empty_and_the_output_goes(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, q, ids = setup(store_path, clock)
    act_at_copied(monkeypatch, q.purge)
    before = store.stats().disk_bytes

    result = compact_all(store)

    assert result.messages_moved == 0
    assert result.output in result.segments_deleted  # nothing live was left in it
    assert result.bytes_freed == before - (store.stats().disk_bytes - HEADER_SIZE)  # new active
    assert q.stats().total == 0
    assert set(files_on_disk(store)) == {store.core.payload.active_id}
    for mid in ids:
        with pytest.raises(qstore.MessageNotFound):
            q.get(mid)
    store.close()


def test_a_queue_deleted_during_the_pass_is_not_brought_back(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, q, ids = setup(store_path, clock)
    other = store.create_queue("other")
    kept = other.push(b"kept")
    act_at_copied(monkeypatch, lambda: store.delete_queue("q"))

    result = compact_all(store)

    assert result.messages_moved == 1
    assert store.queues() == ["other"]
    assert other.get(kept).payload == b"kept"
    store.close()


def test_a_push_during_the_pass_goes_to_the_new_active_segment(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, q, ids = setup(store_path, clock)
    pushed: list[int] = []
    act_at_copied(monkeypatch, lambda: pushed.append(q.push(b"late")))

    result = compact_all(store)

    assert ref_of(store, "q", pushed[0]).file_id == store.core.payload.active_id
    assert result.messages_moved == N
    assert [m.payload for m in q.pop_many(N + 1)][-1] == b"late"
    store.close()


def test_a_message_no_longer_at_the_copied_bytes_is_not_repointed(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No operation moves a payload today; the compare-and-set must still hold if one did.
    store, q, ids = setup(store_path, clock)
    moved_to: list[PayloadRef] = []

    def move_payload_elsewhere() -> None:
        with store.core.lock:
            qid = store.core.queues["q"].qid
            rec = record_of(store, "q", ids[2])
            assert rec is not None
            old = PayloadRef(rec.file_id, rec.offset, rec.length)
            new = store.core.payload.append(store.core.payload.read(old))
            rec.file_id, rec.offset = new.file_id, new.offset
            txn = Txn()
            txn.put(keys.message_key(qid, ids[2]), rec.encode())
            txn.live(old, -1)
            txn.written(new)
            store.core.commit(txn)
            moved_to.append(new)

    act_at_copied(monkeypatch, move_payload_elsewhere)

    result = compact_all(store)

    assert result.messages_moved == N - 1
    assert ref_of(store, "q", ids[2]) == moved_to[0]
    assert q.get(ids[2]).payload == body(2, 1000)
    store.close()
