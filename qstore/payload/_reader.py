"""Reading payload records through a memory map, checking them, scanning a segment.

:func:`frame_problem` is the one check of a record that a reference names
(bounds, stored length, CRC over the length bytes and the body): reads
(:meth:`SegmentReader.read`), compaction (``SegmentSet.copy_live``) and the
audit (:class:`SegmentCheck`, its batch form) all use it, with the fixed
reason strings of ``_format``.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import Corruption
from .._fs import calls as fcalls
from . import _format as fmt
from ._format import Located, PayloadRef
from ._frames import record_crcs

if TYPE_CHECKING:
    import numpy as np
else:
    from .._lazy import np  # imported on first use (_lazy.py)

_REMAP_TRIES = 10
_FRAME_UNPACK, _SEEDS, _crc32 = fmt.FRAME.unpack_from, fmt.SEEDS, fmt.crc32


def frame_problem(view: memoryview, offset: int, length: int, bound: int) -> str | None:
    """Why the ``length``-byte record at ``offset`` of ``view`` is not intact, or None.

    ``bound`` is the end of the valid data (at most ``len(view)``). ``view``
    is sliced, never copied, so checking costs no body copy.
    """
    end = offset + fmt.FRAME_SIZE + length
    if offset < fmt.HEADER_SIZE or end > bound:
        return fmt.OUT_OF_BOUNDS
    stored, crc = _FRAME_UNPACK(view, offset)
    if stored != length:
        return fmt.BAD_LENGTH
    seed = _SEEDS.get(length)  # the CRC of the length bytes, which equal ``length`` here
    if seed is None:
        seed = fmt.length_seed(length)
    if _crc32(view[offset + fmt.FRAME_SIZE : end], seed) != crc:
        return fmt.BAD_CRC
    return None


def check_frames(view: memoryview, offsets: Sequence[int], lengths: Sequence[int],
                 bound: int) -> list[str | None]:
    """:func:`frame_problem` of each ``(offset, length)``: the batch form."""
    check = frame_problem
    return [check(view, off, n, bound) for off, n in zip(offsets, lengths, strict=True)]


def frames_intact(view: memoryview, offsets: np.ndarray, lengths: np.ndarray,
                  bound: int) -> bool:
    """True when :func:`frame_problem` finds every ``(offset, length)`` intact: the bulk form.

    The same checks (bounds, stored length, CRC over the length bytes and the
    body) for many records at once: the frame headers are gathered with one
    numpy index, and the CRCs are one CRC call per body with no
    Python per record around it (about a third of the cost of the loop). It
    says only whether all are intact: on False, ask :func:`frame_problem`
    which are not and why.
    """
    if len(offsets) == 0:
        return True
    ends = offsets + lengths + fmt.FRAME_SIZE
    if int(offsets.min()) < fmt.HEADER_SIZE or int(ends.max()) > bound:
        return False
    data = np.frombuffer(view, np.uint8)
    heads = data[offsets[:, None] + np.arange(fmt.FRAME_SIZE)].view("<u4")  # (k, 2): length, crc
    if not np.array_equal(heads[:, 0], lengths):
        return False
    crcs: list[int] = heads[:, 1].tolist()
    return record_crcs(view, offsets + fmt.FRAME_SIZE, lengths) == crcs


@dataclass(frozen=True)
class ScanStop:
    """Why and where a scan of a segment stopped before its end."""

    offset: int
    reason: str
    torn: bool  # True: nothing but a cut-off record or zeros follows (a crash mid-write)


class SegmentReader:
    """A read-only memory map of one segment file.

    The map covers the file as it was at the last :meth:`remap`. The writer of
    the active segment grows the file ahead of its writes and remaps before it
    publishes a new reference, so a reference read from the metadata always
    lies inside the current map. Readers of a store opened read-only remap on
    demand when a reference points past the map (the writer is another process).

    Deleting the file does not disturb a reader that already holds this object:
    the kernel keeps an unlinked file's pages alive while they are mapped.
    """

    def __init__(self, path: str, file_id: int) -> None:
        self.path = path
        self.file_id = file_id
        self._fd = fcalls.open_fd(path, os.O_RDONLY)
        # The map's own length is the mapped size, so a reader that takes one
        # reference to the map sees a consistent pair even while another thread remaps.
        # ``_whole`` is a view of the same map (reads check through it without copying).
        self._map: mmap.mmap | None = None
        self._whole = memoryview(b"")
        self.remap()
        problem = fmt.header_problem(self._view(0, fmt.HEADER_SIZE), file_id)
        if problem is not None:
            self.close()
            raise Corruption(path, 0, problem)

    def remap(self) -> None:
        if self._fd < 0:
            return  # detached: the file is gone, the map is all there is
        for _ in range(_REMAP_TRIES):
            size = os.fstat(self._fd).st_size
            if size == self.mapped_size:
                return
            try:
                # Replace, never close, the old map: a thread may be slicing it right
                # now, and it is released when the last reference to it goes.
                m = fcalls.mmap(self._fd, size) if size else None
                break
            except ValueError:
                # The file shrank since the fstat: the writer (another process, for a
                # read-only view) sealed it, cutting its preallocated tail. Again.
                continue
        else:
            raise OSError(errno.EAGAIN, "segment file kept changing size while mapped",
                          self.path)
        self._whole = memoryview(m if m is not None else b"")
        self._map = m

    def file_size(self) -> int:
        """The size of the file now (of the map once detached)."""
        return os.fstat(self._fd).st_size if self._fd >= 0 else self.mapped_size

    @property
    def mapped_size(self) -> int:
        m = self._map
        return 0 if m is None else len(m)

    def _view(self, start: int, end: int) -> bytes:
        m = self._map
        if m is None:
            return b""
        return m[start:end]

    def read(self, ref: Located, limit: int | None = None) -> bytes:
        """The payload bytes of ``ref``, checked against its frame and CRC.

        ``limit`` is the end of valid data when known (the writer's end offset);
        anything past it is treated as past the end of the segment.
        """
        end = ref.offset + fmt.FRAME_SIZE + ref.length
        view = self._whole
        if end > len(view):
            self.remap()
            view = self._whole
        bound = len(view) if limit is None else min(limit, len(view))
        problem = frame_problem(view, ref.offset, ref.length, bound)
        if problem is not None:
            raise Corruption(self.path, ref.offset, problem)
        return view[ref.offset + fmt.FRAME_SIZE : end].tobytes()

    def read_many(self, refs: Sequence[Located], limit: int | None = None) -> list[bytes]:
        """:meth:`read` of each of ``refs`` (all in this segment), in order."""
        frame_size = fmt.FRAME_SIZE
        view = self._whole
        bound = len(view) if limit is None else min(limit, len(view))
        out: list[bytes] = []
        append = out.append
        lowest, unpack, seeds, crc32 = fmt.HEADER_SIZE, _FRAME_UNPACK, _SEEDS, _crc32
        for ref in refs:
            # frame_problem's checks, inline: a call per record was a sixth of a
            # batch pop's reading. Anything unusual goes to frame_problem itself.
            offset, length = ref.offset, ref.length
            start = offset + frame_size
            end = start + length
            if offset >= lowest and end <= bound:
                stored, crc = unpack(view, offset)
                seed = seeds.get(length)
                if stored == length and seed is not None:
                    body = view[start:end]
                    if crc32(body, seed) == crc:
                        append(body.tobytes())
                        continue
            if end > len(view):  # written since the map was made: map it again
                self.remap()
                view = self._whole
                bound = len(view) if limit is None else min(limit, len(view))
            problem = frame_problem(view, offset, length, bound)
            if problem is not None:
                raise Corruption(self.path, offset, problem)
            append(view[start:end].tobytes())
        return out

    def scan(self, start: int = fmt.HEADER_SIZE, end: int | None = None) -> Iterator[PayloadRef]:
        """Yield every intact record from ``start``; a stop is raised as :class:`ScanError`."""
        self.remap()
        m = self._map
        mapped = 0 if m is None else len(m)
        size = mapped if end is None else min(end, mapped)
        pos = start
        while pos < size:
            stop = self._check_at(m, pos, size)
            if isinstance(stop, ScanStop):
                raise ScanError(stop)
            yield PayloadRef(self.file_id, pos, stop)
            pos += fmt.FRAME_SIZE + stop

    def _check_at(self, m: mmap.mmap | None, pos: int, size: int) -> int | ScanStop:
        """The body length of the intact record at ``pos``, or why there is none."""
        assert m is not None
        if size - pos < fmt.FRAME_SIZE:
            return ScanStop(pos, fmt.SHORT_FRAME, True)
        length, crc = fmt.FRAME.unpack_from(m, pos)
        body_end = pos + fmt.FRAME_SIZE + length
        if body_end > size:
            return ScanStop(pos, fmt.SHORT_BODY, True)
        if fmt.record_crc(m[pos : pos + 4], m[pos + fmt.FRAME_SIZE : body_end]) != crc:
            return ScanStop(pos, fmt.BAD_CRC, _all_zero(m, body_end, size))
        return int(length)

    def detach(self) -> None:
        """Close the file but keep the map: the segment is being deleted under readers."""
        if self._fd >= 0:
            fcalls.close_fd(self._fd)
            self._fd = -1

    def close(self) -> None:
        self._map = None
        self._whole = memoryview(b"")
        if self._fd >= 0:
            fcalls.close_fd(self._fd)
            self._fd = -1


class ScanError(Exception):
    """Internal: a scan stopped at a record that is not intact."""

    def __init__(self, stop: ScanStop) -> None:
        super().__init__(stop.reason)
        self.stop = stop


def _all_zero(m: mmap.mmap, start: int, end: int, chunk: int = 1 << 20) -> bool:
    for pos in range(start, end, chunk):
        piece = m[pos : min(pos + chunk, end)]
        if piece.count(0) != len(piece):
            return False
    return True


def is_zero_from(m_reader: SegmentReader, start: int) -> bool:
    """True if every byte from ``start`` to the end of the map is zero."""
    m = m_reader._map
    return m is None or _all_zero(m, start, m_reader.mapped_size)


class SegmentCheck:
    """One segment file mapped read-only for checking many references at once.

    The batch form of :meth:`SegmentReader.read`'s checks (:func:`check_frames`
    through one map and ``memoryview`` slices, no body copied): about four
    times faster than reading each payload, which matters when an audit
    checks every record of a store. ``bound`` is where the valid data ends
    (a snapshot's manifest length, not the file size: bytes past it belong to
    the live store). A file that is missing or has a bad header sets
    :attr:`problem`, and every reference into it fails with that reason; so
    does a ``problem`` the caller gives (the file is then not opened).
    """

    def __init__(self, path: str, file_id: int, bound: int, problem: str | None = None) -> None:
        self.path = path
        self.file_id = file_id
        self.problem = problem
        self._map: mmap.mmap | None = None
        self._bound = 0
        if problem is not None:
            return
        try:
            fd = fcalls.open_fd(path, os.O_RDONLY)
        except FileNotFoundError:
            self.problem = fmt.MISSING_SEGMENT
            return
        try:
            size = os.fstat(fd).st_size
            if size:
                self._map = fcalls.mmap(fd, size)
        finally:
            fcalls.close_fd(fd)
        self._bound = min(bound, size)
        header = self._map[: fmt.HEADER_SIZE] if self._map is not None else b""
        self.problem = fmt.header_problem(header, file_id)

    def check(self, offsets: Sequence[int], lengths: Sequence[int]) -> list[str | None]:
        """For each reference, None if it resolves to an intact record, else the reason."""
        if self.problem is not None or self._map is None:
            return [self.problem or fmt.OUT_OF_BOUNDS] * len(offsets)
        with memoryview(self._map) as view:
            return check_frames(view, offsets, lengths, self._bound)

    def close(self) -> None:
        self._map = None  # the map is released with its last reference
