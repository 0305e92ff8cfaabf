"""Byte layout of payload segment files, shared by the reader and the writer.

Every number in this module is written to disk. NEVER CHANGE a value here;
add a new format version instead and keep the old one listed.
See docs/payload-format.md for the grammar and a worked example.

    segment    := header record*
    header     := magic[8] version:u32 file_id:u64 header_crc:u32      (24 bytes)
    record     := length:u32 crc:u32 body[length]                       (8 + length bytes)

All integers are little-endian. ``header_crc`` is zlib CRC-32 of the 20 bytes
before it. A record's ``crc`` is zlib CRC-32 of the 4 length bytes followed by
the body, so a damaged length is caught as well as a damaged body.
"""

from __future__ import annotations

import struct
from typing import NamedTuple, Protocol

try:  # ISA-L's CRC-32: zlib's polynomial and values, several times faster on 1 KiB
    from isal.isal_zlib import crc32 as crc32
except ImportError:  # pragma: no cover - a platform with no isal wheel
    from zlib import crc32 as crc32

MAGIC = b"QSTSEG\r\n"  # never change: 8 bytes; \r\n catches text-mode mangling
FORMAT_VERSION = 1  # never change the meaning of 1
HEADER = struct.Struct("<8sIQI")  # magic, version, file_id, header_crc
HEADER_SIZE = HEADER.size  # 24
FRAME = struct.Struct("<II")  # length, crc
FRAME_SIZE = FRAME.size  # 8
LENGTH = struct.Struct("<I")
MAX_RECORD_LENGTH = 0xFFFF_FFFF
SEGMENT_SUFFIX = ".seg"
# A damaged segment retired by a repair once nothing refers to it: kept as
# ``<segment>.damaged`` (``.2``, ``.3``... if taken), a name that does not parse
# as a segment, so nothing lists it again (docs/faults.md).
DAMAGED_SUFFIX = ".damaged"
FILE_ID_DIGITS = 10

# Fixed reason strings for Corruption and for torn-tail reports.
BAD_MAGIC = "bad magic"
BAD_VERSION = "unsupported format version"
BAD_HEADER_CRC = "header checksum mismatch"
WRONG_FILE_ID = "header file id does not match the file name"
SHORT_HEADER = "file shorter than its header"
SHORT_FRAME = "record header cut short"
SHORT_BODY = "record body cut short"
BAD_CRC = "record checksum mismatch"
BAD_LENGTH = "record length does not match the reference"
OUT_OF_BOUNDS = "reference points past the end of the segment"
MISSING_SEGMENT = "segment file is missing"


class Located(Protocol):
    """Anything that says where a payload lives: a :class:`PayloadRef`, or a
    message record (reads take the record itself, with no ref built for it)."""

    @property
    def file_id(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...


class PayloadRef(NamedTuple):
    """Where one payload lives: the record starting at ``offset`` in segment ``file_id``."""

    file_id: int
    offset: int
    length: int

    @property
    def frame_bytes(self) -> int:
        """Bytes the whole record takes on disk (frame header plus body)."""
        return FRAME_SIZE + self.length


def segment_name(file_id: int) -> str:
    return f"{file_id:0{FILE_ID_DIGITS}d}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    stem, dot, suffix = name.partition(".")
    if dot and "." + suffix == SEGMENT_SUFFIX and len(stem) == FILE_ID_DIGITS and stem.isdigit():
        return int(stem)
    return None


def encode_header(file_id: int) -> bytes:
    head = HEADER.pack(MAGIC, FORMAT_VERSION, file_id, 0)[: HEADER_SIZE - 4]
    return head + LENGTH.pack(crc32(head))


def header_problem(data: bytes, file_id: int) -> str | None:
    """The reason ``data`` is not a valid header for ``file_id``, or None."""
    if len(data) < HEADER_SIZE:
        return SHORT_HEADER
    magic, version, stored_id, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        return BAD_MAGIC
    if crc32(data[: HEADER_SIZE - 4]) != crc:
        return BAD_HEADER_CRC
    if version != FORMAT_VERSION:
        return BAD_VERSION
    if stored_id != file_id:
        return WRONG_FILE_ID
    return None


SEEDS: dict[int, int] = {}  # body length -> CRC-32 of its 4 length bytes (see length_seed)


def length_seed(n: int) -> int:
    """The CRC-32 of the 4 length bytes of an ``n``-byte body: where a record's CRC starts.

    Kept per length (bounded), so a record's CRC is one call over its body.
    """
    seed = SEEDS.get(n)
    if seed is None:
        if len(SEEDS) >= 4096:
            SEEDS.clear()
        seed = SEEDS[n] = crc32(LENGTH.pack(n))
    return seed


def record_crc(length_bytes: bytes, body: bytes | memoryview) -> int:
    return crc32(body, crc32(length_bytes))


def encode_frame(body: bytes) -> bytes:
    """The 8-byte frame header for ``body`` (the body itself is written after it)."""
    n = len(body)
    return FRAME.pack(n, crc32(body, length_seed(n)))
