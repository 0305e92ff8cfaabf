"""Damaged source bytes abort a pass; they are never copied, hidden or repaired."""

from __future__ import annotations

import os
from typing import Any

import pytest

import qstore
from qstore.payload import _format as fmt

from ._support import body, compaction_record, files_on_disk, open_store, recount, ref_of


def flip_body_byte(store: qstore.Store, queue: str, mid: int) -> tuple[str, int]:
    ref = ref_of(store, queue, mid)
    path = store.core.payload.path_of(ref.file_id)
    with open(path, "r+b") as f:
        f.seek(ref.offset + fmt.FRAME_SIZE + 10)
        byte = f.read(1)
        f.seek(ref.offset + fmt.FRAME_SIZE + 10)
        f.write(bytes([byte[0] ^ 0x40]))
    return path, ref.offset


def test_a_damaged_live_record_aborts_the_pass_and_removes_its_output(
    store_path: str, clock: Any
) -> None:
    store = open_store(store_path, clock)
    q = store.create_queue("q", order="fifo")
    ids = [q.push(body(i, 1000)) for i in range(9)]
    q.ack(q.pop())
    path, offset = flip_body_byte(store, "q", ids[2])
    damage = [f"crc_mismatch: message {ids[2]} in 'q' segment {ref_of(store, 'q', ids[2]).file_id}"
              f" @ {offset}: {fmt.BAD_CRC}"]  # what the check reports, and nothing else
    files = {fid: size for fid, size in files_on_disk(store).items()
             if fid != store.core.payload.active_id}
    stats = q.stats()
    sealed_by_the_pass = store.core.payload.active_id

    with pytest.raises(qstore.Corruption) as info:
        store.compact(threshold=0.0)

    assert (info.value.path, info.value.offset, info.value.reason) == (path, offset, fmt.BAD_CRC)
    assert compaction_record(store) is None
    after = files_on_disk(store)
    assert {fid: after[fid] for fid in files} == files  # the sources are untouched
    assert set(after) == {*files, sealed_by_the_pass, store.core.payload.active_id}  # no output
    assert q.stats() == stats
    assert recount(store) == damage
    assert q.get(ids[3]).payload == body(3, 1000)
    with pytest.raises(qstore.Corruption):
        q.get(ids[2])
    with pytest.raises(qstore.Corruption):  # still damaged next time: nothing was "repaired"
        store.compact(threshold=0.0)
    store.close()

    store = open_store(store_path, clock)  # and the store still opens
    assert compaction_record(store) is None
    assert recount(store) == damage
    store.close()


def test_a_damaged_record_nobody_refers_to_is_never_read(store_path: str, clock: Any) -> None:
    store = open_store(store_path, clock)
    q = store.create_queue("q", order="fifo")
    ids = [q.push(body(i, 1000)) for i in range(9)]
    first = ref_of(store, "q", ids[0]).file_id
    flip_body_byte(store, "q", ids[0])
    with pytest.raises(qstore.Corruption):
        q.pop()
    q.purge()  # nothing refers to the damaged bytes any more
    ids = [q.push(body(i, 1000)) for i in range(9, 12)]

    result = store.compact(threshold=0.0)

    assert first in result.segments_deleted
    assert not os.path.exists(store.core.payload.path_of(first))
    assert [q.get(mid).payload for mid in ids] == [body(i, 1000) for i in range(9, 12)]
    assert recount(store) == []
    store.close()
