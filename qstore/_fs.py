"""File-system helpers with the durability rules in one place.

- :func:`write_at` writes buffers back to back at an offset, all of them: a
  ``pwritev`` per ``IOV_MAX`` buffers, and a short write (signals, huge
  batches) is finished rather than lost.
- :func:`fsync_file` and :func:`fsync_dir` make a file's data, or a
  directory's entries (a create, rename or unlink), durable;
  :func:`make_dirs_durably` creates directories that a power loss cannot take
  back (each one's entry in its parent fsynced).
- :func:`write_file_durably` (and :func:`write_json_durably`) replaces a
  small file atomically: write a temporary file, fsync it, rename it over the
  old one, fsync the directory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap as _mmap
import os
from collections.abc import Iterable, Sequence
from typing import Any

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

# Descriptors a store may hold per payload segment (its reader's own and the one
# Python's mmap keeps: two; the active segment's writer more), and besides them
# (RocksDB's table and log files, the process's own).
FDS_PER_SEGMENT = 2
FDS_BESIDES = 1024


def make_room_for_files(segments: int, extra: int = 0) -> int | None:
    """Raise this process's soft limit on open files toward its hard limit when
    ``segments`` payload segments may not fit under it.

    The usual soft limit is 1,024 descriptors, the hard one far higher: a store
    of 500 segments (125 GiB at the default size, far fewer bytes with small
    segments or long-lived messages pinning old ones) then failed every
    rotation with EMFILE, and could not even be opened again. Databases raise
    the soft limit the same way (it is the process's to raise, up to the hard
    one); past the hard limit, opens fail with EMFILE, reported as a
    StorageError naming it. ``extra``: descriptors wanted besides (a server's
    connections). Returns the soft limit then in force (None: none known).
    """
    if resource is None:
        return None
    want = segments * FDS_PER_SEGMENT + FDS_BESIDES + extra
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    if soft >= want:
        return int(soft)
    # Room for the store to grow: twice what it needs now, at most the hard limit.
    new = 2 * want if hard == resource.RLIM_INFINITY else min(hard, 2 * want)
    if new > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def remove_paths(paths: Iterable[str]) -> list[str]:
    """Remove each path (a directory with what it holds; a file or a link itself);
    returns those still there (an error is not raised: the caller says what is
    left, as a failed snapshot or serve cleaning up after itself does)."""
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            _remove_tree(path)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    return [path for path in paths if os.path.lexists(path)]


def _remove_tree(path: str) -> None:
    """``shutil.rmtree(path, ignore_errors=True)`` by names, no descriptor of its own.

    Callers run it after an interrupt (a snapshot cut short). CPython's rmtree
    works through directory descriptors and marks one closed only after
    ``os.close`` returned: a second interrupt in between made its ``finally``
    close that number again, by then another thread's file (the store's own,
    or RocksDB's; an interrupt audit: EBADF in other threads after cut
    snapshots)."""
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, name))
        for name in dirs:
            sub = os.path.join(root, name)
            with contextlib.suppress(OSError):
                if os.path.islink(sub):  # a link to a directory: the link only
                    os.unlink(sub)
                else:
                    os.rmdir(sub)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def map_read(fd: int, size: int) -> _mmap.mmap:
    """A read-only memory map of the first ``size`` bytes of ``fd``."""
    return _mmap.mmap(fd, size, access=_mmap.ACCESS_READ)


def map_write(fd: int, size: int) -> _mmap.mmap:
    """A shared, writable memory map of the first ``size`` bytes of ``fd``.

    Only for bytes backed by allocated blocks (``posix_fallocate``): a store
    into a hole of a full file system would raise SIGBUS instead of an error.
    """
    return _mmap.mmap(fd, size, access=_mmap.ACCESS_WRITE)


class FileCalls:
    """The file calls the store makes on its payload segments and small files.

    Code calls them through :data:`calls` (``calls.pwritev(...)``), so that a
    test can wrap one and fail the Nth call (tests/faults/_inject.py): the
    fault model of docs/faults.md. The lookup costs what ``os.pwritev`` does.
    """

    def __init__(self) -> None:
        self.open_fd = os.open
        self.close_fd = os.close
        self.write = os.write
        self.pread = os.pread
        self.pwritev = os.pwritev
        self.pwrite = os.pwrite
        self.fsync = os.fsync
        self.fdatasync = os.fdatasync
        self.ftruncate = os.ftruncate
        self.fallocate = os.posix_fallocate
        self.truncate = os.truncate
        self.replace = os.replace
        self.unlink = os.unlink
        self.link = os.link
        self.mmap = map_read
        self.mmap_write = map_write


calls = FileCalls()

# pwritev() fails with EINVAL when given more buffers than this (1024 on Linux),
# so a longer list is written in several calls.
IOV_MAX = 1024

Buffer = bytes | memoryview


def write_at(fd: int, parts: Sequence[Buffer], at: int, total: int | None = None) -> int:
    """Write ``parts`` back to back starting at offset ``at``; returns the bytes written.

    ``total``: their size, if the caller knows it (saves adding it up)."""
    done = 0
    for i in range(0, len(parts), IOV_MAX):
        chunk = parts[i : i + IOV_MAX]
        size = total if total is not None and len(parts) <= IOV_MAX else sum(map(len, chunk))
        written = calls.pwritev(fd, chunk, at + done)
        if written < size:
            complete_write(fd, chunk, at + done, written)
        done += size
    return done


def complete_write(fd: int, parts: Sequence[Buffer], at: int, written: int) -> None:
    """Finish a ``pwritev(fd, parts, at)`` that wrote only ``written`` bytes."""
    rest = memoryview(b"".join(parts))[written:]
    pos = at + written
    while rest:
        n = calls.pwrite(fd, rest, pos)
        rest = rest[n:]
        pos += n


def absolute(path: str) -> str:
    """``path`` made absolute against the working directory, not normalised:
    ``os.path.abspath`` collapses ``link/..`` by text, which names another
    directory when ``link`` is a symbolic link."""
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def fsync_file(path: str) -> None:
    fd = calls.open_fd(path, os.O_RDONLY)
    try:
        calls.fsync(fd)
    finally:
        calls.close_fd(fd)


def fsync_dir(path: str) -> None:
    fd = calls.open_fd(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        calls.fsync(fd)
    finally:
        calls.close_fd(fd)


def make_dirs_durably(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, each directory it creates made durable
    in its parent (the parent fsynced after the mkdir).

    A directory's entry lives in its parent: fsyncs of the directory itself and
    of the files in it do not make it durable, so a power loss could take back a
    new store or snapshot whose every file had been synced (a power-loss audit).
    """
    missing = []
    # The path as given, not normalised: ``link/..`` is the parent of what the
    # symlink points to, which only the kernel resolves (abspath made it ``.``).
    here = path.rstrip(os.sep) or os.sep
    while not os.path.exists(here):  # a file on the way: the mkdir says ENOTDIR
        missing.append(here)
        parent = os.path.dirname(here) or os.curdir
        if parent == here:
            break
        here = parent
    made: list[str] = []
    try:
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError:
                if not os.path.isdir(directory):
                    raise
            else:
                made.append(directory)
            # A parent this process may write in but not read (mode 0733) cannot be
            # opened to fsync: the directory is made, its entry as durable as the
            # file system makes it on its own.
            with contextlib.suppress(PermissionError):
                fsync_dir(os.path.dirname(directory) or os.curdir)
    except BaseException:
        # What this call made goes (empty still): a failed open or snapshot left
        # the directories, and a retry found them and fsynced no parent again.
        for directory in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise
    if not missing and not os.path.isdir(path):
        raise FileExistsError(errno.EEXIST, "File exists", path)


def write_file_durably(path: str, data: bytes | memoryview) -> None:
    """Write temp, fsync, rename, fsync the directory."""
    tmp = path + ".tmp"
    fd = calls.open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_at(fd, [data], 0)
        calls.fsync(fd)
    finally:
        calls.close_fd(fd)
    calls.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or os.curdir)  # as given: not link/.. collapsed


def write_json_durably(path: str, value: Any) -> None:
    """``value`` as indented JSON with sorted keys, through :func:`write_file_durably`."""
    write_file_durably(path, json.dumps(value, indent=1, sort_keys=True).encode("utf-8"))
