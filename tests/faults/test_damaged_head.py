"""Case 7: a damaged record at the head of a queue never blocks it.

The test flips real bytes in the body of a record on disk; pop, pop_many and
peek then move the damaged message to the dead letters with the reason
recorded and go on, and compaction of the segment holding it completes.
"""

from __future__ import annotations

import os
import sys

import qstore
from qstore.meta import records


def _flip(store: qstore.Store, q: qstore.Queue, mid: int) -> None:
    """Flip one byte of the body of message ``mid`` in its segment file."""
    raw = store.core.meta.get(qstore.meta.keys.message_key(q._q.qid, mid))
    assert raw is not None
    rec = records.MessageRecord.decode(raw)
    path = os.path.join(store.path, "payload", f"{rec.file_id:010d}.seg")
    with open(path, "r+b") as f:
        f.seek(rec.offset + 8 + 1)  # past the 8-byte frame: inside the body
        b = f.read(1)
        f.seek(rec.offset + 8 + 1)
        f.write(bytes([b[0] ^ 0xFF]))
    store.core.payload._readers.pop(rec.file_id, None)  # no stale map of the file


def _damaged_store(path: str) -> tuple[qstore.Store, qstore.Queue, list[int]]:
    store = qstore.open(path, compactor=False)
    q = store.create_queue("q")
    ids = q.push_many([b"message %03d" % i for i in range(6)])
    store.core.syncer.sync_now()
    _flip(store, q, ids[0])
    _flip(store, q, ids[2])
    return store, q, ids


def _assert_buried(q: qstore.Queue, mids: list[int]) -> None:
    dead = q.dead_letters(10)
    assert [m.id for m in dead] == mids
    for m in dead:
        assert m.dead_reason is not None and m.dead_reason.startswith("damaged payload: ")


def test_pop_moves_a_damaged_head_to_the_dead_letters_and_goes_on(store_path: str) -> None:
    store, q, ids = _damaged_store(store_path)
    with store:
        got = [q.pop(), q.pop()]
        assert [m.id for m in got if m] == [ids[1], ids[3]]
        _assert_buried(q, [ids[0], ids[2]])
        st = q.stats()
        assert (st.ready, st.in_flight, st.dead) == (2, 2, 2)
    # The reason survives a reopen; the store still opens read-write and read-only.
    with qstore.open(store_path, readonly=True) as view:
        _assert_buried(view.queue("q"), [ids[0], ids[2]])


def test_pop_many_and_peek_move_damaged_messages_aside(store_path: str) -> None:
    store, q, ids = _damaged_store(store_path)
    with store:
        assert [m.id for m in q.peek(2)] == [ids[1], ids[3]]
        _assert_buried(q, [ids[0], ids[2]])
        assert [m.id for m in q.pop_many(10)] == [ids[1], ids[3], ids[4], ids[5]]


def test_a_read_only_view_peeks_past_damaged_messages(store_path: str) -> None:
    store, q, ids = _damaged_store(store_path)
    store.close()
    with qstore.open(store_path, readonly=True) as view:
        vq = view.queue("q")
        # It cannot move them aside: it leaves them out and looks further, so
        # peek(n) still gives the first n intact messages while there are any.
        assert [m.id for m in vq.peek(1)] == [ids[1]]
        assert [m.id for m in vq.peek(3)] == [ids[1], ids[3], ids[4]]
        assert [m.id for m in vq.peek(10)] == [ids[1], ids[3], ids[4], ids[5]]
        assert vq.stats().ready == 6


def test_a_dead_letter_damaged_after_it_died_does_not_hide_the_others(
        store_path: str) -> None:
    store = qstore.open(store_path, compactor=False)
    with store:
        q = store.create_queue("q", max_attempts=1)
        ids = q.push_many([b"letter %d" % i for i in range(5)])
        for _ in ids:
            q.nack(q.pop())  # its last attempt: a dead letter, reason None
        store.core.syncer.sync_now()
        _flip(store, q, ids[1])
        dead = q.dead_letters(10)
        assert [m.id for m in dead] == ids
        assert [m.payload for m in dead] == [b"letter 0", b"", b"letter 2", b"letter 3",
                                             b"letter 4"]
        assert dead[1].dead_reason is not None
        assert dead[1].dead_reason.startswith("damaged payload: ")
        assert [m.dead_reason for m in dead if m.id != ids[1]] == [None] * 4


def test_compaction_of_a_segment_holding_a_damaged_record_completes(store_path: str) -> None:
    store, q, ids = _damaged_store(store_path)
    with store:
        for _ in range(4):  # everything but the two damaged messages goes
            m = q.pop_many(1)
            q.ack(m[0])
        first = store.compact(threshold=0.0)
        assert first.segments_read  # the pass ran and finished
        second = store.compact(threshold=0.0)  # and does not fail the next time either
        assert second is not None
        _assert_buried(q, [ids[0], ids[2]])
        # The damaged bytes were kept (copied as they are): still damaged, never data.
        for mid in (ids[0], ids[2]):
            try:
                q.get(mid)
            except qstore.Corruption:
                pass
            else:
                raise AssertionError("a damaged payload was returned as data")


def test_a_long_run_of_damaged_heads_is_buried_without_recursion(store_path: str) -> None:
    # One pop meets more damaged heads than Python's recursion limit allows
    # rounds: each round buries one and tries again, in a loop.
    n = sys.getrecursionlimit() + 50
    with qstore.open(store_path, compactor=False) as store:
        q = store.create_queue("q")
        ids = q.push_many([b"damaged %05d" % i for i in range(n)] + [b"intact"])
        store.core.syncer.sync_now()
        for mid in ids[:n]:
            _flip(store, q, mid)
        m = q.pop()
        assert m is not None and (m.id, m.payload) == (ids[-1], b"intact")
        st = q.stats()
        assert (st.ready, st.in_flight, st.dead) == (0, 1, n)
