"""Payload segments: append-only, length-prefixed, CRC-checked, memory-mapped files.

Message bodies live here; the metadata refers to them by
:class:`PayloadRef` ``(file_id, offset, length)``. See docs/payload-format.md.
"""

from ._format import (
    FRAME_SIZE,
    HEADER_SIZE,
    Located,
    PayloadRef,
    parse_segment_name,
    segment_name,
)
from ._reader import SegmentCheck, SegmentReader
from ._segments import RecoveryReport, SegmentSet, TailRepair
from ._views import VIEWS_LOCK, viewing
from ._writer import restore_records

__all__ = [
    "FRAME_SIZE",
    "HEADER_SIZE",
    "Located",
    "PayloadRef",
    "RecoveryReport",
    "SegmentCheck",
    "SegmentReader",
    "SegmentSet",
    "TailRepair",
    "VIEWS_LOCK",
    "parse_segment_name",
    "restore_records",
    "segment_name",
    "viewing",
]
