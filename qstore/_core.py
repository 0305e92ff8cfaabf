"""The core of an open store: the writer lock, the one commit path, ids, per-queue state.

Layers point one way::

    Store, Queue (facade: validation, the public API), _timers (time-driven passes)
      └─> Core (this module): writer lock, commit, opening and recovery, queue registry
            ├─> _hot (a mixin: the hot paths, id allocation, the record cache)
            ├─> _states (the message state machine, as edits to a Txn)
            ├─> _txn (Txn, QueueState), _durability (Syncer)
            └─> meta/ (RocksDB), payload/ (segments)

The compactor, snapshots and the Spark ingest call the core's methods; only
:meth:`Core.commit` writes counters, segment accounting and heads. One
process may open a store read-write (RocksDB's LOCK file enforces it), any
number read-only.
"""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import errno
import logging
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import _states as states
from ._address import SERVER_FILE
from ._config import Config, checked_clock
from ._durability import Syncer
from ._errors import (
    Corruption,
    InvalidArgument,
    QStoreError,
    ReadOnlyStore,
    StorageError,
    StoreClosed,
    StoreLocked,
)
from ._fs import fsync_dir, fsync_file, make_dirs_durably
from ._heads import ReadyHeads
from ._hot import JOURNAL_FLUSH_BYTES, HotPaths
from ._migrate import mark_current_format, migrate_dedup
from ._rate import TokenBucket
from ._reserve import SpaceReserve, free_bytes
from ._retry_log import RetryLog
from ._seg_accounts import load_segments
from ._txn import NO_EVENT_US, QueueState, Txn, apply_counts, plain_push
from ._waits import sleep_time_of, watch
from .meta import (
    MetaDB,
    keys,
    locked_by_another_process,
    new_batch,
    records,
    space_to_open,
    write_sst,
)
from .payload import (
    FRAME_SIZE,
    HEADER_SIZE,
    Located,
    SegmentSet,
    parse_segment_name,
    restore_records,
    segment_name,
    viewing,
)

if TYPE_CHECKING:
    import numpy as np
else:
    from ._lazy import np  # imported on first use (_lazy.py)

log = logging.getLogger("qstore")

_READY, _INFLIGHT = records.READY, records.INFLIGHT
_U64 = keys.U64.pack

# Metadata views a read-only open takes at most while the writer flushes (and
# deletes log files) or compacts (and deletes the segments the previous view
# referred to); each attempt costs about 2 ms.
VIEW_ATTEMPTS = 8

# Store directories open read-write in this process, by (st_dev, st_ino). RocksDB's
# LOCK file stops other processes, but within one process it only compares path
# strings: a symlink, "./" or a relative spelling would open a second writer.
_writers: set[tuple[int, int]] = set()
_writers_lock = threading.Lock()


def _claim_writer(path: str, claimed: list[tuple[int, int]]) -> tuple[int, int]:
    """Note ``path`` as open read-write in this process (StoreLocked if it is).

    The claim goes into ``claimed`` at once after ``_writers`` (two C calls: no
    signal is raised between them), so that a caller cut short as this returns
    knows what to release: an interrupt there kept the claim, and every later
    open in the process said StoreLocked (a review)."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino)
    with _writers_lock:
        if key in _writers:
            raise StoreLocked(path)
        _writers.add(key)
        claimed.append(key)
    return key


def writer_running(path: str) -> bool:
    """Whether a process (this one or another) has the store at ``path`` open read-write."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    with _writers_lock:
        if (st.st_dev, st.st_ino) in _writers:
            return True
    return locked_by_another_process(os.path.join(path, "meta"))


def _owner_if_not_root(path: str) -> tuple[int, int] | None:
    """(uid, gid) of the store directory when root opens another user's store
    read-write, else None.

    The files such a session creates (segments, tables, the log) are root's,
    and the store's owner could then open it no more ("Permission denied" on a
    new segment; under umask 077 not even read-only): a cron job or an admin
    run as root locked the owner out (a non-root audit). Not refused (a
    container runs as root on a volume another uid owns); the files go to
    the store's owner when the session closes (:func:`_hand_over`).
    """
    if os.geteuid() != 0:
        return None
    st = os.stat(path)
    if st.st_uid == 0:
        return None
    log.warning("opening the store %s of user %d as root: the files this session creates "
                "are handed to that user when it closes (a session killed before leaves "
                "them root's: chown -R them)", path, st.st_uid)
    return st.st_uid, st.st_gid


def _hand_over(path: str, owner: tuple[int, int]) -> None:
    """Give every root-owned directory and file under ``path`` to ``owner``.

    The store's owner controls these directories, so nothing is resolved by
    path: ``os.fwalk`` holds each directory open (a directory swapped for a
    symbolic link while it runs is not entered), and each entry is looked at
    and changed relative to that descriptor, never following a link. A file
    with more than one link is left (a hard link to a file of root's placed
    in the store would be given away; a review found both). A segment a
    snapshot links is such a file: it stays root's and is named.
    """
    uid, gid = owner
    for root, dirs, files, fd in os.fwalk(path, follow_symlinks=False):
        for name in [*dirs, *files]:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if st.st_uid != 0 or stat.S_ISLNK(st.st_mode):
                    continue
                if not stat.S_ISDIR(st.st_mode) and st.st_nlink != 1:
                    log.warning("left %s root's: it has %d links (a snapshot's?)",
                                os.path.join(root, name), st.st_nlink)
                    continue
                os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
            except OSError as exc:  # gone meanwhile, or a filesystem without owners
                if not isinstance(exc, FileNotFoundError):
                    log.warning("cannot give %s to user %d: %s", os.path.join(root, name),
                                uid, exc)


def _release_writer(key: tuple[int, int] | None) -> None:
    if key is not None:
        with _writers_lock:
            _writers.discard(key)


# Every core open in this process, for the fork hook below.
_cores: weakref.WeakSet[Core] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child inherits its parent's open stores, and must leave them alone.

    Its copy shares the parent's files and file offsets, but none of its
    threads (syncer, compactor, sweeper) and possibly locks a parent thread
    held at the fork. Used, it would write into the parent's segment and
    log; closed (a ``with`` block unwinding in the child), it would cut the
    active segment's preallocated tail under the parent's writes and wait
    forever for threads that do not exist here. So each inherited core is
    marked closed, with fresh locks, and refuses every call with a message
    that says why (:meth:`Core.check_open`); closing it does nothing.
    """
    global _writers_lock
    _writers_lock = threading.Lock()
    _writers.clear()  # the parent's claims; this process holds no store yet
    parent = os.getppid()
    for core in list(_cores):
        core.forked_from = parent
        core.lock = writer_lock()
        core.ready = ReadySignal(core.lock)
        core.waiters = 0
        core.closed = True


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


# A purge or delete_queue of a queue with at most this many keys deletes them one
# by one instead of by range (states.remove_all).
POINT_DELETES = 4096

# The payload journal (durability="always", _durability.py) is used only with
# this much free space, and the memtable is flushed after JOURNAL_FLUSH_BYTES
# journaled (see Core._journal_policy).
JOURNAL_MIN_FREE = 128 * 1024 * 1024

# RocksDB's log is kept small (MetaDB.keep_log_small) while the disk has less
# than LOG_TIGHT_FREE bytes free, in every durability mode, and may grow again
# (to the 64 MiB write buffer) once it has LOG_ROOMY_FREE (see Core.watch_space).
LOG_TIGHT_FREE = 256 * 1024 * 1024
LOG_ROOMY_FREE = 512 * 1024 * 1024
FLUSH_MARGIN = 1024 * 1024  # free space a flush leaves beside twice the memtables
SPACE_TICK_WAIT = 0.05  # seconds a background look waits for the writer lock

LOST_METADATA = "metadata is missing or empty next to existing payload segments"


def _raced_writer(exc: StorageError | Corruption) -> bool:
    """Whether a read-only open failed on a file the writer removed meanwhile (a log
    file, or a table file a compaction replaced: RocksDB calls that corruption)."""
    return getattr(exc, "errno", None) == errno.ENOENT or "No such file" in str(exc)


def _segment_files(payload_dir: str) -> list[str]:
    try:
        names = os.listdir(payload_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [n for n in names if parse_segment_name(n) is not None]


# The file that makes a directory a snapshot (qstore/_snapshot.py writes it).
SNAPSHOT_MANIFEST = "MANIFEST.json"
# In a snapshot's directory while it is taken (_snapshot.py): with no manifest,
# a snapshot whose process was killed, which nothing opens.
SNAPSHOT_UNFINISHED = ".qstore-snapshot-unfinished"


def _refuse_lost_metadata(path: str) -> None:
    """Raise Corruption if ``path`` holds payload segments but no metadata database.

    Opening it as a new store would let the compactor delete every segment as
    an orphan: the store refuses, creating and deleting nothing (docs/faults.md).
    """
    meta = os.path.join(path, "meta")
    if os.path.exists(os.path.join(meta, "CURRENT")):
        return
    if os.path.lexists(meta) and not os.path.isdir(meta):
        raise StorageError(f"cannot read the store at {path!r}: {meta!r} is not a directory")
    found = _segment_files(os.path.join(path, "payload"))
    if found:
        raise Corruption(meta, 0, f"{LOST_METADATA} ({len(found)} segment file(s), "
                                  "no meta/CURRENT)")


def require_store(path: str) -> None:
    """Raise unless ``path`` holds a store; for opens that must never create one.

    Used by read-only opens and by the commands that only make sense on an
    existing store (``qstore pop``, ``push`` without ``--create``, ``compact``...),
    so that a mistyped path creates nothing. ``InvalidArgument`` (exit 2)
    when there is no store at all; ``StorageError`` naming the problem when
    something is there but cannot be read as one; ``Corruption`` when payload
    segments lie there without metadata.
    """
    _refuse_lost_metadata(path)
    meta = os.path.join(path, "meta")
    if not os.path.lexists(path):
        raise InvalidArgument(f"no store at {path!r}: the path does not exist "
                              "(nothing was created)")
    if not os.path.isdir(path):
        raise InvalidArgument(f"no store at {path!r}: it is a file, not a store directory")
    if not os.path.lexists(meta):
        raise InvalidArgument(f"{path!r} is not a qstore store: it has no meta/ "
                              "(nothing was created)")
    if not os.path.isdir(meta):
        raise StorageError(f"cannot read the store at {path!r}: {meta!r} is not a directory")
    try:
        names = os.listdir(meta)
    except OSError as exc:
        err = StorageError(f"cannot read the store at {path!r}: cannot list {meta!r} "
                           f"({exc.strerror})")
        err.errno = exc.errno
        raise err from None
    if "CURRENT" not in names:
        raise InvalidArgument(f"{path!r} is not a qstore store: {meta!r} holds no database "
                              "(no CURRENT)")
    current = os.path.join(meta, "CURRENT")
    if not os.path.isfile(current):
        raise StorageError(f"cannot read the store at {path!r}: {current!r} is not a file")


if hasattr(threading.RLock(), "_recursion_count"):
    writer_lock: Callable[[], Any] = threading.RLock
else:
    class _CountedRLock(_thread.RLock):  # type: ignore[misc,unused-ignore]
        """Python before 3.11.6: the C RLock has no ``_recursion_count`` (which the
        writer-lock sections read to undo an ``__enter__`` an interrupt cut short),
        and every open failed with AttributeError on Debian 12's Python 3.11.2 (a
        non-root audit). Its ``repr`` has the count; only these versions read it."""

        __slots__ = ()

        def _recursion_count(self) -> int:
            if not self._is_owned():  # type: ignore[attr-defined]
                return 0
            text = repr(self)
            return int(text[text.index("count=") + 6:text.index(" at ")])

    writer_lock = _CountedRLock


def _let_go(lock: Any, depth: int) -> None:
    """Release ``lock`` if this thread took it once more than ``depth`` (its count
    before the acquire): an ``__enter__`` left by an exception. A KeyboardInterrupt
    is raised as ``acquire()`` returns when SIGINT came while the main thread
    waited for the lock: it left the writer lock taken, and every other thread of
    the process waited on it for good (an interrupt audit: after the first or
    third interrupt of three pushing threads). An acquire the interrupt cut
    before it took the lock leaves the count as it was: nothing is released."""
    if lock._recursion_count() > depth:
        lock.release()


class Settling:
    """The writer lock, taken as ``with core.lock`` would, for sections with no checks
    to make first (passes, inspections that promote, compaction, snapshots); an
    exception leaving after a metadata write started reads memory back
    (:meth:`Core.settle`). After a failed metadata write the outermost entry
    tries :meth:`Core.resume` first, as a writer does: once space is back, the
    section's writes work without waiting for a write elsewhere."""

    __slots__ = ("_core",)

    def __init__(self, core: Core) -> None:
        self._core = core

    def __enter__(self) -> None:
        core = self._core
        lock = core.lock
        depth = lock._recursion_count()
        try:
            lock.acquire()
            if depth:  # nested: the outer mark stands
                return
            if core.meta.failed is not None and not core.closed and not core.readonly:
                # Still failing: the section's writes raise, its reads go on.
                with contextlib.suppress(StorageError):
                    core.resume()
            core.write_mark = core.meta.writes
        except BaseException:
            _let_go(lock, depth)
            raise

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is not None:
                self._core.settle_if_written()
        finally:
            self._core.lock.release()


class Writing(Settling):
    """The writer-lock context of the queue operations (a class: cheaper than a
    generator per call): a closed, read-only or failed store is checked first.

    Durability ``none`` and ``interval``; ``always`` uses :class:`GroupWriting`.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        core = self._core
        lock = core.lock
        depth = lock._recursion_count()
        try:
            lock.acquire()
            if core.closed or core.readonly or core.meta.failed is not None:
                core.check_writable()
                core.resume()  # after a failed metadata write
            core.write_mark = core.meta.writes
        except BaseException:
            _let_go(lock, depth)
            raise


class GroupWriting(Writing):
    """:class:`Writing` in ``durability="always"``: leaving it waits until the changes
    made inside are on stable storage (group commit, see _durability.py)."""

    __slots__ = ()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        core = self._core
        syncer = core.syncer
        ticket = None
        try:  # one finally for every path: an interrupt anywhere here frees the lock
            ticket = syncer.ticket()
            if exc_type is not None:
                # The failed operation may have appended payload that no journal key
                # covers: the next sync must fdatasync the segment too (_durability.py).
                syncer.payload_needed = True
                core.settle_if_written()
        finally:
            core.lock.release()
        if ticket is not None and exc_type is None:
            syncer.wait(ticket)


class ReadySignal(threading.Condition):
    """The condition blocked pops wait on, with one optional listener.

    The server (qstore/server) parks waiting pops without a thread: while it
    has any, it counts itself in ``Core.waiters`` and sets ``listener``, which
    is then called (writer lock held, so it must only schedule work) each time
    ready keys are added, with the name of the queue they were added to (None:
    any queue may have them, as after the clock moved), so that it tries only
    the pops waiting on that queue.
    """

    listener: Callable[[str | None], None] | None = None

    def notify_all(self, queue: str | None = None) -> None:
        super().notify_all()
        if self.listener is not None:
            self.listener(queue)


class Core(HotPaths):
    """Everything an open store holds, and the only code that commits changes."""

    payload: SegmentSet
    format: int  # the store format (records.STORE_FORMAT once a writer opened it)

    def __init__(self, path: str, config: Config) -> None:
        self.path = path
        self.config = config
        self.clock = checked_clock(config.clock)  # a bad time raises, never is stored
        self.readonly = config.readonly
        self.max_payload_bytes = config.max_payload_bytes
        self.lock = writer_lock()
        self.ready = ReadySignal(self.lock)  # notified when ready keys are added
        self.waiters = 0  # pops blocked in ready.wait (lock held to change it)
        self._sleep_time = sleep_time_of(config.clock, self.clock)  # see wait_until
        # What a pop's wait is measured by: an injected clock decides its outcome;
        # with the default wall clock, the monotonic one, so that a step of the
        # wall clock (NTP, a resumed VM) neither stretches nor cuts a wait.
        self.wait_clock = time.monotonic if config.clock is time.time else self.clock
        self.writing = GroupWriting(self) if config.durability == "always" else Writing(self)
        self.settling = Settling(self)
        self.closed = False
        self.write_mark = 0  # meta.writes when the writer lock was last taken (settle)
        self.forked_from: int | None = None  # set in a forked child: see _after_fork_in_child
        self._records = {}  # the record cache (see _hot.py)
        # The payload journal (durability="always", _durability.py): whether
        # batches carry their bodies now (set by _journal_policy), and the bytes
        # journaled since the last flush. _awaiting_sync: (file_id, record end,
        # key) of the keys a segment sync up to that record makes needless, in
        # append order: the journal's J keys and the pending batches' M batch/
        # keys (meta/_keys.py), deleted with the durable mark (_record_synced_mark).
        self.always = config.durability == "always" and not config.readonly
        self.journaling = False
        self._awaiting_sync: list[tuple[int, int, bytes]] = []
        # Keys the close deletes in its last batch, made durable by its flush (a
        # backfill's marker: delete_at_close).
        self._deletes_at_close: list[bytes] = []
        self._journal_bytes = 0
        # The segment whose S record single pushes defer (_seg_accounts.py);
        # S records found deferring at open (file id -> covered id).
        self._deferred: int | None = None
        self._deferred_n = 0
        self._found_covered: dict[int, int] = {}
        self._writer_key: tuple[int, int] | None = None
        # close() in steps, so that one cut short (Ctrl-C) is finished by the next:
        # the files closed (and what the active segment was), everything released.
        self._files_closed = False
        self._close_active: tuple[int | None, int] | None = None
        self._released = False  # the database closed and the writer claim given up
        self._close_done = False
        _refuse_lost_metadata(path)
        manifest = os.path.exists(os.path.join(path, SNAPSHOT_MANIFEST))
        if not manifest and os.path.exists(os.path.join(path, SNAPSHOT_UNFINISHED)):
            # Its segments are hard links to the live store's (a read-write open cut
            # the shared active segment), its metadata maybe half written.
            raise InvalidArgument(f"{path!r} holds a snapshot whose taking was cut short "
                                  "(its process was killed): nothing in it is to be read "
                                  "or written; remove it, or take the snapshot to it again "
                                  "(which replaces it)")
        if not config.readonly and manifest:
            # A snapshot's segments are hard links to the live store's files (its
            # active one too): a read-write open would cut or append to them.
            raise InvalidArgument(f"{path!r} is a snapshot (it holds {SNAPSHOT_MANIFEST}): "
                                  "open it with readonly=True; a snapshot is never changed "
                                  "(to start a store from it, copy the directory and "
                                  f"remove {SNAPSHOT_MANIFEST} from the copy)")
        self.reserve = SpaceReserve(path)
        self.space_low = False
        # Retried at every tick of the sync thread, else of the sweeper.
        self._space_retries = RetryLog(
            log, "keeping the metadata log small on a nearly full disk",
            config.sync_interval if config.durability != "none" else config.sweep_interval)
        self._log_flush_due = False  # the log grown before it was kept small: flush it
        self._mark_failing = False  # the last write of the durable mark failed
        self._owner: tuple[int, int] | None = None  # see _owner_if_not_root
        if not config.readonly:
            make_dirs_durably(path)
            self._owner = _owner_if_not_root(path)
            claimed: list[tuple[int, int]] = []
            try:
                self._writer_key = _claim_writer(path, claimed)
            except BaseException:
                for key in claimed:
                    _release_writer(key)
                raise
        else:
            require_store(path)  # a read-only open creates nothing
        if config.readonly:
            self._open_view()
        else:
            try:
                self._make_room("opening the store")
                new_meta = not os.path.isdir(os.path.join(path, "meta"))
                self.meta = MetaDB(os.path.join(path, "meta"), readonly=False,
                                   store_path=path)
                if new_meta:  # RocksDB syncs what is in meta/, not its entry here
                    fsync_dir(path)
            except BaseException:
                if hasattr(self, "meta"):
                    self.meta.close()
                _release_writer(self._writer_key)
                raise
            try:
                self._load()
                self._redo_journal()
                self.payload = self._open_payload()
                if self.format == 1:
                    migrate_dedup(self.meta, self.payload,
                                  [q.qid for q in self.queues.values() if q.rec.dedup])
                elif self.format != records.STORE_FORMAT:
                    mark_current_format(self.meta)  # 2 -> 3: the meaning, not the data
                self.format = records.STORE_FORMAT
            except BaseException:
                if hasattr(self, "payload"):
                    self.payload.close()
                self.meta.close()
                _release_writer(self._writer_key)
                raise
        if self.readonly:
            try:
                self.syncer = Syncer(config.durability, config.sync_interval, self.payload,
                                     self.meta)
                self._unwatch_clock = watch(config.clock, self._clock_moved)
                _cores.add(self)
            except BaseException:
                # The view's files and pins go too (they stayed open for the life of
                # the process: a review of the open's cleanup).
                with contextlib.ExitStack() as undo:
                    undo.callback(self.meta.close)
                    undo.callback(self.payload.close)
                    if hasattr(self, "_unwatch_clock"):
                        undo.callback(self._unwatch_clock)
                raise
        else:
            try:
                self.syncer = Syncer(config.durability, config.sync_interval, self.payload,
                                     self.meta)
                self._recover_and_start(path)
                # Last: a clock that tells of its moves wakes the blocked pops
                # (_waits.py); and the fork hook knows the store.
                self._unwatch_clock = watch(config.clock, self._clock_moved)
                _cores.add(self)
            except BaseException:
                # A recovery that failed (a segment's fsync) or was cut short kept
                # RocksDB's LOCK and this process's claim: every later open, here
                # or in another process, said StoreLocked (a faults audit). Each
                # step runs whatever the one before raised (last added, first run).
                with contextlib.ExitStack() as undo:
                    undo.callback(_release_writer, self._writer_key)
                    undo.callback(self.meta.close)
                    undo.callback(self.payload.close)
                    if hasattr(self, "syncer"):
                        undo.callback(self.syncer.stop)
                    if hasattr(self, "_unwatch_clock"):
                        undo.callback(self._unwatch_clock)
                raise

    def _recover_and_start(self, path: str) -> None:
        """The rest of a read-write open: what a stop left is settled, and the
        background threads start."""
        self.syncer.on_synced = self._record_synced_mark
        if self.always:
            self.syncer.on_checkpoint = self._journal_policy
            self._journal_policy()
        self._report_missing_segments(self._missing_segments())
        self._drop_lost_tails()
        self._complete_found()
        # Without its reserve (released by an earlier run on a full disk, and
        # no room to make it again), pushes wait for space from the start:
        # space_low lived in memory only, so after a restart pushes took the
        # room back (a review).
        self.space_low = not self.space_ok()
        self.space_tick()
        self.syncer.on_tick = self.space_tick
        # This process holds the store: a server's file left in it (by one
        # killed) names no server any more (its pid may live on in a container
        # or be reused).
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, SERVER_FILE))
        self.syncer.start()

    # -- waiting --------------------------------------------------------------

    def wait_until(self, until: float) -> None:
        """Block (writer lock held; let go meanwhile) until the store's clock reads
        ``until``, ready keys are added, the store closes or a clock that tells of its
        moves moves. The caller reads the clock again and decides (``_waits.py``)."""
        seconds = self._sleep_time(until)
        if seconds is not None and seconds <= 0:
            return  # the clock jumped to ``until`` itself
        self.waiters += 1
        try:
            self.ready.wait(seconds)
        finally:
            self.waiters -= 1

    def sleep_time(self, until: float) -> float | None:
        """Real seconds to wait for the store's clock to read ``until`` (None: until
        the clock tells of a move; see _waits.py). An autojump clock jumps there."""
        return self._sleep_time(until)

    def _clock_moved(self) -> None:
        with self.lock:
            if self.waiters:
                self.ready.notify_all()

    def _make_room(self, doing: str) -> bool:
        """Release the space reserve if the disk lacks what RocksDB needs for ``doing``.

        True if there is (now) about enough free space.
        """
        need = space_to_open(os.path.join(self.path, "meta"))
        if free_bytes(self.path) >= need:
            return True
        if not self.space_low:
            log.warning("disk nearly full: pushes are refused until space is back")
        self.space_low = True  # the room left is for acks and compaction
        self.reserve.release(f"{doing} needs about {need} bytes free")
        return free_bytes(self.path) >= need

    def watch_space(self) -> bool:
        """Keep RocksDB's log small while the disk is nearly full (writer lock held).

        Run at open, at each tick of the sync thread (``interval`` and
        ``always``) and of the sweeper (every mode), and after a compaction
        pass that deleted segments (:meth:`space_tick`). Without it, a store
        that filled its disk with small operations had a log several MiB larger
        than the space reserve, and once a write failed the database could not
        be reopened: no ack, pop or compaction went through until a file was
        deleted by hand (:meth:`MetaDB.keep_log_small`). True if it tried
        something (a switch, a flush), which then worked.

        Under the writer lock: a flush outside it raced the reopen after a
        failed write (rocksdict refuses to close a handle another thread is
        inside, "Already borrowed", which then kept the store's LOCK, and the
        push that reopened raised ``StoreLocked``; a review). The flush of the
        log grown so far waits for room for its table file: one that failed on
        a full disk left RocksDB refusing every write, and the reopen needs
        about the log's size free (a review: a disk that filled between two
        looks lost its acks to that flush).
        """
        try:
            free = free_bytes(self.path)
        except OSError:
            return False
        meta = self.meta
        if self.closed:
            return False
        tried = False
        small = free < (LOG_ROOMY_FREE if meta.small_log else LOG_TIGHT_FREE)
        if small != meta.small_log:
            meta.keep_log_small(small)  # raises on failure: tried again at the next tick
            log.info("%s: %d bytes free: the metadata log is kept %s", self.path, free,
                     "small" if small else "at its usual size again")
            self._log_flush_due = small
            tried = True
        if self._log_flush_due and meta.failed is None \
                and free >= 2 * meta.memtable_bytes() + FLUSH_MARGIN:
            meta.flush()
            self._log_flush_due = False
            tried = True
        return tried

    def space_tick(self) -> None:
        """:meth:`watch_space` for a background thread, under the writer lock: a
        failure (on a full disk) is logged once per episode and tried again at
        the next tick; "works again" only once an attempt did."""
        # Three threads tick: the sync thread, the sweeper, the compactor. Each waits
        # for the lock a little only, and skips this look when it is busy: a close
        # joins these threads, and one from a signal handler may hold the lock.
        got = False
        try:
            got = self.lock.acquire(timeout=SPACE_TICK_WAIT)
            if got and self.watch_space():
                self._space_retries.worked()
        except StorageError as exc:
            self._space_retries.failed(exc)
        finally:
            if got:
                self.lock.release()

    # -- opening --------------------------------------------------------------

    def _load(self) -> None:
        fmt = self.meta.get(keys.FORMAT_KEY)
        if fmt is None and _segment_files(os.path.join(self.path, "payload")):
            # A metadata database without the format key next to payload: not a
            # new store but one whose metadata was lost (never "recovered" as empty).
            raise Corruption(self.meta.path, 0, LOST_METADATA)
        if fmt is None and not self.readonly:
            batch = new_batch()
            batch.put(keys.FORMAT_KEY, records.pack([records.RECORD_VERSION,
                                                     records.STORE_FORMAT]))
            self.meta.write(batch, sync=True)
        self.format = records.STORE_FORMAT if fmt is None else records.unpack(fmt, "format")[1]
        if self.format not in records.READABLE_FORMATS:
            raise StorageError(f"unsupported store format {self.format!r} in {self.path} "
                               f"(this version reads {records.READABLE_FORMATS})")
        hwm = self.meta.get(keys.ID_HWM_KEY)
        self._next_id = records.unpack(hwm, "id")[1] if hwm else 1
        self._id_hwm = self._next_id
        qnext = self.meta.get(keys.QID_NEXT_KEY)
        self._next_qid = records.unpack(qnext, "qid")[1] if qnext else 1
        self.queues: dict[str, QueueState] = {}
        self._load_queues()
        # file_id -> [live bytes, live count, end]: what the S records say.
        self.segments: dict[int, list[int]] = self._load_segments()
        hints = {fid: v[2] for fid, v in self.segments.items()}
        synced = self.meta.get(keys.SYNCED_KEY)
        if synced is not None:
            # Recovery scans the segment that was active from the last offset known
            # to be durable, not from the end the metadata refers to: after a power
            # loss the metadata may refer to bytes that never reached the disk.
            _, sfid, soff = records.unpack(synced, "synced")
            hints[sfid] = min(soff, hints.get(sfid, soff))
        # Only the segment that was active may have lost unsynced bytes; any other
        # one was fsynced when sealed, and bytes missing from it are damage.
        self._active_at_crash = None if synced is None else sfid
        self.synced_segment = self._active_at_crash  # what a view reports as active
        self._durable_at_crash = 0 if synced is None else soff  # in that segment
        self._synced_mark: tuple[int, int] | None = None
        self._hints = hints

    def _redo_journal(self) -> None:
        """Write the journal's bodies back into their segments, then drop the journal.

        Keys are left only by a store that stopped (crash, power loss) between
        an ``always``-mode operation and the checkpoint that synced its segment
        (_durability.py); a segment may have lost those bytes. Before the
        segments are opened: their tail recovery then finds the records whole.
        """
        if self.meta.first_key(keys.JOURNAL, keys.prefix_end(keys.JOURNAL)) is None:
            return
        entries = [(*keys.journal_parts(key), body)
                   for key, body in self.meta.scan(keys.JOURNAL, keys.prefix_end(keys.JOURNAL))]
        try:
            written, missing = restore_records(os.path.join(self.path, "payload"), entries)
        except OSError as exc:
            raise _os_error(exc, "writing journaled payload back into its segments") from exc
        if missing:
            log.error("the payload journal holds records of segments %s, which are missing: "
                      "reads of their messages raise Corruption; run `qstore check`", missing)
        batch = new_batch()
        for fid, offset, _ in entries:
            batch.delete(keys.journal_key(fid, offset))
        self.meta.write(batch, sync=True)
        if written:
            log.warning("wrote %d payload record(s) back into their segments from the journal "
                        "(they had not reached the disk when the store stopped)", written)

    def _open_payload(self) -> SegmentSet:
        """The segments of a read-write open: recovery from the metadata's marks."""
        compaction = self.meta.get(keys.COMPACTION_KEY)
        discard: list[int] = []
        try:
            phase, output, _ = (records.decode_compaction(compaction) if compaction is not None
                                else ("", 0, []))
        except StorageError:
            phase = ""  # Compactor.recover says so and drops it (see there)
        if phase == records.COPYING:
            discard.append(output)
        return SegmentSet(
            os.path.join(self.path, "payload"),
            segment_max_bytes=self.config.segment_max_bytes,
            max_payload_bytes=self.config.max_payload_bytes,
            tail_hints=self._hints,
            discard=discard,
            next_file_id_floor=max(self.segments, default=0) + 1,
            hints_are_durable_marks=True,
        )

    def _load_queues(self) -> None:
        """Bring ``self.queues`` in line with the database, keeping the states that
        exist (queue handles share them); a state the database lacks is dropped."""
        found: set[str] = set()
        firsts = self._first_dues()
        for key, value in self.meta.scan(keys.QUEUE, keys.prefix_end(keys.QUEUE)):
            try:
                rec = records.QueueRecord.decode(value)
            except StorageError as exc:
                raise StorageError(
                    f"the record of queue {key[1:].decode('utf-8', 'replace')!r} (key "
                    f"{key.hex()}) is damaged: {exc}; a read-only `qstore check` names "
                    "what else is") from None
            raw = self.meta.get(keys.counts_key(rec.qid))
            counts = self._counts_of(rec.qid, raw)
            name = key[1:].decode("utf-8")
            state = self.queues.get(name)
            if state is None or state.qid != rec.qid:
                state = QueueState(name, rec, counts)
                self.queues[name] = state
            else:  # what was learnt from batches that may not have been written goes
                state.counts = counts
                state.heads = ReadyHeads(rec.qid)
                state.time_floor_us = 0
                state.dead_floor = 0
                state.next_event_us = 0
            totals = self.meta.get(keys.totals_key(rec.qid))
            try:
                state.expired = records.decode_totals(totals) if totals else 0
            except StorageError as exc:  # a lifetime total: counted from 0 again
                log.error("queue %r: its totals record is damaged (%s); expired counts "
                          "from 0 again", name, exc)
                state.expired = 0
            self.set_options(state, rec)  # (the floor is 0: every key counts)
            state.next_event_us = min(state.aging_next_us, firsts.get(rec.qid, NO_EVENT_US))
            found.add(name)
        for name in set(self.queues) - found:
            self.queues.pop(name).deleted = True

    def _counts_of(self, qid: int, raw: bytes | None) -> list[int]:
        """A queue's counters from its C record, or recounted from its message
        records when that does not decode: the open failed with a msgpack
        traceback, and so did the `check --repair` that rebuilds it (a
        check-vs-audit differential). The next write of the queue, or a repair,
        writes the record again."""
        if raw is None:
            return [0, 0, 0, 0, 0]
        try:
            return records.decode_counts(raw)
        except StorageError as exc:
            counts = [0, 0, 0, 0, 0]
            prefix = keys.prefix(keys.MESSAGE, qid)
            for _, value in self.meta.scan(prefix, keys.prefix_end(prefix)):
                try:
                    rec = records.MessageRecord.decode(value)
                except StorageError:
                    continue  # a bad record: the check names it
                counts[rec.state] += 1
                counts[4] += rec.length
            log.error("queue id %d: its counters record is damaged (%s); recounted from its "
                      "messages: %s", qid, exc, counts)
            return counts

    def _first_dues(self) -> dict[int, int]:
        """The earliest time in the delayed, in-flight and expiry indexes of each queue
        that has keys there: one seek for each (index, such queue), not three seeks
        for every queue (an open of 160,000 queues took 3.1 s, a scale audit)."""
        out: dict[int, int] = {}
        for kind in (keys.DELAYED, keys.INFLIGHT, keys.EXPIRY):
            end = keys.prefix_end(kind)
            key = self.meta.first_key(kind, end)
            while key is not None:
                if len(key) != keys.TIMED_KEY_SIZE:  # damage (the check names it): past it
                    key = self.meta.first_key(key + b"\x00", end)
                    continue
                qid = keys.U32.unpack_from(key, 1)[0]
                when = keys.timed_parts(key)[0]
                if when < out.get(qid, NO_EVENT_US):
                    out[qid] = when
                key = self.meta.first_key(keys.prefix_end(keys.prefix(kind, qid)), end)
        return out

    def _load_segments(self) -> dict[int, list[int]]:
        """What the S records say, with the pushes they defer added (_seg_accounts.py)."""
        segments, self._found_covered = load_segments(self.meta)
        self._deferred, self._deferred_n = None, 0
        return segments

    def _complete_found(self) -> None:
        """Rewrite the S records the open found deferring pushes, whole: pushes now
        defer from a record of their own, and no later open scans for these."""
        found = [fid for fid in self._found_covered if fid in self.segments]
        if found:
            batch = new_batch()
            for fid in found:
                batch.put(keys.segment_key(fid), records.encode_segment(*self.segments[fid]))
            self.meta.write(batch)
        self._found_covered = {}

    def settle_segments(self) -> None:
        """Write the S record of the segment pushes defer, as this process counts it
        (lock held), before a snapshot or a repair reads the records."""
        fid = self._deferred
        seg = None if fid is None else self.segments.get(fid)
        if fid is None or seg is None:
            return
        batch = new_batch()
        batch.put(keys.segment_key(fid), self.segment_record(fid, seg))
        self.meta.write(batch)
        self._deferred_n = 0

    def stored_segments(self) -> dict[int, list[int]]:
        """The segment accounting the database holds now, deferred pushes counted:
        what an open would load (for the tests and the crash harness to compare
        with ``segments``)."""
        return load_segments(self.meta)[0]

    def drift(self, *, segment_ends: bool = True) -> list[str]:
        """Where the in-memory state differs from what the database holds (lock
        held): each queue's counters, and each segment's live bytes and count
        (and data end, with ``segment_ends``). Empty when memory follows the
        database, as it must after every operation (for the tests and the crash
        harness; ``check()`` compares the database with itself)."""
        problems = []
        for name, state in self.queues.items():
            raw = self.meta.get(keys.counts_key(state.qid))
            if raw is not None and records.decode_counts(raw) != list(state.counts):
                problems.append(f"queue {name!r}: in-memory counters {state.counts} differ "
                                f"from the stored {records.decode_counts(raw)}")
        stored = self.stored_segments()
        width = 3 if segment_ends else 2
        for fid in sorted(set(stored) | set(self.segments)):
            on_disk, in_memory = stored.get(fid), self.segments.get(fid)
            if (on_disk or [0, 0, 0])[:width] != (in_memory or [0, 0, 0])[:width]:
                problems.append(f"segment {fid}: accounting stored {on_disk}, "
                                f"in memory {in_memory}")
        return problems

    def resume(self) -> None:
        """Make metadata writes work again after a failed one (writer lock held).

        A failed RocksDB write (a full disk, an I/O error) leaves the database
        refusing every write; the binding cannot resume it, so it is reopened,
        and everything this process keeps in memory about it (counters, segment
        accounting, ids, queue heads, the record cache) is read back from it:
        the in-memory state is what the database holds, whatever the failed
        batch did. Raises :class:`StorageError` if the reopen fails (the next
        write tries again).
        """
        failed = self.meta.failed
        if failed is None:
            return
        if not self._make_room("reopening the metadata database"):
            # Closing the database now would leave no handle to read with.
            err = StorageError(f"not enough free space to reopen the metadata database "
                               f"(about {space_to_open(self.meta.path)} bytes needed) after "
                               f"{failed}")
            err.errno = errno.ENOSPC
            raise err
        with contextlib.suppress(OSError):
            if free_bytes(self.path) < LOG_TIGHT_FREE:
                # The disk filled faster than the watch looked: reopen with the
                # small log (a failed database takes only the flag).
                self.meta.keep_log_small(True)
        self.meta.reopen()
        self._reload()
        log.warning("metadata writes work again: the database was reopened after %s", failed)

    def _reload(self) -> None:
        """Read back from the database everything kept in memory about it (lock held)."""
        self._records.clear()
        self._synced_mark = None
        hwm = self.meta.get(keys.ID_HWM_KEY)
        if hwm is not None:
            self._id_hwm = records.unpack(hwm, "id")[1]
            self._next_id = max(self._next_id, self._id_hwm)
        qnext = self.meta.get(keys.QID_NEXT_KEY)
        if qnext is not None:
            self._next_qid = max(self._next_qid, records.unpack(qnext, "qid")[1])
        self._load_queues()
        self.segments = self._load_segments()
        self.space_low = not self.space_ok()
        # The journal and pending batch keys the database holds, for the syncs to
        # delete (an interrupted push may have written some it did not note).
        awaiting = self._pending_batches()
        if self.always:
            awaiting.extend(
                (fid, offset + FRAME_SIZE + len(body), key)
                for key, body in self.meta.scan(keys.JOURNAL, keys.prefix_end(keys.JOURNAL))
                for fid, offset in (keys.journal_parts(key),))
        self._awaiting_sync = sorted(awaiting)

    def _pending_batches(self) -> list[tuple[int, int, bytes]]:
        """(end file id, end offset, key) of the pending batch keys in the database."""
        found = []
        for key, value in self.meta.scan(keys.PENDING_BATCH, keys.prefix_end(keys.PENDING_BATCH)):
            _, _, fid, end = records.unpack(value, "pending batch")
            found.append((fid, end, key))
        return found

    def settle_if_written(self) -> None:
        """:meth:`settle`, if a metadata write started since the writer lock was taken."""
        if self.meta.writes != self.write_mark:  # a read-only view never writes
            self.settle()

    def settle(self) -> None:
        """After an exception left a writer section that had started a metadata write
        (writer lock held): read the in-memory state back from the database.

        A write's in-memory changes (counters, heads, segment accounting, the
        record cache) follow it in Python, and an exception can cut them short:
        above all KeyboardInterrupt, which lands at whatever bytecode runs when
        Ctrl-C or SIGINT arrives, or SystemExit from a signal handler. The
        database holds the whole batch; memory would hold part of it, and the
        next operation would act on that (a pop delivering the message the cut
        one had delivered, counters written back wrong). Reading it back makes
        memory what the database holds, as after a failed write (:meth:`resume`).
        If reading fails, the database is marked failed, so that the next writer
        reopens it and reads everything back then.
        """
        if self.meta.failed is not None:
            return  # a failed write: the next writer reopens and reads back (resume)
        try:
            self._reload()
        except Exception as exc:
            log.error("reading the store's state back after an interrupted write failed: %s",
                      exc)
            if self.meta.failed is None:
                self.meta.failed = exc if isinstance(exc, StorageError) else StorageError(
                    f"the in-memory state could not be read back: {exc}")
        self.write_mark = self.meta.writes

    def _open_view(self) -> None:
        """A read-only view: segments pinned first, then a metadata view they cover.

        The writer may be compacting: between listing the segment files and
        opening the metadata, a pass can delete a source or create an output.
        Segments are opened (and held) before the metadata, so every segment
        the metadata refers to was either pinned already or created later; a
        later one is pinned after. The views lock (payload/_views.py), held
        shared meanwhile, keeps the writer from unlinking any segment in
        between. Without a lock file (a store no writer opened since), a
        segment gone by then means the metadata is older than the pass that
        deleted it: it is reopened, fresher. A view never reports a segment
        the writer deleted as missing (issue 11 case 11).
        """
        meta_path = os.path.join(self.path, "meta")
        payload_dir = os.path.join(self.path, "payload")
        with viewing(payload_dir):
            self.payload = SegmentSet(
                payload_dir,
                segment_max_bytes=self.config.segment_max_bytes,
                max_payload_bytes=self.config.max_payload_bytes,
                readonly=True,
            )
            self._pin_view(meta_path)
        self.payload.fallback = self._journaled_body

    def data_size(self, fid: int) -> int:
        """Bytes of data in segment ``fid``. A view sees the writer's active segment
        with its preallocated zeros (the writer cuts them off when it closes): its
        data ends where the records this view's metadata refers to end."""
        size = self.payload.segment_size(fid)
        if self.readonly:
            size = min(size, max(HEADER_SIZE, self.segments.get(fid, [0, 0, 0])[2]))
        return size

    def _journaled_body(self, ref: Located) -> bytes | None:
        """A view's read of a record its segment does not hold (intact): the body the
        payload journal keeps for it, if any. A store that stopped (a crash, a
        power loss) in ``always`` mode before its segment was synced has such
        records until a read-write open writes them back (_redo_journal); a
        view must not take them for damage meanwhile."""
        body = self.meta.get(keys.journal_key(ref.file_id, ref.offset))
        if body is None or len(body) != ref.length:
            return None
        return body

    def _pin_view(self, meta_path: str) -> None:
        """Open the metadata view and pin every segment it refers to (views lock held).

        RocksDB's read-only open reads the writer's live files: a flush or a
        compaction that deletes a log or table file between the open's reading
        of the manifest and its opening of the file fails the open ("No such
        file"), or leaves it without the flushed keys (then no format key: it
        looks like lost metadata). Both are a race with the writer, not damage:
        the open is tried again, and only a failure that persists is reported.
        """
        try:
            for attempt in range(VIEW_ATTEMPTS):
                last = attempt == VIEW_ATTEMPTS - 1
                try:
                    self.meta = MetaDB(meta_path, readonly=True, store_path=self.path)
                except (StorageError, Corruption) as exc:
                    if last or not _raced_writer(exc):
                        raise
                    continue
                try:
                    self._load()
                    # Every segment its metadata has an S record of (with live
                    # messages or not: the view's check accounts for each one).
                    missing = self.payload.pin(sorted(self.segments))
                except Corruption as exc:
                    self.meta.close()
                    if last or exc.reason != LOST_METADATA:
                        raise
                    continue
                except BaseException:
                    self.meta.close()
                    raise
                if not missing or last:
                    # Still missing with fresh metadata: damage, which reads report.
                    self._report_missing_segments(missing)
                    return
                self.meta.close()
                self.payload.refresh()
        except BaseException:
            self.payload.close()
            raise

    def _missing_segments(self) -> list[int]:
        """Segments the metadata has an S record of whose file is not there (a
        damaged header is not missing: the payload names it in ``damaged``)."""
        there = set(self.payload.file_ids()) | set(self.payload.damaged)
        return sorted(fid for fid in self.segments if fid not in there)

    def _report_missing_segments(self, missing: list[int]) -> None:
        """Log each missing segment file once, with what the metadata says is in it.

        Always damage: compaction deletes a segment's S record before its file,
        so no crash leaves a record of a deleted file (a repair's retirement
        aside: it renames the file first). Without this line an open said
        nothing, and the first sign was a pop's dead letters (docs/faults.md).
        """
        for fid in missing:
            live_bytes, count, _ = self.segments[fid]
            path = os.path.join(self.path, "payload", segment_name(fid))
            if count:
                log.error("segment file %s is missing: the metadata says %d live message(s) "
                          "(%d bytes) refer to it; reads of them raise Corruption, pops move "
                          "them to the dead letters; `qstore check` reports them "
                          "(missing_segment) and `qstore check --repair` moves them all to "
                          "the dead letters", path, count, live_bytes)
            else:
                log.error("segment file %s is missing: no message refers to it, but the "
                          "metadata still has its S record; `qstore check` reports it "
                          "(missing_segment) and `qstore check --repair` removes the record",
                          path)

    def _drop_lost_tails(self) -> None:
        """Forget messages whose payload bytes did not survive a power loss.

        Only possible for bytes past the last durable offset, which belong to
        operations that had not returned in ``durability="always"`` (an
        operation returns only after the sync that covers its bytes); in the
        other modes a power loss may also take operations that had returned.
        Without this, those messages would fail every read with Corruption.
        A batch push is atomic: one whose sync never came (its pending batch
        key is still here) and that lost any message loses them all. All of
        it is one synced batch: a stop in the middle of it changes nothing,
        and the next open finds the same (the segments were cut already).
        """
        txn = Txn()
        lost: set[tuple[int, int]] = set()  # (qid, id)
        cuts = []
        files = set(self.payload.file_ids())
        for fid, (_, _, end) in list(self.segments.items()):
            if fid not in files:
                continue  # missing (logged by the open) or a damaged header: reads raise
            valid = self.payload.segment_size(fid)
            if valid >= end:
                continue
            if fid != self._active_at_crash and self._active_at_crash is not None:
                # A sealed segment cut short: damage, not a torn tail. Its messages
                # stay; a read of one in the missing bytes raises Corruption, and
                # `qstore check` names them.
                log.error("sealed segment %s ends at %d but its records reach %d: the file "
                          "was damaged (cut); its messages are kept, reads of the lost ones "
                          "raise Corruption; run `qstore check`", fid, valid, end)
                continue
            # Bytes up to the durable mark were synced: if they are gone the file
            # was damaged (cut), and those messages stay, as in a sealed segment.
            # Only what lies past the mark was never known to be on disk.
            durable = self._durable_at_crash if fid == self._active_at_crash else 0
            if valid < durable:
                log.error("segment %s ends at %d, short of the %d bytes known to be durable: "
                          "the file was damaged (cut); the messages up to %d are kept, reads "
                          "of the lost ones raise Corruption; run `qstore check`", fid, valid,
                          durable, durable)
            cut = max(valid, durable)
            if cut >= end:
                continue
            dropped = 0
            for key, value in self.meta.scan(keys.MESSAGE, keys.prefix_end(keys.MESSAGE)):
                rec = records.MessageRecord.decode(value)
                if rec.file_id != fid or rec.offset + FRAME_SIZE + rec.length <= cut:
                    continue
                states.remove(txn, self._state_of_key(key), keys.trailing_id(key), rec)
                lost.add(keys.QID_ID.unpack_from(key, 1))
                dropped += 1
            txn.set_end(fid, cut)
            cuts.append((fid, cut, end, dropped))
        batches = self._settle_pending_batches(txn, lost)
        if not cuts and batches is None:
            return
        for fid, cut, _, _ in cuts:
            self.segments[fid][2] = cut
        self.commit(txn)
        self.syncer.sync_now()
        for fid, cut, end, dropped in cuts:
            log.error("segment %s ends at %d but the metadata referred up to %d (a power loss "
                      "before those bytes were synced): %d message(s) dropped", fid, cut,
                      end, dropped)
        if batches:
            log.error("a power loss took part of %d batch push(es) before their sync: a "
                      "batch is all or nothing, so the rest of each was dropped too: %s",
                      len(batches), "; ".join(batches))

    def _settle_pending_batches(self, txn: Txn, lost: set[tuple[int, int]]) -> list[str] | None:
        """At open, the pending batch keys a stop left, into ``txn``: the rest of each
        batch that lost a message (``lost``: (qid, id) dropped for lost bytes) is
        dropped, and the keys deleted, once the segments they end in are fsynced
        here (a kill left their bytes in the page cache only). Returns what was
        dropped, one text a batch; None if there was no key."""
        found = [(key, records.unpack(value, "pending batch")) for key, value
                 in self.meta.scan(keys.PENDING_BATCH, keys.prefix_end(keys.PENDING_BATCH))]
        if not found:
            return None
        dropped: list[str] = []
        qstates = {q.qid: q for q in self.queues.values()}
        for key, (_, last, _, _) in found:
            qid, first = keys.pending_batch_parts(key)
            q = qstates.get(qid)
            if q is None or not any((qid, mid) in lost for mid in range(first, last + 1)):
                continue
            n = 0
            for mid in range(first, last + 1):
                raw = None if (qid, mid) in lost else self.meta.get(keys.message_key(qid, mid))
                if raw is not None:  # (acked since, or dropped above: nothing to do)
                    states.remove(txn, q, mid, records.MessageRecord.decode(raw))
                    n += 1
            if n:  # else the whole batch was lost: nothing kept to drop
                dropped.append(f"{n} more of queue {q.name!r} (ids {first}-{last})")
        files = set(self.payload.file_ids())
        for fid in sorted({end_fid for _, (_, _, end_fid, _) in found} & files):
            try:
                fsync_file(self.payload.path_of(fid))
            except OSError as exc:
                raise _os_error(exc, f"syncing payload segment {fid}") from exc
        for key, _ in found:
            txn.delete(key)
        return dropped

    def _state_of_key(self, key: bytes) -> QueueState:
        qid = keys.U32.unpack_from(key, 1)[0]
        return next(q for q in self.queues.values() if q.qid == qid)

    # -- checks ---------------------------------------------------------------

    def check_open(self) -> None:
        if self.closed:
            if self.forked_from is not None:
                raise StoreClosed(
                    f"store {self.path!r} was opened by process {self.forked_from}, which "
                    "this process was forked from; a forked child cannot use it. Open "
                    "stores after forking, or share one through `qstore serve` and "
                    "qstore.connect")
            raise StoreClosed(f"store {self.path!r} is closed")

    def check_writable(self) -> None:
        self.check_open()
        if self.readonly:
            raise ReadOnlyStore(f"store {self.path!r} was opened with readonly=True")

    # -- the commit path ------------------------------------------------------

    def commit(self, txn: Txn) -> None:
        """Write ``txn`` as one batch, then bring the in-memory state in line (lock held).

        The one place counters reach the database: each batch carries the new
        counts of every queue and segment it changes.
        """
        batch = txn.seal()
        new_counts = []
        for q, delta in txn.queues.items():
            counts = apply_counts(q.counts, delta)
            batch.put(q.counts_key, records.encode_counts(counts))
            new_counts.append((q, counts))
        new_segs = []
        segments = self.segments
        if txn.segments:
            self.release_deferred(batch)
        for fid, (dbytes, dcount, end) in txn.segments.items():
            old = segments.get(fid)
            seg = ([dbytes, dcount, end] if old is None
                   else [old[0] + dbytes, old[1] + dcount, max(old[2], end)])
            batch.put(keys.segment_key(fid), self.segment_record(fid, seg))
            new_segs.append((fid, seg))
        synced = self.payload.synced_position()
        if synced != self._synced_mark:
            batch.put(keys.SYNCED_KEY, records.pack([records.RECORD_VERSION, *synced]))
        self.meta.write(batch)
        self._synced_mark = synced
        if txn.journal:
            self._awaiting_sync.extend(txn.journal)
        if txn.forget_records:
            self._records.clear()
        cache = self._records
        for key, value in txn.records:
            if value is None:
                cache.pop(key, None)
            elif txn.cache_records:
                self._cache_record(key, value)
            elif key in cache:
                cache[key] = value
        for q, counts in new_counts:
            q.counts = counts
        for fid, seg in new_segs:
            segments[fid] = seg
        if txn.id_hwm is not None:
            self._id_hwm = txn.id_hwm
        if txn.ready_keys is not None:
            for q, added in txn.ready_keys.items():
                q.heads.added(added)
            if self.waiters:
                if len(txn.ready_keys) == 1:
                    self.ready.notify_all(next(iter(txn.ready_keys)).name)
                else:
                    self.ready.notify_all()
        if txn.events is not None:
            for q, when in txn.events.items():
                if when < q.next_event_us:
                    q.next_event_us = when
                if when < q.time_floor_us:
                    q.time_floor_us = when
        self.syncer.wrote()

    def rebuild_derived(self, puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes],
                        counts: dict[QueueState, list[int]],
                        segments: dict[int, tuple[int, int, int] | None],
                        id_hwm: int | None) -> None:
        """Rewrite derived state from a recount, in one synced batch (``check(repair=True)``).

        ``puts``/``deletes``: index keys; ``counts``: a queue's counters as
        recounted (written whole, not as deltas: the stored ones are wrong);
        ``segments``: a segment's S record as recounted, None to delete it;
        ``id_hwm``: a raised id high-water mark. Lock held. The in-memory
        state follows: counters, segment records, ready heads (learnt again)
        and the next due times.
        """
        batch = new_batch()
        for key in deletes:
            batch.delete(key)
        for key, value in puts:
            batch.put(key, value)
        for q, c in counts.items():
            batch.put(q.counts_key, records.encode_counts(c))
        for fid, seg in segments.items():
            if seg is None:
                batch.delete(keys.segment_key(fid))
            else:
                batch.put(keys.segment_key(fid), self.segment_record(fid, seg))
        if id_hwm is not None:
            batch.put(keys.ID_HWM_KEY, records.pack([records.RECORD_VERSION, id_hwm]))
        self.meta.write(batch, sync=True)
        for q, c in counts.items():
            q.counts = list(c)
        for fid, seg in segments.items():
            if seg is None:
                self.segments.pop(fid, None)
            else:
                self.segments[fid] = list(seg)
        if id_hwm is not None:
            self._id_hwm = max(self._id_hwm, id_hwm)
            self._next_id = max(self._next_id, id_hwm)
        self._records.clear()
        for q in self.queues.values():
            q.heads = ReadyHeads(q.qid)
            q.time_floor_us = 0
            q.dead_floor = 0
            self.refresh_next_event(q)
        if self.waiters:
            self.ready.notify_all()

    def _record_synced_mark(self) -> None:
        """After a sync: record how far the active segment is now durable (M synced).

        Written before the operations the sync covered return, without a sync
        of its own (the next sync, or close, makes it durable; a process kill
        keeps it): a record below the mark is never taken for an unsynced tail
        on open (see _durability.py).
        """
        with self.settling:  # an interrupt after the write reads the journal keys back
            synced = self.payload.synced_position()
            covered = self._covered_by_sync(synced) if self._awaiting_sync else 0
            if synced == self._synced_mark and not covered:
                return
            batch = new_batch()
            if synced != self._synced_mark:
                batch.put(keys.SYNCED_KEY, records.pack([records.RECORD_VERSION, *synced]))
            awaiting = self._awaiting_sync
            for i in range(covered):
                batch.delete(awaiting[i][2])
            try:
                self.meta.write(batch)
            except StorageError as exc:
                # What this sync covered is durable: the mark is a saving, and its
                # failure (a full disk) must not fail those operations. It did:
                # in always mode a push raised although its batch was written and
                # synced, so a retry would push it twice (a disk-full test). The
                # mark stays where it was (a later sync moves it), the keys
                # awaiting it stay (an open writes equal journaled bytes over,
                # and finds every message of a pending batch), and the failed
                # write makes the next one reopen the database.
                if not self._mark_failing:
                    log.warning("the durable mark was not moved after a sync (what the "
                                "sync covered is durable): %s", exc)
                self._mark_failing = True
                return
            self._mark_failing = False
            self._synced_mark = synced
            del awaiting[:covered]

    def _journal_policy(self) -> None:
        """At open and after each checkpoint (always mode): journal only while the
        disk has ``JOURNAL_MIN_FREE`` bytes free, and keep the RocksDB log the
        journal fills small. A metadata write that fails on a full disk can only
        be resumed by reopening the database, which needs about the log's size
        free (``space_to_open``): so the memtable is flushed (and the log
        dropped) after every ``JOURNAL_FLUSH_BYTES`` journaled, by then deleted
        by checkpoints, and at once when journaling stops."""
        try:
            self.journaling = free_bytes(self.path) >= JOURNAL_MIN_FREE
        except OSError:
            self.journaling = False
        pending = self._journal_bytes
        if pending >= JOURNAL_FLUSH_BYTES or (pending and not self.journaling):
            self.meta.flush()
            with self.lock:  # writers add to it under the lock
                self._journal_bytes -= pending

    def _covered_by_sync(self, synced: tuple[int, int]) -> int:
        """How many of the oldest keys awaiting a sync the segment sync at ``synced``
        covers: those of earlier segments (sealed, so synced) and those up to its
        offset."""
        sfid, soff = synced
        n = 0
        for fid, end, _ in self._awaiting_sync:
            if fid > sfid or (fid == sfid and end > soff):
                break
            n += 1
        return n

    def delete_at_close(self, key: bytes) -> None:
        """Delete ``key`` in the last batch :meth:`close` writes (durable by its flush),
        not now. A close that cannot write it (a full disk) leaves it: then it is
        still in :attr:`kept_at_close` after the close."""
        self._deletes_at_close.append(key)

    @property
    def kept_at_close(self) -> list[bytes]:
        """The keys :meth:`delete_at_close` named that no close has deleted yet."""
        return list(self._deletes_at_close)

    def write_synced(self, puts: Sequence[tuple[bytes, bytes]] = (),
                     deletes: Sequence[bytes] = ()) -> None:
        """A synced batch of bookkeeping keys that carry no counters (compaction records)."""
        batch = new_batch()
        for key, value in puts:
            batch.put(key, value)
        for key in deletes:
            batch.delete(key)
        self.meta.write(batch, sync=True)

    # -- ids for bulk loads ---------------------------------------------------

    def reserve_ids(self, n: int) -> int:
        """Reserve ``n`` consecutive message ids, durably; returns the first."""
        with self.lock:
            self.check_writable()
            first = self._next_id
            end = first + n
            hwm = max(self._id_hwm, end)
            puts = [(keys.ID_HWM_KEY, records.pack([records.RECORD_VERSION, hwm]))]
            deferred = self._deferred
            if deferred is not None and deferred in self.segments:
                # Move its covered id past these: an open after a crash then
                # scans none of the bulk load's messages for deferred pushes.
                seg = self.segments[deferred]
                puts.append((keys.segment_key(deferred),
                             records.encode_segment(seg[0], seg[1], seg[2], end)))
            self.write_synced(puts)
            self._next_id = end
            self._id_hwm = hwm
        return first

    def ids_reserved_below(self) -> int:
        """Every id below this was handed out or reserved."""
        return self._id_hwm

    def reserve_file_ids(self, n: int) -> list[int]:
        """``n`` segment file ids above every segment of the store (held in memory only)."""
        with self.lock:
            self.check_writable()
            return [self.payload.reserve_file_id() for _ in range(n)]

    def ingest(self, q: QueueState, paths: list[str], counts_delta: list[int],
               new_segments: dict[int, tuple[int, int, int]], end_id: int,
               min_due_us: int | None, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Ingest sorted SST files holding new messages of ``q`` (a bulk load), atomically.

        The counters, segment records and id high-water mark (and ``extra``
        keys) go in one more file of the same ingestion, so all of it lands or
        none. Lock held.
        """
        counts = apply_counts(q.counts, counts_delta)
        hwm = max(self._id_hwm, end_id)
        entries = [
            (q.counts_key, records.encode_counts(counts)),
            (keys.ID_HWM_KEY, records.pack([records.RECORD_VERSION, hwm])),
        ]
        for fid, (live_bytes, live_count, end) in new_segments.items():
            entries.append((keys.segment_key(fid),
                            records.encode_segment(live_bytes, live_count, end)))
        entries.extend(extra)
        meta_sst = os.path.join(os.path.dirname(paths[0]) if paths else self.path,
                                "meta.sst")
        write_sst(meta_sst, entries)
        self.meta.ingest([*paths, meta_sst])
        q.counts = counts
        try:
            self.payload.adopt(new_segments)
        except QStoreError as exc:  # the load stands; a read of its messages says more
            log.error("the bulk load's segments could not be opened: %s", exc)
        for fid, seg in new_segments.items():
            self.segments[fid] = list(seg)
        self._id_hwm = hwm
        self._next_id = max(self._next_id, end_id)
        q.heads = ReadyHeads(q.qid)  # loaded keys may sort anywhere: learn the levels again
        if min_due_us is not None:  # the earliest due time or expiry of the loaded messages
            q.next_event_us = min(q.next_event_us, min_due_us)
            q.time_floor_us = min(q.time_floor_us, min_due_us)
        if q.rec.aging is not None:  # plan aging again: the new ready messages are waiting too
            q.aging_next_us = 0
            q.next_event_us = 0
        if counts_delta[0] and self.waiters:
            self.ready.notify_all(q.name)

    # -- queues ---------------------------------------------------------------

    def add_queue(self, name: str, order: str, priority_type: str, max_attempts: int,
                  dedup: bool, **options: Any) -> QueueState:
        """Create queue ``name`` (writer lock held; the caller checked it is new and
        validated ``options``, the QueueRecord fields of contract section 10)."""
        rec = records.QueueRecord(self._next_qid, order, priority_type, max_attempts, dedup,
                                  self.clock(), **options)
        txn = Txn()
        txn.put(keys.queue_key(name), rec.encode())
        txn.put(keys.QID_NEXT_KEY, records.pack([records.RECORD_VERSION, rec.qid + 1]))
        state = QueueState(name, rec, [0, 0, 0, 0, 0])
        state.next_event_us = NO_EVENT_US
        state.heads = ReadyHeads.of_empty_queue(rec.qid)
        self.set_options(state, rec)
        txn.count(state, 0, 0)
        self.queues[name] = state
        try:
            self.commit(txn)
        except BaseException:
            del self.queues[name]
            raise
        self._next_qid += 1
        return state

    def set_options(self, q: QueueState, rec: records.QueueRecord) -> None:
        """Bring the in-memory state of ``q`` in line with its (new) record."""
        old = q.rec
        q.rec = rec
        q.plain = plain_push(rec)
        q.heads.aging_skip.clear()  # a new cap (or none): capped messages may move again
        if rec.rate is None:
            q.bucket = None
        elif q.bucket is None or old.rate != rec.rate:
            q.bucket = TokenBucket(rec.rate[0], rec.rate[1], self.clock())
        q.aging_next_us = 0 if rec.aging is not None else NO_EVENT_US
        q.next_event_us = min(q.next_event_us, q.aging_next_us)

    def configure_queue(self, q: QueueState, options: dict[str, Any]) -> None:
        """Change the options of ``q`` (validated by the caller; writer lock held)."""
        rec = dataclasses.replace(q.rec, **options)
        txn = Txn()
        txn.put(keys.queue_key(q.name), rec.encode())
        self.commit(txn)
        self.set_options(q, rec)
        if self.waiters:  # a rate lifted or raised: pops waiting for a token may go now
            self.ready.notify_all(q.name)

    def drop_queue(self, q: QueueState) -> None:
        """Delete a queue with every message in it, in one batch (writer lock held)."""
        txn = Txn()
        states.remove_all(txn, q, self.payload_totals(q)[1], self._keys_of_small(q))
        txn.delete(keys.queue_key(q.name))
        # The counters put that commit() adds for q would bring the key back:
        # drop q's deltas, the key goes with the queue.
        del txn.queues[q]
        txn.delete(q.counts_key)
        txn.delete(keys.totals_key(q.qid))
        self.commit(txn)
        q.deleted = True
        del self.queues[q.name]
        if self.waiters:  # pops waiting on it raise QueueNotFound now, not at their deadline
            self.ready.notify_all(q.name)

    def purge(self, q: QueueState) -> int:
        """Delete every message of ``q`` in one batch; returns how many (lock held)."""
        n, per_segment = self.payload_totals(q)
        txn = Txn()
        states.remove_all(txn, q, per_segment, self._keys_of_small(q))
        self.commit(txn)
        q.heads = ReadyHeads.of_empty_queue(q.qid)
        q.dead_floor = self._next_id  # every id below was purged; a later one is above
        q.next_event_us = NO_EVENT_US
        return n

    def _keys_of_small(self, q: QueueState) -> list[bytes] | None:
        """Every key of ``q``'s tables, if there are at most POINT_DELETES of them
        (deleted one by one: no range tombstone, see states.remove_all); else None."""
        found: list[bytes] = []
        for kind in keys.PER_QUEUE_KINDS:
            lo = keys.prefix(kind, q.qid)
            found += self.meta.scan_keys(lo, keys.prefix_end(lo),
                                         POINT_DELETES + 1 - len(found))
            if len(found) > POINT_DELETES:
                return None
        return found

    def payload_totals(self, q: QueueState) -> tuple[int, dict[int, tuple[int, int]]]:
        """How many messages ``q`` holds, and per segment the bytes (frames included)
        and number of their payloads: what a purge releases. Records are read
        in bulk (:func:`records.message_refs`: a purge of a million messages
        held the writer lock 3.7 s decoding them one by one)."""
        lo = keys.prefix(keys.MESSAGE, q.qid)
        ks: list[bytes] = []
        vs: list[bytes] = []
        n = 0
        per: dict[int, tuple[int, int]] = {}

        def add() -> None:
            if len(ks) < 512:  # a small queue's: no numpy (loaded on first use)
                for key, value in zip(ks, vs, strict=True):
                    try:
                        fid, _, length = records.message_ref(value)
                    except Exception:  # msgpack's errors have no common base
                        # Raised as the bulk path raises it: StorageError naming the
                        # key (a raw FormatError reached purge).
                        records.decode_messages([key], [value])
                        raise
                    old = per.get(fid, (0, 0))
                    per[fid] = (old[0] + FRAME_SIZE + length, old[1] + 1)
                ks.clear()
                vs.clear()
                return
            refs = records.message_refs(ks, vs)
            fids, where = np.unique(refs[:, 0], return_inverse=True)
            nbytes = np.zeros(len(fids), np.int64)
            np.add.at(nbytes, where, refs[:, 2] + FRAME_SIZE)
            counts = np.bincount(where, minlength=len(fids))
            for fid, b, c in zip(fids.tolist(), nbytes.tolist(), counts.tolist(), strict=True):
                old = per.get(fid, (0, 0))
                per[fid] = (old[0] + b, old[1] + c)
            ks.clear()
            vs.clear()

        for key, value in self.meta.scan(lo, keys.prefix_end(lo)):
            ks.append(key)
            vs.append(value)
            n += 1
            if len(ks) >= 8192:
                add()
        if ks:
            add()
        return n, per

    # -- time (the passes themselves are in _timers.py) ------------------------

    def refresh_next_event(self, q: QueueState) -> None:
        """Recompute the earliest due time or lease deadline from the indexes."""
        earliest = q.aging_next_us
        floor = keys.U64.pack(q.time_floor_us)
        for kind in (keys.DELAYED, keys.INFLIGHT, keys.EXPIRY):
            base = keys.prefix(kind, q.qid)
            end = keys.prefix_end(base)
            first = self.meta.first_key(base + floor, end)
            while first is not None and len(first) != keys.TIMED_KEY_SIZE:  # damage: past it
                first = self.meta.first_key(first + b"\x00", end)
            if first is not None:
                earliest = min(earliest, keys.timed_parts(first)[0])
        q.next_event_us = earliest

    # -- closing --------------------------------------------------------------

    def close(self) -> None:
        """Make everything durable and release the database (background work stopped).

        The database and the in-process writer claim are released whatever
        fails; then a :class:`StorageError` is raised if something that returned
        could not be made durable (the payload fsync, the WAL sync).
        """
        if self._close_done:
            return
        self._unwatch_clock()
        self.syncer.stop()
        with self.lock:
            error: StorageError | None = None
            try:
                if not self._files_closed:
                    if self._released:
                        # An earlier close was cut short with the store released:
                        # another may write to these files now. Close the descriptors
                        # as they are: no cut, no sync, no mark (the next open scans
                        # the tail, as after a crash).
                        self.payload.close(as_is=True)
                    elif self.readonly:
                        self.payload.close()
                    else:
                        error = self._close_writer()
                    self._files_closed = True
            finally:
                try:
                    self.meta.close()  # closing it again does nothing
                except StorageError as exc:
                    log.warning("%s", exc)
                _release_writer(self._writer_key)
                self._released = True
                if self._owner is not None:
                    _hand_over(self.path, self._owner)
            self._close_done = True
        if error is not None:
            raise error

    def _close_writer(self) -> StorageError | None:
        if self._close_active is None:  # else a close cut short took it, then closed the files
            self._close_active = (self.payload.active_id, self.payload.active_end)
        active = self._close_active
        try:
            self.payload.close()  # cuts the preallocated tail and fsyncs the segment
        except OSError as exc:
            return _os_error(exc, "closing the active segment failed")
        try:
            self.resume()  # after a failed write, reopening replays and flushes the WAL
            self.meta.sync_wal()
        except StorageError as exc:
            log.error("closing %s: the last metadata changes may not be durable: %s",
                      self.path, exc)
            return exc
        try:
            # Record that all of it is durable, so the next open scans nothing
            # (in durability="none" nothing else ever records it). Give back the
            # ids reserved and never handed out, so that after a clean restart ids
            # go on from the last one (after a crash the rest of the block is
            # skipped). Write the S record pushes defer whole, so the next open
            # scans no message records for deferred pushes (_seg_accounts.py).
            # Flushing the memtable now means the next open replays no
            # WAL: it opens faster and without that memory. All are only savings:
            # on a full disk they may fail, and everything is already durable;
            # either value of the id mark lies above every id handed out.
            batch = new_batch()
            batch.put(keys.SYNCED_KEY, records.pack([records.RECORD_VERSION, *active]))
            fid = self._deferred
            if fid is not None and fid in self.segments:  # whole: no push follows
                batch.put(keys.segment_key(fid), records.encode_segment(*self.segments[fid]))
            for _, _, key in self._awaiting_sync:  # the segment was fsynced above
                batch.delete(key)
            for key in self._deletes_at_close:
                batch.delete(key)
            if self._next_id < self._id_hwm:
                batch.put(keys.ID_HWM_KEY, records.pack([records.RECORD_VERSION,
                                                         self._next_id]))
            self.meta.write(batch)
            self._awaiting_sync.clear()
            self._deletes_at_close.clear()
            self.meta.flush()
        except StorageError as exc:
            log.warning("closing %s: %s (the next open replays the log)", self.path, exc)
        return None


def _os_error(exc: OSError, doing: str) -> StorageError:
    err = StorageError(f"{doing}: {exc}")
    err.errno = exc.errno
    return err
