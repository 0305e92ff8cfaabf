"""File-system helpers with the durability rules in one place.

- :func:`write_at` writes buffers back to back at an offset, all of them: a
  ``pwritev`` per ``IOV_MAX`` buffers, and a short write (signals, huge
  batches) is finished rather than lost.
- :func:`fsync_file` and :func:`fsync_dir` make a file's data, or a
  directory's entries (a create, rename or unlink), durable.
- :func:`write_file_durably` (and :func:`write_json_durably`) replaces a
  small file atomically: write a temporary file, fsync it, rename it over the
  old one, fsync the directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

# pwritev() fails with EINVAL when given more buffers than this (1024 on Linux),
# so a longer list is written in several calls.
IOV_MAX = 1024

Buffer = bytes | memoryview


def write_at(fd: int, parts: Sequence[Buffer], at: int) -> int:
    """Write ``parts`` back to back starting at offset ``at``; returns the bytes written."""
    done = 0
    for i in range(0, len(parts), IOV_MAX):
        chunk = parts[i : i + IOV_MAX]
        size = sum(len(part) for part in chunk)
        written = os.pwritev(fd, chunk, at + done)
        if written < size:
            complete_write(fd, chunk, at + done, written)
        done += size
    return done


def complete_write(fd: int, parts: Sequence[Buffer], at: int, written: int) -> None:
    """Finish a ``pwritev(fd, parts, at)`` that wrote only ``written`` bytes."""
    rest = memoryview(b"".join(parts))[written:]
    pos = at + written
    while rest:
        n = os.pwrite(fd, rest, pos)
        rest = rest[n:]
        pos += n


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: str, data: bytes) -> None:
    """Write temp, fsync, rename, fsync the directory."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json_durably(path: str, value: Any) -> None:
    """``value`` as indented JSON with sorted keys, through :func:`write_file_durably`."""
    write_file_durably(path, json.dumps(value, indent=1, sort_keys=True).encode("utf-8"))
