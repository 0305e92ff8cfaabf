"""Appending records to the active segment."""

from __future__ import annotations

import os
from collections.abc import Sequence

from . import _format as fmt
from ._format import PayloadRef

# The active segment's file is grown ahead of the writes in steps of this many
# bytes, so that one memory map covers every record written for a while and
# reads never remap on the hot path. The step is allocated with real blocks
# (posix_fallocate, see SegmentWriter.reserve), so it takes disk space until
# the segment is sealed and cut back to its data end.
GROW_STEP = 8 * 1024 * 1024

# pwritev() fails with EINVAL when given more buffers than this (1024 on Linux),
# so a large batch is written in several calls.
IOV_MAX = 1024


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_segment_file(path: str, file_id: int) -> None:
    """Create a new segment holding only its header, durable with its directory entry."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, fmt.encode_header(file_id))
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))


class SegmentWriter:
    """Appends framed records at ``end``; the file beyond ``end`` is zeros.

    An append is one ``pwritev`` call per ``IOV_MAX // 2`` records. The file
    is extended ahead of the data with ``posix_fallocate`` (allocated zeros;
    ``ftruncate`` only on a filesystem without fallocate); :meth:`finish` cuts
    it back to ``end`` when the segment is sealed or the store closes cleanly.
    """

    def __init__(self, path: str, file_id: int, end: int, max_bytes: int) -> None:
        self.path = path
        self.file_id = file_id
        self.end = end
        self.max_bytes = max_bytes
        self._fd = os.open(path, os.O_RDWR)
        self.allocated = os.fstat(self._fd).st_size
        self.unsynced = False
        self.synced_end = end  # bytes below this are known to be on stable storage

    @property
    def empty(self) -> bool:
        return self.end == fmt.HEADER_SIZE

    def room(self) -> int:
        """Bytes left before the segment reaches its size limit."""
        return self.max_bytes - self.end

    def reserve(self, nbytes: int) -> bool:
        """Make the file at least ``end + nbytes`` long. True if it grew (remap readers)."""
        need = self.end + nbytes
        if need <= self.allocated:
            return False
        size = min(max(need, self.allocated + GROW_STEP), max(need, self.max_bytes))
        try:
            # Real blocks, not a sparse hole: an fdatasync of data written into
            # allocated blocks need not commit new block mappings (measured here:
            # 325 us against 885 us into a hole).
            os.posix_fallocate(self._fd, self.allocated, size - self.allocated)
        except OSError:  # a filesystem without fallocate: a sparse extension will do
            os.ftruncate(self._fd, size)
        self.allocated = size
        return True

    def append(self, bodies: Sequence[bytes]) -> list[PayloadRef]:
        """Write ``bodies`` as consecutive records (space must be reserved)."""
        parts: list[bytes] = []
        refs: list[PayloadRef] = []
        pos = self.end
        for body in bodies:
            parts.append(fmt.encode_frame(body))
            parts.append(body)
            refs.append(PayloadRef(self.file_id, pos, len(body)))
            pos += fmt.FRAME_SIZE + len(body)
        at = self.end
        for i in range(0, len(parts), IOV_MAX):
            chunk = parts[i : i + IOV_MAX]
            total = sum(len(part) for part in chunk)
            written = os.pwritev(self._fd, chunk, at)
            while written < total:  # a short write (rare: signals, huge batches): finish it
                written += os.pwrite(self._fd, b"".join(chunk)[written:], at + written)
            at += total
        self.end = pos
        self.unsynced = True
        return refs

    def append_one(self, body: bytes) -> PayloadRef:
        """One record in one pwritev call (space must be reserved)."""
        pos = self.end
        frame = fmt.encode_frame(body)
        total = fmt.FRAME_SIZE + len(body)
        written = os.pwritev(self._fd, (frame, body), pos)
        if written < total:  # a short write (rare): finish it
            rest = (frame + body)[written:]
            while rest:
                n = os.pwrite(self._fd, rest, pos + total - len(rest))
                rest = rest[n:]
        self.end = pos + total
        self.unsynced = True
        return PayloadRef(self.file_id, pos, len(body))

    def sync(self) -> None:
        if self.unsynced:
            self.unsynced = False
            os.fdatasync(self._fd)

    def finish(self) -> None:
        """Cut the preallocated tail, make the segment durable, and close it."""
        if self._fd < 0:
            return
        if self.allocated != self.end:
            os.ftruncate(self._fd, self.end)
            self.allocated = self.end
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
