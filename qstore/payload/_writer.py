"""Writing segments: the active segment's appends, compaction outputs, backfill segments.

Every segment file is written through :class:`SegmentWriter`: the store
appends bodies to its active segment (:meth:`~SegmentWriter.append`), and
compaction and the backfill executors append runs of records that are
already framed (:meth:`~SegmentWriter.append_framed`) to new segments.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections.abc import Sequence

from .._fs import Buffer, complete_write, fsync_dir, write_at
from .._fs import calls as fcalls
from . import _format as fmt
from ._format import PayloadRef

# The active segment's file is grown ahead of the writes in steps of this many
# bytes, so that one memory map covers every record written for a while and
# reads never remap on the hot path. The step is allocated with real blocks
# (posix_fallocate, see SegmentWriter.reserve), so it takes disk space until
# the segment is sealed and cut back to its data end.
GROW_STEP = 8 * 1024 * 1024

_FRAME_PACK, _crc32, _length_seed = fmt.FRAME.pack, fmt.crc32, fmt.length_seed

__all__ = ["GROW_STEP", "NEW_SUFFIX", "SegmentWriter", "create_segment_file", "restore_records"]


NEW_SUFFIX = ".new"  # a segment being created: never listed as a segment (see below)


def _close_descriptors_of(path: str) -> None:
    """Close this process's descriptors on ``path``, a file only the caller opened.

    For an open cut by an interrupt as it returned: the descriptor exists but
    was never handed back. Found by name in ``/proc/self/fd`` (Linux; elsewhere
    nothing is closed and the descriptor leaks until the process ends).
    """
    target = os.path.realpath(path)
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                if os.readlink(f"/proc/self/fd/{name}") == target:
                    os.close(int(name))


def create_segment_file(path: str, file_id: int, *, durable: bool = True) -> None:
    """Create a new segment holding only its header.

    ``durable``: the header is written and fsynced under a temporary name
    (``<segment>.new``) that is then renamed to ``path`` and the directory
    fsynced, so a segment file is never visible without its whole header
    (a read-only view listing the directory meanwhile would take a
    header-less file for damage). Without it (a backfill's staged segment,
    published later by a rename of its own) the file is created in place and
    made durable when it is finished.
    """
    if os.path.exists(path):  # ids are never reused; never clobber a segment
        raise FileExistsError(errno.EEXIST, "segment file exists", path)
    tmp = path + NEW_SUFFIX if durable else path
    try:
        fd = fcalls.open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise
    except BaseException:
        # With O_EXCL a file there now is the one this call made: an interrupt as
        # the open returned left it (a header-less .new file for every cut
        # rotation, until the next open; an interrupt audit), and a descriptor
        # on it that was never handed back.
        _close_descriptors_of(tmp)
        with contextlib.suppress(OSError):
            fcalls.unlink(tmp)
        raise
    try:
        try:
            write_at(fd, [fmt.encode_header(file_id)], 0)  # a short write is finished
            if durable:
                fcalls.fsync(fd)
        finally:
            fcalls.close_fd(fd)
        if durable:
            fcalls.replace(tmp, path)
            fsync_dir(os.path.dirname(path))
    except BaseException:
        # Never leave a header-less file among the segments (a full disk, an I/O
        # error): a later open would take it for damage. If even the unlink
        # fails, open removes a leftover ``.new`` file (or a short file that no
        # metadata names).
        for leftover in (tmp, path) if durable else (path,):
            with contextlib.suppress(OSError):
                fcalls.unlink(leftover)
        raise


class SegmentWriter:
    """Appends framed records at ``end``; the file beyond ``end`` is zeros.

    An append is one ``pwritev`` call per ``IOV_MAX // 2`` records. The file
    is extended ahead of the data with ``posix_fallocate`` (allocated zeros;
    ``ftruncate`` only on a filesystem without fallocate); :meth:`finish` cuts
    it back to ``end`` when the segment is sealed or the store closes cleanly.
    Writers of new segments that are written once and sealed (compaction,
    backfill) skip the preallocation and append framed runs.
    """

    def __init__(self, path: str, file_id: int, end: int, max_bytes: int) -> None:
        self.path = path
        self.file_id = file_id
        self.end = end
        self.max_bytes = max_bytes
        self._fd = fcalls.open_fd(path, os.O_RDWR)
        self.allocated = os.fstat(self._fd).st_size
        # Appends ending at or below this need no rotation and no allocation.
        self.fast_limit = min(self.allocated, max_bytes)
        self.unsynced = False
        self.synced_end = end  # bytes below this are known to be on stable storage
        self.sync_failed = False  # finish's fsync failed: its bytes are in doubt
        # A writable map of the file while every byte from ``end`` to its size
        # is an allocated block (see :meth:`reserve`): :meth:`append_one` copies
        # into it instead of making a system call. None: write with pwritev.
        self._map: mmap.mmap | None = None

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
        self._unmap()
        try:
            # Real blocks, not a sparse hole: an fdatasync of data written into
            # allocated blocks need not commit new block mappings (measured here:
            # 325 us against 885 us into a hole). From ``end``, not from the old
            # size: every byte past the data is then a real block, which is
            # what makes writing through a map safe (no SIGBUS on a full disk).
            fcalls.fallocate(self._fd, self.end, size - self.end)
            blocks = True
        except OSError:  # a filesystem without fallocate: a sparse extension will do
            fcalls.ftruncate(self._fd, size)
            blocks = False
        self.allocated = size
        self.fast_limit = min(size, self.max_bytes)
        if blocks:
            with contextlib.suppress(OSError, ValueError):  # no map: pwritev will do
                self._map = fcalls.mmap_write(self._fd, size)
        return True

    def _unmap(self) -> None:
        m, self._map = self._map, None
        if m is not None:
            m.close()

    def append(self, bodies: Sequence[bytes]) -> list[PayloadRef]:
        """Write ``bodies`` as consecutive records (space must be reserved)."""
        parts: list[bytes] = []
        refs: list[PayloadRef] = []
        pos = self.end
        fid = self.file_id
        frame_size = fmt.FRAME_SIZE
        seed = -1
        size = -1
        new_ref = tuple.__new__  # PayloadRef's own __new__ is Python: twice the time
        for body in bodies:
            n = len(body)
            if n != size:  # the CRC of the 4 length bytes, once per run of one size
                size, seed = n, _length_seed(n)
            parts.append(_FRAME_PACK(n, _crc32(body, seed)))  # fmt.encode_frame
            parts.append(body)
            refs.append(new_ref(PayloadRef, (fid, pos, n)))
            pos += frame_size + n
        write_at(self._fd, parts, self.end, pos - self.end)
        self.end = pos
        self.unsynced = True
        return refs

    def append_framed(self, parts: Sequence[Buffer]) -> int:
        """Write records that are already framed (``parts`` back to back); returns their offset.

        The caller vouches for the bytes: each record's frame is right (a
        compaction copies checked records unchanged; a backfill frames its
        own). Space need not be reserved: the file grows as written.
        """
        at = self.end
        self._unmap()  # the file grows past any map as it is written
        self.end = at + write_at(self._fd, parts, at)
        self.allocated = max(self.allocated, self.end)
        self.fast_limit = min(self.allocated, self.max_bytes)
        self.unsynced = True
        return at

    def append_one(self, body: bytes) -> PayloadRef:
        """One record: a copy into the map, else one pwritev call (space must be reserved)."""
        pos = self.end
        n = len(body)
        frame = _FRAME_PACK(n, _crc32(body, _length_seed(n)))  # fmt.encode_frame
        total = fmt.FRAME_SIZE + n
        m = self._map
        if m is not None and pos + total <= len(m):
            # A copy into the page cache, as pwritev would make, minus the
            # system call: space was reserved, so the map covers the record.
            start = pos + fmt.FRAME_SIZE
            m[pos:start] = frame
            m[start:pos + total] = body
        else:
            written = fcalls.pwritev(self._fd, (frame, body), pos)
            if written < total:  # a short write (rare): finish it
                complete_write(self._fd, (frame, body), pos, written)
        self.end = pos + total
        self.unsynced = True
        return PayloadRef(self.file_id, pos, n)

    def fileno(self) -> int:
        return self._fd

    def sync(self) -> None:
        if self.unsynced:
            self.unsynced = False
            fcalls.fdatasync(self._fd)

    def finish(self) -> None:
        """Cut the preallocated tail, make the segment durable, and close it."""
        if self._fd < 0:
            return
        self._unmap()  # before the cut: a map past the end of a file is a SIGBUS
        if self.allocated != self.end:
            fcalls.ftruncate(self._fd, self.end)
            self.allocated = self.end
        try:
            fcalls.fsync(self._fd)
        except OSError:
            self.sync_failed = True  # its bytes are in doubt (SegmentSet.in_doubt)
            raise
        # Forget the descriptor before closing it: an interrupt (Ctrl-C) right after
        # the close left it set, and the next append wrote into whatever file got
        # that number next, a later close cutting that file (an interrupt audit).
        fd, self._fd = self._fd, -1
        fcalls.close_fd(fd)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def abandon(self) -> None:
        """Close without cutting or syncing (the caller removes the unfinished file)."""
        if self._fd >= 0:
            self._unmap()
            fd, self._fd = self._fd, -1  # forgotten first, as in finish
            fcalls.close_fd(fd)


def restore_records(directory: str, records: Sequence[tuple[int, int, bytes]]
                    ) -> tuple[int, list[int]]:
    """Write each ``(file_id, offset, body)`` back as a framed record at ``offset`` of
    its segment in ``directory``, unless the segment holds that record already.

    The payload journal's redo on open (durability ``always``, _durability.py):
    a crash may have lost appended bytes the journal still holds. Segments
    written to are fsynced before this returns. Returns the number of records
    written back and the ids of segments that do not exist (nothing is
    created: a missing segment is damage, which reads and the check report).
    """
    fds: dict[int, int] = {}
    missing: list[int] = []
    written = 0
    changed: set[int] = set()
    try:
        for fid, offset, body in records:
            fd = fds.get(fid)
            if fd is None:
                if fid in missing:
                    continue
                try:
                    fd = fds[fid] = fcalls.open_fd(os.path.join(directory, fmt.segment_name(fid)),
                                                   os.O_RDWR)
                except FileNotFoundError:
                    missing.append(fid)
                    continue
            frame = fmt.encode_frame(body)
            if fcalls.pread(fd, len(frame) + len(body), offset) != frame + body:
                write_at(fd, [frame, body], offset)
                changed.add(fid)
                written += 1
        for fid in changed:
            fcalls.fsync(fds[fid])
    finally:
        for fd in fds.values():
            fcalls.close_fd(fd)
    return written, missing
