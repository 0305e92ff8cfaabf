"""The systems under test, each behind one small adapter with the same interface.

An adapter offers ``push(body, priority)``, ``pop() -> handle | None``,
``ack(handle)`` and the batch forms. Peers without a batch API get the loop
from :class:`Peer` (``native_batches`` says which). Adapters that are not
thread-safe on their own take a lock in threaded workloads, as a user would.

Peers other than qstore and the bare queue are benchmark extras
(``pip install qstore[bench]``): they are imported only when an adapter is
built, so a missing one is reported as "not installed" instead of failing.
What each peer guarantees (durability, priorities, acks) is in
docs/benchmarks.md; the ``guarantees`` line of each spec is its summary.
"""

from __future__ import annotations

import abc
import contextlib
import importlib.metadata
import importlib.util
import itertools
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qstore._config import Durability

Handle = Any  # whatever pop returns and ack takes: opaque to the workloads
Item = tuple[bytes, int]  # (payload, priority 0..9; higher pops first where supported)


class Peer(abc.ABC):
    """One open queue of one system, in a fresh directory."""

    native_batches = False
    ack_note = ""  # shown next to pop figures when the peer's pop is not a lease

    @abc.abstractmethod
    def push(self, body: bytes, priority: int) -> None: ...

    @abc.abstractmethod
    def pop(self) -> Handle | None: ...

    @abc.abstractmethod
    def ack(self, handle: Handle) -> None: ...

    def push_many(self, items: Sequence[Item]) -> None:
        for body, priority in items:
            self.push(body, priority)

    def pop_many(self, n: int) -> list[Handle]:
        out = []
        for _ in range(n):
            handle = self.pop()
            if handle is None:
                break
            out.append(handle)
        return out

    def ack_many(self, handles: Sequence[Handle]) -> None:
        for handle in handles:
            self.ack(handle)

    def fill(self, items: Sequence[Item]) -> None:
        """Build a backlog (untimed) by the peer's fastest path; durability may be relaxed."""
        for start in range(0, len(items), 1000):
            self.push_many(items[start : start + 1000])

    @abc.abstractmethod
    def close(self) -> None: ...


# -- qstore ---------------------------------------------------------------------


class QstorePeer(Peer):
    native_batches = True

    def __init__(self, path: str, durability: Durability) -> None:
        import qstore

        self.store = qstore.open(path, durability=durability, compactor=False)
        self.queue = self.store.create_queue("bench", order="max")

    def push(self, body: bytes, priority: int) -> None:
        self.queue.push(body, priority)

    def pop(self) -> Handle | None:
        return self.queue.pop(lease=3600.0)

    def ack(self, handle: Handle) -> None:
        self.queue.ack(handle)

    def push_many(self, items: Sequence[Item]) -> None:
        self.queue.push_many(items)

    def pop_many(self, n: int) -> list[Handle]:
        return list(self.queue.pop_many(n, lease=3600.0))

    def ack_many(self, handles: Sequence[Handle]) -> None:
        self.queue.ack_many(handles)

    def close(self) -> None:
        self.store.close()


# -- the bare queue on rocksdict ------------------------------------------------

_READY = b"r"
_READY_END = b"s"
_FLIGHT = b"f"
_KEY = struct.Struct(">BQ")  # complemented priority (max first), then a sequence number


class BareQueue(Peer):
    """The least a priority queue on rocksdict must do; the payload lives in the value.

    push: one put of ``r prio seq -> payload``. pop: a fresh iterator bounded
    by ``set_iterate_upper_bound``, a seek to the head, then one WriteBatch
    moving the entry to ``f prio seq``. ack: one delete. Pops seek from one
    queue-wide head cursor (the lowest key that may still be ready) rather
    than the prefix, or every pop would wade through the tombstones of all
    earlier pops; one cursor is enough here because nothing is ever given
    back (qstore, whose nacks and expired leases put messages back, keeps a
    head per priority level: docs/meta-schema.md). No leases, counters, ids
    or payload checksums.
    """

    native_batches = True

    def __init__(self, path: str, sync: bool) -> None:
        from rocksdict import Options, Rdict, ReadOptions, WriteBatch, WriteOptions

        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        self._db = Rdict(path, opts)
        self._read_options = ReadOptions
        self._batch = WriteBatch
        self._wo = WriteOptions()
        self._wo.sync = sync
        self._fast = WriteOptions()
        self._seq = itertools.count()
        self._head = _READY
        self._lock = threading.Lock()  # pops must not both take the head

    def _key(self, priority: int) -> bytes:
        return _READY + _KEY.pack(255 - priority, next(self._seq))

    def push(self, body: bytes, priority: int) -> None:
        key = self._key(priority)
        with self._lock:
            self._db.put(key, body, self._wo)
            if key < self._head:
                self._head = key

    def push_many(self, items: Sequence[Item], sync: bool = True) -> None:
        batch = self._batch(raw_mode=True)
        low = None
        for body, priority in items:
            key = self._key(priority)
            batch.put(key, body)
            if low is None or key < low:
                low = key
        with self._lock:
            self._db.write(batch, self._wo if sync else self._fast)
            if low is not None and low < self._head:
                self._head = low

    def pop(self) -> Handle | None:
        with self._lock:
            ro = self._read_options()
            ro.set_iterate_upper_bound(_READY_END)
            it = self._db.iter(ro)
            it.seek(self._head)
            if not it.valid():
                del it
                return None
            key = it.key()
            body = it.value()
            del it
            flight = _FLIGHT + key[1:]
            batch = self._batch(raw_mode=True)
            batch.delete(key)
            batch.put(flight, body)
            self._db.write(batch, self._wo)
            self._head = key
            return flight

    def pop_many(self, n: int) -> list[Handle]:
        with self._lock:
            ro = self._read_options()
            ro.set_iterate_upper_bound(_READY_END)
            it = self._db.iter(ro)
            it.seek(self._head)
            batch = self._batch(raw_mode=True)
            out: list[Handle] = []
            key = b""
            while len(out) < n and it.valid():
                key = it.key()
                flight = _FLIGHT + key[1:]
                batch.delete(key)
                batch.put(flight, it.value())
                out.append(flight)
                it.next()
            del it
            if out:
                self._db.write(batch, self._wo)
                self._head = key
            return out

    def ack(self, handle: Handle) -> None:
        self._db.delete(handle, self._wo)

    def ack_many(self, handles: Sequence[Handle]) -> None:
        batch = self._batch(raw_mode=True)
        for handle in handles:
            batch.delete(handle)
        self._db.write(batch, self._wo)

    def fill(self, items: Sequence[Item]) -> None:
        for start in range(0, len(items), 1000):
            self.push_many(items[start : start + 1000], sync=False)

    def close(self) -> None:
        self._db.close()


# -- persist-queue --------------------------------------------------------------


@contextlib.contextmanager
def _sqlite_unsynced(conn: Any) -> Iterator[None]:
    """Build a backlog without a sync per insert, then restore the peer's setting."""
    old = conn.execute("PRAGMA synchronous").fetchone()[0]
    conn.execute("PRAGMA synchronous=OFF")
    try:
        yield
    finally:
        conn.execute(f"PRAGMA synchronous={int(old)}")


class PersistAckPeer(Peer):
    """persist-queue's ``SQLiteAckQueue``: FIFO, get/ack, a SQLite commit per call.

    ``auto_commit`` stays True (the ack queue refuses False); ``multithreading``
    is True only in threaded workloads (a second connection for puts). Acked
    rows stay in the table until ``clear_acked_data``; the adapter never calls it.
    """

    def __init__(self, path: str, threaded: bool) -> None:
        import persistqueue

        self._empty = persistqueue.Empty
        self._q: Any = persistqueue.SQLiteAckQueue(path, multithreading=threaded, auto_commit=True)

    def push(self, body: bytes, priority: int) -> None:
        self._q.put(body)

    def pop(self) -> Handle | None:
        try:
            got = self._q.get(block=False, raw=True)
        except self._empty:
            return None
        return got["pqid"]

    def ack(self, handle: Handle) -> None:
        self._q.ack(id=handle)

    def fill(self, items: Sequence[Item]) -> None:
        with _sqlite_unsynced(self._q._putter):
            for body, _ in items:
                self._q.put(body)

    def close(self) -> None:
        self._q.close()


class PersistPriorityPeer(Peer):
    """persist-queue's ``PriorityQueue``: priorities, but no acks (get deletes the row)."""

    ack_note = "no ack: get deletes"

    def __init__(self, path: str, threaded: bool) -> None:
        import persistqueue

        self._empty = persistqueue.Empty
        self._q: Any = persistqueue.PriorityQueue(path, multithreading=threaded, auto_commit=True)

    def push(self, body: bytes, priority: int) -> None:
        self._q.put(body, priority=9 - priority)  # it pops the lowest number first

    def pop(self) -> Handle | None:
        try:
            self._q.get(block=False)
        except self._empty:
            return None
        return True

    def ack(self, handle: Handle) -> None:
        """Nothing to do: the get already deleted the message."""

    def fill(self, items: Sequence[Item]) -> None:
        with _sqlite_unsynced(self._q._putter):
            for body, priority in items:
                self.push(body, priority)

    def close(self) -> None:
        self._q.close()


# -- litequeue ------------------------------------------------------------------


class LiteQueuePeer(Peer):
    """litequeue's ``LiteQueue``: FIFO, pop/done, SQLite WAL with synchronous=NORMAL."""

    def __init__(self, path: str, threaded: bool) -> None:
        import litequeue

        os.makedirs(path, exist_ok=True)
        self._q: Any = litequeue.LiteQueue(os.path.join(path, "queue.db"))
        # One connection shared by all threads: a pop's transaction must not interleave.
        self._lock: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if threaded else contextlib.nullcontext()
        )

    def push(self, body: bytes, priority: int) -> None:
        with self._lock:
            self._q.put(body)

    def pop(self) -> Handle | None:
        with self._lock:
            message = self._q.pop()
        return None if message is None else message.message_id

    def ack(self, handle: Handle) -> None:
        with self._lock:
            self._q.done(handle)

    def fill(self, items: Sequence[Item]) -> None:
        with self._lock, self._q.transaction():
            for body, _ in items:
                self._q.put(body)

    def close(self) -> None:
        self._q.close()


# -- the registry ---------------------------------------------------------------


@dataclass(frozen=True)
class PeerSpec:
    """One row of the comparison: a system in one durability setting."""

    name: str  # e.g. "qstore/interval", "bare-sync"
    system: str
    durability: str  # "none", "interval" or "always": the class it is compared in
    compare_to: str  # the qstore row its ratio is taken against
    guarantees: str
    distribution: str | None  # the PyPI distribution to import lazily (None: always present)
    module: str | None
    make: Callable[[str, bool], Peer]  # (fresh directory, threaded) -> open peer

    def missing(self) -> str | None:
        """Why this peer cannot run here, or None."""
        if self.module is not None and importlib.util.find_spec(self.module) is None:
            return "not installed"
        return None

    def version(self) -> str | None:
        dist = self.distribution or "rocksdict"
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None


def _qstore(durability: Durability) -> Callable[[str, bool], Peer]:
    return lambda path, threaded: QstorePeer(path, durability)


PEERS: tuple[PeerSpec, ...] = (
    PeerSpec("qstore/none", "qstore", "none", "qstore/interval",
             "priorities, leases, acks; OS decides when bytes reach disk",
             None, None, _qstore("none")),
    PeerSpec("qstore/interval", "qstore", "interval", "qstore/interval",
             "priorities, leases, acks; payload+WAL synced every 50 ms",
             None, None, _qstore("interval")),
    PeerSpec("qstore/always", "qstore", "always", "qstore/interval",
             "priorities, leases, acks; synced before returning (group commit)",
             None, None, _qstore("always")),
    PeerSpec("bare", "bare rocksdict", "none", "qstore/interval",
             "priorities, in-flight set, no leases; RocksDB WAL written, not synced",
             None, None, lambda path, threaded: BareQueue(path, sync=False)),
    PeerSpec("bare-sync", "bare rocksdict", "always", "qstore/always",
             "as bare, every write with WriteOptions.sync=True",
             None, None, lambda path, threaded: BareQueue(path, sync=True)),
    PeerSpec("persist-ack", "persist-queue SQLiteAckQueue", "always", "qstore/always",
             "FIFO (no priorities), get/ack; SQLite WAL, synchronous=FULL: a sync per commit",
             "persist-queue", "persistqueue", PersistAckPeer),
    PeerSpec("persist-prio", "persist-queue PriorityQueue", "always", "qstore/always",
             "priorities, NO acks (get deletes); SQLite WAL, synchronous=FULL",
             "persist-queue", "persistqueue", PersistPriorityPeer),
    PeerSpec("litequeue", "litequeue", "none", "qstore/interval",
             "FIFO (no priorities), pop/done; SQLite WAL, synchronous=NORMAL: no sync per commit",
             "litequeue", "litequeue", LiteQueuePeer),
)

BY_NAME = {spec.name: spec for spec in PEERS}
