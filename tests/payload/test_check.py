"""The one frame checker: single reads and the batch check agree on every reason."""

from __future__ import annotations

from typing import Any

from qstore import Corruption
from qstore.payload import PayloadRef, SegmentCheck, SegmentReader
from qstore.payload._format import encode_frame
from qstore.payload._writer import SegmentWriter, create_segment_file


def test_segment_check_gives_the_reasons_segment_reader_gives(tmp_path: Any) -> None:
    path = str(tmp_path / "0000000001.seg")
    create_segment_file(path, 1)
    writer = SegmentWriter(path, 1, 24, 1 << 20)
    writer.reserve(1000)
    good, flipped, last = writer.append([b"a" * 10, b"b" * 20, b"c" * 30])
    writer.finish()
    with open(path, "r+b") as f:
        f.seek(flipped.offset + 8 + 3)
        f.write(b"X")
    end = last.offset + last.frame_bytes
    refs = [good, flipped, last, good._replace(length=9), good._replace(offset=4),
            last._replace(length=31)]
    reader = SegmentReader(path, 1)

    def reason(ref: PayloadRef) -> str | None:
        try:
            reader.read(ref, end)
            return None
        except Corruption as exc:
            return exc.reason

    expected = [reason(r) for r in refs]
    assert expected == [None, "record checksum mismatch", None,
                        "record length does not match the reference",
                        "reference points past the end of the segment",
                        "reference points past the end of the segment"]
    check = SegmentCheck(path, 1, end)
    assert check.check([r.offset for r in refs], [r.length for r in refs]) == expected
    assert SegmentCheck(path, 1, last.offset).check([last.offset], [last.length]) == [
        "reference points past the end of the segment"]  # the manifest length bounds it
    assert SegmentCheck(str(tmp_path / "nope.seg"), 2, 100).problem == "segment file is missing"
    assert SegmentCheck(path, 1, end, problem="not listed").check([24, 42], [10, 20]) == [
        "not listed", "not listed"]  # the file is not even opened
    assert SegmentCheck(path, 7, end).problem == "header file id does not match the file name"


def test_framed_runs_append_after_the_data_and_read_back(tmp_path: Any) -> None:
    """append_framed takes records that carry their frames, as copies and backfills do."""
    path = str(tmp_path / "0000000003.seg")
    create_segment_file(path, 3, durable=False)
    writer = SegmentWriter(path, 3, 24, 24)
    bodies = [b"", b"x" * 100, b"tail"]
    run = b"".join(encode_frame(b) + b for b in bodies[:2])
    assert writer.append_framed([run]) == 24
    assert writer.append_framed([memoryview(encode_frame(bodies[2])), memoryview(b"tail")]) == (
        24 + len(run))
    writer.finish()
    reader = SegmentReader(path, 3)
    refs = list(reader.scan())
    assert [reader.read(r) for r in refs] == bodies
    assert reader.mapped_size == refs[-1].offset + refs[-1].frame_bytes  # sealed: no zero tail
