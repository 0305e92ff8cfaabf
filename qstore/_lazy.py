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
"""

from __future__ import annotations

import importlib
import types
from typing import Any


class _LazyModule(types.ModuleType):
    """Stands for a module until an attribute is read, then imports it and copies its
    names, so that every later read is a plain attribute lookup."""

    def __getattr__(self, name: str) -> Any:  # only for names not copied yet
        module = importlib.import_module(self.__name__)
        self.__dict__.update(module.__dict__)
        return getattr(module, name)


def lazy(name: str) -> Any:
    """A stand-in for module ``name`` that imports it when an attribute is first read."""
    return _LazyModule(name)


np: Any = lazy("numpy")
