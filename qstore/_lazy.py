"""Modules imported the first time something uses them: numpy, and what
the command line loads for some commands only.

Only the bulk paths use numpy (compaction and its frame check, the check,
the backfill's record and key encoders); a process that embeds a store for
single operations, or only talks to a server (``qstore.connect``), never
needs it. Importing it costs about 50 ms and 20 MB of memory, and starts
OpenBLAS's thread pool, in every such process (a web worker that pushes, a
command-line ``qstore push``). A store's first use is usually a compaction
pass's scan (``Compactor._scan_live``), which runs outside the writer lock,
so the one-time import does not hold up pushes. Modules that use numpy
write::

    if TYPE_CHECKING:
        import numpy as np
    else:
        from .._lazy import np

and use ``np`` as usual inside functions; nothing may touch it at import.

The command line (``qstore/cli.py``, ``qstore/_cli_target.py``) loads the
server (asyncio, Prometheus), the embedded store (RocksDB, the core), the
check and the demo the same way, through :func:`lazy`: a ``qstore push`` or
``qstore pop`` through a running server needs none of them, and importing
them doubled the command's start-up (about 0.2 s against 0.1 s). Each such
module is also imported under ``TYPE_CHECKING``, so the type checker and the
layer test (tests/test_layers.py) see the import as a module-level one.

A Ctrl-C must not land inside such an import: numpy's C extension cannot
be loaded twice in one process, so a ``KeyboardInterrupt`` raised halfway
through its first import left numpy unusable until the process ended (every
later compaction or check failed with "cannot load module more than once per
process"; an interrupt audit). The first import therefore holds back SIGINT,
when the main thread runs it, and delivers it to the old handler once the
import is done (:func:`_signals_held`).
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import sys
import threading
import types
from collections.abc import Iterator
from types import FrameType
from typing import Any


class _LazyModule(types.ModuleType):
    """Stands for a module until an attribute is read, then imports it and copies its
    names, so that every later read is a plain attribute lookup."""

    def __getattr__(self, name: str) -> Any:  # only for names not copied yet
        # Through import_module even when sys.modules has it: one another thread is
        # still importing is there already, half done, and import_module waits
        # for it (a review). Only a first import holds back SIGINT.
        first = self.__name__ not in sys.modules
        with _signals_held() if first else contextlib.nullcontext():
            module = importlib.import_module(self.__name__)
        self.__dict__.update(module.__dict__)
        return getattr(module, name)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold back SIGINT for the body, then give it to the handler it was meant for.

    Only the main thread runs Python signal handlers, and only it may set
    them: elsewhere the body runs as it is (no ``KeyboardInterrupt`` is raised
    in other threads). A handler that is not a Python callable (ignored, or
    the default) is left alone.
    """
    old = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(old):
        yield
        return
    caught: list[FrameType | None] = []
    signal.signal(signal.SIGINT, lambda _signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if caught:
            old(signal.SIGINT, caught[0])  # default_int_handler: KeyboardInterrupt now


def lazy(name: str) -> Any:
    """A stand-in for module ``name`` that imports it when an attribute is first read."""
    return _LazyModule(name)


np: Any = lazy("numpy")
