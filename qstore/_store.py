"""The store facade: one directory holding RocksDB metadata (meta/) and payload segments (payload/).

:class:`Store` validates arguments and delegates: the core (``_core.py``)
owns the writer lock, the commit path, ids and per-queue state; the
compactor (``_compact.py``) and the sweeper thread run beside it. Every
change is one WriteBatch, written after the payload bytes it refers to.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable
from typing import Any, Unpack

from . import _timers as timers
from ._address import checked_path
from ._check import run_check
from ._check_report import CheckReport
from ._compact import Compactor
from ._config import Config
from ._core import Core
from ._errors import InvalidArgument, QueueExists, QueueNotFound, StorageError
from ._fs import absolute
from ._message import CompactionResult, SegmentStats, StoreStats
from ._options import QueueOptions, StoreOptions
from ._queue import MAX_SECONDS, Queue
from ._repair import repair as run_repair
from ._retry_log import RetryLog
from ._snapshot import take_snapshot
from ._txn import QueueState
from .meta import keys, records

log = logging.getLogger("qstore")

MAX_QUEUE_NAME_BYTES = 255
# Largest max_attempts, aging_cap and rate n: they are stored as msgpack ints (u32
# is far more than any queue needs; a bigger int could not be encoded at all).
MAX_COUNT = 2**32 - 1


class Store:
    """An open qstore directory. Use :func:`qstore.open`."""

    def __init__(self, path: str, config: Config) -> None:
        self.path = path
        self.config = config
        self.readonly = config.readonly
        if not path:
            raise InvalidArgument("the store path must not be empty")
        try:
            self._core = core = Core(path, config)
        except OSError as exc:
            # A file where the store directory should be, an unreadable segment,
            # a full disk...: a QStoreError with the errno kept (docs/faults.md).
            err = StorageError(f"cannot open the store at {path!r}: {exc}")
            err.errno = exc.errno
            raise err from exc
        self._compactor: Compactor | None = None
        self._stop = threading.Event()
        self._closing = threading.RLock()
        self._in_close = False  # a close() runs in the thread holding _closing
        self._closed = False  # every step of close() done
        self._sweeper: threading.Thread | None = None
        if self.readonly:
            return
        try:
            self._compactor = Compactor(core)
            self._compactor.recover()
            self._sweeper = threading.Thread(target=self._sweep_loop, name="qstore-sweeper",
                                             daemon=True)
            self._sweeper.start()
            if config.compactor:
                self._compactor.start()
                core.payload.on_doubt = self._compactor.wake
        except BaseException:
            # Also cut short as a thread started (a review): else those threads ran
            # on, and the core held the store locked for the life of the process.
            self._stop.set()
            try:
                if self._sweeper is not None and self._sweeper.ident is not None:
                    self._sweeper.join()
                if self._compactor is not None:
                    self._compactor.stop()
            finally:
                core.close()
            raise

    @property
    def compactor(self) -> Compactor | None:
        """The store's compactor (None when read-only), for the server's metrics;
        not public API."""
        return self._compactor

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
        ttl: float | None = None,
        on_expire: str | None = None,
        aging: float | None = None,
        aging_cap: int | None = None,
        rate: tuple[int, float] | None = None,
    ) -> Queue:
        """Create queue ``name``; the options after ``exist_ok`` are those of
        :meth:`configure_queue` (``on_expire`` None is "drop").

        With ``exist_ok`` an existing queue is returned if it has the same
        ``order``, ``priority_type``, ``max_attempts`` and ``dedup``, and the
        same value of each of the other options given (not None): those are
        the ones :meth:`configure_queue` changes, so a worker that starts
        with ``create_queue(name, exist_ok=True)`` keeps working after an
        operator changed, say, the TTL. A difference raises
        ``InvalidArgument`` naming each option that differs.
        """
        name = _check_queue_name(name)
        if not isinstance(exist_ok, bool):
            raise InvalidArgument(f"exist_ok must be a bool, not {exist_ok!r:.60}")
        if order not in ("max", "min", "fifo"):
            raise InvalidArgument(f"order must be 'max', 'min' or 'fifo', not {order!r}")
        if priority_type not in ("int", "str"):
            raise InvalidArgument(f"priority_type must be 'int' or 'str', not {priority_type!r}")
        if (not isinstance(max_attempts, int) or isinstance(max_attempts, bool)
                or not 1 <= max_attempts <= MAX_COUNT):
            raise InvalidArgument(f"max_attempts must be an int in [1, {MAX_COUNT}], "
                                  f"not {max_attempts!r:.60}")
        if not isinstance(dedup, bool):
            raise InvalidArgument("dedup must be a bool")
        given = {"ttl": ttl, "on_expire": on_expire, "aging": aging, "aging_cap": aging_cap,
                 "rate": rate}
        options = check_options(order, priority_type,
                                {**given, "on_expire": "drop" if on_expire is None else on_expire})
        core = self._core
        with core.writing:
            existing = core.queues.get(name)
            if existing is None:
                return Queue(core, core.add_queue(name, order, priority_type, max_attempts,
                                                  dedup, **options))
            if not exist_ok:
                raise QueueExists(name)
            r = existing.rec
            want = {"order": order, "priority_type": priority_type,
                    "max_attempts": max_attempts, "dedup": dedup,
                    **{f: options[f] for f in OPTION_NAMES if given[f] is not None}}
            differ = [f for f, v in want.items() if getattr(r, f) != v]
            if differ:
                raise InvalidArgument(
                    f"queue {name!r} exists with "
                    + ", ".join(f"{f}={getattr(r, f)!r}" for f in differ)
                    + ", not " + ", ".join(f"{f}={want[f]!r}" for f in differ))
            return Queue(core, existing)

    def configure_queue(self, name: str, **options: Unpack[QueueOptions]) -> Queue:
        """Change options of queue ``name``; the others keep their values.

        Options (contract section 10): ``ttl`` (seconds, or None: messages
        pushed from now on expire that long after their push unless they give
        their own), ``on_expire`` ("drop" or "dead"), ``aging`` (seconds per
        priority level gained; int-priority "max"/"min" queues), ``aging_cap``
        (most levels gained, or None), ``rate`` ((n, per_seconds) or None).
        They persist with the queue. A TTL already given to a message stays.
        What fell due before the change (an expiry, an aging step) happens
        first, under the options of that time: the outcome never depends on
        when a pass last looked.
        """
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise InvalidArgument(f"unknown queue option(s) {unknown}; known: {OPTION_NAMES}")
        core = self._core
        before = core.queues.get(name) if isinstance(name, str) else None
        if before is not None:
            timers.catch_up(core, before)  # the bulk, letting go of the lock between batches
        with core.writing:
            state = _lookup(core.queues, name)
            now_us = keys.to_us(core.clock())
            if state.next_event_us <= now_us:
                timers.promote_all(core, state, now_us)  # what fell due since
            r = state.rec
            merged = {f: options.get(f, getattr(r, f)) for f in OPTION_NAMES}
            if "aging_cap" not in options and not can_age(r.order, r.priority_type):
                merged["aging_cap"] = None  # set before it was refused here; it never applied
            core.configure_queue(state, check_options(r.order, r.priority_type, merged))
            return Queue(core, state)

    def queue(self, name: str) -> Queue:
        self._core.check_open()
        return Queue(self._core, _lookup(self._core.queues, name))

    def queues(self) -> list[str]:
        self._core.check_open()
        return sorted(self._core.queues)

    def delete_queue(self, name: str) -> None:
        """Delete a queue with every message in it, in one batch."""
        core = self._core
        with core.writing:
            core.drop_queue(_lookup(core.queues, name))

    # -- maintenance ----------------------------------------------------------

    def _sweep_loop(self) -> None:
        interval = self.config.sweep_interval
        retries = RetryLog(log, "lease/delay sweep", interval)
        while not self._stop.wait(interval):
            self._core.space_tick()
            try:
                timers.promote_due(self._core)
                retries.worked()
            except StorageError as exc:  # a full disk, an I/O error: nothing was committed
                retries.failed(exc)
            except Exception:
                log.exception("lease/delay sweep failed; it will be retried")

    def compact(self, *, threshold: float | None = None, max_bytes: int | None = None,
                progress: Callable[[int, int], None] | None = None) -> CompactionResult:
        """Run one seal-then-compact pass now (see docs/compaction.md).

        ``threshold``: the garbage ratio a sealed segment needs to be rewritten
        (default: the store's ``compact_threshold``); ``max_bytes``: the most
        live bytes copied (default ``compact_max_bytes``); ``progress(done,
        total)`` is called with the bytes copied so far.
        """
        if progress is not None and not callable(progress):
            raise InvalidArgument(f"progress must be a callable or None, not {progress!r:.60}")
        self._core.check_writable()
        assert self._compactor is not None
        return self._compactor.run_pass(threshold, max_bytes, progress)

    def snapshot(self, dest: str | os.PathLike[str]) -> str:
        """A consistent, self-contained copy of the store at ``dest`` (see docs/spark.md);
        returns its absolute path, as a client's ``snapshot`` does."""
        self._core.check_open()
        return absolute(take_snapshot(self._core, dest))

    def stats(self) -> StoreStats:
        core = self._core
        core.check_open()
        for q in list(core.queues.values()):
            # The bulk of each queue's passes, letting go of the writer lock between
            # batches (under the lock below, each stats() finds little left).
            timers.catch_up_to_read(core, q)
        # Each queue's counts under the lock on their own, not all of them in one
        # hold: a metrics scrape of 5,000 queues held every writer for up to 200 ms
        # (an observability audit). A queue deleted meanwhile is left out.
        queues = []
        for q in sorted(core.queues.values(), key=lambda s: s.name):
            try:
                queues.append(Queue(core, q).stats())
            except QueueNotFound:
                continue
        with core.lock:
            payload = core.payload
            # A view appends nowhere: the writer's active segment is the one its
            # last sync named (M synced; a clean close writes it too). Views said
            # no segment was active where the server said one was (an audit).
            active = payload.active_id if not core.readonly else core.synced_segment
            segs = []
            for fid in payload.file_ids():
                live = core.segments.get(fid, [0, 0, 0])
                # A view's segments are pinned: their sizes hold even after the
                # writer's compaction deleted a file.
                segs.append(SegmentStats(fid, core.data_size(fid), live[0], live[1],
                                         fid == active))
        return StoreStats(tuple(queues), tuple(segs))

    def close(self) -> None:
        """Stop background work, make everything durable, and release the lock.

        A close cut short (Ctrl-C) is finished by the next ``close()``: it
        marked the store closed first, and a second call returned at once,
        leaving the threads running, the database open and the store locked
        in this process (an interrupt audit). Every step is safe to repeat."""
        core = self._core
        if core.forked_from is not None:
            return  # a forked child's copy: closing it closes nothing of the parent's
        with self._closing:  # a concurrent close waits for this one, then returns
            if self._closed or self._in_close:
                return  # or a close called again inside this one (a signal handler)
            self._in_close = True
            try:
                self._close_steps(core)
            finally:
                self._in_close = False

    def _close_steps(self, core: Core) -> None:
        with core.lock:
            core.closed = True
            core.ready.notify_all()
        self._stop.set()
        if self._compactor is not None:
            self._compactor.stop()
        if self._sweeper is not None:
            self._sweeper.join()
        try:
            core.close()
        except StorageError:
            self._closed = True  # a failure to sync is reported once, not retried
            raise
        self._closed = True

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "readonly" if self.readonly else self.config.durability
        state = "closed" if self._core.closed else "open"
        return f"<qstore.Store {self.path!r} {mode} {state}>"

    def check(self, *, repair: bool = False) -> CheckReport:
        """Check the whole store's integrity (docs/check.md); returns a :class:`CheckReport`.

        Holds the writer lock for the whole check, so nothing changes meanwhile:
        every push, pop and ack of this store waits until it returns (about 15 s
        per million small messages). Reads every message record and payload.

        ``repair=True`` (a read-write store): move messages with damaged
        payloads to the dead letters and rebuild counters, index keys and
        segment records from the message records (``_repair.py``); the report
        is that of a check after the repair, and its ``repairs`` say what was
        done. No payload and no message record is ever deleted.
        """
        if not isinstance(repair, bool):  # a truthy "no" must not start a repair
            raise InvalidArgument(f"repair must be a bool, not {repair!r:.60}")
        core = self._core
        payload_dir = os.path.join(self.path, "payload")
        if repair:
            with core.writing:
                return run_repair(core, payload_dir)
        core.check_open()
        with core.lock:
            core.check_open()  # again: a close() may have run while this waited for the lock
            pinned = core.payload.pinned() if core.readonly else None
            return run_check(core.meta, payload_dir, active_id=core.payload.active_id,
                             pinned=pinned)


OPTION_NAMES = ("ttl", "on_expire", "aging", "aging_cap", "rate")


def _positive_seconds(value: object, what: str) -> float:
    # An int is compared as it is: math.isfinite(10**400) would raise OverflowError.
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value))
            or value <= 0 or value > MAX_SECONDS):
        raise InvalidArgument(f"{what} must be a number of seconds in (0, {MAX_SECONDS}], "
                              f"not {value!r:.60}")
    return float(value)


def can_age(order: str, priority_type: str) -> bool:
    return priority_type == "int" and order != "fifo"


def check_options(order: str, priority_type: str, options: dict[str, Any]) -> dict[str, Any]:
    """The queue options of contract section 10, validated and normalised."""
    ttl, on_expire, aging, cap, rate = (options[f] for f in OPTION_NAMES)
    if ttl is not None:
        ttl = _positive_seconds(ttl, "ttl")
    if on_expire not in records.ON_EXPIRE:
        raise InvalidArgument(f"on_expire must be 'drop' or 'dead', not {on_expire!r}")
    if aging is not None:
        aging = _positive_seconds(aging, "aging")
        if not can_age(order, priority_type):
            raise InvalidArgument("aging needs an int-priority queue of order 'max' or 'min'")
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_COUNT:
            raise InvalidArgument(f"aging_cap must be an int in [1, {MAX_COUNT}] or None, "
                                  f"not {cap!r:.60}")
        if not can_age(order, priority_type):  # it would be kept, and never apply
            raise InvalidArgument("aging_cap needs an int-priority queue of order 'max' or "
                                  "'min', as aging does")
    if rate is not None:
        if not isinstance(rate, (tuple, list)) or len(rate) != 2:
            raise InvalidArgument(f"rate must be a pair (n, per_seconds), not {rate!r}")
        n, per = rate
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_COUNT:
            raise InvalidArgument(f"rate needs n, an int in [1, {MAX_COUNT}], not {n!r:.60}")
        rate = (n, _positive_seconds(per, "rate's per_seconds"))
    return {"ttl": ttl, "on_expire": on_expire, "aging": aging, "aging_cap": cap, "rate": rate}


def _check_name_type(name: object) -> None:
    """Not a name at all (a lookup of it is InvalidArgument, not QueueNotFound)."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"queue name must be a non-empty str, not {name!r}")


def _lookup(queues: dict[str, QueueState], name: object) -> QueueState:
    """The state of queue ``name``; a name no queue can have (not a str, empty, or
    not UTF-8) is InvalidArgument, as it is through a client, and never a
    ``TypeError`` from the lookup (an unhashable one)."""
    if isinstance(name, str):
        state = queues.get(name)
        if state is not None:
            return state
    _check_name_type(name)
    assert isinstance(name, str)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: the clients cannot send it
        raise InvalidArgument(f"queue name {name!r} is not encodable as UTF-8") from None
    raise QueueNotFound(name)


def _check_queue_name(name: object) -> str:
    """``name`` checked, as a plain str: a str subclass (a str Enum's member) was
    kept as given, so stats, messages and ``queues()`` showed ``QName.JOBS`` until
    a reopen, and ``'jobs'`` through a client (an API audit)."""
    _check_name_type(name)
    assert isinstance(name, str)
    if type(name) is not str:
        name = str.__str__(name)
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate such as "\udc80"
        raise InvalidArgument(f"queue name {name!r} is not encodable as UTF-8") from None
    if size > MAX_QUEUE_NAME_BYTES:
        raise InvalidArgument(f"queue name is over {MAX_QUEUE_NAME_BYTES} UTF-8 bytes")
    return name


def open_store(path: str | os.PathLike[str], **options: Unpack[StoreOptions]) -> Store:
    """Open (creating if needed) the store in directory ``path``.

    Options are those of :class:`qstore.Config`; an unknown one is an error.
    """
    path = checked_path(path, "store path")
    config = Config.from_options(dict(options))
    return Store(path, config)
