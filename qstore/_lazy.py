"""numpy, imported the first time something uses it.

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


np: Any = _LazyModule("numpy")
