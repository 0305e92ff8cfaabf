"""Damaged source bytes are never hidden or repaired; a pass carries them as they are."""

from __future__ import annotations

import os
from typing import Any

import pytest

import qstore
from qstore.payload import _format as fmt

from ._support import body, compaction_record, open_store, recount, ref_of


def flip_body_byte(store: qstore.Store, queue: str, mid: int) -> tuple[str, int]:
    ref = ref_of(store, queue, mid)
    path = store.core.payload.path_of(ref.file_id)
    with open(path, "r+b") as f:
        f.seek(ref.offset + fmt.FRAME_SIZE + 10)
        byte = f.read(1)
        f.seek(ref.offset + fmt.FRAME_SIZE + 10)
        f.write(bytes([byte[0] ^ 0x40]))
    return path, ref.offset


def test_a_damaged_live_record_is_carried_as_it_is_and_the_pass_completes(
    store_path: str, clock: Any
) -> None:
    """Issue 11 case 7: a pass used to fail on it forever; now the damaged
    record is copied unchanged (still damaged, never returned as data), the
    pass finishes and the check reports the same damage at its new place."""
    store = open_store(store_path, clock)
    q = store.create_queue("q", order="fifo")
    ids = [q.push(body(i, 1000)) for i in range(9)]
    q.ack(q.pop())
    flip_body_byte(store, "q", ids[2])
    stats = q.stats()

    result = store.compact(threshold=0.0)

    assert result.segments_read
    assert compaction_record(store) is None
    new = ref_of(store, "q", ids[2])
    assert recount(store) == [f"crc_mismatch: message {ids[2]} in 'q' segment {new.file_id}"
                              f" @ {new.offset}: {fmt.BAD_CRC}"]  # the damage, nothing else
    assert q.stats() == stats
    assert q.get(ids[3]).payload == body(3, 1000)
    with pytest.raises(qstore.Corruption):
        q.get(ids[2])
    store.compact(threshold=0.0)  # and the next pass does not fail either
    store.close()

    store = open_store(store_path, clock)  # the store still opens
    assert compaction_record(store) is None
    with pytest.raises(qstore.Corruption):  # still damaged: nothing was "repaired"
        store.queue("q").get(ids[2])
    store.close()


def test_a_damaged_record_nobody_refers_to_is_never_read(store_path: str, clock: Any) -> None:
    store = open_store(store_path, clock)
    q = store.create_queue("q", order="fifo")
    ids = [q.push(body(i, 1000)) for i in range(9)]
    first = ref_of(store, "q", ids[0]).file_id
    flip_body_byte(store, "q", ids[0])
    popped = q.pop()  # the damaged head goes to the dead letters (issue 11 case 7)
    assert popped is not None and popped.id == ids[1]
    assert [m.id for m in q.dead_letters()] == [ids[0]]
    q.purge()  # nothing refers to the damaged bytes any more
    ids = [q.push(body(i, 1000)) for i in range(9, 12)]

    result = store.compact(threshold=0.0)

    assert first in result.segments_deleted
    assert not os.path.exists(store.core.payload.path_of(first))
    assert [q.get(mid).payload for mid in ids] == [body(i, 1000) for i in range(9, 12)]
    assert recount(store) == []
    store.close()
