"""Damaged and torn segments: what open and read do, and what they report."""

from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qstore._errors import Corruption
from qstore.payload import PayloadRef, SegmentSet, TailRepair
from qstore.payload import _format as fmt

LOGGER = "qstore.payload"
BODIES = [b"first record", b"second record!", b"third", b"fourth record body", b"fifth"]
SEG1 = "0000000001.seg"
SEG2 = "0000000002.seg"


def open_set(directory: Path, **options: object) -> SegmentSet:
    kwargs: dict[str, object] = {"segment_max_bytes": 1 << 20, "max_payload_bytes": 1024}
    kwargs.update(options)
    return SegmentSet(str(directory), **kwargs)  # type: ignore[arg-type]


def crash(segs: SegmentSet) -> None:
    """Drop ``segs`` as a killed process would: the preallocated zero tail stays."""
    writer = segs._writer
    assert writer is not None
    os.close(writer._fd)
    writer._fd = -1
    segs.close()


def write_records(directory: Path, *, crashed: bool = False) -> list[PayloadRef]:
    """Segment 1 holding BODIES; closed cleanly (no zero tail) unless ``crashed``."""
    segs = open_set(directory)
    refs = segs.append_many(BODIES)
    if crashed:
        crash(segs)
        assert os.path.getsize(directory / SEG1) > refs[-1].offset + refs[-1].frame_bytes
    else:
        segs.close()
    return refs


def flip(path: Path, offset: int, mask: int = 0xFF) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        (byte,) = f.read(1)
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def payload_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
    ]


def assert_corruption(
    info: pytest.ExceptionInfo[Corruption], path: Path, offset: int, reason: str
) -> None:
    assert (info.value.path, info.value.offset, info.value.reason) == (str(path), offset, reason)


@pytest.fixture(autouse=True)
def _capture_payload_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)


# -- headers -----------------------------------------------------------------


def assert_kept_damaged(segs: SegmentSet, path: Path, reason: str) -> None:
    """Issue 11 case 8: the set opened; the file is recorded as damaged, kept, and a
    read of a record in it raises Corruption at offset 0 with the reason."""
    fid = fmt.parse_segment_name(path.name)
    assert fid is not None
    assert segs.damaged == {fid: reason}
    with pytest.raises(Corruption) as info:
        segs.read(PayloadRef(fid, fmt.HEADER_SIZE, 5))
    assert_corruption(info, path, 0, reason)
    segs.append(b"pushes go on")
    segs.close()


def _two_segments(directory: Path) -> None:
    segs = open_set(directory)
    segs.append(b"in the sealed segment")
    segs.seal()
    segs.append(b"in the active segment")
    segs.close()


@pytest.mark.parametrize("name", [SEG1, SEG2], ids=["sealed", "active"])
@pytest.mark.parametrize(
    ("pos", "reason"),
    [
        (0, fmt.BAD_MAGIC),
        (7, fmt.BAD_MAGIC),
        (8, fmt.BAD_HEADER_CRC),  # version
        (13, fmt.BAD_HEADER_CRC),  # file id
        (20, fmt.BAD_HEADER_CRC),  # the header crc itself
        (23, fmt.BAD_HEADER_CRC),
    ],
)
def test_damaged_header_is_kept_aside_and_raises_corruption_on_read_at_offset_0(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, pos: int, reason: str
) -> None:
    _two_segments(tmp_path)
    flip(tmp_path / name, pos)
    before = (tmp_path / name).read_bytes()
    assert_kept_damaged(open_set(tmp_path), tmp_path / name, reason)
    assert (tmp_path / name).read_bytes() == before
    assert payload_warnings(caplog) == []


def _rewrite_header(path: Path, version: int, file_id: int) -> None:
    head = struct.pack("<8sIQ", fmt.MAGIC, version, file_id)
    with open(path, "r+b") as f:
        f.write(head + struct.pack("<I", zlib.crc32(head)))


@pytest.mark.parametrize("name", [SEG1, SEG2], ids=["sealed", "active"])
@pytest.mark.parametrize(
    ("version", "file_id", "reason"),
    [(2, None, fmt.BAD_VERSION), (1, 99, fmt.WRONG_FILE_ID)],
    ids=["newer-version", "renamed-file"],
)
def test_header_with_valid_crc_but_wrong_version_or_file_id_is_kept_aside(
    tmp_path: Path, name: str, version: int, file_id: int | None, reason: str
) -> None:
    _two_segments(tmp_path)
    _rewrite_header(tmp_path / name, version, file_id or fmt.parse_segment_name(name) or 0)
    assert_kept_damaged(open_set(tmp_path), tmp_path / name, reason)


@pytest.mark.parametrize("name", [SEG1, SEG2], ids=["sealed", "active"])
def test_segment_cut_inside_its_header_is_kept_aside(tmp_path: Path, name: str) -> None:
    _two_segments(tmp_path)
    os.truncate(tmp_path / name, 10)
    assert_kept_damaged(open_set(tmp_path), tmp_path / name, fmt.SHORT_HEADER)


@pytest.mark.parametrize("size", [0, 10])
def test_active_segment_of_only_zeros_shorter_than_a_header_is_rewritten_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, size: int
) -> None:
    # A crash between creating the file and syncing its header.
    _two_segments(tmp_path)
    (tmp_path / SEG2).write_bytes(b"\x00" * size)
    segs = open_set(tmp_path)
    assert (tmp_path / SEG2).read_bytes() == fmt.encode_header(2)
    assert segs.recovery.torn_tails == []
    assert segs.append(b"x") == PayloadRef(2, fmt.HEADER_SIZE, 1)
    segs.close()
    (message,) = payload_warnings(caplog)
    assert f"rewrote the header of {tmp_path / SEG2} ({size} bytes" in message


# -- damaged records -----------------------------------------------------------

# (byte in the record, xor mask, reason when the ref is read).
RECORD_DAMAGE = [
    (0, 0x01, fmt.BAD_LENGTH),
    (1, 0x01, fmt.BAD_LENGTH),
    (4, 0xFF, fmt.BAD_CRC),
    (7, 0x80, fmt.BAD_CRC),
    (8, 0x01, fmt.BAD_CRC),  # first body byte
    (-1, 0x01, fmt.BAD_CRC),  # last body byte
]
RECORD_DAMAGE_IDS = ["length0", "length1", "crc0", "crc3", "body-first", "body-last"]


def _damage(path: Path, ref: PayloadRef, where: int, mask: int) -> None:
    flip(path, ref.offset + (where if where >= 0 else ref.frame_bytes + where), mask)


@pytest.mark.parametrize(("where", "mask", "reason"), RECORD_DAMAGE, ids=RECORD_DAMAGE_IDS)
def test_damaged_record_in_a_sealed_segment_raises_corruption_on_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: int, mask: int, reason: str
) -> None:
    segs = open_set(tmp_path)
    refs = segs.append_many(BODIES)
    segs.seal()
    segs.close()
    bad = refs[-1]  # damage at the very end is still corruption in a sealed file
    _damage(tmp_path / SEG1, bad, where, mask)
    _damage(tmp_path / SEG1, refs[1], where, mask)

    segs = open_set(tmp_path)  # sealed segments are not scanned on open

    assert segs.recovery.torn_tails == []
    for ref in (refs[1], bad):
        with pytest.raises(Corruption) as info:
            segs.read(ref)
        assert_corruption(info, tmp_path / SEG1, ref.offset, reason)
    assert [segs.read(r) for r in (refs[0], refs[2], refs[3])] == [BODIES[0], *BODIES[2:4]]
    segs.close()
    assert payload_warnings(caplog) == []


@pytest.mark.parametrize(("where", "mask", "reason"), RECORD_DAMAGE, ids=RECORD_DAMAGE_IDS)
def test_damaged_record_in_the_open_active_segment_raises_corruption_on_read(
    tmp_path: Path, where: int, mask: int, reason: str
) -> None:
    segs = open_set(tmp_path)
    refs = segs.append_many(BODIES)
    _damage(tmp_path / SEG1, refs[2], where, mask)  # under the live writer's map
    with pytest.raises(Corruption) as info:
        segs.read(refs[2])
    assert_corruption(info, tmp_path / SEG1, refs[2].offset, reason)
    assert segs.read(refs[3]) == BODIES[3]
    segs.close()


# Damage to refs[2] (b"third"). A damaged length stays short of the last record's
# end here: see the next test for a length that reaches further.
MIDDLE_DAMAGE = [(0, 0x04), (0, 0x08), (4, 0xFF), (7, 0x80), (8, 0x01), (-1, 0x01)]
MIDDLE_DAMAGE_IDS = ["length-5-to-1", "length-5-to-13", "crc0", "crc3", "body-first", "body-last"]


@pytest.mark.parametrize("crashed", [False, True], ids=["closed", "crashed"])
@pytest.mark.parametrize(("where", "mask"), MIDDLE_DAMAGE, ids=MIDDLE_DAMAGE_IDS)
def test_bad_record_followed_by_valid_records_in_active_segment_raises_corruption_on_open(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    crashed: bool,
    where: int,
    mask: int,
) -> None:
    refs = write_records(tmp_path, crashed=crashed)
    assert BODIES[2] == b"third"
    _damage(tmp_path / SEG1, refs[2], where, mask)
    before = (tmp_path / SEG1).read_bytes()

    with pytest.raises(Corruption) as info:
        open_set(tmp_path)

    # The scan meets a CRC mismatch whatever the damaged field: the CRC covers the length.
    assert_corruption(info, tmp_path / SEG1, refs[2].offset, fmt.BAD_CRC)
    assert (tmp_path / SEG1).read_bytes() == before  # never truncated
    assert payload_warnings(caplog) == []


@pytest.mark.parametrize(
    ("crashed", "pos", "reason"),
    [
        (False, 1, fmt.SHORT_BODY),  # length += 2**8: past the end of the file
        (False, 3, fmt.SHORT_BODY),  # length += 2**24
        (True, 1, fmt.BAD_CRC),  # ends inside the preallocated zeros
        (True, 3, fmt.SHORT_BODY),  # past the end of the preallocated file
    ],
)
def test_length_damaged_to_reach_past_the_data_is_cut_like_a_torn_record_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, crashed: bool, pos: int, reason: str
) -> None:
    # Known limit (docs/payload-format.md): a length that reaches past the last
    # non-zero byte cannot be told from a record cut short by a crash, so the valid
    # records after it are cut too. The cut is reported with its byte count, and
    # the lost records are never returned as data.
    refs = write_records(tmp_path, crashed=crashed)
    size = os.path.getsize(tmp_path / SEG1)
    flip(tmp_path / SEG1, refs[2].offset + pos, 0x01)

    segs = open_set(tmp_path)

    cut = size - refs[2].offset
    assert segs.recovery.torn_tails == [TailRepair(1, refs[2].offset, cut, reason)]
    assert payload_warnings(caplog) == [
        f"truncated torn tail of {tmp_path / SEG1} at offset {refs[2].offset}: "
        f"{cut} bytes cut ({reason})"
    ]
    assert [segs.read(r) for r in refs[:2]] == BODIES[:2]
    for ref in refs[2:]:
        with pytest.raises(Corruption) as info:
            segs.read(ref)
        assert_corruption(info, tmp_path / SEG1, ref.offset, fmt.OUT_OF_BOUNDS)
    segs.close()


# -- torn tails ----------------------------------------------------------------


def _assert_torn_tail_cut(
    directory: Path,
    caplog: pytest.LogCaptureFixture,
    refs: list[PayloadRef],
    offset: int,
    cut: int,
    reason: str,
) -> None:
    """Reopen: the tail from ``offset`` is cut and reported; earlier records still read."""
    segs = open_set(directory)
    assert segs.recovery.torn_tails == [TailRepair(1, offset, cut, reason)]
    assert payload_warnings(caplog) == [
        f"truncated torn tail of {directory / SEG1} at offset {offset}: {cut} bytes cut ({reason})"
    ]
    assert os.path.getsize(directory / SEG1) == offset == segs.active_end
    intact = [r for r in refs if r.offset + r.frame_bytes <= offset]
    assert [segs.read(r) for r in intact] == BODIES[: len(intact)]
    new = segs.append(b"after the cut")
    assert new == PayloadRef(1, offset, 13)  # appends go right after the cut
    assert segs.read(new) == b"after the cut"
    segs.close()
    segs = open_set(directory)
    assert segs.recovery.torn_tails == []
    assert [segs.read(r) for r in intact] == BODIES[: len(intact)]
    assert segs.read(new) == b"after the cut"
    segs.close()


@pytest.mark.parametrize(
    ("keep", "reason"),
    [
        (1, fmt.SHORT_FRAME),
        (7, fmt.SHORT_FRAME),
        (8, fmt.SHORT_BODY),
        (9, fmt.SHORT_BODY),
        (8 + len(BODIES[-1]) - 1, fmt.SHORT_BODY),
    ],
)
def test_truncated_trailing_record_is_cut_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, keep: int, reason: str
) -> None:
    refs = write_records(tmp_path)
    last = refs[-1]
    os.truncate(tmp_path / SEG1, last.offset + keep)
    _assert_torn_tail_cut(tmp_path, caplog, refs, last.offset, keep, reason)


@pytest.mark.parametrize(("where", "mask"), [(4, 0xFF), (8, 0x01), (-1, 0x80)])
def test_bad_crc_on_the_last_record_is_a_torn_tail_cut_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: int, mask: int
) -> None:
    refs = write_records(tmp_path)
    _damage(tmp_path / SEG1, refs[-1], where, mask)
    _assert_torn_tail_cut(
        tmp_path, caplog, refs, refs[-1].offset, refs[-1].frame_bytes, fmt.BAD_CRC
    )


def test_last_record_half_written_before_a_crash_is_cut_with_the_zero_tail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    refs = write_records(tmp_path, crashed=True)
    last = refs[-1]
    size = os.path.getsize(tmp_path / SEG1)
    with open(tmp_path / SEG1, "r+b") as f:  # the end of the body never reached the disk
        f.seek(last.offset + 10)
        f.write(b"\x00" * (last.frame_bytes - 10))
    _assert_torn_tail_cut(tmp_path, caplog, refs, last.offset, size - last.offset, fmt.BAD_CRC)


@pytest.mark.parametrize("zeros", [1, 7, 8, 9, 4096])
def test_zero_filled_tail_is_preallocation_and_is_cut_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, zeros: int
) -> None:
    refs = write_records(tmp_path)
    data_end = os.path.getsize(tmp_path / SEG1)
    with open(tmp_path / SEG1, "ab") as f:
        f.write(b"\x00" * zeros)

    segs = open_set(tmp_path)

    assert segs.recovery.torn_tails == []
    assert payload_warnings(caplog) == []
    assert os.path.getsize(tmp_path / SEG1) == data_end == segs.active_end
    assert [segs.read(r) for r in refs] == BODIES
    segs.close()


def test_preallocated_tail_left_by_a_crash_is_cut_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    refs = write_records(tmp_path, crashed=True)
    segs = open_set(tmp_path)
    assert segs.recovery.torn_tails == []
    assert payload_warnings(caplog) == []
    data_end = refs[-1].offset + refs[-1].frame_bytes
    assert os.path.getsize(tmp_path / SEG1) == data_end == segs.active_end
    assert [segs.read(r) for r in refs] == BODIES
    segs.close()


@pytest.mark.parametrize(
    ("garbage", "reason"),
    [
        (b"\xff" * 5, fmt.SHORT_FRAME),
        (b"\xab" * 64, fmt.SHORT_BODY),  # length 0xabababab: a record cut off by the crash
        (struct.pack("<II", 4, 12345) + b"\x01\x02\x03\x04", fmt.BAD_CRC),  # then only EOF
        (struct.pack("<II", 4, 12345) + b"\x01\x02\x03\x04" + b"\x00" * 50, fmt.BAD_CRC),
    ],
    ids=["short-frame", "short-body", "bad-crc-at-eof", "bad-crc-then-zeros"],
)
def test_garbage_that_looks_like_a_cut_off_record_is_cut_as_a_torn_tail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, garbage: bytes, reason: str
) -> None:
    refs = write_records(tmp_path)
    data_end = os.path.getsize(tmp_path / SEG1)
    with open(tmp_path / SEG1, "ab") as f:
        f.write(garbage)
    _assert_torn_tail_cut(tmp_path, caplog, refs, data_end, len(garbage), reason)


def test_garbage_record_followed_by_more_non_zero_bytes_raises_corruption_on_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_records(tmp_path)
    data_end = os.path.getsize(tmp_path / SEG1)
    with open(tmp_path / SEG1, "ab") as f:
        f.write(struct.pack("<II", 4, 12345) + b"\x01\x02\x03\x04" + b"\x05" * 20)
    before = (tmp_path / SEG1).read_bytes()
    with pytest.raises(Corruption) as info:
        open_set(tmp_path)
    assert_corruption(info, tmp_path / SEG1, data_end, fmt.BAD_CRC)
    assert (tmp_path / SEG1).read_bytes() == before
    assert payload_warnings(caplog) == []


@given(garbage=st.binary(min_size=1, max_size=300).filter(lambda b: b.strip(b"\x00") != b""))
@settings(max_examples=75, deadline=None)
def test_any_non_zero_garbage_after_the_last_record_is_cut_and_reported_or_refused(
    tmp_path_factory: pytest.TempPathFactory, garbage: bytes
) -> None:
    directory = tmp_path_factory.mktemp("garbage")
    refs = write_records(directory)
    data_end = os.path.getsize(directory / SEG1)
    with open(directory / SEG1, "ab") as f:
        f.write(garbage)
    try:
        segs = open_set(directory)
    except Corruption as exc:
        assert (exc.path, exc.offset, exc.reason) == (str(directory / SEG1), data_end, fmt.BAD_CRC)
        assert (directory / SEG1).read_bytes()[data_end:] == garbage  # untouched
        return
    (repair,) = segs.recovery.torn_tails
    assert (repair.file_id, repair.offset, repair.bytes_cut) == (1, data_end, len(garbage))
    assert repair.reason in (fmt.SHORT_FRAME, fmt.SHORT_BODY, fmt.BAD_CRC)
    assert os.path.getsize(directory / SEG1) == data_end
    assert [segs.read(r) for r in refs] == BODIES
    segs.close()


@given(data=st.data())
@settings(max_examples=100, deadline=None)
def test_a_damaged_record_is_never_returned_as_data(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    directory = tmp_path_factory.mktemp("damage")
    segs = open_set(directory, segment_max_bytes=160)
    written = {segs.append(body): body for body in BODIES * 3}
    if data.draw(st.booleans(), label="crash"):
        crash(segs)
    else:
        segs.close()
    segment_files = (n for n in os.listdir(directory) if fmt.parse_segment_name(n) is not None)
    name = data.draw(st.sampled_from(sorted(segment_files)), label="file")
    path = directory / name
    pos = data.draw(st.integers(0, os.path.getsize(path) - 1), label="pos")
    flip(path, pos, data.draw(st.integers(1, 255), label="mask"))
    hit = [
        ref
        for ref in written
        if fmt.segment_name(ref.file_id) == name
        and ref.offset <= pos < ref.offset + ref.frame_bytes
    ]

    try:
        segs = open_set(directory, segment_max_bytes=160)
    except Corruption as exc:
        assert exc.path == str(path)
        return
    for ref, body in written.items():
        try:
            got = segs.read(ref)
        except Corruption as exc:
            assert exc.path == str(path)
            continue
        assert got == body
        assert ref not in hit
    segs.close()


# -- tail hints and discarded files --------------------------------------------


def test_recovery_scans_the_active_segment_only_from_the_tail_hint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    refs = write_records(tmp_path)
    flip(tmp_path / SEG1, refs[1].offset + fmt.FRAME_SIZE, 0x01)  # before the hint
    with pytest.raises(Corruption) as info:
        open_set(tmp_path)
    assert_corruption(info, tmp_path / SEG1, refs[1].offset, fmt.BAD_CRC)

    segs = open_set(tmp_path, tail_hints={1: refs[3].offset})

    assert segs.recovery.torn_tails == []
    assert payload_warnings(caplog) == []
    with pytest.raises(Corruption) as info:
        segs.read(refs[1])  # not seen on open, caught on read
    assert_corruption(info, tmp_path / SEG1, refs[1].offset, fmt.BAD_CRC)
    assert [segs.read(r) for r in refs[2:]] == BODIES[2:]
    segs.close()


def test_torn_tail_after_the_tail_hint_is_still_cut_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    refs = write_records(tmp_path)
    last = refs[-1]
    os.truncate(tmp_path / SEG1, last.offset + 3)
    segs = open_set(tmp_path, tail_hints={1: refs[2].offset})
    assert segs.recovery.torn_tails == [TailRepair(1, last.offset, 3, fmt.SHORT_FRAME)]
    assert len(payload_warnings(caplog)) == 1
    assert [segs.read(r) for r in refs[:-1]] == BODIES[:-1]
    segs.close()


def test_an_active_segment_shorter_than_its_tail_hint_is_read_as_sealed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The hint is a durable mark: bytes below it were on disk, so a file that
    # ends before it was cut (damage), not torn. Nothing is cut or rewritten:
    # its intact records read back, a read past its end raises, a new segment
    # takes the appends.
    refs = write_records(tmp_path)
    size = os.path.getsize(tmp_path / SEG1)
    os.truncate(tmp_path / SEG1, size - 1)  # the last record loses its last byte
    segs = open_set(tmp_path, tail_hints={1: size})
    assert os.path.getsize(tmp_path / SEG1) == size - 1
    assert segs.damaged == {} and segs.recovery.torn_tails == []
    assert [segs.read(r) for r in refs[:-1]] == list(BODIES[:-1])
    with pytest.raises(Corruption) as info:
        segs.read(refs[-1])
    assert_corruption(info, tmp_path / SEG1, refs[-1].offset, fmt.OUT_OF_BOUNDS)
    assert segs.append(b"new").file_id == 2
    segs.close()
    assert any("short of the" in r.getMessage() and "damaged (cut)" in r.getMessage()
               for r in caplog.records)


def test_discarded_segment_is_removed_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    segs = open_set(tmp_path)
    refs = segs.append_many(BODIES)
    fid = segs.reserve_file_id()
    segs.copy_live(fid, refs[:2])  # as if a compaction into fid had not been recorded as done
    segs.close()

    segs = open_set(tmp_path, discard=[fid, 77])  # 77 never existed: nothing to report

    assert segs.recovery.discarded == [fid]
    assert not os.path.exists(segs.path_of(fid))
    assert fid not in segs.file_ids()
    assert payload_warnings(caplog) == [
        f"removed {segs.path_of(fid)}: output of an unfinished compaction"
    ]
    assert [segs.read(r) for r in refs] == BODIES
    segs.close()


def test_discarded_file_id_is_never_handed_out_again(tmp_path: Path) -> None:
    segs = open_set(tmp_path)
    segs.append(b"live")
    output = segs.reserve_file_id()
    segs.copy_live(output, [])
    segs.close()
    segs = open_set(tmp_path, discard=[output])
    assert segs.recovery.discarded == [output]
    assert not (tmp_path / fmt.segment_name(output)).exists()
    assert segs.reserve_file_id() > output
    segs.close()


def test_crashed_active_segment_below_a_newer_segment_has_its_zero_tail_cut(tmp_path: Path) -> None:
    # The active segment (1) dies with its preallocated tail while a compaction
    # output (2) already exists, so on reopen 1 is no longer the highest id.
    segs = open_set(tmp_path)
    refs = segs.append_many(BODIES)
    end = refs[-1].offset + refs[-1].frame_bytes
    output = segs.reserve_file_id()
    segs.copy_live(output, [])
    crash(segs)
    assert os.path.getsize(tmp_path / SEG1) > end
    segs = open_set(tmp_path, tail_hints={1: end})
    assert segs.active_id == output
    assert os.path.getsize(tmp_path / SEG1) == end
    assert [segs.read(r) for r in refs] == BODIES
    assert segs.recovery.torn_tails == []  # zeros are preallocation, not a torn record
    segs.close()


def test_damage_past_the_durable_mark_is_cut_and_kept_and_a_second_cut_keeps_both(
        tmp_path: Path) -> None:
    # Bad bytes followed by more data past the durable mark (a page a power
    # loss dropped): cut there, and the cut bytes kept beside the segment. A
    # second such cut at the same offset (after more appends, another power
    # loss) keeps its bytes in a new file: the first is never overwritten.
    kept_files = []
    for round_ in range(2):
        segs = open_set(tmp_path)  # segment 1: new, or cut back to its header
        refs = segs.append_many([b"round %d a" % round_, b"round %d b" % round_])
        crash(segs)
        assert refs[0].offset == fmt.HEADER_SIZE
        flip(tmp_path / SEG1, refs[0].offset + fmt.FRAME_SIZE)  # the first body: bad CRC
        tail = (tmp_path / SEG1).read_bytes()[fmt.HEADER_SIZE:refs[1].offset + refs[1].frame_bytes]
        segs = open_set(tmp_path, tail_hints={1: fmt.HEADER_SIZE},
                        hints_are_durable_marks=True)
        (repair,) = segs.recovery.torn_tails
        assert repair.offset == fmt.HEADER_SIZE
        segs.close()
        assert os.path.getsize(tmp_path / SEG1) == fmt.HEADER_SIZE
        kept_files = sorted(n for n in os.listdir(tmp_path) if ".cut-" in n)
        assert len(kept_files) == round_ + 1
        newest = tmp_path / (f"{SEG1}.cut-{fmt.HEADER_SIZE}" if round_ == 0
                             else f"{SEG1}.cut-{fmt.HEADER_SIZE}.2")
        assert newest.read_bytes()[:len(tail)] == tail
    first = (tmp_path / f"{SEG1}.cut-{fmt.HEADER_SIZE}").read_bytes()
    assert b"round 0 b" in first and b"round 1" not in first
