"""The views lock: read-only views opening a store, against the writer unlinking segments.

A read-only view lists and opens the segment files, then opens a metadata
view, then opens any segment that metadata refers to and it does not hold
yet (``SegmentSet.pin``). Once a view holds a segment (a descriptor and a
memory map), unlinking the file cannot take its bytes away; only the window
while it opens is at risk: a compaction pass of the writer could delete a
segment that the view's metadata, a moment older than the writer's, still
refers to. The view holds ``payload/views.lock`` shared (``flock``) through
that window; the writer deletes segments only while it holds the lock
exclusively (contract section 4, step 5).

The writer goes first: it takes ``payload/views.gate`` exclusively, which
new views must pass (shared, for a moment) before they take the lock, and
then waits, up to a bound, for the views already opening to finish. Without
the gate, views opened back to back (two processes polling ``qstore stats``
beside a busy writer) always held the lock between them, and the writer,
which took it without waiting, skipped nearly every deletion: 862 dead
segments, 817 MB, after a minute (a resource audit). If the wait runs out,
the deletion is left for the next pass.

The writer creates both files; a view never does (a snapshot or a read-only
filesystem must not be written to): without the lock file a view falls back
to taking a fresh metadata view when a segment it needs is gone, and
without the gate (a store an older writer made) it takes the lock alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

VIEWS_LOCK = "views.lock"  # in payload/; never parsed as a segment name
VIEWS_GATE = "views.gate"  # likewise
# How long the writer waits for the views already opening (a view's open replays
# the writer's RocksDB log: up to about a second with a full memtable).
VIEW_WAIT = 2.0
_PAUSE = 0.002  # seconds between the writer's tries of the lock

# Descriptors of the two files this process has open (and maybe locked) now. A
# child forked meanwhile shares their open files, and with them the locks: it
# would hold them for its whole life, every view of the store waiting at the
# gate and no dead segment deleted (a review). The child closes its copies.
_held: set[int] = set()


def _close_inherited() -> None:
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)  # only the copy: the parent's lock stays the parent's
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited)


def create_views_lock(directory: str) -> None:
    """Make sure the lock and gate files exist (the writer, at open)."""
    for name in (VIEWS_LOCK, VIEWS_GATE):
        os.close(os.open(os.path.join(directory, name), os.O_RDONLY | os.O_CREAT, 0o644))


def _open(directory: str, name: str, flags: int = 0) -> int:
    """A descriptor of ``name`` (in ``_held`` until :func:`_close`), or -1 if it
    cannot be opened."""
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | flags, 0o644)
    except OSError:
        return -1
    _held.add(fd)
    return fd


def _close(fd: int) -> None:
    _held.discard(fd)
    os.close(fd)


@contextlib.contextmanager
def viewing(directory: str) -> Iterator[bool]:
    """Hold the views lock shared while a view opens; yields False if there is no lock file."""
    fd = _open(directory, VIEWS_LOCK)
    if fd < 0:
        yield False
        return
    try:
        gate = _open(directory, VIEWS_GATE)
        try:
            if gate >= 0:
                fcntl.flock(gate, fcntl.LOCK_SH)  # waits while the writer deletes
            fcntl.flock(fd, fcntl.LOCK_SH)
        finally:
            if gate >= 0:
                _close(gate)  # passed: the gate holds no view up once it is in
        yield True
    finally:
        _close(fd)  # releases the lock


def _take(fd: int, deadline: float) -> bool:
    """``fd`` locked exclusively by ``deadline`` (monotonic), or False."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            _pause()


def _pause() -> None:
    time.sleep(_PAUSE)


@contextlib.contextmanager
def no_view_opening(directory: str, wait: float = VIEW_WAIT) -> Iterator[bool]:
    """The writer's side: yields True while it holds the lock exclusively, False if
    views opening did not finish within ``wait`` seconds (the caller then leaves its
    deletion for later). New views wait at the gate meanwhile. Never call it with
    the writer lock held: it may wait."""
    fd = _open(directory, VIEWS_LOCK, os.O_CREAT)
    if fd < 0:
        yield True  # no lock can be had: delete as before (views retry, see Core)
        return
    gate = _open(directory, VIEWS_GATE, os.O_CREAT)
    try:
        deadline = time.monotonic() + wait
        yield (gate < 0 or _take(gate, deadline)) and _take(fd, deadline)
    finally:
        _close(fd)
        if gate >= 0:
            _close(gate)
