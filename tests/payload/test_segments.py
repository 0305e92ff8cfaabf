"""Appending, reading, rotating, sealing, copying and deleting segments (SegmentSet)."""

from __future__ import annotations

import os
import queue
import random
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qstore._errors import Corruption, PayloadTooLarge
from qstore.payload import PayloadRef, SegmentSet, _writer
from qstore.payload import _format as fmt
from qstore.payload._reader import SegmentReader

LIMIT = 600  # max_payload_bytes of the round-trip tests: above their smallest segments


def open_set(directory: Path, **options: object) -> SegmentSet:
    kwargs: dict[str, object] = {"segment_max_bytes": 4096, "max_payload_bytes": 1024}
    kwargs.update(options)
    return SegmentSet(str(directory), **kwargs)  # type: ignore[arg-type]


def file_size(segs: SegmentSet, file_id: int) -> int:
    return os.path.getsize(segs.path_of(file_id))


def assert_reads_back(segs: SegmentSet, written: dict[PayloadRef, bytes]) -> None:
    for ref, body in written.items():
        assert segs.read(ref) == body, ref


def assert_layout(segs: SegmentSet, refs: list[PayloadRef], segment_max: int) -> None:
    """Records are packed from offset 24, and only a lone record may pass segment_max."""
    by_file: dict[int, list[PayloadRef]] = {}
    for ref in refs:
        by_file.setdefault(ref.file_id, []).append(ref)
    for fid, in_file in by_file.items():
        in_file.sort(key=lambda r: r.offset)
        pos = fmt.HEADER_SIZE
        for ref in in_file:
            assert ref.offset == pos
            pos += ref.frame_bytes
        assert segs.segment_size(fid) == pos
        assert pos <= segment_max or len(in_file) == 1


# Mostly small payloads, and some at or just under the limit.
payloads = st.one_of(st.binary(max_size=LIMIT), st.binary(min_size=LIMIT - 8, max_size=LIMIT))
operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), payloads),
        st.tuples(st.just("append_many"), st.lists(payloads, max_size=8)),
        st.tuples(st.just("reopen")),
        st.tuples(st.just("seal")),
    ),
    max_size=25,
)


@given(segment_max=st.integers(256, 4096), ops=operations)
@settings(max_examples=75, deadline=None)
def test_any_payloads_round_trip_across_rotations_and_reopen(
    tmp_path_factory: pytest.TempPathFactory, segment_max: int, ops: list[tuple[object, ...]]
) -> None:
    directory = tmp_path_factory.mktemp("roundtrip")
    options = {"segment_max_bytes": segment_max, "max_payload_bytes": LIMIT}
    segs = open_set(directory, **options)
    written: dict[PayloadRef, bytes] = {}
    appended = 0
    for op in ops:
        if op[0] == "append":
            body = op[1]
            assert isinstance(body, bytes)
            ref = segs.append(body)
            assert ref.length == len(body)
            assert segs.read(ref) == body  # at once: no stale map
            written[ref] = body
            appended += 1
        elif op[0] == "append_many":
            bodies = op[1]
            assert isinstance(bodies, list)
            refs = segs.append_many(bodies)
            appended += len(bodies)
            assert [r.length for r in refs] == [len(b) for b in bodies]
            assert [segs.read(r) for r in refs] == bodies
            written.update(zip(refs, bodies, strict=True))
            # read_many of everything so far, in a shuffled order across segments
            order = list(written)
            random.Random(len(order)).shuffle(order)
            assert segs.read_many(order) == [written[r] for r in order]
        elif op[0] == "seal":
            before = segs.active_id
            assert segs.seal() == before
        else:
            segs.close()
            segs = open_set(directory, **options)
            assert segs.recovery.torn_tails == []
    assert len(written) == appended  # no ref handed out twice
    assert_reads_back(segs, written)
    assert_layout(segs, list(written), segment_max)
    segs.close()

    segs = open_set(directory, **options)
    assert segs.recovery.torn_tails == []
    assert_reads_back(segs, written)
    for fid in segs.file_ids():
        assert segs.segment_size(fid) == file_size(segs, fid)  # clean close left no zero tail
    segs.close()


def test_empty_payload_round_trips(tmp_path: Path) -> None:
    segs = open_set(tmp_path)
    ref = segs.append(b"")
    assert ref == PayloadRef(1, fmt.HEADER_SIZE, 0)
    assert segs.read(ref) == b""
    segs.close()
    segs = open_set(tmp_path)
    assert segs.read(ref) == b""
    segs.close()


def test_append_many_of_no_payloads_writes_nothing(tmp_path: Path) -> None:
    segs = open_set(tmp_path)
    assert segs.append_many([]) == []
    assert segs.active_end == fmt.HEADER_SIZE
    segs.close()


def test_append_many_of_more_records_than_one_pwritev_call_takes_round_trips(
    tmp_path: Path,
) -> None:
    # pwritev() takes at most 1024 buffers; a record is two (frame, body).
    segs = open_set(tmp_path, segment_max_bytes=1 << 20)
    bodies = [i.to_bytes(2, "little") * (i % 5) for i in range(3000)]
    refs = segs.append_many(bodies)
    assert len({r.file_id for r in refs}) == 1
    assert [segs.read(r) for r in refs] == bodies
    segs.close()
    segs = open_set(tmp_path, segment_max_bytes=1 << 20)
    assert [segs.read(r) for r in refs] == bodies
    segs.close()


def test_payload_of_exactly_max_payload_bytes_is_accepted(tmp_path: Path) -> None:
    segs = open_set(tmp_path, segment_max_bytes=256, max_payload_bytes=1000)
    body = bytes(range(256)) * 3 + b"x" * 232
    assert len(body) == 1000
    ref = segs.append(body)
    assert segs.read(ref) == body
    (ref2,) = segs.append_many([body])
    assert segs.read(ref2) == body
    segs.close()


@pytest.mark.parametrize("call", ["append", "append_many"])
def test_payload_one_byte_over_max_payload_bytes_raises_and_writes_nothing(
    tmp_path: Path, call: str
) -> None:
    segs = open_set(tmp_path, max_payload_bytes=1000)
    kept = segs.append(b"kept")
    end, size, ids = segs.active_end, file_size(segs, 1), segs.file_ids()
    with pytest.raises(PayloadTooLarge) as info:
        if call == "append":
            segs.append(b"x" * 1001)
        else:  # a batch with one bad payload writes none of the batch
            segs.append_many([b"ok", b"x" * 1001, b"ok"])
    assert isinstance(info.value, ValueError)
    assert (info.value.size, info.value.limit) == (1001, 1000)
    assert (segs.active_end, file_size(segs, 1), segs.file_ids()) == (end, size, ids)
    assert segs.read(kept) == b"kept"
    assert segs.append(b"next").offset == end
    segs.close()


def test_record_larger_than_segment_max_bytes_goes_alone_into_a_segment_of_its_own(
    tmp_path: Path,
) -> None:
    segs = open_set(tmp_path, segment_max_bytes=256, max_payload_bytes=4096)
    small = segs.append(b"a" * 10)
    big = segs.append(b"b" * 1000)
    after = segs.append(b"c" * 10)
    assert (small.file_id, big.file_id, after.file_id) == (1, 2, 3)
    assert big.offset == fmt.HEADER_SIZE
    assert after.offset == fmt.HEADER_SIZE
    assert file_size(segs, 2) == fmt.HEADER_SIZE + big.frame_bytes  # sealed, nothing else in it
    assert [segs.read(r) for r in (small, big, after)] == [b"a" * 10, b"b" * 1000, b"c" * 10]
    segs.close()


def test_record_that_exactly_fills_the_segment_stays_in_it_and_the_next_one_rotates(
    tmp_path: Path,
) -> None:
    segs = open_set(tmp_path, segment_max_bytes=fmt.HEADER_SIZE + 2 * fmt.FRAME_SIZE + 100)
    first = segs.append(b"a" * 40)
    fill = segs.append(b"b" * 60)
    nxt = segs.append(b"")
    segs.seal()
    first2, fill2 = segs.append_many([b"a" * 40, b"b" * 60])  # the same, as one batch
    assert [r.file_id for r in (first, fill, nxt)] == [1, 1, 2]
    assert [r.file_id for r in (first2, fill2)] == [3, 3]
    assert file_size(segs, 1) == file_size(segs, 3) == segs.segment_max_bytes
    segs.close()


def test_a_reader_of_another_writer_maps_the_grown_file_again_in_read_many(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a read-only view's reader: the writer that grows the file is not its own.
    monkeypatch.setattr(_writer, "GROW_STEP", 64)
    segs = open_set(tmp_path, segment_max_bytes=1 << 20)
    first = segs.append(b"a" * 40)
    reader = SegmentReader(segs._path(first.file_id), first.file_id)
    mapped = reader.mapped_size
    later = segs.append_many([b"b" * 300, b"c" * 200])
    assert later[-1].offset + fmt.FRAME_SIZE + later[-1].length > mapped  # past its map
    assert reader.read_many([later[1], first, later[0]]) == [b"c" * 200, b"a" * 40, b"b" * 300]
    assert reader.mapped_size > mapped
    reader.close()
    segs.close()


def test_oversized_record_in_a_batch_also_gets_a_segment_of_its_own(tmp_path: Path) -> None:
    segs = open_set(tmp_path, segment_max_bytes=256, max_payload_bytes=4096)
    bodies = [b"a" * 300, b"b" * 10, b"c" * 500, b"d" * 10]
    refs = segs.append_many(bodies)
    # The fresh (empty) active segment takes the first big record alone.
    assert [(r.file_id, r.offset) for r in refs] == [(1, 24), (2, 24), (3, 24), (4, 24)]
    assert [segs.read(r) for r in refs] == bodies
    segs.close()


def test_reads_at_once_see_records_appended_across_many_file_grows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_writer, "GROW_STEP", 64)
    options = {"segment_max_bytes": 1 << 20, "max_payload_bytes": 4096}
    rng = random.Random(7)
    segs = open_set(tmp_path, **options)
    written: dict[PayloadRef, bytes] = {}
    reader = segs._readers[1]
    maps_seen = {reader.mapped_size}
    for i in range(400):
        body = rng.randbytes(rng.randrange(0, 300))
        ref = segs.append(body) if i % 3 else segs.append_many([body, body[::-1]])[0]
        assert segs.read(ref) == body
        written[ref] = body
        maps_seen.add(reader.mapped_size)
    assert len(maps_seen) > 100  # the file really grew (and was remapped) many times
    assert_reads_back(segs, written)
    segs.close()

    segs = open_set(tmp_path, **options)
    for _ in range(50):
        body = rng.randbytes(rng.randrange(0, 300))
        ref = segs.append(body)
        assert segs.read(ref) == body
        written[ref] = body
    assert_reads_back(segs, written)
    segs.close()


def test_reads_at_once_see_records_appended_across_the_real_8_mib_grow_step(
    tmp_path: Path,
) -> None:
    mib = 1024 * 1024
    options = {"segment_max_bytes": 64 * mib, "max_payload_bytes": mib}
    segs = open_set(tmp_path, **options)
    written: dict[PayloadRef, bytes] = {}
    for i in range(10):
        body = bytes([i + 1]) * mib
        ref = segs.append(body)
        assert segs.read(ref) == body
        written[ref] = body
    assert segs._readers[1].mapped_size > _writer.GROW_STEP + fmt.HEADER_SIZE
    assert_reads_back(segs, written)
    segs.close()

    segs = open_set(tmp_path, **options)
    ref = segs.append(b"after reopen")
    assert segs.read(ref) == b"after reopen"
    assert_reads_back(segs, written)
    segs.close()


def test_reads_from_other_threads_match_while_one_thread_appends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_writer, "GROW_STEP", 256)
    segs = open_set(tmp_path, segment_max_bytes=8192, max_payload_bytes=2048)
    rng = random.Random(11)
    batches = [
        [rng.randbytes(rng.randrange(0, 700)) for _ in range(rng.randrange(1, 6))]
        for _ in range(300)
    ]
    channels: list[queue.Queue[tuple[PayloadRef, bytes] | None]] = [queue.Queue(), queue.Queue()]
    results: list[list[tuple[PayloadRef, bytes, bytes]]] = [[], []]

    def write() -> None:
        for batch in batches:
            refs = segs.append_many(batch) if len(batch) > 1 else [segs.append(batch[0])]
            for ref, body in zip(refs, batch, strict=True):
                for channel in channels:
                    channel.put((ref, body))
        for channel in channels:
            channel.put(None)

    def read(n: int) -> None:
        seen: list[tuple[PayloadRef, bytes]] = []
        while (item := channels[n].get()) is not None:
            seen.append(item)
            ref, body = item
            results[n].append((ref, body, segs.read(ref)))
            old_ref, old_body = seen[len(seen) // 2]  # and an older one, maybe in a sealed file
            results[n].append((old_ref, old_body, segs.read(old_ref)))

    threads = [threading.Thread(target=read, args=(n,)) for n in range(2)]
    threads.append(threading.Thread(target=write))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    total = sum(len(b) for b in batches)
    assert len(segs.file_ids()) > 10  # rotated many times while being read
    for n in range(2):
        assert len(results[n]) == 2 * total
        mismatched = [(ref, len(want), len(got)) for ref, want, got in results[n] if got != want]
        assert mismatched == []
    segs.close()


def test_seal_returns_the_sealed_id_and_cuts_its_preallocated_tail(tmp_path: Path) -> None:
    segs = open_set(tmp_path, segment_max_bytes=1 << 20)
    refs = segs.append_many([b"one", b"two", b"three"])
    data_end = segs.active_end
    assert file_size(segs, 1) > data_end  # preallocated while active

    sealed = segs.seal()

    assert sealed == 1
    assert segs.active_id is not None and segs.active_id > sealed
    assert file_size(segs, sealed) == data_end == segs.segment_size(sealed)
    assert [segs.read(r) for r in refs] == [b"one", b"two", b"three"]
    new = segs.append(b"four")
    assert (new.file_id, new.offset) == (segs.active_id, fmt.HEADER_SIZE)
    segs.close()


def test_seal_of_an_empty_active_segment_leaves_a_header_only_file(tmp_path: Path) -> None:
    segs = open_set(tmp_path)
    assert segs.seal() == 1
    assert file_size(segs, 1) == fmt.HEADER_SIZE
    assert segs.file_ids() == [1, 2]
    segs.close()


def _live_refs(segs: SegmentSet) -> tuple[list[PayloadRef], dict[PayloadRef, bytes]]:
    rng = random.Random(3)
    written: dict[PayloadRef, bytes] = {}
    for _ in range(60):
        body = rng.randbytes(rng.randrange(0, 200))
        written[segs.append(body)] = body
    segs.seal()
    live = [ref for i, ref in enumerate(written) if i % 3 != 1]
    return live, written


def test_copy_live_copies_refs_into_a_new_sealed_segment_and_maps_old_to_new(
    tmp_path: Path,
) -> None:
    segs = open_set(tmp_path, segment_max_bytes=2048)
    live, written = _live_refs(segs)
    assert len({r.file_id for r in live}) > 1
    fid = segs.reserve_file_id()
    assert fid > max(segs.file_ids())
    progress: list[int] = []

    mapping = segs.copy_live(fid, live, progress=progress.append)

    assert list(mapping) == live
    new_refs = list(mapping.values())
    assert all(new.file_id == fid for new in new_refs)
    assert [new.offset for new in new_refs] == [
        fmt.HEADER_SIZE + sum(r.frame_bytes for r in live[:i]) for i in range(len(live))
    ]
    for old, new in mapping.items():
        assert new.length == old.length
        assert segs.read(new) == written[old]
    data_end = fmt.HEADER_SIZE + sum(r.frame_bytes for r in live)
    assert file_size(segs, fid) == data_end == segs.segment_size(fid)  # sealed: no zero tail
    assert sum(progress) == data_end - fmt.HEADER_SIZE
    assert fid in segs.file_ids()
    assert segs.active_id != fid
    segs.close()


def test_copy_live_of_many_small_and_some_large_records_round_trips(tmp_path: Path) -> None:
    # Thousands of records per flush (one pwritev each) and several 4 MiB flushes.
    mib = 1024 * 1024
    segs = open_set(tmp_path, segment_max_bytes=16 * mib, max_payload_bytes=2 * mib)
    small = [i.to_bytes(4, "little") for i in range(3000)]
    bodies = small + [bytes([i]) * 2 * mib for i in range(5)]
    refs = segs.append_many(bodies)
    fid = segs.reserve_file_id()
    mapping = segs.copy_live(fid, refs)
    assert [segs.read(mapping[r]) for r in refs] == bodies
    assert file_size(segs, fid) == fmt.HEADER_SIZE + sum(fmt.FRAME_SIZE + len(b) for b in bodies)
    segs.close()


def test_copy_live_of_a_damaged_source_raises_corruption_and_removes_the_output(
    tmp_path: Path,
) -> None:
    segs = open_set(tmp_path, segment_max_bytes=2048)
    live, _ = _live_refs(segs)
    bad = next(r for r in live[5:] if r.length > 0)
    with open(segs.path_of(bad.file_id), "r+b") as f:
        f.seek(bad.offset + fmt.FRAME_SIZE)
        byte = f.read(1)
        f.seek(bad.offset + fmt.FRAME_SIZE)
        f.write(bytes([byte[0] ^ 0x01]))
    fid = segs.reserve_file_id()

    with pytest.raises(Corruption) as info:
        segs.copy_live(fid, live)

    assert (info.value.path, info.value.offset, info.value.reason) == (
        segs.path_of(bad.file_id),
        bad.offset,
        fmt.BAD_CRC,
    )
    assert not os.path.exists(segs.path_of(fid))
    assert fid not in segs.file_ids()
    segs.close()


def test_deleted_segment_file_is_removed_and_earlier_readers_still_read_it(
    tmp_path: Path,
) -> None:
    segs = open_set(tmp_path, segment_max_bytes=1 << 20)
    refs = segs.append_many([b"alpha", b"beta"])
    sealed = segs.seal()
    reader = segs._readers[sealed]

    segs.delete([sealed])

    assert not os.path.exists(segs.path_of(sealed))
    assert sealed not in segs.file_ids()
    assert [reader.read(r) for r in refs] == [b"alpha", b"beta"]  # its map stays valid
    with pytest.raises(Corruption) as info:
        segs.read(refs[0])
    assert (info.value.path, info.value.offset, info.value.reason) == (
        segs.path_of(sealed),
        0,
        fmt.MISSING_SEGMENT,
    )
    segs.delete([sealed])  # deleting a missing segment is a no-op
    segs.close()


def test_deleting_the_active_segment_raises_and_deletes_nothing(tmp_path: Path) -> None:
    segs = open_set(tmp_path)
    old = segs.append(b"old")
    sealed = segs.seal()
    active = segs.append(b"active")
    with pytest.raises(ValueError, match="active segment"):
        segs.delete([sealed, active.file_id])
    assert os.path.exists(segs.path_of(sealed))
    assert segs.file_ids() == [sealed, active.file_id]
    assert segs.read(old) == b"old"
    assert segs.read(active) == b"active"
    segs.close()


def test_readonly_set_reads_records_the_writer_appends_after_it_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_writer, "GROW_STEP", 128)
    writer = open_set(tmp_path, segment_max_bytes=2048)
    written = {writer.append(b"before the view opened"): b"before the view opened"}
    view = open_set(tmp_path, readonly=True)
    rng = random.Random(5)
    for i in range(200):
        bodies = [rng.randbytes(rng.randrange(0, 150)) for _ in range(1 + i % 3)]
        refs = writer.append_many(bodies)
        written.update(zip(refs, bodies, strict=True))
        for ref, body in zip(refs, bodies, strict=True):
            assert view.read(ref) == body  # grown file (remap) and new segment files
    assert len(writer.file_ids()) > 5
    assert_reads_back(view, written)
    with pytest.raises(RuntimeError):
        view.append(b"x")
    view.close()
    writer.close()


def test_readonly_set_never_truncates_or_creates_anything(tmp_path: Path) -> None:
    segs = open_set(tmp_path)
    refs = segs.append_many([b"one", b"two"])
    segs.close()
    path = tmp_path / "0000000001.seg"
    with open(path, "ab") as f:
        f.write(b"\xab" * 40 + b"\x00" * 100)  # a torn tail and a zero tail
    before = path.read_bytes()

    view = open_set(tmp_path, readonly=True, discard=[1])

    assert view.recovery.torn_tails == [] and view.recovery.discarded == []
    assert [view.read(r) for r in refs] == [b"one", b"two"]
    view.close()
    assert path.read_bytes() == before

    missing = tmp_path / "missing"
    view = open_set(missing, readonly=True)
    assert view.file_ids() == []
    view.close()
    assert not missing.exists()


def test_segment_size_and_disk_usage_count_data_not_preallocated_zeros(tmp_path: Path) -> None:
    segs = open_set(tmp_path, segment_max_bytes=1 << 20)
    segs.append_many([b"a" * 100, b"b" * 50])
    sealed = segs.seal()
    segs.append(b"c" * 30)
    active = segs.active_id
    assert active is not None

    assert segs.segment_size(sealed) == file_size(segs, sealed) == 24 + 108 + 58
    assert segs.segment_size(active) == segs.active_end == 24 + 38
    assert file_size(segs, active) > segs.active_end  # the zeros are on disk but not counted
    assert segs.disk_usage() == (24 + 108 + 58) + (24 + 38)
    segs.close()

    segs = open_set(tmp_path, segment_max_bytes=1 << 20)
    assert segs.disk_usage() == sum(file_size(segs, fid) for fid in segs.file_ids())
    assert segs.disk_usage() == (24 + 108 + 58) + (24 + 38)
    segs.close()


def test_read_many_raises_corruption_for_a_damaged_record(tmp_path: Path) -> None:
    segs = open_set(tmp_path)
    refs = segs.append_many([b"one" * 10, b"two" * 10, b"three" * 10])
    segs.sync()
    path = segs.path_of(refs[1].file_id)
    with open(path, "r+b") as f:
        f.seek(refs[1].offset + fmt.FRAME_SIZE)
        f.write(b"X")
    assert segs.read_many([refs[0], refs[2]]) == [b"one" * 10, b"three" * 10]
    with pytest.raises(Corruption, match="checksum"):
        segs.read_many(refs)
    segs.close()
