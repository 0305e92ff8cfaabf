"""A file of allocated space the store gives back to the disk when the disk is full.

RocksDB writes on every read-write open (a new MANIFEST, an OPTIONS file, its
info LOG, and a table file holding whatever its write-ahead log replays), and
reopening it after a failed write does the same. On a disk with no space left
a store could then not even be opened to ack messages and compact, which is
how space comes back. So a store opened read-write keeps ``reserve`` in its
directory: :data:`RESERVE_BYTES` of real blocks (``posix_fallocate``). When
the disk has less free space than RocksDB needs (:func:`meta.space_to_open`),
the core deletes the reserve first (:meth:`SpaceReserve.release`); it is
made again (:meth:`SpaceReserve.restore`) at the next open, reopen or
compaction pass that finds at least twice its size free.
"""

from __future__ import annotations

import contextlib
import logging
import os

from ._fs import calls, fsync_dir

log = logging.getLogger("qstore")

RESERVE_NAME = "reserve"
RESERVE_BYTES = 1024 * 1024


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still allocate on the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class SpaceReserve:
    """The reserve file of one store directory."""

    def __init__(self, store_path: str, size: int = RESERVE_BYTES) -> None:
        self.directory = store_path
        self.path = os.path.join(store_path, RESERVE_NAME)
        self.size = size

    def held(self) -> int:
        """Bytes the reserve holds now (0 when it is released)."""
        return _blocks(self.path)

    def release(self, why: str) -> int:
        """Delete the reserve, and a half-made one a process killed while making it
        left (``reserve.tmp``); returns the bytes given back (0 if there was none).
        That one held 1 MiB no release gave back: on the next full disk the store
        could not open (a crash-point audit)."""
        given = 0
        for path in (self.path + ".tmp", self.path):
            held = _blocks(path)
            if not held:
                continue
            try:
                calls.unlink(path)
            except OSError as exc:
                log.error("cannot release the space reserve %s: %s", path, exc)
                continue
            given += held
        if given:
            log.warning("disk nearly full (%s): released the %d-byte space reserve %s; ack, "
                        "delete or compact to free space", why, given, self.path)
        return given

    def restore(self) -> bool:
        """Make the reserve whole again if the disk has room for it twice; True if it is."""
        tmp = self.path + ".tmp"
        if self.held() >= self.size:
            if os.path.exists(tmp):  # left by a process killed making it (see release)
                with contextlib.suppress(OSError):
                    calls.unlink(tmp)
            return True
        if free_bytes(self.directory) < 2 * self.size:
            return False
        try:
            fd = calls.open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                calls.fallocate(fd, 0, self.size)
            finally:
                calls.close_fd(fd)
            calls.replace(tmp, self.path)
            fsync_dir(self.directory)
        except OSError as exc:
            # Only a saving for later: a filesystem without fallocate, a race
            # for the last free blocks. The store works without it.
            log.warning("cannot make the space reserve %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                calls.unlink(tmp)
            return False
        return True


def _blocks(path: str) -> int:
    """Bytes of disk the file at ``path`` holds (0 if there is none)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0
