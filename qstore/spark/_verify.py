"""Checking many payload references of a snapshot at once, without copying their bodies.

The checks are :meth:`qstore.payload.SegmentReader.read`'s (bounds, frame
length, CRC over the length bytes and the body) with the same fixed reason
strings, applied to a batch through one memory map and ``memoryview`` slices:
about four times faster than reading each payload, which matters when the
audit checks every record of a store. The bounds are the snapshot manifest's
lengths, not the file sizes: bytes past them belong to the live store.
"""

from __future__ import annotations

import mmap
import os

from .._errors import Corruption
from ..payload import _format as fmt

NOT_IN_MANIFEST = "segment is not listed in the snapshot manifest"


class SegmentCheck:
    """One segment file of a snapshot, mapped read-only for checking references."""

    def __init__(self, path: str, file_id: int, length: int | None) -> None:
        self.path = path
        self.file_id = file_id
        self.problem: str | None = None  # set: every reference into this segment fails so
        self._map: mmap.mmap | None = None
        self._bound = 0
        if length is None:
            self.problem = NOT_IN_MANIFEST
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self.problem = fmt.MISSING_SEGMENT
            return
        try:
            size = os.fstat(fd).st_size
            if size:
                self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._bound = min(length, size)
        header = self._map[: fmt.HEADER_SIZE] if self._map is not None else b""
        self.problem = fmt.header_problem(header, file_id)

    def check(self, offsets: list[int], lengths: list[int]) -> list[str | None]:
        """For each reference, None if it resolves to an intact record, else the reason."""
        if self.problem is not None or self._map is None:
            return [self.problem or fmt.OUT_OF_BOUNDS] * len(offsets)
        m = self._map
        view = memoryview(m)
        bound = self._bound
        unpack = fmt.FRAME.unpack_from
        crc_of = fmt.record_crc
        frame = fmt.FRAME_SIZE
        out: list[str | None] = []
        try:
            for off, n in zip(offsets, lengths, strict=True):
                end = off + frame + n
                if off < fmt.HEADER_SIZE or end > bound:
                    out.append(fmt.OUT_OF_BOUNDS)
                    continue
                length, crc = unpack(m, off)
                if length != n:
                    out.append(fmt.BAD_LENGTH)
                elif crc_of(m[off : off + 4], view[off + frame : end]) != crc:
                    out.append(fmt.BAD_CRC)
                else:
                    out.append(None)
        finally:
            view.release()
        return out

    def error(self, offset: int, reason: str) -> Corruption:
        return Corruption(self.path, offset, reason)

    def close(self) -> None:
        self._map = None  # the map is released with its last reference
