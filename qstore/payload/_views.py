"""The views lock: read-only views opening a store, against the writer unlinking segments.

A read-only view lists and opens the segment files, then opens a metadata
view, then opens any segment that metadata refers to and it does not hold
yet (``SegmentSet.pin``). Once a view holds a segment (a descriptor and a
memory map), unlinking the file cannot take its bytes away; only the window
while it opens is at risk: a compaction pass of the writer could delete a
segment that the view's metadata, a moment older than the writer's, still
refers to. The view holds ``payload/views.lock`` shared (``flock``) through
that window; the writer deletes segments only while it holds the lock
exclusively, taken without waiting: if a view is opening, the deletion is
left for the next pass (contract section 4, step 5).

The writer creates the file; a view never does (a snapshot or a read-only
filesystem must not be written to), and without it a view falls back to
taking a fresh metadata view when a segment it needs is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

VIEWS_LOCK = "views.lock"  # in payload/; never parsed as a segment name


def create_views_lock(directory: str) -> None:
    """Make sure the lock file exists (the writer, at open)."""
    fd = os.open(os.path.join(directory, VIEWS_LOCK), os.O_RDONLY | os.O_CREAT, 0o644)
    os.close(fd)


@contextlib.contextmanager
def viewing(directory: str) -> Iterator[bool]:
    """Hold the views lock shared while a view opens; yields False if there is no lock file."""
    try:
        fd = os.open(os.path.join(directory, VIEWS_LOCK), os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # the writer holds it only while it unlinks
        yield True
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def no_view_opening(directory: str) -> Iterator[bool]:
    """The writer's side: yields True while it holds the lock exclusively, False if a
    view is opening (the caller then leaves its deletion for later)."""
    try:
        fd = os.open(os.path.join(directory, VIEWS_LOCK), os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        yield True  # no lock can be had: delete as before (views retry, see Core)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
