"""The set of segment files of one store: append, read, rotate, seal, copy, delete."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from .._errors import Corruption, PayloadTooLarge, StorageError
from .._fs import calls as fcalls
from .._fs import fsync_dir, make_dirs_durably, make_room_for_files, write_file_durably
from . import _format as fmt
from ._format import Located, PayloadRef
from ._reader import ScanError, SegmentReader, frame_problem, frames_intact, is_zero_from
from ._views import create_views_lock, no_view_opening, viewing
from ._writer import NEW_SUFFIX, SegmentWriter, create_segment_file

if TYPE_CHECKING:
    import numpy as np
else:
    from .._lazy import np  # imported on first use (_lazy.py)

log = logging.getLogger("qstore.payload")

_COPY_PIECES = 1000  # pieces per pwritev of copy_live (Linux takes at most IOV_MAX = 1024)
_COPY_BYTES = 4 * 1024 * 1024  # bytes per pwritev of copy_live
_FLUSH_BYTES = 32 * 1024 * 1024  # copy_live starts a background fdatasync this often


_P = ParamSpec("_P")
_R = TypeVar("_R")


def storage_error(exc: OSError, doing: str) -> StorageError:
    """The :class:`StorageError` an OS error on a payload file becomes (the errno kept)."""
    err = StorageError(f"payload {doing} failed: {exc}")
    err.errno = exc.errno
    return err


def _os_errors(doing: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Raise an ``OSError`` of the method as :class:`StorageError` (cold paths only)."""

    def wrap(method: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(method)
        def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return method(*args, **kwargs)
            except OSError as exc:
                raise storage_error(exc, doing) from exc

        return call

    return wrap


@dataclass(frozen=True)
class TailRepair:
    """What recovery cut from the active segment's tail on open."""

    file_id: int
    offset: int
    bytes_cut: int
    reason: str


@dataclass
class RecoveryReport:
    torn_tails: list[TailRepair] = field(default_factory=list)
    discarded: list[int] = field(default_factory=list)


class SegmentSet:
    """All payload segments in one directory.

    One segment is active (appended to); all others are sealed (immutable).
    Appends and rotation are serialised by the caller's writer lock plus an
    internal lock that also guards the segment table for readers.
    """

    @_os_errors("open")
    def __init__(
        self,
        directory: str,
        *,
        segment_max_bytes: int,
        max_payload_bytes: int,
        readonly: bool = False,
        tail_hints: Mapping[int, int] | None = None,
        discard: Sequence[int] = (),
        next_file_id_floor: int = 1,
        hints_are_durable_marks: bool = False,
    ) -> None:
        """Open (creating if needed) the segments in ``directory``.

        ``tail_hints`` maps a file id to an offset up to which the metadata
        already references records: recovery scans the active segment only
        from there. ``discard`` names segment files to delete first (the
        unfinished output of an interrupted compaction).
        ``hints_are_durable_marks``: nothing past a hint was known to be on
        stable storage (the store's ``M synced`` mark), so damage there followed
        by more data is a page lost in a power loss: it is cut (its bytes kept
        aside) rather than refused. Without it such damage raises Corruption.
        """
        self._cut_damage = hints_are_durable_marks
        self.directory = directory
        self.segment_max_bytes = segment_max_bytes
        self.max_payload_bytes = max_payload_bytes
        self.readonly = readonly
        self.recovery = RecoveryReport()
        # Where a read-only view finds a record its segment lost (Core sets it: the
        # payload journal); asked only after a read raised Corruption.
        self.fallback: Callable[[Located], bytes | None] | None = None
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()  # one fdatasync at a time (see sync)
        self._readers: dict[int, SegmentReader] = {}
        self._writer: SegmentWriter | None = None
        self._synced = (0, 0)
        # Segments an fdatasync (or the fsync of a seal) failed on: the bytes it
        # should have covered may never reach the disk, even once a later call
        # succeeds (Linux reports a writeback error once and may drop the dirty
        # pages: "fsyncgate"). The compactor copies their live records to a
        # new segment, which it syncs, and deletes them (docs/faults.md).
        # Replaced, never changed in place, under _doubt_lock: readers take it as is.
        self.in_doubt: frozenset[int] = frozenset()
        self._doubt_lock = threading.Lock()
        self.on_doubt: Callable[[], None] | None = None  # the compactor's wake-up
        if not readonly:
            make_dirs_durably(directory)
            self._remove_unfinished_creates()
            create_views_lock(directory)
        ids = self._list_ids()
        make_room_for_files(len(ids) + 1)
        if not readonly:
            for fid in discard:
                if fid in ids:
                    fcalls.unlink(self._path(fid))
                    ids.remove(fid)
                    self.recovery.discarded.append(fid)
                    log.warning("removed %s: output of an unfinished compaction", self._path(fid))
            if self.recovery.discarded:
                fsync_dir(directory)
        hints = dict(tail_hints or {})
        if not readonly:
            for fid in ids[:-1]:
                # An empty file a failed rotation could not remove (create_segment_file):
                # no record was ever in it and no metadata names it. Anything else
                # short is damage, raised below.
                path = self._path(fid)
                if fid not in hints and os.path.getsize(path) == 0:
                    fcalls.unlink(path)
                    ids.remove(fid)
                    log.warning("removed %s: an empty segment file that "
                                "no metadata names (left by a failed rotation)", path)
        # Never hand out an id a file ever had (a discarded output's included).
        self._next_id = max([next_file_id_floor, *(i + 1 for i in ids), *(i + 1 for i in hints),
                             *(i + 1 for i in discard)])
        # Segments whose file header is damaged (a flipped byte, a 0-byte, swapped
        # or renamed file): file id -> what is wrong. They stay as they are and get
        # no reader; a read of a message in one raises Corruption (docs/faults.md).
        # A repair retires one nothing refers to any more (retire_damaged).
        self.damaged: dict[int, str] = {}
        if ids and not readonly:
            # The last file's header is damaged (a flipped byte, a cut, a renamed or
            # swapped file): never append to it; a new segment takes the pushes.
            # (All zeros shorter than a header is a crash while creating it: rewritten.)
            # A short all-zero file that the metadata names data in (its hint past
            # the header) was a segment once: damage, not a creation.
            problem = self._header_problem(ids[-1])
            if problem is not None and (problem != fmt.SHORT_HEADER
                                        or not self._all_zeros(ids[-1])
                                        or hints.get(ids[-1], fmt.HEADER_SIZE)
                                        > fmt.HEADER_SIZE):
                self.damaged[ids[-1]] = problem
        for fid in ids[:-1]:
            try:
                reader = self._readers[fid] = SegmentReader(self._path(fid), fid)
            except FileNotFoundError:
                if not readonly:
                    raise
                continue  # a view: the writer deleted it since the listing (see pin)
            except Corruption as exc:
                self.damaged[fid] = exc.reason
                log.error("segment %s is damaged (%s): the messages in it cannot be read; "
                          "the store opens without it (run `qstore check`)", exc.path, exc.reason)
                continue
            hint = hints.get(fid)
            if not readonly and hint is not None and reader.mapped_size > hint:
                # A segment that was active when the process died while a later id
                # (a compaction output) already existed: cut its tail as for the
                # active segment. Nothing past the hint is referenced, so no data
                # is at stake; a cleanly sealed segment ends at its hint.
                if _on_a_record_boundary(reader, hint):
                    self._recover_tail(reader, hint)
                else:
                    # Mid-record: the hint (its S record's end) is damaged, not the
                    # file. The scan from it met no record and cut every one after
                    # it, live messages too (a check-vs-audit differential).
                    log.error("segment %s: its recorded data end %d falls inside a record; "
                              "the record was damaged, the file is left whole (run `qstore "
                              "check --repair`, which rebuilds the record)", reader.path, hint)
        if readonly:
            if ids:
                self.pin(ids[-1:])
            return
        last = ids[-1] if ids else None
        mark = fmt.HEADER_SIZE if last is None else hints.get(last, fmt.HEADER_SIZE)
        if last is not None and last not in self.damaged and mark > fmt.HEADER_SIZE \
                and os.path.getsize(self._path(last)) < mark:
            # Shorter than its durable mark: bytes known to be on disk are gone, so
            # the file was damaged (cut), not torn by a power loss. It is read as
            # a sealed segment (its intact messages stay readable, reads of the
            # lost ones raise Corruption) and a new segment takes the pushes.
            self._readers[last] = SegmentReader(self._path(last), last)
            log.error("segment %s is %d bytes, short of the %d known to be durable: the file "
                      "was damaged (cut); its intact messages stay readable, a new segment "
                      "takes the pushes (run `qstore check`)", self._path(last),
                      os.path.getsize(self._path(last)), mark)
            self._start_segment()
        elif last is not None and last not in self.damaged:
            self._open_active(last, mark)
        else:
            if ids:
                log.error("segment %s is damaged (%s): left as it is; a new segment takes "
                          "the pushes", self._path(ids[-1]), self.damaged[ids[-1]])
            self._start_segment()

    def _remove_unfinished_creates(self) -> None:
        """Remove ``<segment>.new`` files: a crash while creating a segment left them.

        Such a file was never a segment (it is renamed only once its header is
        durable, see create_segment_file), so no metadata can name it.
        """
        removed = False
        for name in os.listdir(self.directory):
            if name.endswith(NEW_SUFFIX) and fmt.parse_segment_name(
                    name[: -len(NEW_SUFFIX)]) is not None:
                fcalls.unlink(os.path.join(self.directory, name))
                log.warning("removed %s: a segment whose creation a crash interrupted", name)
                removed = True
        if removed:
            fsync_dir(self.directory)

    # -- read-only views: pinning what they read ------------------------------

    def pin(self, file_ids: Iterable[int]) -> list[int]:
        """Open (and keep open) a reader of each segment not held yet; the missing ones.

        A read-only view pins the segments its metadata refers to, so a
        compaction of the writer deleting one afterwards cannot take it away
        (the open descriptor and map keep the unlinked file's bytes). An id
        whose file is not there is returned: either the view's metadata is
        older than a compaction that deleted it (the caller takes a fresh
        view), or it is damage (reads raise Corruption). A damaged header is
        recorded in :attr:`damaged`, as on open.
        """
        missing = []
        for fid in file_ids:
            if fid in self._readers or fid in self.damaged:
                continue
            try:
                reader = SegmentReader(self._path(fid), fid)
            except FileNotFoundError:
                missing.append(fid)
                continue
            except Corruption as exc:
                self.damaged[fid] = exc.reason
                log.error("segment %s is damaged (%s)", exc.path, exc.reason)
                continue
            with self._lock:
                self._readers[fid] = reader
        return missing

    def pinned(self) -> dict[int, SegmentReader]:
        """The open readers of the segments (a read-only view's pinned ones)."""
        with self._lock:
            return dict(self._readers)

    def write_pinned(self, file_id: int, path: str, length: int) -> None:
        """Write the first ``length`` bytes of pinned segment ``file_id`` to a new file
        ``path``, durably: a view's copy of a segment the writer deleted since it
        opened (the map keeps the unlinked file's bytes; nothing can link them)."""
        with self._lock:
            reader = self._readers[file_id]
        reader.remap()  # a map no shorter than the file was when pinned
        write_file_durably(path, reader._whole[:length])

    def viewing(self) -> contextlib.AbstractContextManager[bool]:
        """Held by a read-only view while it opens (see _views.py)."""
        return viewing(self.directory)

    def no_view_opening(self) -> contextlib.AbstractContextManager[bool]:
        """The writer: True inside while no view is opening, so segments may be unlinked."""
        return no_view_opening(self.directory)

    def refresh(self) -> None:
        """A view taking fresh metadata: pin the segments created since it opened."""
        self.pin(self._list_ids())

    def _header_problem(self, file_id: int) -> str | None:
        with open(self._path(file_id), "rb") as f:
            return fmt.header_problem(f.read(fmt.HEADER_SIZE), file_id)

    def _all_zeros(self, file_id: int) -> bool:
        with open(self._path(file_id), "rb") as f:
            return not f.read(fmt.HEADER_SIZE).strip(b"\x00")

    # -- opening --------------------------------------------------------------

    def _path(self, file_id: int) -> str:
        return os.path.join(self.directory, fmt.segment_name(file_id))

    def _list_ids(self) -> list[int]:
        if not os.path.isdir(self.directory):
            return []
        ids = (fmt.parse_segment_name(n) for n in os.listdir(self.directory))
        return sorted(i for i in ids if i is not None)

    def _open_active(self, file_id: int, scan_from: int) -> None:
        path = self._path(file_id)
        size = os.path.getsize(path)
        if size < fmt.HEADER_SIZE and scan_from <= fmt.HEADER_SIZE:
            # A crash between creating the file and syncing its header: nothing
            # can reference it yet, so it is rewritten.
            with open(path, "rb") as f:
                if f.read().strip(b"\x00") and size:
                    raise Corruption(path, 0, fmt.SHORT_HEADER)
            log.warning("rewrote the header of %s (%d bytes were left by a crash)", path, size)
            fcalls.unlink(path)
            create_segment_file(path, file_id)
        reader = SegmentReader(path, file_id)
        end = self._recover_tail(reader, max(scan_from, fmt.HEADER_SIZE))
        self._readers[file_id] = reader
        self._writer = SegmentWriter(path, file_id, end, self.segment_max_bytes)
        # What survived the last run may sit only in the page cache: make it durable
        # before anything is recorded as synced.
        fcalls.fdatasync(self._writer._fd)
        self._synced = (file_id, end)

    def _recover_tail(self, reader: SegmentReader, start: int) -> int:
        """The end of the intact records from ``start`` (the durable mark); the rest is cut.

        A torn tail (a cut-off record, zeros) is cut. Damage followed by more
        data raises Corruption, unless ``start`` is a durable mark (see
        ``hints_are_durable_marks``): then it is cut too, since a power loss may
        lose any unsynced page, but its bytes are first kept beside the segment
        (``<segment>.cut-<offset>``): they are never deleted on a guess.
        """
        if start > reader.mapped_size:
            raise Corruption(reader.path, reader.mapped_size, fmt.OUT_OF_BOUNDS)
        end = start
        try:
            for ref in reader.scan(start):
                end = ref.offset + ref.frame_bytes
        except ScanError as exc:
            stop = exc.stop
            cut = reader.mapped_size - stop.offset
            if not stop.torn and not self._cut_damage:
                raise Corruption(reader.path, stop.offset, stop.reason) from None
            if not stop.torn:
                # Bad bytes followed by more data past the durable mark: a power loss
                # can lose any unsynced page, not only the last ones. Nothing from
                # here on was known to be durable, so it is cut like a torn tail
                # (the metadata's references to it are dropped by the core).
                repair = TailRepair(reader.file_id, stop.offset, cut,
                                    f"{stop.reason} in the unsynced region")
                self.recovery.torn_tails.append(repair)
                kept = _free_name(f"{reader.path}.cut-{stop.offset}")
                m = reader._map
                write_file_durably(kept, b"" if m is None else m[stop.offset:])
                log.error("cut %s at offset %d: %d bytes past the durable mark were damaged "
                          "(%s; a lost page after a power loss); they are kept in %s",
                          reader.path, stop.offset, cut, stop.reason, kept)
            elif not is_zero_from(reader, stop.offset):
                repair = TailRepair(reader.file_id, stop.offset, cut, stop.reason)
                self.recovery.torn_tails.append(repair)
                log.warning(
                    "truncated torn tail of %s at offset %d: %d bytes cut (%s)",
                    reader.path, stop.offset, cut, stop.reason,
                )
            end = stop.offset
        if end != reader.mapped_size:
            fcalls.truncate(reader.path, end)
            reader.remap()
        return end

    def _start_segment(self, sealing: SegmentWriter | None = None) -> None:
        """Begin a fresh active segment, finishing ``sealing`` (the old one) once it exists."""
        fid = self._next_id
        self._next_id += 1  # never reused, even when this fails
        path = self._path(fid)
        make_room_for_files(len(self._readers) + 1)
        create_segment_file(path, fid)
        reader: SegmentReader | None = None
        try:
            reader = SegmentReader(path, fid)
            writer = SegmentWriter(path, fid, fmt.HEADER_SIZE, self.segment_max_bytes)
            try:
                if sealing is not None:
                    sealing.finish()
            except BaseException as exc:
                if sealing is not None and isinstance(exc, OSError) and sealing.sync_failed:
                    self._doubt(sealing.file_id, exc)
                if sealing is not None and sealing.closed:
                    # Finished but cut short after (an interrupt): the old segment is
                    # closed, so the new one must be the active one now.
                    self._install(fid, reader, writer)
                    raise
                writer.abandon()
                raise
        except BaseException:
            if self._readers.get(fid) is None:  # not installed: the new file goes
                if reader is not None:
                    reader.close()
                with contextlib.suppress(OSError):
                    fcalls.unlink(path)
            raise
        self._install(fid, reader, writer)
        if sealing is not None:
            # The sealed file was cut back to its data; a failed remap here is
            # harmless (a read past the map remaps on demand).
            with contextlib.suppress(OSError):
                self._readers[sealing.file_id].remap()

    def _install(self, fid: int, reader: SegmentReader, writer: SegmentWriter) -> None:
        self._readers[fid] = reader
        self._writer = writer
        self._synced = (fid, fmt.HEADER_SIZE)

    # -- writing --------------------------------------------------------------

    def check_size(self, body: bytes) -> None:
        if len(body) > self.max_payload_bytes:
            raise PayloadTooLarge(len(body), self.max_payload_bytes)

    def append(self, body: bytes) -> PayloadRef:
        return self.append_many([body])[0]

    def append_one(self, body: bytes) -> PayloadRef:
        """``append`` for a body already checked with :meth:`check_size` (the hot path)."""
        nbytes = fmt.FRAME_SIZE + len(body)
        try:  # costs nothing unless raised (Python 3.11)
            with self._lock:
                writer = self._writer
                # The common case in one comparison: room in the space already allocated.
                if writer is None or writer.end + nbytes > writer.fast_limit:
                    writer = self._active_writer()
                    if nbytes > writer.room() and not writer.empty:
                        writer = self._rotate_locked()
                    if writer.reserve(nbytes):
                        self._readers[writer.file_id].remap()
                return writer.append_one(body)
        except OSError as exc:
            raise storage_error(exc, "append") from exc

    @_os_errors("append")
    def append_many(self, bodies: Sequence[bytes],
                    started: list[int] | None = None) -> list[PayloadRef]:
        """Append each body as a record; a batch that fits is one pwritev per 512 records.

        The segment rotates before a record that would take it past
        ``segment_max_bytes``; a single record larger than that gets a segment
        of its own. ``started`` gets the id of each segment a rotation starts,
        as it starts (so the caller knows them also when the call raises).
        """
        if bodies and max(map(len, bodies)) > self.max_payload_bytes:
            for body in bodies:
                self.check_size(body)  # raises for the first that is too large
        refs: list[PayloadRef] = []
        with self._lock:
            writer = self._active_writer()
            total = fmt.FRAME_SIZE * len(bodies) + sum(map(len, bodies))
            if bodies and total <= writer.room():  # the usual batch: all of it fits
                if writer.reserve(total):
                    self._readers[writer.file_id].remap()
                return writer.append(bodies)
            start = 0
            while start < len(bodies):
                room = writer.room()
                nbytes = fmt.FRAME_SIZE + len(bodies[start])
                if nbytes > room and not writer.empty:
                    writer = self._rotate_locked()
                    if started is not None:
                        started.append(writer.file_id)
                    continue
                stop = start + 1
                while stop < len(bodies) and nbytes + fmt.FRAME_SIZE + len(bodies[stop]) <= room:
                    nbytes += fmt.FRAME_SIZE + len(bodies[stop])
                    stop += 1
                if writer.reserve(nbytes):
                    self._readers[writer.file_id].remap()
                refs.extend(writer.append(bodies[start:stop]))
                start = stop
        return refs

    def _active_writer(self) -> SegmentWriter:
        if self._writer is None:
            raise RuntimeError("segment set is read-only or closed")
        return self._writer

    def _rotate_locked(self) -> SegmentWriter:
        """Seal the active segment and start the next one.

        The next file is created before the old one is finished, so a failure
        (a full disk, an I/O error) leaves the old writer open and appending,
        and no header-less file behind.
        """
        old = self._active_writer()
        self._start_segment(old)
        return self._active_writer()
    @_os_errors("seal")
    def seal(self) -> int:
        """Make the active segment immutable and start a new one; returns the sealed id."""
        with self._lock:
            sealed = self._active_writer().file_id
            self._rotate_locked()
        return sealed

    @_os_errors("sync")
    def sync(self) -> None:
        """fdatasync what was appended to the active segment (sealed ones are synced).

        Callers are serialised: one that finds nothing left to sync returns only
        after the sync in progress, which covers its bytes, has finished.
        """
        with self._sync_lock:
            fd = -1
            taken: SegmentWriter | None = None
            try:
                with self._lock:
                    writer = self._writer
                    if writer is None or not writer.unsynced:
                        return
                    end = writer.end
                    fd = os.dup(writer._fd)
                    # Taken inside the try, noted first: an interrupt as dup returned
                    # (or as the lock was let go) left the flag cleared with nothing
                    # synced, and an always-mode group commit then returned durable
                    # what no fdatasync had covered (an interrupt audit).
                    taken = writer
                    writer.unsynced = False
                fcalls.fdatasync(fd)
            except BaseException as exc:
                if taken is not None:
                    taken.unsynced = True  # not known to be on disk: the next sync retries
                    if isinstance(exc, OSError):  # the fdatasync failed (dup is before)
                        self._doubt(taken.file_id, exc)
                raise
            finally:
                if fd >= 0:
                    fcalls.close_fd(fd)
            writer.synced_end = max(writer.synced_end, end)
            if writer is self._writer:
                self._synced = (writer.file_id, writer.synced_end)

    def _doubt(self, file_id: int, exc: OSError) -> None:
        """Note that an fdatasync of ``file_id`` failed (see :attr:`in_doubt`)."""
        with self._doubt_lock:
            new = file_id not in self.in_doubt
            self.in_doubt = self.in_doubt | {file_id}
        if new:
            log.error("the sync of segment %s failed (%s): what it held may not be on disk "
                      "even when a later sync succeeds; its live messages will be copied to "
                      "a new segment by the next compaction pass", self._path(file_id), exc)
            if self.on_doubt is not None:  # once: a disk failing every sync must not
                self.on_doubt()  # make the compactor retry in a tight loop

    def synced_position(self) -> tuple[int, int]:
        """(active file id, offset): the active segment's bytes below it are durable.

        The same tuple object until it changes, so callers can compare cheaply.
        """
        return self._synced

    @property
    def unsynced(self) -> bool:
        writer = self._writer
        return writer is not None and writer.unsynced

    # -- reading --------------------------------------------------------------

    def read_many(self, refs: Sequence[Located]) -> list[bytes]:
        """:meth:`read` of each of ``refs``, in order: one reader lookup per run
        of references into one segment."""
        out: list[bytes] = []
        writer = self._writer
        start = 0
        try:  # costs nothing unless raised (Python 3.11)
            while start < len(refs):
                fid = refs[start].file_id
                stop = start + 1
                while stop < len(refs) and refs[stop].file_id == fid:
                    stop += 1
                reader = self._readers.get(fid)
                if reader is None:
                    reader = self._open_reader(fid)
                limit = writer.end if writer is not None and writer.file_id == fid else None
                out.extend(reader.read_many(refs[start:stop], limit))
                start = stop
        except OSError as exc:
            raise storage_error(exc, "read") from exc
        except Corruption:
            if self.fallback is None:
                raise
            return [self.read(ref) for ref in refs]  # each from its fallback, or raises
        return out

    def read(self, ref: Located) -> bytes:
        try:  # costs nothing unless raised (Python 3.11)
            reader = self._readers.get(ref.file_id)
            if reader is None:
                reader = self._open_reader(ref.file_id)
            writer = self._writer
            limit = writer.end if writer is not None and writer.file_id == ref.file_id else None
            return reader.read(ref, limit)
        except OSError as exc:
            raise storage_error(exc, "read") from exc
        except Corruption:
            body = None if self.fallback is None else self.fallback(ref)
            if body is None:
                raise
            return body

    @_os_errors("open")
    def _open_reader(self, file_id: int) -> SegmentReader:
        """A reader for a segment that appeared after open (read-only views)."""
        path = self._path(file_id)
        if not os.path.exists(path):
            raise Corruption(path, 0, fmt.MISSING_SEGMENT)
        with self._lock:
            reader = self._readers.get(file_id)
            if reader is None:
                reader = self._readers[file_id] = SegmentReader(path, file_id)
        return reader

    def adopt(self, file_ids: Iterable[int]) -> None:
        """Open readers for sealed segments moved into the directory after open (a
        bulk load's): listed by :meth:`file_ids` from now on, as after a reopen,
        so stats, snapshots and compaction see them before any read does."""
        for fid in file_ids:
            self._open_reader(fid)

    # -- compaction primitives ------------------------------------------------

    def reserve_file_id(self) -> int:
        """A fresh file id for a compaction output (record it before writing it)."""
        with self._lock:
            fid = self._next_id
            self._next_id += 1
        return fid

    def copy_live(
        self,
        file_id: int,
        refs: Sequence[PayloadRef],
        progress: Callable[[int], None] | None = None,
        damaged: list[tuple[PayloadRef, str]] | None = None,
    ) -> dict[PayloadRef, PayloadRef]:
        """:meth:`copy_records` of ``refs``; returns old -> new refs."""
        n = len(refs)
        table = np.fromiter(itertools.chain.from_iterable(refs), np.int64, 3 * n).reshape(n, 3)
        news = self.copy_records(file_id, table, progress, damaged).tolist()
        return dict(zip(refs, map(PayloadRef, itertools.repeat(file_id, n), news,
                                  table[:, 2].tolist()), strict=True))

    @_os_errors("copy")
    def copy_records(
        self,
        file_id: int,
        table: np.ndarray,
        progress: Callable[[int], None] | None = None,
        damaged: list[tuple[PayloadRef, str]] | None = None,
    ) -> np.ndarray:
        """Copy records into new sealed segment ``file_id``, fsynced; returns their new offsets.

        ``table`` is an ``(n, 3)`` int64 array of references (file id, offset,
        length), best sorted by file id and offset; the result holds the offset
        in ``file_id`` of each, in the same order (lengths do not change).

        Every source record is CRC-checked as it is read: damage raises
        :class:`Corruption` and the output is removed; unless ``damaged`` is a
        list, then a damaged record is copied as it is (zero-filled past the end
        of its source), so it stays damaged and is never returned as data, and
        ``(ref, reason)`` is appended to ``damaged``. ``progress(nbytes)``
        follows the bytes written.

        A record is copied unchanged, frame and all (its CRC covers its length
        and body, not its offset), straight from the source's memory map, so
        record ``i`` lands at the header plus the sizes of the records before
        it. The references into one source are checked together
        (:func:`frames_intact`); only a source where one is not intact is
        checked again a record at a time, to say which and why. Records that
        lie back to back in a source go out as one piece of a ``pwritev``, and
        the output is synced in the background as it grows (see _Flusher).
        """
        path = self._path(file_id)
        create_segment_file(path, file_id)
        out = SegmentWriter(path, file_id, fmt.HEADER_SIZE, fmt.HEADER_SIZE)
        sink = _CopySink(out, _Flusher(out.fileno()), progress)
        views: dict[int, memoryview] = {}
        n = len(table)
        fids, offsets, lengths = table[:, 0], table[:, 1], table[:, 2]
        sizes = lengths + fmt.FRAME_SIZE
        try:
            cuts = (np.flatnonzero(fids[1:] != fids[:-1]) + 1).tolist()
            for a, b in itertools.pairwise([0, *cuts, n] if n else []):
                fid = int(fids[a])
                offs, lens = offsets[a:b], lengths[a:b]
                view = views.get(fid) or self._source_view(fid, views)
                if not frames_intact(view, offs, lens, len(view)):
                    # A stale map (the active segment grew since it was taken): remap once.
                    view = self._source_view(fid, views, fresh=True)
                    if not frames_intact(view, offs, lens, len(view)):
                        refs = list(map(PayloadRef, itertools.repeat(fid, b - a),
                                        offs.tolist(), lens.tolist()))
                        sink.add_checked(view, refs, self._path(fid), damaged)
                        continue
                sink.add_runs(view, offs, offs + sizes[a:b])
            sink.finish()
            out.finish()  # fsyncs and closes
            fsync_dir(self.directory)
            reader = SegmentReader(path, file_id)
        except BaseException:
            sink.abandon()
            out.abandon()
            with contextlib.suppress(OSError):  # the caller retries by name (delete)
                fcalls.unlink(path)
            raise
        finally:
            views.clear()
        with self._lock:
            self._readers[file_id] = reader
        # Every record is copied whole (a damaged one padded to its size), in order.
        news: np.ndarray = np.cumsum(sizes) - sizes + fmt.HEADER_SIZE
        return news

    def _source_view(
        self, file_id: int, views: dict[int, memoryview], fresh: bool = False
    ) -> memoryview:
        """A view of the map of segment ``file_id`` (cached in ``views``) for copy_live."""
        if fresh:
            views.pop(file_id, None)
        reader = self._readers.get(file_id)
        if reader is None:
            reader = self._open_reader(file_id)
        if fresh:
            reader.remap()
        m = reader._map  # written from directly: payload bytes never pass through Python
        view = memoryview(m) if m is not None else memoryview(b"")
        writer = self._writer
        if writer is not None and writer.file_id == file_id:
            view = view[: writer.end]  # past the writer's end is preallocated zeros
        views[file_id] = view
        return view

    @_os_errors("delete")
    def delete(self, file_ids: Iterable[int]) -> None:
        """Unlink sealed segments. Readers already holding one keep a valid map.

        Every id is tried; a segment whose unlink failed stays in the set (its
        reader kept, listed by :meth:`file_ids`), so a later call can retry it,
        and the first error is raised once the others are done.
        """
        removed = False
        failed: OSError | None = None
        ids = list(file_ids)
        with self._lock:
            # Check every id before unlinking any, so a bad call changes nothing.
            if self._writer is not None and self._writer.file_id in ids:
                raise ValueError(f"cannot delete the active segment {self._writer.file_id}")
            for fid in ids:
                try:
                    fcalls.unlink(self._path(fid))
                    removed = True
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    failed = failed or exc
                    continue
                reader = self._readers.pop(fid, None)
                if reader is not None:
                    reader.detach()
                if fid in self.in_doubt:
                    with self._doubt_lock:
                        self.in_doubt = self.in_doubt - {fid}
        if removed:
            fsync_dir(self.directory)
        if failed is not None:
            raise failed

    @_os_errors("retire")
    def retire_damaged(self, file_id: int) -> str:
        """Rename damaged segment ``file_id`` out of the segment namespace; its new path.

        Only a segment of :attr:`damaged` (its header unreadable: it has no
        reader, nothing here holds it), and only once nothing refers to it (the
        caller's part: ``check(repair=True)``). It becomes ``<segment>.damaged``
        (``.2``, ``.3``... if taken: never over an earlier one), a name that does
        not parse as a segment, so no open, view, snapshot, compaction or check
        lists it again; its bytes stay for whoever looks into the damage.
        """
        with self._lock:
            if file_id not in self.damaged or file_id in self._readers:
                raise ValueError(f"segment {file_id} is not a damaged segment of this set")
            path = self._path(file_id)
            kept = _free_name(path + fmt.DAMAGED_SUFFIX)
            fcalls.replace(path, kept)  # kept is free: nothing is replaced
            del self.damaged[file_id]
        fsync_dir(self.directory)
        return kept

    # -- accounting -----------------------------------------------------------

    @property
    def active_id(self) -> int | None:
        writer = self._writer
        return writer.file_id if writer is not None else None

    @property
    def active_end(self) -> int:
        return self._active_writer().end

    def file_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._readers)

    def segment_size(self, file_id: int) -> int:
        """Bytes of data in a segment (the active one's preallocated zeros excluded)."""
        writer = self._writer
        if writer is not None and writer.file_id == file_id:
            return writer.end
        reader = self._readers.get(file_id)
        if reader is not None:
            return reader.file_size()  # a pinned file, even if the writer deleted it since
        return os.path.getsize(self._path(file_id))

    def disk_usage(self) -> int:
        return sum(self.segment_size(fid) for fid in self.file_ids())

    def path_of(self, file_id: int) -> str:
        return self._path(file_id)

    def close(self, *, as_is: bool = False) -> None:
        """Seal nothing: cut the active segment's preallocated tail, fsync it, close every file.

        Every file is closed even when the cut or the fsync fails (that error
        is raised after). ``as_is``: no cut and no sync, the files only closed
        (the store was released already: another may write to them now).
        """
        with self._lock:
            writer, self._writer = self._writer, None
            try:
                if writer is not None:
                    try:
                        if not as_is:
                            writer.finish()
                    finally:
                        writer.abandon()  # does nothing once finish closed it
            finally:
                for reader in self._readers.values():
                    reader.close()
                self._readers.clear()


def _on_a_record_boundary(reader: SegmentReader, offset: int) -> bool:
    """Whether a record starts (or the intact run ends) at ``offset``, walking the
    segment's records from its header; also True when damage before ``offset``
    stops the walk (nothing tells then: the hint is taken, as before)."""
    try:
        for ref in reader.scan(fmt.HEADER_SIZE):
            if ref.offset >= offset:
                return ref.offset == offset
    except ScanError as exc:
        return exc.stop.offset <= offset
    return True  # the intact records end before it: the tail past them is torn


class _CopySink:
    """copy_live's output: pieces of checked records gathered into pwritev calls."""

    def __init__(self, out: SegmentWriter, flusher: _Flusher,
                 progress: Callable[[int], None] | None) -> None:
        self._out = out
        self._flusher = flusher
        self._progress = progress
        self._pieces: list[memoryview] = []
        self._bytes = 0  # in _pieces

    def add_runs(self, view: memoryview, starts: np.ndarray, ends: np.ndarray) -> None:
        """Records ``view[starts[i]:ends[i]]``, checked; back-to-back ones become one piece."""
        if not len(starts):
            return
        brk = np.flatnonzero(starts[1:] != ends[:-1]) + 1
        run_starts = starts[np.r_[0, brk]]
        run_ends = ends[np.r_[brk - 1, len(ends) - 1]]
        if int((run_ends - run_starts).max()) > _COPY_BYTES:
            # Long runs go out in pieces of _COPY_BYTES, for the progress reports.
            cuts = [np.arange(s, e, _COPY_BYTES) for s, e in
                    zip(run_starts.tolist(), run_ends.tolist(), strict=True)]
            run_starts = np.concatenate(cuts)
            run_ends = np.minimum(run_starts + _COPY_BYTES,
                                  np.repeat(run_ends, [len(c) for c in cuts]))
        self.add_many([view[s:e] for s, e in
                       zip(run_starts.tolist(), run_ends.tolist(), strict=True)],
                      np.cumsum(run_ends - run_starts))

    def add_many(self, pieces: list[memoryview], ends: np.ndarray) -> None:
        """:meth:`add` of each of ``pieces``, whose sizes sum to ``ends[i]`` up to
        piece ``i``: the same writes, without a call per piece."""
        start, n = 0, len(pieces)
        while start < n:
            before = int(ends[start - 1]) if start else 0
            # Up to the piece that fills the write's bytes, or its count of pieces.
            full = int(np.searchsorted(ends, before + _COPY_BYTES - self._bytes)) + 1
            stop = min(n, full, start + _COPY_PIECES - len(self._pieces))
            self._pieces.extend(pieces[start:stop])
            self._bytes += int(ends[stop - 1]) - before
            if len(self._pieces) >= _COPY_PIECES or self._bytes >= _COPY_BYTES:
                self._write()
            start = stop

    def add_checked(self, view: memoryview, refs: Sequence[PayloadRef], path: str,
                    damaged: list[tuple[PayloadRef, str]] | None) -> None:
        """The records of ``refs`` (all in the segment at ``path``), checked one at a time.

        A damaged record raises :class:`Corruption`, or, when ``damaged`` is a
        list, is reported there and copied as it is, zero-filled past the end
        of the source.
        """
        bound = len(view)
        for ref in refs:
            off, length = ref.offset, ref.length
            end = off + fmt.FRAME_SIZE + length
            problem = frame_problem(view, off, length, bound)
            if problem is not None:
                if damaged is None:
                    raise Corruption(path, off, problem)
                damaged.append((ref, problem))
                if end > bound:  # the bytes are not all there: pad them
                    kept = bytes(view[min(off, bound):bound])
                    self.add(memoryview(kept + bytes(end - off - len(kept))))
                    continue
            self.add(view[off:end])

    def add(self, piece: memoryview) -> None:
        self._pieces.append(piece)
        self._bytes += len(piece)
        if len(self._pieces) >= _COPY_PIECES or self._bytes >= _COPY_BYTES:
            self._write()

    def _write(self) -> None:
        _write_pieces(self._out, self._pieces, self._progress)
        self._pieces = []
        self._bytes = 0
        self._flusher.wrote_up_to(self._out.end)

    def finish(self) -> None:
        self._write()
        self._flusher.finish()

    def abandon(self) -> None:
        self._pieces = []
        self._flusher.abandon()


class _Flusher:
    """fdatasyncs copy_live's output in a helper thread every _FLUSH_BYTES written.

    The disk then writes while Python checks and gathers the next records, and
    the final fsync finds little left to do: on a disk slower than the copy
    loop, that hides most of the disk's time instead of adding it at the end.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._kicked_at = 0
        self._thread: threading.Thread | None = None
        self._error: OSError | None = None

    def wrote_up_to(self, offset: int) -> None:
        if offset - self._kicked_at < _FLUSH_BYTES:
            return
        if self._thread is not None:
            if self._thread.is_alive():
                return  # the one in progress will do; kick again after it
            self._thread.join()
        self._kicked_at = offset
        self._thread = threading.Thread(target=self._sync, name="qstore-copy-flush", daemon=True)
        self._thread.start()

    def _sync(self) -> None:
        try:
            fcalls.fdatasync(self._fd)
        except OSError as exc:  # raised by finish(): the next fsync may not report it again
            self._error = exc

    def finish(self) -> None:
        self.abandon()
        if self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """Wait for the sync in progress (the file is about to be closed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _write_pieces(
    out: SegmentWriter, pieces: list[memoryview], progress: Callable[[int], None] | None
) -> None:
    """Append ``pieces`` (runs of checked records) to ``out``; report the bytes."""
    if not pieces:
        return
    at = out.end
    out.append_framed(pieces)
    if progress is not None:
        progress(out.end - at)


def _free_name(path: str) -> str:
    """``path``, or ``path.2``, ``path.3``... the first that does not exist: cut bytes
    kept by an earlier open at the same offset are never overwritten."""
    name, n = path, 1
    while os.path.lexists(name):
        n += 1
        name = f"{path}.{n}"
    return name
