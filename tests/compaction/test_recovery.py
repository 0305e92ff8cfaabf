"""A pass cut short at any step: open finishes or rolls it back, and nothing is lost.

A crash is simulated by raising a BaseException from the step hook (the pass
does not roll back for those, exactly as if the process had died there) and
closing the store, or by leaving the files and the compaction record as a
crash would. tests/compaction/test_crash.py runs the real thing (SIGKILL).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

import qstore
from qstore import _compact
from qstore._txn import Txn
from qstore.meta import keys, records
from qstore.payload import PayloadRef
from qstore.payload._writer import create_segment_file

from ._support import (
    SimulatedCrash,
    body,
    compaction_record,
    dead_sealed_segments,
    files_on_disk,
    open_store,
    recount,
    ref_of,
    snapshot_messages,
)


def busy_store(store_path: str, clock: Any) -> tuple[qstore.Store, list[int], list[int]]:
    """Three full segments and an active one, each with garbage; returns (ids, sources)."""
    store = open_store(store_path, clock)
    q = store.create_queue("q", order="fifo", max_attempts=3)
    ids = [q.push(body(i, 1000), priority=i) for i in range(14)]
    sources = sorted({ref_of(store, "q", mid).file_id for mid in ids})
    msgs = q.pop_many(14)
    q.ack_many([m for m in msgs if m.id % 3 == 0])
    for m in msgs:
        if m.id % 3 == 1:
            q.nack(m)
    q.pop()  # one stays in flight
    return store, ids, sources


def crash_at(monkeypatch: pytest.MonkeyPatch, step: str, nth: int = 1) -> None:
    seen = []

    def hook(name: str) -> None:
        if name == step:
            seen.append(name)
            if len(seen) == nth:
                raise SimulatedCrash(step)

    monkeypatch.setattr(_compact, "step_hook", hook)


STEPS = ("sealed", "copied", "repointed_chunk", "repointed", "deleting", "done")


def test_a_pass_goes_through_every_step_in_order(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, ids, sources = busy_store(store_path, clock)
    seen: list[str] = []
    monkeypatch.setattr(_compact, "step_hook", seen.append)
    monkeypatch.setattr(_compact, "REPOINT_CHUNK", 4)

    store.compact(threshold=0.0)

    chunks = -(-len(snapshot_messages(store.queue("q"), ids)) // 4)
    assert seen == ["sealed", "copied", *["repointed_chunk"] * chunks, "repointed", "deleting",
                    "done"]
    assert tuple(dict.fromkeys(seen)) == STEPS
    store.close()


@pytest.mark.parametrize("step", STEPS)
def test_a_crash_at_each_step_leaves_a_store_that_opens_and_loses_nothing(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    store, ids, sources = busy_store(store_path, clock)
    before = snapshot_messages(store.queue("q"), ids)
    monkeypatch.setattr(_compact, "REPOINT_CHUNK", 2)
    crash_at(monkeypatch, step)
    with pytest.raises(SimulatedCrash):
        store.compact(threshold=0.0)
    record = compaction_record(store)
    store.close()
    monkeypatch.setattr(_compact, "step_hook", None)

    store = open_store(store_path, clock)

    assert compaction_record(store) is None
    assert snapshot_messages(store.queue("q"), ids) == before
    assert recount(store) == []
    files = files_on_disk(store)
    if step == "copied":  # rolled back: the output is gone, every message where it was
        assert record is not None and record[1] == "copying"
        assert record[2] not in files
        assert {ref_of(store, "q", mid).file_id for mid in before} <= set(sources)
    if step in ("repointed", "deleting"):  # rolled forward: the sources are gone
        assert record is not None
        assert not set(record[3]) & set(files)
        assert {ref_of(store, "q", mid).file_id for mid in before} == {record[2]}
    if step == "done":
        assert record is None
    assert dead_sealed_segments(store) == []

    store.compact()  # and the next pass leaves no garbage segment behind
    assert dead_sealed_segments(store) == []
    assert recount(store) == []
    assert snapshot_messages(store.queue("q"), ids) == before
    store.close()


def test_a_crash_between_repoint_chunks_is_finished_by_the_next_pass(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, ids, sources = busy_store(store_path, clock)
    before = snapshot_messages(store.queue("q"), ids)
    monkeypatch.setattr(_compact, "REPOINT_CHUNK", 2)
    crash_at(monkeypatch, "repointed_chunk")
    with pytest.raises(SimulatedCrash):
        store.compact(threshold=0.0)
    record = compaction_record(store)
    assert record is not None and record[1] == "repointing"
    store.close()
    monkeypatch.setattr(_compact, "step_hook", None)

    store = open_store(store_path, clock)
    output, old = record[2], record[3]
    where = {ref_of(store, "q", mid).file_id for mid in before}
    assert output in where and where & set(old)  # half moved, half not: both readable
    assert snapshot_messages(store.queue("q"), ids) == before

    result = store.compact(threshold=1.0)  # only the interrupted pass's sources qualify

    assert set(result.segments_read) == where - {output}
    assert not set(old) & set(files_on_disk(store))
    assert snapshot_messages(store.queue("q"), ids) == before
    assert recount(store) == []
    store.close()


def test_a_failed_copy_is_rolled_back_at_once(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, ids, sources = busy_store(store_path, clock)
    before = snapshot_messages(store.queue("q"), ids)
    files = set(files_on_disk(store))

    def fail(step: str) -> None:
        if step == "copied":
            raise RuntimeError("disk on fire")

    monkeypatch.setattr(_compact, "step_hook", fail)
    with pytest.raises(RuntimeError, match="disk on fire"):
        store.compact(threshold=0.0)

    assert compaction_record(store) is None
    assert set(files_on_disk(store)) <= files | {store.core.payload.active_id}  # no output left
    assert snapshot_messages(store.queue("q"), ids) == before
    assert recount(store) == []
    monkeypatch.setattr(_compact, "step_hook", None)
    result = store.compact(threshold=0.0)
    assert result.messages_moved == len(before)
    assert snapshot_messages(store.queue("q"), ids) == before
    store.close()


def test_a_failed_repoint_keeps_what_moved_and_the_next_pass_finishes(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, ids, sources = busy_store(store_path, clock)
    before = snapshot_messages(store.queue("q"), ids)
    monkeypatch.setattr(_compact, "REPOINT_CHUNK", 2)

    def fail(step: str) -> None:
        if step == "repointed_chunk":
            raise RuntimeError("metadata write failed")

    monkeypatch.setattr(_compact, "step_hook", fail)
    with pytest.raises(RuntimeError):
        store.compact(threshold=0.0)
    assert compaction_record(store) is None
    assert snapshot_messages(store.queue("q"), ids) == before
    assert recount(store) == []
    monkeypatch.setattr(_compact, "step_hook", None)

    store.compact(threshold=1.0)  # the interrupted sources are taken whatever their garbage

    assert not set(sources) & set(files_on_disk(store))
    assert dead_sealed_segments(store) == []
    assert snapshot_messages(store.queue("q"), ids) == before
    store.close()


def test_an_unfinished_copy_left_on_disk_is_discarded_on_open(store_path: str, clock: Any) -> None:
    store, ids, sources = busy_store(store_path, clock)
    before = snapshot_messages(store.queue("q"), ids)
    output = store.core.payload.reserve_file_id()
    txn = Txn()  # as the pass leaves it: record synced, output half written
    txn.put(keys.COMPACTION_KEY, records.encode_compaction(_compact.COPYING, output, sources[:2]))
    store.core.meta.write(txn.batch, sync=True)
    store.close()
    path = os.path.join(store_path, "payload", f"{output:010d}.seg")
    create_segment_file(path, output)
    with open(path, "ab") as f:
        f.write(b"\x10\x00\x00\x00torn")

    store = open_store(store_path, clock)

    assert compaction_record(store) is None
    assert not os.path.exists(path)
    assert store.core.payload.recovery.discarded == [output]
    assert snapshot_messages(store.queue("q"), ids) == before
    assert recount(store) == []
    store.close()


def test_sources_left_by_a_pass_that_was_deleting_are_removed_on_open(
    store_path: str, clock: Any
) -> None:
    store = open_store(store_path, clock)
    q = store.create_queue("q", order="fifo")
    ids = [q.push(body(i, 1000)) for i in range(9)]
    emptied = ref_of(store, "q", ids[0]).file_id
    q.ack_many(q.pop_many(4))  # as if its records had all been repointed
    txn = Txn()
    txn.put(keys.COMPACTION_KEY, records.encode_compaction(_compact.DELETING, 999, [emptied]))
    store.core.meta.write(txn.batch, sync=True)
    store.close()

    store = open_store(store_path, clock)

    assert compaction_record(store) is None
    assert emptied not in files_on_disk(store)
    assert [m.id for m in store.queue("q").peek(9)] == ids[4:]
    assert recount(store) == []
    store.close()


def test_orphan_segment_files_are_deleted_on_open(store_path: str, clock: Any) -> None:
    store, ids, sources = busy_store(store_path, clock)
    before = snapshot_messages(store.queue("q"), ids)
    store.close()
    orphan = os.path.join(store_path, "payload", f"{0:010d}.seg")  # no counters, no references
    create_segment_file(orphan, 0)

    store = open_store(store_path, clock)

    assert not os.path.exists(orphan)
    assert 0 not in store.core.payload.file_ids()
    assert snapshot_messages(store.queue("q"), ids) == before
    store.close()


def test_a_reader_holding_a_deleted_source_still_reads_it(store_path: str, clock: Any) -> None:
    store, ids, sources = busy_store(store_path, clock)
    live = [mid for mid in ids if mid % 3 != 0]
    first = next(mid for mid in live if ref_of(store, "q", mid).file_id == sources[0])
    ref: PayloadRef = ref_of(store, "q", first)
    reader = store.core.payload._readers[ref.file_id]

    store.compact(threshold=0.0)

    assert not os.path.exists(store.core.payload.path_of(ref.file_id))
    assert reader.read(ref) == body(first - 1, 1000)
    store.close()
