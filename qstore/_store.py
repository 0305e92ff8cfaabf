"""The store facade: one directory holding RocksDB metadata (meta/) and payload segments (payload/).

:class:`Store` validates arguments and delegates: the core (``_core.py``)
owns the writer lock, the commit path, ids and per-queue state; the
compactor (``_compact.py``) and the sweeper thread run beside it. Every
change is one WriteBatch, written after the payload bytes it refers to.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ._check import run_check
from ._check_report import CheckReport
from ._compact import CompactionResult, Compactor
from ._config import Config
from ._core import Core
from ._errors import InvalidArgument, QueueExists, QueueNotFound
from ._message import SegmentStats, StoreStats
from ._queue import Queue
from ._snapshot import take_snapshot

log = logging.getLogger("qstore")

MAX_QUEUE_NAME_BYTES = 255


class Store:
    """An open qstore directory. Use :func:`qstore.open`."""

    def __init__(self, path: str, config: Config) -> None:
        self.path = path
        self.config = config
        self.readonly = config.readonly
        self._core = core = Core(path, config)
        self._compactor: Compactor | None = None
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        if self.readonly:
            return
        try:
            self._compactor = Compactor(core)
            self._compactor.recover()
        except BaseException:
            core.close()
            raise
        self._sweeper = threading.Thread(target=self._sweep_loop, name="qstore-sweeper",
                                         daemon=True)
        self._sweeper.start()
        if config.compactor:
            self._compactor.start()

    @property
    def core(self) -> Core:
        """The layer under this facade, for qstore's own jobs (Spark ingest); not public API."""
        return self._core

    # -- queues ---------------------------------------------------------------

    def create_queue(
        self,
        name: str,
        *,
        order: str = "max",
        priority_type: str = "int",
        max_attempts: int = 5,
        dedup: bool = False,
        exist_ok: bool = False,
    ) -> Queue:
        _check_queue_name(name)
        if order not in ("max", "min", "fifo"):
            raise InvalidArgument(f"order must be 'max', 'min' or 'fifo', not {order!r}")
        if priority_type not in ("int", "str"):
            raise InvalidArgument(f"priority_type must be 'int' or 'str', not {priority_type!r}")
        if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
            raise InvalidArgument(f"max_attempts must be an int >= 1, not {max_attempts!r}")
        if not isinstance(dedup, bool):
            raise InvalidArgument("dedup must be a bool")
        core = self._core
        with core.writing:
            existing = core.queues.get(name)
            if existing is None:
                return Queue(core, core.add_queue(name, order, priority_type, max_attempts,
                                                  dedup))
            if not exist_ok:
                raise QueueExists(name)
            want = (order, priority_type, max_attempts, dedup)
            have = (existing.rec.order, existing.rec.priority_type,
                    existing.rec.max_attempts, existing.rec.dedup)
            if want != have:
                raise InvalidArgument(
                    f"queue {name!r} exists with order, priority_type, max_attempts, "
                    f"dedup = {have}, not {want}"
                )
            return Queue(core, existing)

    def queue(self, name: str) -> Queue:
        self._core.check_open()
        state = self._core.queues.get(name)
        if state is None:
            raise QueueNotFound(name)
        return Queue(self._core, state)

    def queues(self) -> list[str]:
        self._core.check_open()
        return sorted(self._core.queues)

    def delete_queue(self, name: str) -> None:
        """Delete a queue with every message in it, in one batch."""
        core = self._core
        with core.writing:
            state = core.queues.get(name)
            if state is None:
                raise QueueNotFound(name)
            core.drop_queue(state)

    # -- maintenance ----------------------------------------------------------

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.config.sweep_interval):
            try:
                self._core.promote_due()
            except Exception:
                log.exception("lease/delay sweep failed; it will be retried")

    def compact(self, **options: Any) -> CompactionResult:
        """Run one seal-then-compact pass now (see docs/compaction.md)."""
        self._core.check_writable()
        assert self._compactor is not None
        return self._compactor.run_pass(**options)

    def snapshot(self, dest: str) -> str:
        """A consistent, self-contained copy of the store at ``dest`` (see docs/spark.md)."""
        self._core.check_open()
        return take_snapshot(self._core, dest)

    def stats(self) -> StoreStats:
        core = self._core
        core.check_open()
        with core.lock:
            queues = tuple(Queue(core, q).stats() for q in
                           sorted(core.queues.values(), key=lambda s: s.name))
            payload = core.payload
            active = payload.active_id
            segs = []
            for fid in payload.file_ids():
                live = core.segments.get(fid, [0, 0, 0])
                size = payload.segment_size(fid) if fid == active or not self.readonly \
                    else os.path.getsize(payload.path_of(fid))
                segs.append(SegmentStats(fid, size, live[0], live[1], fid == active))
        return StoreStats(queues, tuple(segs))

    def close(self) -> None:
        """Stop background work, make everything durable, and release the lock."""
        core = self._core
        with core.lock:
            if core.closed:
                return
            core.closed = True
            core.ready.notify_all()
        self._stop.set()
        if self._compactor is not None:
            self._compactor.stop()
        if self._sweeper is not None:
            self._sweeper.join()
        core.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "readonly" if self.readonly else self.config.durability
        state = "closed" if self._core.closed else "open"
        return f"<qstore.Store {self.path!r} {mode} {state}>"

    def check(self) -> CheckReport:
        """Check the whole store's integrity (docs/check.md); returns a :class:`CheckReport`.

        Holds the writer lock for the whole check, so nothing changes meanwhile:
        every push, pop and ack of this store waits until it returns (about 15 s
        per million small messages). Reads every message record and payload.
        """
        core = self._core
        core.check_open()
        with core.lock:
            return run_check(core.meta, os.path.join(self.path, "payload"),
                             active_id=core.payload.active_id)


def _check_queue_name(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"queue name must be a non-empty str, not {name!r}")
    if len(name.encode("utf-8")) > MAX_QUEUE_NAME_BYTES:
        raise InvalidArgument(f"queue name is over {MAX_QUEUE_NAME_BYTES} UTF-8 bytes")


def open_store(path: str | os.PathLike[str], **options: Any) -> Store:
    """Open (creating if needed) the store in directory ``path``.

    Options are those of :class:`qstore.Config`; an unknown one is an error.
    """
    config = Config.from_options(options)
    return Store(os.fspath(path), config)
