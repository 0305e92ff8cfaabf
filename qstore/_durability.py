"""When written bytes reach stable storage: the three durability modes.

- ``none``: the OS decides. A process kill loses nothing that returned
  (payload bytes and the RocksDB WAL are in the page cache), a power loss may.
- ``interval`` (default): a background thread fdatasyncs the payload and syncs
  the WAL every ``sync_interval`` seconds when something was written, like
  beanstalkd's 50 ms fsync. A power loss loses at most about that window.
- ``always``: an operation returns only after its bytes are on stable storage.
  Concurrent callers share syncs (group commit): each commits its batch under
  the writer lock, releases it, and waits for a sync that covers its batch;
  one waiter performs the sync for everyone queued behind it.

A sync runs the payload fdatasync and the WAL sync at the same time (both
release the GIL), so an operation in ``always`` mode pays for about one sync,
not two in a row. That is safe because an operation returns only after both
have finished, and because every batch records how far the active segment
was durable when it was written (the ``M synced`` key): if power fails while
the WAL is on disk but a payload is not, recovery on open scans the segment
from that offset, cuts what did not survive, and drops the messages that
referred to it. They belong to operations that had not returned.

After each sync the mark moves to what that sync covered, in a small batch
written (not synced: the next sync carries it to disk) before any waiter
returns (``on_synced``). So once an operation has returned, even a process
kill right after it leaves a mark covering its bytes, and a record below the
mark that is later found damaged is damage (kept, reported, Corruption on
read), never cut as an unsynced tail (issue 11 case 4). Only a power loss
before the next sync can lose that batch: the mark then lags one sync, and
damage in that last synced stretch is cut like an unsynced tail.

In ``always`` mode a batch of up to ``JOURNAL_MAX_BYTES`` of payload also
carries the bodies it appended (``J`` keys, the payload journal): the WAL
sync alone then makes the operation durable, one flush of the disk instead
of two. The segment itself is fdatasynced by a background checkpoint every
``sync_interval`` (and when a segment is sealed or the store closes), after
which the journal keys it covers are deleted; an open after a crash first
writes every journaled body back into its segment. Payload bytes that no
journal key covers (a larger batch, the records of a failed operation) set
``payload_needed``, and the next sync fdatasyncs the payload as well.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ._errors import StorageError
from ._retry_log import RetryLog

if TYPE_CHECKING:
    from .meta import MetaDB
    from .payload import SegmentSet

log = logging.getLogger("qstore")


class Syncer:
    def __init__(self, mode: str, interval: float, payload: SegmentSet, meta: MetaDB) -> None:
        self.mode = mode
        self._interval = interval
        self._payload = payload
        self._meta = meta
        self._written = 0  # batches written (under the writer lock)
        self._synced = 0  # batches known to be on stable storage
        self._syncing = False
        self._leader = 0  # the thread whose sync ``_syncing`` is
        # An RLock, which knows its owner: wait() must tell, whatever cut it short.
        self._cv_lock = threading.RLock()
        self._cv = threading.Condition(self._cv_lock)
        self._dirty = False
        self._stop = threading.Event()
        self._kick = threading.Event()  # wakes the thread before its interval ends
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.syncs = 0
        self.sync_seconds = 0.0  # spent in the syncs counted by ``syncs``
        self._retries = RetryLog(log, "background sync", interval)
        # always mode: the WAL sync alone makes journaled appends durable (see above)
        self.journal = mode == "always"
        self.payload_needed = False  # unjournaled payload bytes await a sync
        # Held from taking payload_needed until the payload sync it stands for is
        # done (sync_now): a sync that finds the flag taken waits here for that one.
        self._payload_lock = threading.Lock()
        # Called after each successful sync, before any waiter returns: the core
        # records the new durable mark (M synced) there. See sync_now.
        self.on_synced: Callable[[], None] | None = None
        # always mode: called after each checkpoint tick (the core's journal policy)
        self.on_checkpoint: Callable[[], None] | None = None
        # Called at each tick of the thread, before its sync or checkpoint (the
        # core's watch of the free space; it logs its own failures).
        self.on_tick: Callable[[], None] | None = None

    def wrote(self) -> None:
        """A batch was written (writer lock held)."""
        self._written += 1
        self._dirty = True

    def ticket(self) -> int | None:
        """What :meth:`wait` must see synced for the caller's changes (writer lock held)."""
        return self._written if self.mode == "always" else None

    def wait(self, ticket: int | None) -> None:
        if ticket is None:
            return
        cv, lock, me = self._cv, self._cv_lock, threading.get_ident()
        try:
            # Inside the try: an interrupt as the acquire returned left the lock held
            # for good, and every other thread's write waited forever (an
            # interrupt audit).
            lock.acquire()
            while self._synced < ticket:
                if self._syncing:
                    cv.wait()
                    continue
                self._syncing, self._leader = True, me
                target = self._written
                lock.release()
                try:
                    self.sync_now()
                finally:
                    lock.acquire()
                self._syncing = False
                cv.notify_all()
                self._synced = max(self._synced, target)
        finally:
            # Also when cut short at any point (a failed sync, or KeyboardInterrupt
            # between two lines): the lock held once more, a sync this thread led
            # marked over so that the other waiters take their turn instead of
            # waiting for it for good, then the lock released.
            try:
                if not lock._is_owned():  # type: ignore[attr-defined]
                    lock.acquire()
                if self._syncing and self._leader == me:
                    self._syncing = False
                    cv.notify_all()
            finally:  # and if this is cut short too, the lock still goes
                if lock._is_owned():  # type: ignore[attr-defined]
                    lock.release()

    def sync_now(self) -> None:
        """Make everything written so far durable: payload first, then the WAL."""
        self._dirty = False
        started = time.perf_counter()
        payload = self._payload
        with self._payload_lock:
            needed, self.payload_needed = self.payload_needed, False
            try:  # no call between taking the flag and this: no interrupt point
                self._sync_now(payload, needed)
            except BaseException:
                if needed:
                    self.payload_needed = True  # still not known to be on disk
                raise
        self.syncs += 1
        self.sync_seconds += time.perf_counter() - started
        if self.on_synced is not None:
            self.on_synced()

    def _sync_now(self, payload: SegmentSet, needed: bool) -> None:
        """:meth:`sync_now`'s syncs, ``_payload_lock`` held: a caller that took
        ``payload_needed`` (the compactor calls sync_now beside the group commit)
        syncs the payload before any other sync returns. Without the lock, a
        group commit that found the flag taken synced only the log and let its
        waiters return while that fdatasync still ran (a race audit)."""
        try:
            if self.journal and not needed:
                self._meta.sync_wal()  # journaled: the checkpoint syncs the segment later
            elif payload.unsynced:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="qstore-fdatasync")
                done = self._pool.submit(payload.sync)
                try:
                    self._meta.sync_wal()
                finally:
                    done.result()
            else:
                self._meta.sync_wal()
                # Nothing looked unsynced, but another caller (the compactor) may have
                # taken the flag and still be inside its fdatasync, or have failed
                # it: sync() waits for that one and retries a failure. Returning
                # before it would report bytes durable that are not (issue case 5).
                payload.sync()
        except OSError as exc:
            raise StorageError(f"sync failed: {exc}") from exc

    def start(self) -> None:
        if self.mode in ("interval", "always"):
            self._thread = threading.Thread(target=self._loop, name="qstore-sync", daemon=True)
            self._thread.start()

    def kick(self) -> None:
        """Run the background step (always mode: the checkpoint) now, not at the end
        of the interval: the journal grew large (see ``_hot.JOURNAL_FLUSH_BYTES``)."""
        self._kick.set()

    def _loop(self) -> None:
        while True:
            self._kick.wait(self._interval)
            self._kick.clear()
            if self._stop.is_set():
                return
            if self.on_tick is not None:
                self.on_tick()
            if self.journal:
                self.checkpoint()
            else:
                self.background_sync()

    def checkpoint(self) -> None:
        """always mode, in the background: fdatasync the journaled payload, then let
        ``on_synced`` delete the journal keys it covers (their batch needs no sync
        of its own: a lost delete only makes the next open rewrite equal bytes)."""
        payload = self._payload
        try:
            if payload.unsynced:
                try:
                    payload.sync()
                except OSError as exc:
                    raise StorageError(f"sync failed: {exc}") from exc
                if self.on_synced is not None:
                    self.on_synced()
            if self.on_checkpoint is not None:
                self.on_checkpoint()
        except StorageError as exc:
            self._retries.failed(exc)
            return
        self._retries.worked()

    def background_sync(self) -> None:
        """One attempt of the background thread: sync if something was written.

        A failure (a full disk, metadata writes stopped after an error) is
        logged once per episode, not at every interval, and retried next time.
        """
        if not self._dirty:
            return
        try:
            self.sync_now()
        except StorageError as exc:
            self._dirty = True
            self._retries.failed(exc)
            return
        self._retries.worked()

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            if self._thread.ident is not None:  # else its start was cut short: no thread
                self._thread.join()
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
