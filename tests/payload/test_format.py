"""The byte layout of segment files (qstore/payload/_format.py, docs/payload-format.md)."""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qstore.payload import PayloadRef, SegmentSet, _frames
from qstore.payload import _format as fmt

DOC = Path(__file__).resolve().parents[2] / "docs" / "payload-format.md"


def test_values_written_to_disk_never_change() -> None:
    assert fmt.MAGIC == b"QSTSEG\r\n"
    assert fmt.FORMAT_VERSION == 1
    assert fmt.HEADER.format == "<8sIQI"
    assert fmt.HEADER_SIZE == 24
    assert fmt.FRAME.format == "<II"
    assert fmt.FRAME_SIZE == 8
    assert fmt.LENGTH.format == "<I"
    assert fmt.MAX_RECORD_LENGTH == 2**32 - 1
    assert fmt.SEGMENT_SUFFIX == ".seg"
    assert fmt.FILE_ID_DIGITS == 10


def test_reason_strings_are_fixed() -> None:
    # Log alerts and callers match on these; they are part of the contract.
    assert {
        "BAD_MAGIC": fmt.BAD_MAGIC,
        "BAD_VERSION": fmt.BAD_VERSION,
        "BAD_HEADER_CRC": fmt.BAD_HEADER_CRC,
        "WRONG_FILE_ID": fmt.WRONG_FILE_ID,
        "SHORT_HEADER": fmt.SHORT_HEADER,
        "SHORT_FRAME": fmt.SHORT_FRAME,
        "SHORT_BODY": fmt.SHORT_BODY,
        "BAD_CRC": fmt.BAD_CRC,
        "BAD_LENGTH": fmt.BAD_LENGTH,
        "OUT_OF_BOUNDS": fmt.OUT_OF_BOUNDS,
        "MISSING_SEGMENT": fmt.MISSING_SEGMENT,
    } == {
        "BAD_MAGIC": "bad magic",
        "BAD_VERSION": "unsupported format version",
        "BAD_HEADER_CRC": "header checksum mismatch",
        "WRONG_FILE_ID": "header file id does not match the file name",
        "SHORT_HEADER": "file shorter than its header",
        "SHORT_FRAME": "record header cut short",
        "SHORT_BODY": "record body cut short",
        "BAD_CRC": "record checksum mismatch",
        "BAD_LENGTH": "record length does not match the reference",
        "OUT_OF_BOUNDS": "reference points past the end of the segment",
        "MISSING_SEGMENT": "segment file is missing",
    }


def test_header_is_magic_version_file_id_little_endian_then_crc_of_the_first_20_bytes() -> None:
    header = fmt.encode_header(0x0102030405060708)
    assert len(header) == fmt.HEADER_SIZE
    assert header[0:8] == b"QSTSEG\r\n"
    assert header[8:12] == b"\x01\x00\x00\x00"
    assert header[12:20] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert header[20:24] == struct.pack("<I", zlib.crc32(header[:20]))
    assert fmt.header_problem(header, 0x0102030405060708) is None


@given(body=st.binary(max_size=2048))
@settings(max_examples=100, deadline=None)
def test_frame_crc_covers_the_length_bytes_then_the_body(body: bytes) -> None:
    frame = fmt.encode_frame(body)
    length_bytes = struct.pack("<I", len(body))
    assert len(frame) == fmt.FRAME_SIZE
    assert frame[:4] == length_bytes
    assert frame[4:] == struct.pack("<I", zlib.crc32(length_bytes + body))
    assert fmt.record_crc(length_bytes, body) == zlib.crc32(length_bytes + body)


@given(body=st.binary(max_size=4096), head=st.binary(max_size=8), cut=st.integers(0, 64))
@settings(max_examples=200, deadline=None)
def test_the_crc_in_use_gives_zlibs_values_chained_and_on_memoryviews(
        body: bytes, head: bytes, cut: int) -> None:
    # The payload CRC is ISA-L's where installed: it must equal zlib's for every
    # input, seeded (chained) as records are, and on slices of a map's view.
    seed = zlib.crc32(head)
    view = memoryview(b"\0" * cut + body)[cut:]
    assert fmt.crc32(view, fmt.crc32(head)) == zlib.crc32(body, seed)
    assert fmt.length_seed(len(body)) == zlib.crc32(struct.pack("<I", len(body)))


def test_isal_is_the_crc_in_use_and_the_length_seed_cache_stays_bounded() -> None:
    import isal.isal_zlib
    assert fmt.crc32 is isal.isal_zlib.crc32  # installed by the project: the fast path
    fmt.SEEDS.clear()
    for n in range(5000):
        assert fmt.length_seed(n) == zlib.crc32(struct.pack("<I", n))
    assert 0 < len(fmt.SEEDS) <= 4096


def test_all_zero_frame_is_never_a_valid_record() -> None:
    # Recovery relies on this to tell preallocated zeros from an empty record.
    assert fmt.encode_frame(b"") == b"\x00\x00\x00\x00" + struct.pack("<I", 0x2144DF1C)


@given(data=st.data(), body=st.binary(max_size=512))
@settings(max_examples=100, deadline=None)
def test_any_single_byte_change_in_a_record_breaks_its_crc(
    data: st.DataObject, body: bytes
) -> None:
    record = bytearray(fmt.encode_frame(body) + body)
    pos = data.draw(st.integers(0, len(record) - 1), label="pos")
    record[pos] ^= data.draw(st.integers(1, 255), label="mask")
    length_bytes, (crc,) = bytes(record[:4]), struct.unpack_from("<I", record, 4)
    assert fmt.record_crc(length_bytes, bytes(record[8:])) != crc


@pytest.mark.parametrize("file_id", [0, 1, 42, 9_999_999_999])
def test_segment_name_is_the_file_id_as_ten_zero_padded_digits_and_parses_back(
    file_id: int,
) -> None:
    name = fmt.segment_name(file_id)
    assert name == f"{file_id:010d}.seg"
    assert len(name) == 14
    assert fmt.parse_segment_name(name) == file_id


@pytest.mark.parametrize(
    "name",
    [
        "1.seg",
        "00000000001.seg",
        "000000000a.seg",
        "0000000001.log",
        "0000000001",
        "0000000001.seg.tmp",
        "0000000001.SEG",
        "-000000001.seg",
    ],
)
def test_names_that_are_not_segment_files_are_ignored(name: str) -> None:
    assert fmt.parse_segment_name(name) is None


def _with_byte_flipped(data: bytes, pos: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= 0xFF
    return bytes(out)


@pytest.mark.parametrize(
    ("pos", "reason"),
    [
        (0, fmt.BAD_MAGIC),
        (7, fmt.BAD_MAGIC),
        # The CRC is checked before version and file id, so damage there is a CRC mismatch.
        (8, fmt.BAD_HEADER_CRC),
        (11, fmt.BAD_HEADER_CRC),
        (12, fmt.BAD_HEADER_CRC),
        (19, fmt.BAD_HEADER_CRC),
        (20, fmt.BAD_HEADER_CRC),
        (23, fmt.BAD_HEADER_CRC),
    ],
)
def test_header_problem_names_the_damaged_field(pos: int, reason: str) -> None:
    assert fmt.header_problem(_with_byte_flipped(fmt.encode_header(5), pos), 5) == reason


def _header_with_valid_crc(magic: bytes, version: int, file_id: int) -> bytes:
    head = struct.pack("<8sIQ", magic, version, file_id)
    return head + struct.pack("<I", zlib.crc32(head))


def test_header_with_valid_crc_but_other_version_is_unsupported() -> None:
    assert fmt.header_problem(_header_with_valid_crc(fmt.MAGIC, 2, 5), 5) == fmt.BAD_VERSION


def test_header_with_valid_crc_but_other_file_id_does_not_match_the_name() -> None:
    assert fmt.header_problem(_header_with_valid_crc(fmt.MAGIC, 1, 6), 5) == fmt.WRONG_FILE_ID


@pytest.mark.parametrize("size", [0, 1, 23])
def test_header_shorter_than_24_bytes_is_short(size: int) -> None:
    assert fmt.header_problem(fmt.encode_header(5)[:size], 5) == fmt.SHORT_HEADER


def test_ref_frame_bytes_is_the_frame_header_plus_the_body() -> None:
    ref = PayloadRef(3, 24, 10)
    assert ref.frame_bytes == 18
    assert (ref.file_id, ref.offset, ref.length) == (3, 24, 10)


_EXAMPLE = re.compile(
    r"<!-- worked-example:begin -->\n```text\n(.*?)```\n<!-- worked-example:end -->", re.S
)


def _doc_hex_dump() -> bytes:
    """The bytes of the worked example in docs/payload-format.md, offsets checked."""
    match = _EXAMPLE.search(DOC.read_text(encoding="utf-8"))
    assert match is not None, "worked example fences not found in docs/payload-format.md"
    lines = match.group(1).splitlines()
    assert lines[0].split() == ["offset", "bytes", "field"]
    dump = bytearray()
    for line in lines[1:]:
        offset, hex_bytes, _field = re.split(r" {2,}", line, maxsplit=2)
        assert int(offset, 16) == len(dump), f"offset column is wrong on {line!r}"
        dump += bytes.fromhex(hex_bytes)
    return bytes(dump)


def test_doc_worked_example_matches_encoder(tmp_path: Path) -> None:
    expected = (
        fmt.encode_header(1)
        + fmt.encode_frame(b"hi")
        + b"hi"
        + fmt.encode_frame(b"qstore")
        + b"qstore"
    )
    assert _doc_hex_dump() == expected

    # ...and it is what the segment set really writes.
    segs = SegmentSet(str(tmp_path), segment_max_bytes=4096, max_payload_bytes=1024)
    refs = [segs.append(b"hi"), segs.append(b"qstore")]
    segs.close()
    assert refs == [PayloadRef(1, 24, 2), PayloadRef(1, 34, 6)]
    assert (tmp_path / "0000000001.seg").read_bytes() == expected


@given(st.lists(st.binary(max_size=300), min_size=1, max_size=40), st.booleans())
def test_bulk_framing_writes_the_bytes_of_encode_frame(bodies: list[bytes], same: bool) -> None:
    if same:  # the equal-lengths path
        bodies = [b.ljust(16, b"x")[:16] for b in bodies]
    data = b"".join(bodies)
    offsets = np.cumsum([0] + [len(b) for b in bodies]).astype(np.int64)
    crcs = _frames.record_crcs(data, offsets[:-1], offsets[1:] - offsets[:-1])
    expected = b"".join(fmt.encode_frame(b) + b for b in bodies)
    assert _frames.frame_contiguous(data, offsets, crcs).tobytes() == expected
    one_by_one = b"".join(_frames.frame_header(len(b), c) + b
                          for b, c in zip(bodies, crcs, strict=True))
    assert one_by_one == expected
