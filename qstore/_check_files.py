"""The segment files an integrity check reads, opened once and pinned.

Every payload check goes through :class:`qstore.payload.SegmentReader` (its
``read`` checks bounds, frame length and CRC and raises ``Corruption`` with the
fixed reason strings); nothing here parses a frame.

Files are listed and mapped when the check starts, before the metadata of a
running store is opened read-only: a compaction pass that deletes a segment
after that still leaves the check its bytes (a map keeps an unlinked file's
pages), so a frozen metadata view never sees a false ``missing_segment``.
Maps are detached from their file descriptors, so a store with thousands of
segments does not run out of descriptors; a segment still being written
(the active one, a compaction output) is mapped again when a reference
points past the map.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ._check_report import NOT_IN_MANIFEST
from ._errors import Corruption, StorageError
from .payload import PayloadRef, SegmentReader
from .payload import _format as fmt


class SegmentFiles:
    """The ``*.seg`` files of one payload directory, for checking references.

    ``lengths``: for a snapshot, the data length of each segment it lists
    (its manifest); references past it are out of bounds, and a segment it
    does not list is reported as not in the manifest. None for a store: the
    bounds are the file sizes.
    """

    def __init__(self, directory: str, lengths: Mapping[int, int] | None,
                 pinned: Mapping[int, SegmentReader] | None = None) -> None:
        self.directory = directory
        self.lengths = lengths
        self.sizes: dict[int, int] = {}  # file id -> size of the file when first opened
        self._readers: dict[int, SegmentReader | Corruption] = {}
        self._borrowed: set[int] = set()  # pinned readers: the view's, never closed here
        # A read-only view checks the files it pinned when it opened, not what the
        # directory holds now: the writer may have made segments since (which the
        # view's metadata cannot account for: not orphans) or deleted some.
        names = [] if pinned is not None else (
            sorted(os.listdir(directory)) if os.path.isdir(directory) else [])
        for name in names:
            fid = fmt.parse_segment_name(name)
            if fid is not None:
                self._open(fid)
        # A read-only view's segments, pinned when it opened: one the writer has
        # deleted since is still the view's (its metadata names it), not missing.
        for fid, reader in (pinned or {}).items():
            if fid not in self.sizes:
                self._readers[fid] = reader
                # Its size now, not its map's: the view pinned it before it opened
                # its metadata, and the writer appended meanwhile. A fresh active
                # segment pinned at its 24-byte header was "truncated" against the
                # data end its S record gave (a race audit).
                self.sizes[fid] = reader.file_size()
                self._borrowed.add(fid)

    def path(self, file_id: int) -> str:
        return os.path.join(self.directory, fmt.segment_name(file_id))

    def _open(self, file_id: int) -> SegmentReader | Corruption:
        path = self.path(file_id)
        reader: SegmentReader | Corruption
        try:
            size = os.path.getsize(path)
            reader = SegmentReader(path, file_id)
        except FileNotFoundError:
            reader = Corruption(path, 0, fmt.MISSING_SEGMENT)
        except OSError as exc:  # EACCES, EIO...: the check cannot run, it finds nothing
            err = StorageError(f"cannot read segment {path!r}: {exc}")
            err.errno = exc.errno
            raise err from exc
        except Corruption as exc:  # a damaged header: no record of the file can be read
            reader = exc
            self.sizes[file_id] = size
        else:
            reader.detach()
            self.sizes[file_id] = size
        self._readers[file_id] = reader
        return reader

    def header_problem(self, file_id: int) -> str | None:
        """Why the file's header is damaged, or None (also None for a missing file)."""
        reader = self._readers.get(file_id)
        if isinstance(reader, Corruption) and reader.reason != fmt.MISSING_SEGMENT:
            return reader.reason
        return None

    def check(self, ref: PayloadRef) -> str | None:
        """None if ``ref`` resolves to an intact record, else the Corruption reason."""
        reader = self._readers.get(ref.file_id)
        if reader is None:  # created after the listing (the writer rotated meanwhile)
            reader = self._open(ref.file_id)
        if self.lengths is not None and ref.file_id not in self.lengths:
            return NOT_IN_MANIFEST
        if isinstance(reader, Corruption):
            return reader.reason
        limit = None if self.lengths is None else self.lengths[ref.file_id]
        try:
            reader.read(ref, limit)
        except Corruption as exc:
            if exc.reason not in (fmt.OUT_OF_BOUNDS, fmt.BAD_LENGTH, fmt.BAD_CRC):
                return exc.reason
            fresh = self._reopen_if_grown(ref.file_id, reader)
            if fresh is None:
                return exc.reason
            try:
                fresh.read(ref, limit)
            except Corruption as again:
                return again.reason
        return None

    def _reopen_if_grown(self, file_id: int, reader: SegmentReader) -> SegmentReader | None:
        """A new map of a file that grew since it was mapped (the writer appends to it)."""
        try:
            grown = os.path.getsize(self.path(file_id)) > reader.mapped_size
        except FileNotFoundError:
            return None
        if not grown:
            return None
        fresh = self._open(file_id)
        return fresh if isinstance(fresh, SegmentReader) else None

    def close(self) -> None:
        for fid, reader in self._readers.items():
            if isinstance(reader, SegmentReader) and fid not in self._borrowed:
                reader.close()
        self._readers.clear()
