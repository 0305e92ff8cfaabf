"""One seal-then-compact pass: what it frees, what it keeps, what it chooses."""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any

import pytest

import qstore
from qstore import _compact
from qstore.meta import records
from qstore.payload import _segments, _views
from qstore.payload._format import HEADER_SIZE

from ._support import (
    body,
    compaction_record,
    dead_sealed_segments,
    disk_bytes,
    files_on_disk,
    open_store,
    recount,
    ref_of,
    snapshot_messages,
)

RECORD = 1000  # body bytes: 4 records (4 x 1008 + 24 = 4056 bytes) fill a 4096-byte segment


def four_per_segment(store: qstore.Store, n: int) -> tuple[qstore.Queue, list[int]]:
    """A fifo queue with ``n`` messages of RECORD bytes: ids 4k+1..4k+4 share a segment."""
    q = store.create_queue("q", order="fifo", max_attempts=100)
    ids = [q.push(body(i, RECORD)) for i in range(n)]
    for i in range(0, n, 4):
        assert len({ref_of(store, "q", mid).file_id for mid in ids[i : i + 4]}) == 1
    return q, ids


def ack_only(q: qstore.Queue, ids: list[int], to_ack: set[int]) -> None:
    """Pop everything, ack ``to_ack``, and give the rest back (nack puts them in place)."""
    msgs = q.pop_many(len(ids))
    assert [m.id for m in msgs] == ids
    for m in msgs:
        if m.id in to_ack:
            q.ack(m)
        else:
            q.nack(m)


def test_pass_frees_space_and_keeps_every_live_message_unchanged(
    store_path: str, clock: Any
) -> None:
    store = open_store(store_path, clock)
    q = store.create_queue("q", max_attempts=2)
    ids = [q.push(body(i, (i * 97) % 1500), priority=i % 10) for i in range(40)]
    delayed = q.push(body(99, 700), priority=3, delay=100.0)
    popped = q.pop_many(20)
    acked = [m.id for m in popped[:10]]
    q.ack_many(popped[:10])
    for m in popped[10:15]:
        q.nack(m)
    again = q.pop()  # the head again: a second delivery, then nacked into the dead letters
    assert again is not None and again.attempts == 2
    q.nack(again)
    live_ids = [mid for mid in [*ids, delayed] if mid not in acked]
    before = snapshot_messages(q, live_ids)
    states = {v[2] for v in before.values()}
    assert states == {"ready", "delayed", "in_flight", "dead"}
    peek_before = [m.id for m in q.peek(50)]
    stats_before = q.stats()
    disk_before = disk_bytes(store)

    result = store.compact(threshold=0.0)

    assert result.sealed is not None
    assert result.messages_moved == len(live_ids)
    assert result.bytes_copied == sum(8 + len(v[0]) for v in before.values())
    disk_after = disk_bytes(store)
    assert disk_after < disk_before
    assert abs((disk_before - disk_after) - result.bytes_freed) <= HEADER_SIZE  # new active
    assert snapshot_messages(q, live_ids) == before
    assert [m.id for m in q.peek(50)] == peek_before
    assert q.stats() == stats_before
    assert recount(store) == []
    for mid in acked:
        with pytest.raises(qstore.MessageNotFound):
            q.get(mid)
    contents = b"".join(Path(store.core.payload.path_of(fid)).read_bytes()
                        for fid in files_on_disk(store))
    for i, mid in enumerate(ids):
        stamp = body(i, 30)[:20]
        if len(body(i, (i * 97) % 1500)) >= 20:
            assert (stamp in contents) == (mid not in acked), mid
    store.close()

    store = open_store(store_path, clock)  # and all of it survives a reopen
    q = store.queue("q")
    assert snapshot_messages(q, live_ids) == before
    assert recount(store) == []
    store.close()


def test_threshold_selects_only_segments_with_enough_garbage(store_path: str, clock: Any) -> None:
    store = open_store(store_path, clock)
    q, ids = four_per_segment(store, 12)
    s1, s2, s3 = (ref_of(store, "q", ids[i]).file_id for i in (0, 4, 8))
    ack_only(q, ids, {*ids[0:3], ids[4], *ids[8:10]})  # garbage 75%, 25%, 50% (active)
    ratios = {s.file_id: s.garbage_ratio for s in store.stats().segments}
    assert ratios == {s1: 0.75, s2: 0.25, s3: 0.5}

    result = store.compact(threshold=0.5)

    assert result.sealed == s3
    assert result.segments_read == (s1, s3)
    assert set(result.segments_deleted) == {s1, s3}
    assert result.messages_moved == 3
    assert {ref_of(store, "q", mid).file_id for mid in ids[5:8]} == {s2}
    assert {ref_of(store, "q", mid).file_id for mid in [ids[3], *ids[10:12]]} == {result.output}
    assert set(files_on_disk(store)) == {s2, result.output, store.core.payload.active_id}
    assert recount(store) == []
    store.close()


def test_max_bytes_caps_the_live_bytes_rewritten_per_pass(store_path: str, clock: Any) -> None:
    store = open_store(store_path, clock)
    q, ids = four_per_segment(store, 13)  # the 13th alone in the active segment: no garbage
    sealed = [ref_of(store, "q", ids[i]).file_id for i in (0, 4, 8)]
    ack_only(q, ids, {mid for i, mid in enumerate(ids[:12]) if i % 4 != 0})  # 75% garbage each

    first = store.compact(threshold=0.5, max_bytes=RECORD + 8)
    second = store.compact(threshold=0.5, max_bytes=1)  # the oldest is taken whatever the cap
    third = store.compact(threshold=0.5, max_bytes=10 * RECORD)

    assert first.sealed is second.sealed is third.sealed is None
    assert first.segments_read == (sealed[0],)
    assert second.segments_read == (sealed[1],)
    assert third.segments_read == (sealed[2],)  # the outputs hold no garbage
    assert recount(store) == []
    store.close()


def test_a_segment_without_live_records_is_deleted_without_copying(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(store_path, clock)
    q, ids = four_per_segment(store, 5)
    s1 = ref_of(store, "q", ids[0]).file_id
    ack_only(q, ids, set(ids[:4]))

    def no_copy(*args: object) -> None:
        raise AssertionError("copy_live must not run")

    monkeypatch.setattr(store.core.payload, "copy_live", no_copy)
    result = store.compact(threshold=0.5)

    assert result.segments_deleted == (s1,)
    assert result.segments_read == ()
    assert (result.output, result.messages_moved, result.bytes_copied) == (None, 0, 0)
    assert result.bytes_freed == HEADER_SIZE + 4 * (RECORD + 8)
    assert s1 not in files_on_disk(store)
    assert recount(store) == []
    store.close()


def test_many_dead_segments_are_deleted_a_chunk_per_hold_of_the_writer_lock(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # All dead segments went in one hold of the writer lock, about 100 us each:
    # 5,000 of them held every push 0.5 s (a scale audit).
    monkeypatch.setattr(_compact, "DELETE_CHUNK", 4)
    store = open_store(store_path, clock)
    q, ids = four_per_segment(store, 44)  # 11 segments
    dead = {ref_of(store, "q", i).file_id for i in ids[:40]}
    ack_only(q, ids, set(ids[:40]))
    held: list[tuple[int, int]] = []  # (segments deleted, writer lock depth) per delete
    real = store.core.payload.delete

    def spy(file_ids: Any) -> None:
        fids = list(file_ids)
        held.append((len(fids), store.core.lock._recursion_count()))
        real(fids)

    monkeypatch.setattr(store.core.payload, "delete", spy)
    result = store.compact(threshold=0.5)
    assert set(result.segments_deleted) == dead and len(dead) == 10
    assert [n for n, _ in held] == [4, 4, 2] and {d for _, d in held} == {1}
    assert not dead & set(files_on_disk(store))
    assert recount(store) == []
    store.close()


@pytest.mark.parametrize("why", ["view_opening", "failed_after_repoint"])
def test_a_pass_that_cannot_delete_its_sources_frees_nothing_until_one_does(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    # It reported minus its output, and the server added that to its Prometheus
    # counter qstore_compaction_bytes_freed_total, which went down (an audit).
    store = open_store(store_path, clock)
    q, ids = four_per_segment(store, 13)  # 3 full sealed segments; the 13th is active
    ack_only(q, ids, {mid for i, mid in enumerate(ids[:12]) if i % 4})  # 75% garbage
    sources = sorted(fid for fid in files_on_disk(store)
                     if fid != store.core.payload.active_id)
    assert len(sources) == 3
    disk_before = disk_bytes(store)
    if why == "view_opening":
        # A read-only view opening holds the views lock as the pass ends: its
        # metadata may still refer to the sources, so they stay (no waiting here).
        monkeypatch.setattr(_segments, "no_view_opening",
                            functools.partial(_views.no_view_opening, wait=0.0))
        opening = _views.viewing(os.path.join(store_path, "payload"))
        assert opening.__enter__()
        try:
            first = store.compact(threshold=0.5)
        finally:
            opening.__exit__(None, None, None)
        assert first.sealed is None and list(first.segments_read) == sources
        assert first.output is not None and first.segments_deleted == ()
        assert first.bytes_freed == 0
        reported = [first.bytes_freed]
    else:
        def fail(step: str) -> None:
            if step == "repointed":
                raise OSError(5, "injected")

        monkeypatch.setattr(_compact, "step_hook", fail)
        with pytest.raises(qstore.StorageError):  # the output stays, the sources too
            store.compact(threshold=0.5)
        monkeypatch.setattr(_compact, "step_hook", None)
        reported = []  # a failed pass returns no result
    assert disk_bytes(store) > disk_before  # an output was written, nothing deleted
    assert store.compactor is not None and store.compactor.bytes_freed == 0

    second = store.compact(threshold=0.5)
    assert sorted(second.segments_deleted) == sources and second.output is None
    freed = disk_before - disk_bytes(store)
    assert freed > 0
    assert second.bytes_freed == freed  # the sources' size minus the first pass's output
    reported.append(second.bytes_freed)
    assert min(reported) >= 0 and sum(reported) == freed
    assert store.compactor.bytes_freed == freed  # the server's counter: 0, then freed
    assert [m.id for m in q.pop_many(10)] == [ids[i] for i in (0, 4, 8, 12)]
    store.close()


def test_the_active_segment_is_sealed_only_when_worth_it(store_path: str, clock: Any) -> None:
    store = open_store(store_path, clock)
    first = store.core.payload.active_id
    assert store.compact(threshold=0.0).sealed is None  # empty: nothing to gain
    assert store.core.payload.active_id == first
    q = store.create_queue("q", order="fifo")
    ids = [q.push(body(i, RECORD)) for i in range(2)]
    assert store.compact(threshold=0.5).sealed is None  # no garbage
    q.ack(q.pop())  # half of it is garbage now

    result = store.compact(threshold=0.5)

    assert result.sealed == first
    assert store.core.payload.active_id not in (first, result.output)
    assert first not in files_on_disk(store)
    assert ref_of(store, "q", ids[1]).file_id == result.output
    new = q.push(b"after the seal")
    assert ref_of(store, "q", new).file_id == store.core.payload.active_id
    assert recount(store) == []
    store.close()


def test_threshold_zero_seals_and_rewrites_even_a_segment_without_garbage(
    store_path: str, clock: Any
) -> None:
    store = open_store(store_path, clock)
    q = store.create_queue("q")
    mid = q.push(b"x" * 100)
    active = store.core.payload.active_id

    result = store.compact(threshold=0.0)

    assert result.sealed == active
    assert result.segments_read == (active,)
    assert ref_of(store, "q", mid).file_id == result.output
    assert q.get(mid).payload == b"x" * 100
    store.close()


def test_store_stats_show_size_live_bytes_and_garbage_ratio(store_path: str, clock: Any) -> None:
    store = open_store(store_path, clock)
    q, ids = four_per_segment(store, 6)
    s1, s2 = (ref_of(store, "q", ids[i]).file_id for i in (0, 4))
    ack_only(q, ids, {ids[0], ids[4]})
    segments = {s.file_id: s for s in store.stats().segments}

    assert (segments[s1].size, segments[s1].live_bytes, segments[s1].live_count) == (
        HEADER_SIZE + 4 * (RECORD + 8), 3 * (RECORD + 8), 3)
    assert segments[s1].garbage_ratio == 0.25
    assert not segments[s1].active
    assert segments[s2].active and segments[s2].live_count == 1
    assert segments[s2].garbage_ratio == 0.5
    store.close()


def test_a_long_lived_message_is_copied_forward_not_left_pinning_its_segment(
    store_path: str, clock: Any
) -> None:
    store = open_store(store_path, clock)
    q = store.create_queue("q", order="fifo")
    old = q.push(body(0, RECORD))
    first = ref_of(store, "q", old).file_id
    held = q.pop(lease=3600)
    assert held is not None
    for i in range(1, 13):
        q.push(body(i, RECORD))
    q.ack_many(q.pop_many(12))

    result = store.compact()

    assert first in result.segments_read
    assert first not in files_on_disk(store)
    assert ref_of(store, "q", old).file_id == result.output
    assert dead_sealed_segments(store) == []
    q.ack(held)  # the receipt of the lease survives the move
    assert recount(store) == []
    store.close()


def test_many_small_sealed_segments_are_merged_by_a_pass(store_path: str, clock: Any) -> None:
    store = open_store(store_path, clock, segment_max_bytes=64 * 1024)
    q = store.create_queue("q", order="fifo")
    keep = []
    for i in range(_compact.MERGE_MIN + 1):  # one record each, as old outputs often hold
        keep.append(q.push(body(i, 200)))
        with store.core.lock:
            store.core.payload.seal()
    q.push(body(100, RECORD))
    q.push(body(101, RECORD))
    q.ack(q.pop_many(_compact.MERGE_MIN + 2)[-1])  # garbage in the active segment only
    assert len(files_on_disk(store)) == _compact.MERGE_MIN + 2

    result = store.compact(threshold=0.4)

    assert len(result.segments_read) == _compact.MERGE_MIN + 2
    assert set(files_on_disk(store)) == {result.output, store.core.payload.active_id}
    assert recount(store) == []
    store.close()


def test_copying_never_holds_the_writer_lock(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(store_path, clock)
    q, ids = four_per_segment(store, 8)
    ack_only(q, ids, {ids[0], ids[1]})
    done: list[str] = []

    def other_thread_works(step: str) -> None:
        if step in ("copied", "repointed_chunk", "repointed", "deleting"):
            t = threading.Thread(target=lambda: done.append(str(q.push(b"meanwhile"))))
            t.start()
            t.join(timeout=30)
            assert not t.is_alive(), f"a push blocked at step {step}"

    monkeypatch.setattr(_compact, "step_hook", other_thread_works)
    store.compact(threshold=0.0)
    assert len(done) == 4
    assert recount(store) == []
    store.close()


def test_background_compactor_runs_passes_on_its_own(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    passed = threading.Event()

    def hook(step: str) -> None:
        if step == "done":
            passed.set()

    monkeypatch.setattr(_compact, "step_hook", hook)
    store = open_store(store_path, clock, compactor=True, compact_interval=0.01)
    q = store.create_queue("q", order="fifo")
    for i in range(12):
        q.push(body(i, RECORD))
    q.ack_many(q.pop_many(10))

    assert passed.wait(timeout=60)
    store.close()  # stops the thread, waiting for a pass in progress
    store = open_store(store_path, clock)
    assert recount(store) == []
    assert dead_sealed_segments(store) == []
    assert compaction_record(store) is None
    assert [m.payload for m in store.queue("q").peek(5)] == [body(10, RECORD), body(11, RECORD)]
    store.close()


def test_close_abandons_a_pass_that_is_still_copying(store_path: str, clock: Any) -> None:
    mib = 1024 * 1024
    store = open_store(store_path, clock, segment_max_bytes=4 * mib)
    q = store.create_queue("q", order="fifo")
    ids = [q.push(bytes([i]) * mib) for i in range(10)]  # several writes of copy_live
    compactor = store._compactor
    assert compactor is not None

    def closing(done: int, total: int) -> None:
        compactor._stop.set()  # as close() does from another thread

    with pytest.raises(qstore.StoreClosed):
        store.compact(threshold=0.0, progress=closing)

    assert compaction_record(store) is None
    assert set(files_on_disk(store)) == {ref_of(store, "q", mid).file_id for mid in ids} | {
        store.core.payload.active_id}
    assert [q.get(mid).payload for mid in ids] == [bytes([i]) * mib for i in range(10)]
    store.close()


@pytest.mark.parametrize(
    "options",
    [{"threshold": -0.1}, {"threshold": 1.5}, {"threshold": "0.5"}, {"threshold": True},
     {"max_bytes": 0}, {"max_bytes": 1.5}],
)
def test_compact_rejects_bad_options_and_changes_nothing(
    store: qstore.Store, options: dict[str, Any]
) -> None:
    with pytest.raises(qstore.InvalidArgument):
        store.compact(**options)
    assert store._compactor is not None and store._compactor.passes == 0


def test_compact_on_a_readonly_store_raises(store_path: str, clock: Any) -> None:
    open_store(store_path, clock).close()
    with qstore.open(store_path, readonly=True) as view, pytest.raises(qstore.ReadOnlyStore):
        view.compact()


def test_message_ref_and_repoint_agree_with_the_message_record() -> None:
    rec = records.MessageRecord(0, 7, 11, 222, 3333, 1, 1, 1.5, 0, b"d" * 16)
    assert records.message_ref(rec.encode()) == (11, 222, 3333)
    moved = records.MessageRecord.decode(records.repoint(rec.encode(), 12, 24))
    assert (moved.file_id, moved.offset, moved.length) == (12, 24, 3333)
    rec.file_id, rec.offset = 12, 24
    assert moved.encode() == rec.encode()  # nothing but the reference changed
