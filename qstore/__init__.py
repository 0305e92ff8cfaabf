"""qstore: a durable, embedded priority work queue.

Architecture, in one page:

- ``qstore.open(path)`` opens a :class:`Store`: a directory with ``meta/``, a
  RocksDB database (through rocksdict) holding queues, messages, priority
  indexes, leases and counters (``qstore.meta``), and ``payload/``, append-only
  CRC-checked segment files holding message bodies, read through mmap
  (``qstore.payload``). A message refers to its body by
  ``(file_id, offset, length)``.
- Every operation is one RocksDB WriteBatch, written after the payload bytes it
  refers to. Durability modes decide when both reach stable storage.
- A :class:`Queue` pops in plain key order of its ready index; leases,
  delays, dead letters and dedup are further indexes (docs/meta-schema.md).
- A background compactor runs seal-then-compact passes (docs/compaction.md);
  ``store.snapshot`` takes consistent snapshots that the Spark data source
  ``qstore`` reads for the audit and backfill jobs (docs/spark.md).
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from ._check_report import CheckReport, Finding
from ._client import Client, RemoteQueue, connect
from ._config import Config
from ._errors import (
    Corruption,
    InvalidArgument,
    LeaseExpired,
    MessageNotFound,
    PayloadTooLarge,
    QStoreError,
    QueueExists,
    QueueNotFound,
    ReadOnlyStore,
    StorageError,
    StoreClosed,
    StoreLocked,
)
from ._message import CompactionResult, Message, QueueStats, SegmentStats, StoreStats
from ._net_errors import AuthenticationFailed, ConnectionLost, ProtocolError, ServerBusy

__version__ = "0.1.0"

if _TYPE_CHECKING:
    from . import aio
    from ._queue import Queue
    from ._store import Store
    from ._store import open_store as open

_EMBEDDED = ("Queue", "Store", "open")  # the embedded store's names, loaded on first use


def __getattr__(name: str) -> _Any:
    """What only some processes need, imported on first use: the embedded store
    (``open``, ``Store``, ``Queue``: RocksDB and the core) and ``qstore.aio``
    (asyncio, about 25 ms). A process that only talks to a server
    (``qstore.connect``) loads neither, nor numpy (see _lazy.py)."""
    if name == "aio":
        import qstore.aio

        return qstore.aio
    if name in _EMBEDDED:
        from ._queue import Queue
        from ._store import Store, open_store

        found = {"open": open_store, "Store": Store, "Queue": Queue}
        globals().update(found)  # later reads are plain attribute reads
        return found[name]
    raise AttributeError(f"module 'qstore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "aio", *_EMBEDDED})


__all__ = [
    "AuthenticationFailed",
    "CheckReport",
    "Client",
    "CompactionResult",
    "Config",
    "ConnectionLost",
    "Corruption",
    "Finding",
    "InvalidArgument",
    "LeaseExpired",
    "Message",
    "MessageNotFound",
    "PayloadTooLarge",
    "ProtocolError",
    "QStoreError",
    "Queue",
    "QueueExists",
    "QueueNotFound",
    "QueueStats",
    "ReadOnlyStore",
    "RemoteQueue",
    "SegmentStats",
    "ServerBusy",
    "StorageError",
    "Store",
    "StoreClosed",
    "StoreLocked",
    "StoreStats",
    "__version__",
    "aio",
    "connect",
    "open",
]
