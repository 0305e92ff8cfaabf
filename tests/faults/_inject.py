"""A fault-injecting layer under the file calls the store makes (``qstore._fs.calls``).

In the style of SQLite's I/O-error tests: :class:`FaultyCalls` counts the
calls of the chosen names and fails the Nth one with an ``OSError`` (ENOSPC
unless told), once or persistently (every call from the Nth on), until
:meth:`FaultyCalls.heal`. Used where a real fault cannot be made on demand;
the disk-full tests fill a real tmpfs instead.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

import pytest

from qstore._fs import calls

NAMES = ("open_fd", "write", "pread", "pwritev", "pwrite", "fsync", "fdatasync", "ftruncate",
         "fallocate", "truncate", "replace", "unlink", "link", "mmap", "mmap_write")


class FaultyCalls:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...] = NAMES,
                 err: int = errno.ENOSPC,
                 only: Callable[[str, tuple[Any, ...]], bool] | None = None) -> None:
        self.count = 0
        self.fail_at: int | None = None
        self.persistent = False
        self.failed: list[str] = []
        self._err = err
        self._only = only
        for name in names:
            monkeypatch.setattr(calls, name, self._wrap(name, getattr(calls, name)))

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._only is None or self._only(name, args):
                self.count += 1
                n = self.fail_at
                if n is not None and (self.count == n or (self.persistent and self.count > n)):
                    self.failed.append(name)
                    # As the OS does, a call on a path names it.
                    path = args[0] if args and isinstance(args[0], str) else None
                    raise OSError(self._err, os.strerror(self._err) + " (injected)", path)
            return real(*args, **kwargs)

        return call

    def arm(self, n: int, *, persistent: bool = False) -> None:
        """Fail the ``n``-th call from now (and every later one if ``persistent``)."""
        self.count = 0
        self.fail_at = n
        self.persistent = persistent
        self.failed = []

    def heal(self) -> None:
        self.fail_at = None

    def counting(self) -> None:
        """Count calls from now without failing any."""
        self.count = 0
        self.fail_at = None


def creates(name: str, args: tuple[Any, ...]) -> bool:
    """Only opens that create a file (a new segment, a temporary file)."""
    return name == "open_fd" and len(args) > 1 and bool(args[1] & os.O_CREAT)
