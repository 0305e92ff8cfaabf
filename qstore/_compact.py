"""Seal-then-compact: reclaim the space of acknowledged messages.

One pass (docs/compaction.md says what each crash point leaves and how open
finishes or rolls it back):

1. ``seal``: if the active segment holds records and its garbage ratio is at
   least the threshold, seal it; pushes go to a fresh segment.
2. ``choose``: sealed segments with nothing live are deleted without copying.
   Then the sources: sealed segments whose garbage ratio (dead bytes / data
   bytes, from the per-segment counters in the metadata) is at least the
   threshold, oldest first, up to ``max_bytes`` of live payload (the first
   is always taken). Sources of an interrupted pass come first, whatever
   their ratio; many small sealed segments are folded in (see MERGE_MIN).
3. ``copy``: the compaction record ``[copying, output, sources]`` is synced,
   then the live records (found through a point-in-time scan of the metadata,
   never by trusting the files) are copied into the output segment, each
   CRC-checked on the way, and the output is fsynced.
4. ``repoint``: in chunks of :data:`REPOINT_CHUNK` messages, each one batch
   under the writer lock, a message's reference moves to the copy only if the
   message still exists and still points at the old bytes (compare-and-set):
   an ack, nack, purge or dead-lettering racing the pass is never undone.
   While the metadata's write mark shows that nothing but the pass wrote
   since the scan's view, every record is still as scanned and a chunk
   writes without reading them again (see _repoint). The first chunk's batch
   also moves the record to ``repointing``, so from then on the output is
   never discarded.
5. ``delete``: a sync makes the new references durable, the record moves to
   ``deleting``, the sources (now unreferenced) are unlinked, and the record
   is removed. Every payload read happens under the writer lock, so once the
   last chunk is committed nothing can look a source up again; a reader that
   already holds a source's map keeps it (POSIX keeps unlinked mapped files).

Copying runs outside the writer lock; pushes and pops wait at most for one
repoint chunk, one seal, or the unlinking of the dead segments.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._core import Core
from ._errors import InvalidArgument, StorageError, StoreClosed
from ._message import CompactionResult
from ._retry_log import RetryLog
from ._txn import Txn
from .meta import keys, records
from .payload import FRAME_SIZE as _FRAME_SIZE
from .payload import HEADER_SIZE, PayloadRef

if TYPE_CHECKING:
    import numpy as np
else:
    from ._lazy import np  # imported on first use (_lazy.py)

log = logging.getLogger("qstore.compact")

COPYING, REPOINTING, DELETING = records.COPYING, records.REPOINTING, records.DELETING

REPOINT_CHUNK = 1000  # messages per repoint batch: bounds how long the writer lock is held
DELETE_CHUNK = 64  # dead segments deleted per hold of the writer lock
# A pass that rewrites anything also folds in small sealed segments (at most
# 1/SMALL_FRACTION of segment_max_bytes) once there are MERGE_MIN of them, so
# the outputs of many passes holding a few long-lived messages do not pile up.
SMALL_FRACTION = 8
MERGE_MIN = 8

# Test hook: called with the name of each step as it completes ("sealed",
# "copied", "repointed_chunk", "repointed", "deleting", "done"), outside the
# writer lock. The crash harness kills the process from here. None normally.
step_hook: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if step_hook is not None:
        step_hook(name)


_SCAN_CHUNK = 8192  # message records decoded at a time by the scan


@dataclass
class _Live:
    """The messages whose payload is in the sources, in (file id, offset) order.

    Parallel columns, not an object per message (see _cyclic_gc_paused).
    """

    keys: list[bytes]
    values: list[bytes]  # each record as scanned: the compare-and-set compares against it
    refs: np.ndarray  # (n, 3) int64: file id, offset, length of each payload
    # The metadata's write mark (MetaDB.write_mark) when the scan's view was
    # taken, moved on past the pass's own writes; None once anything else wrote.
    mark: tuple[int, int] | None


class _Cancelled(Exception):
    """Internal: the store is closing while a pass copies."""


class Compactor:
    """Runs passes for one store: on demand, from a background thread, and on open."""

    def __init__(self, core: Core) -> None:
        self._core = core
        self._pass_lock = threading.Lock()  # one pass at a time
        self._pass_owner: int | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # a pass now, not at the end of the interval
        self._thread: threading.Thread | None = None
        # Sources of an interrupted pass that still hold live records: the next
        # pass takes them whatever their garbage ratio, so it finishes that pass.
        self._carry: list[int] = []
        # Since the store opened (the server's metrics): passes done and failed,
        # and what the done ones moved, freed and took.
        self.passes = 0
        self.failed_passes = 0
        self.messages_moved = 0
        self.bytes_freed = 0  # never decreases: each pass's bytes_freed is >= 0
        self.seconds = 0.0
        # Output bytes written by passes that could not delete their sources yet (a
        # read-only view was opening, or the pass failed once its repoint began):
        # the pass that deletes those sources subtracts them from what it frees.
        self._owed = 0

    # -- crash recovery on open -----------------------------------------------

    def recover(self) -> None:
        """Finish or roll back a pass a crash interrupted, and remove orphan segments.

        Runs while the store opens, before any other thread. The store has
        already discarded the output file of a pass still in ``copying``.
        """
        core = self._core
        raw = core.meta.get(keys.COMPACTION_KEY)
        if raw is not None:
            try:
                phase, output, sources = records.decode_compaction(raw)
            except StorageError as exc:
                # Damaged (the open failed with a msgpack traceback; a differential).
                # Dropping it is safe: an output nothing refers to is deleted below as
                # dead, one messages refer to is kept and accounted, and sources
                # still holding records are compacted again by their garbage.
                log.error("the record of an interrupted compaction pass is damaged (%s): "
                          "dropped; its output and sources are settled as any segment is",
                          exc)
                core.write_synced(deletes=[keys.COMPACTION_KEY])
                raw = None
        if raw is not None:
            phase, output, sources = records.decode_compaction(raw)
            log.warning("finishing a compaction pass interrupted in phase %s "
                        "(output %s, sources %s)", phase, output, sources)
            deletes = [keys.COMPACTION_KEY]
            if phase == COPYING:
                # Rolled back: nothing refers to the output (its file is gone).
                deletes.append(keys.segment_key(output))
            core.write_synced(deletes=deletes)
            if phase == COPYING:
                core.segments.pop(output, None)
            else:
                # Rolled forward: what was repointed stays repointed; sources
                # that still hold records are finished by the next pass.
                self._carry = [fid for fid in sources if fid in core.segments]
        # Sealed segments nothing refers to: sources of a finished pass, and
        # files a crash left between deleting their counters and unlinking them.
        self._delete_dead_segments()

    # -- background thread ----------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="qstore-compactor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        interval = self._core.config.compact_interval
        retries = RetryLog(log, "background compaction pass", interval)
        while True:
            self._wake.wait(interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.run_pass()
                retries.worked()
            except StoreClosed:
                return
            except StorageError as exc:  # a full disk, an I/O error: the pass rolled back
                retries.failed(exc)
            except Exception:
                # The store stays consistent whatever failed (see docs/compaction.md);
                # the error is reported and the pass retried at the next interval.
                log.exception("background compaction pass failed; it will be retried")

    def wake(self) -> None:
        """Run the background pass now (a segment's sync failed: SegmentSet.in_doubt)."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the background thread and wait for any pass in progress (closing).

        A pass still copying is abandoned (its output removed); one repointing
        finishes, which takes at most a few batches.
        """
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            if self._thread.ident is not None:  # else its start was cut short: no thread
                self._thread.join()
            self._thread = None
        if self._pass_owner != threading.get_ident():
            with self._pass_lock:
                pass

    # -- one pass -------------------------------------------------------------

    def run_pass(
        self,
        threshold: float | None = None,
        max_bytes: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> CompactionResult:
        """One seal-then-compact pass. ``progress(done, total)`` gets bytes copied."""
        core = self._core
        cfg = core.config
        threshold = cfg.compact_threshold if threshold is None else _check_threshold(threshold)
        max_bytes = cfg.compact_max_bytes if max_bytes is None else _check_max_bytes(max_bytes)
        with self._pass_lock:
            self._pass_owner = threading.get_ident()
            try:
                result = self._run(threshold, max_bytes, progress)
            except OSError as exc:  # the pass rolled back or stopped where it was safe to
                self.failed_passes += 1
                err = StorageError(f"compaction pass failed: {exc}")
                err.errno = exc.errno
                raise err from exc
            except StorageError:
                self.failed_passes += 1
                raise
            finally:
                self._pass_owner = None
            self.passes += 1
            self.messages_moved += result.messages_moved
            self.bytes_freed += result.bytes_freed
            self.seconds += result.seconds
            return result

    def _run(
        self, threshold: float, max_bytes: int, progress: Callable[[int, int], None] | None
    ) -> CompactionResult:
        core = self._core
        if self._stop.is_set():
            raise StoreClosed(f"store {core.path!r} is closing")
        started = time.perf_counter()
        with core.settling:
            core.check_writable()
            core.resume()  # after a failed metadata write (a full disk): reopen it first
        sealed = self._seal_if_worth(threshold)
        _step("sealed")
        deleted = self._delete_dead_segments()
        sources = self._choose(threshold, max_bytes)
        output = None
        moved = copied = written = 0
        if sources:
            output, moved, copied, written, more = self._compact(sources, progress)
            deleted.extend(more)
        # Never negative (CompactionResult): an output whose sources stay has freed
        # nothing yet; it is owed by the pass that deletes them. A negative amount
        # made the server's counter qstore_compaction_bytes_freed_total go down.
        # Settled before anything below can raise, so what is owed stays true.
        net = sum(size for _, size in deleted) - written - self._owed
        self._owed = max(0, -net)
        if deleted:
            with core.settling:
                core.reserve.restore()  # a full disk released it: space is back
            core.space_tick()
        return CompactionResult(
            sealed=sealed,
            segments_read=tuple(sources),
            segments_deleted=tuple(fid for fid, _ in deleted),
            output=output,
            messages_moved=moved,
            bytes_copied=copied,
            bytes_freed=max(0, net),
            seconds=time.perf_counter() - started,
        )

    # -- steps ----------------------------------------------------------------

    def _active_worth_sealing(self, threshold: float) -> bool:
        """Writer lock held: the active segment holds records, and its garbage is at
        least ``threshold`` or a sync of it failed (``SegmentSet.in_doubt``)."""
        core = self._core
        core.check_writable()
        active = core.payload.active_id
        assert active is not None
        size = core.payload.segment_size(active)
        live = core.segments.get(active, [0, 0, 0])[0]
        return size > HEADER_SIZE and (_garbage(size, live) >= threshold
                                       or active in core.payload.in_doubt)

    def _seal_if_worth(self, threshold: float) -> int | None:
        core = self._core
        with core.settling:
            if not self._active_worth_sealing(threshold):
                return None
        # Flush the active segment outside the writer lock, so that the fsync
        # sealing does under the lock finds next to nothing left to write.
        core.payload.sync()
        with core.settling:
            if not self._active_worth_sealing(threshold):
                return None
            return core.payload.seal()

    def _sealed_segments(self) -> list[tuple[int, int, int, int]]:
        """(file id, size, live bytes, live count) of every sealed segment, oldest first.

        Writer lock held, or the caller accepts a view that may be stale.
        """
        core = self._core
        active = core.payload.active_id
        out = []
        for fid in core.payload.file_ids():
            if fid != active:
                live = core.segments.get(fid, [0, 0, 0])
                out.append((fid, core.payload.segment_size(fid), live[0], live[1]))
        return out

    def _delete_dead_segments(self) -> list[tuple[int, int]]:
        """Delete sealed segments nothing refers to; returns (file id, size) of each.

        :data:`DELETE_CHUNK` at a time: their counters go first, in one synced
        batch, then the files; a crash between the two leaves files without
        counters, which the next open deletes. Under the writer lock, so no read
        can be looking one up; and only while no read-only view is opening
        (payload/_views.py): one that is may hold metadata that still refers to
        them, so they are left (nothing live) for the next pass.
        """
        core = self._core
        with core.settling:
            dead = [(fid, size) for fid, size, _, count in self._sealed_segments() if count == 0]
            unrecorded = [fid for fid, _ in dead if fid not in core.segments]
            if unrecorded:
                kept = self._recount_unrecorded(unrecorded)
                dead = [(fid, size) for fid, size in dead if fid not in kept]
        done: list[tuple[int, int]] = []
        # DELETE_CHUNK at a time, letting go of the writer lock between them: one
        # hold for all took about 100 us a segment (5,000 dead segments held every
        # push 0.5 s; a scale audit). A sealed segment with nothing live stays so:
        # only pushes (to the active segment) and passes (to new ones) add refs.
        for start in range(0, len(dead), DELETE_CHUNK):
            chunk = dead[start:start + DELETE_CHUNK]
            # Outside the writer lock: this waits (a bounded time) for read-only
            # views that are opening, and holds new ones back meanwhile.
            with core.payload.no_view_opening() as free, core.settling:
                if not free:
                    # Views kept opening past the wait: their metadata may still refer
                    # to these. They stay (S records with nothing live) for the next pass.
                    break
                if core.closed:
                    break
                core.write_synced(deletes=[keys.segment_key(fid) for fid, _ in chunk])
                accounts = {fid: core.segments.pop(fid, None) for fid, _ in chunk}
                try:
                    core.payload.delete(fid for fid, _ in chunk)
                except StorageError:
                    self._account_undeleted(accounts)
                    raise
            done += chunk
        return done

    def _recount_unrecorded(self, fids: list[int]) -> set[int]:
        """Writer lock held: of sealed segments with no S record, those messages
        refer to; their S records are rebuilt from a recount (an ERROR line each).

        A file without an S record is one whose deletion a crash cut short (the
        record goes first): nothing refers to it, and it is deleted. But a lost
        or damaged S record looks the same, and the open deleted a segment full
        of live messages, a later ``check --repair`` then burying them all as
        damaged (a check-vs-audit differential). The scan of every message
        record this costs (about 0.5 s per million messages) is paid only when
        such a file is there: at the first open after a crash or power loss
        (rotated segments whose pushes the loss took, deletions cut short; a
        power-loss audit found them at 5-50% of its opens), then not again.
        """
        core = self._core
        live = self._scan_live(fids)
        if not live.keys:
            return set()
        frames = live.refs[:, 2] + _FRAME_SIZE
        found: dict[int, tuple[int, int, int]] = {}
        for fid in np.unique(live.refs[:, 0]).tolist():
            rows = live.refs[:, 0] == fid
            found[fid] = (int(frames[rows].sum()), int(rows.sum()),
                          int((live.refs[rows, 1] + frames[rows]).max()))
        core.rebuild_derived([], [], {}, dict(found), None)
        for fid, (nbytes, count, end) in found.items():
            log.error("segment %s has no S record, but %d messages refer to it: kept, its "
                      "record rebuilt from them (%d bytes, data end %d); the record was "
                      "lost or damaged (run `qstore check`)", core.payload.path_of(fid),
                      count, nbytes, end)
        return set(found)

    def _account_undeleted(self, accounts: dict[int, list[int] | None]) -> None:
        """Writer lock held: give the dead segments whose unlink failed their S records back.

        With its S record (nothing live) such a file is accounted for, as any
        dead segment waiting for a pass, rather than an orphan; the next pass
        finds it dead again and retries the unlink (the payload keeps it listed).
        """
        core = self._core
        left = set(core.payload.file_ids())
        back = {}
        for fid, old in accounts.items():
            if fid in left:
                back[fid] = [0, 0, old[2] if old else core.payload.segment_size(fid)]
        if not back:
            return
        try:
            core.write_synced([(keys.segment_key(fid), records.encode_segment(*seg))
                               for fid, seg in back.items()])
        except StorageError:
            # Only the check's view suffers (an orphan until the next pass or open
            # deletes it): the unlink's error is the one to report.
            log.exception("could not record dead segments %s again", sorted(back))
            return
        core.segments.update(back)

    def _choose(self, threshold: float, max_bytes: int) -> list[int]:
        """Sources of this pass: carried over, or garbage >= threshold; oldest first."""
        core = self._core
        with core.settling:
            segments = self._sealed_segments()
        # A segment whose sync failed is rewritten whatever its garbage, as a carry is.
        carry = set(self._carry) | core.payload.in_doubt
        chosen: list[int] = []
        budget = 0
        for fid, size, live, _ in segments:
            if fid in carry or _garbage(size, live) >= threshold:
                if chosen and budget + live > max_bytes:
                    break
                chosen.append(fid)
                budget += live
        if chosen:
            small_max = core.config.segment_max_bytes // SMALL_FRACTION
            small = [(fid, live) for fid, size, live, _ in segments
                     if fid not in chosen and size <= small_max]
            if len(small) >= MERGE_MIN:
                for fid, live in small:
                    if budget + live > max_bytes:
                        break
                    chosen.append(fid)
                    budget += live
        self._carry = [fid for fid in self._carry if fid not in chosen]
        return sorted(chosen)

    def _compact(
        self, sources: list[int], progress: Callable[[int, int], None] | None
    ) -> tuple[int | None, int, int, int, list[tuple[int, int]]]:
        """Copy, repoint, delete. Returns (output, moved, copied, written, deleted)."""
        with _cyclic_gc_paused():
            return self._compact_sources(sources, progress)

    def _compact_sources(
        self, sources: list[int], progress: Callable[[int, int], None] | None
    ) -> tuple[int | None, int, int, int, list[tuple[int, int]]]:
        core = self._core
        # Record the durable mark (M synced) the seal moved now, not from the
        # background sync in the middle of the pass: any write after the scan's
        # view makes every repoint chunk read its records again (see _repoint).
        core.syncer.sync_now()
        live = self._scan_live(sources)
        if not live.keys:
            # Everything in the sources was acked since they were chosen.
            return None, 0, 0, 0, self._delete_dead_segments()
        total = int(live.refs[:, 2].sum()) + _FRAME_SIZE * len(live.keys)
        output = core.payload.reserve_file_id()
        self._write_record(COPYING, output, sources, live)
        try:
            news = self._copy(output, live.refs, total, progress)
            _step("copied")
        except BaseException as exc:
            # Not a (simulated) crash: roll back now. A Ctrl-C too: it left the
            # output unknown to the running store (an orphan to the check) and the
            # pass's record in place until the next open (an interrupt audit).
            if isinstance(exc, (Exception, KeyboardInterrupt)):
                self._roll_back(output)
            if isinstance(exc, _Cancelled):
                raise StoreClosed(f"store {core.path!r} is closing; "
                                  "the compaction pass was rolled back") from None
            raise
        written = core.payload.segment_size(output)
        try:
            moved = self._repoint(live, news, output, written, sources)
            # Make the new references durable before the old bytes can go.
            core.syncer.sync_now()
            _step("repointed")
            self._write_record(DELETING, output, sources)
            _step("deleting")
            deleted = self._delete_dead_segments()
        except (Exception, KeyboardInterrupt):
            # Messages may refer to the output now: keep it, stop here, and let
            # the next pass finish moving what is left in the sources and delete
            # them (a source is deleted only once nothing refers to it, and an
            # unlink that failed is retried: see _delete_dead_segments).
            self._carry = list(sources)
            self._owed += written  # the output stays: owed by the pass that deletes them
            self._clear_record_quietly()
            raise
        left = [fid for fid in sources if core.segments.get(fid, [0, 0])[1]]
        if left:  # cannot happen while pushes only target the active segment
            log.error("segments %s still hold live records after repointing; kept", left)
            self._carry = left
        self._clear_record()
        _step("done")
        return output, moved, total, written, deleted

    def _scan_live(self, sources: list[int]) -> _Live:
        """Every message whose payload is in ``sources``, in (file id, offset) order.

        A point-in-time scan of the metadata, outside the writer lock. Pushes
        only ever go to the active segment, so no message can come to point
        into a source after the scan; anything acked, nacked or moved since is
        caught by the compare-and-set of the repoint. The scan's iterator (its
        view) is made under the writer lock, together with the write mark
        that tells the repoint whether anything was written since.
        """
        meta = self._core.meta
        wanted = np.array(sources, np.int64)
        live = _Live([], [], np.empty((0, 3), np.int64), None)
        tables = [live.refs]
        ks: list[bytes] = []
        vs: list[bytes] = []

        def keep() -> None:
            refs = records.message_refs(ks, vs)
            inside = np.isin(refs[:, 0], wanted)
            if inside.all():
                live.keys.extend(ks)
                live.values.extend(vs)
                tables.append(refs)
            elif inside.any():
                rows = np.flatnonzero(inside).tolist()
                live.keys.extend([ks[i] for i in rows])
                live.values.extend([vs[i] for i in rows])
                tables.append(refs[inside])
            ks.clear()
            vs.clear()

        with self._core.settling:
            live.mark = meta.write_mark()
            items = meta.scan(keys.MESSAGE, keys.prefix_end(keys.MESSAGE))
            first = next(items, None)  # makes the iterator: its view is of this moment
        try:
            if first is not None:
                ks.append(first[0])
                vs.append(first[1])
            for key, value in items:
                ks.append(key)
                vs.append(value)
                if len(ks) >= _SCAN_CHUNK:
                    keep()
            if ks:
                keep()
        finally:
            items.close()  # a live iterator would keep RocksDB's LOCK after close()
        live.refs = np.concatenate(tables)
        order = np.lexsort((live.refs[:, 1], live.refs[:, 0]))
        if not np.array_equal(order, np.arange(len(order))):
            rows = order.tolist()
            live.keys = [live.keys[i] for i in rows]
            live.values = [live.values[i] for i in rows]
            live.refs = live.refs[order]
        return live

    def _copy(
        self,
        output: int,
        refs: np.ndarray,
        total: int,
        progress: Callable[[int, int], None] | None,
    ) -> np.ndarray:
        """Copy the payloads ``refs`` into segment ``output``; returns their new offsets."""
        done = 0

        def on_copy(nbytes: int) -> None:
            nonlocal done
            if self._stop.is_set():
                raise _Cancelled()
            done += nbytes
            if progress is not None:
                progress(done, total)

        damaged: list[tuple[PayloadRef, str]] = []
        news = self._core.payload.copy_records(output, refs, on_copy, damaged)
        for ref, reason in damaged:
            # Copied as it is (still damaged): the pass must not fail on it forever.
            # A pop moves the message to the dead letters; `qstore check` names it.
            log.error("compaction: the record at %s is damaged (%s); copied as it is to "
                      "segment %d", ref, reason, output)
        return news

    def _repoint(
        self,
        live: _Live,
        news: np.ndarray,
        output: int,
        output_end: int,
        sources: list[int],
    ) -> int:
        """Move each message still at its old bytes to the copy; returns how many moved.

        Under the writer lock, a chunk whose write mark is still the one the
        pass left (nothing but the pass itself wrote since the scan's view)
        holds every message as scanned: its new records go in as they are.
        Once anything else wrote, every later chunk reads its records again
        and compares them with the scan (the compare-and-set).
        """
        core = self._core
        repoint, message_ref = records.repoint, records.message_ref
        mkeys, scanned = live.keys, live.values
        offsets = news.tolist()
        fids, frames = live.refs[:, 0], live.refs[:, 2] + _FRAME_SIZE
        # The new record of each message as the scan saw it, encoded outside the lock.
        encoded = records.repoint_many(scanned, output, offsets)
        old_refs: list[list[int]] | None = None  # made when a chunk has to compare
        moved = 0
        for start in range(0, len(mkeys), REPOINT_CHUNK):
            stop = min(start + REPOINT_CHUNK, len(mkeys))
            with core.settling:
                txn = Txn()
                txn.cache_records = False
                if start == 0:
                    txn.put(keys.COMPACTION_KEY,
                            records.encode_compaction(REPOINTING, output, sources))
                    txn.set_end(output, output_end)
                put = txn.put_record
                if live.mark is not None and core.meta.write_mark() == live.mark:
                    txn.put_records(mkeys[start:stop], encoded[start:stop])
                    chosen: slice | list[int] = slice(start, stop)
                else:
                    live.mark = None
                    if old_refs is None:
                        old_refs = live.refs.tolist()
                    raws = core.meta.multi_get(mkeys[start:stop])
                    chosen = []
                    for i, raw in zip(range(start, stop), raws, strict=True):
                        value = encoded[i]
                        if raw != scanned[i]:
                            if raw is None:
                                continue  # acked, purged, or its queue deleted since the scan
                            # Changed since the scan (nacked, leased, dead-lettered...):
                            # move it only if it still points at the bytes copied.
                            if list(message_ref(raw)) != old_refs[i]:
                                continue
                            value = repoint(raw, output, offsets[i])
                        put(mkeys[i], value)
                        chosen.append(i)
                n = _count_moves(txn, fids[chosen], frames[chosen], output)
                core.commit(txn)
                if live.mark is not None:
                    live.mark = core.meta.write_mark()
            moved += n
            _step("repointed_chunk")
        return moved

    # -- the compaction record ------------------------------------------------

    def _write_record(self, phase: str, output: int, sources: list[int],
                      live: _Live | None = None) -> None:
        """Write the record; ``live``'s write mark moves past it if nothing else wrote."""
        core = self._core
        with core.settling:
            unchanged = live is not None and core.meta.write_mark() == live.mark
            core.write_synced([(keys.COMPACTION_KEY,
                                records.encode_compaction(phase, output, sources))])
            if live is not None:
                live.mark = core.meta.write_mark() if unchanged else None

    def _clear_record(self) -> None:
        self._core.write_synced(deletes=[keys.COMPACTION_KEY])

    def _clear_record_quietly(self) -> None:
        """Clear the record while another error is on its way up (it is the one to report)."""
        try:
            self._clear_record()
        except Exception:
            log.exception("could not clear the compaction record; the next open will")

    def _roll_back(self, output: int) -> None:
        """Undo a pass that failed before any message referred to its output."""
        core = self._core
        try:
            with core.settling:
                # By name, whether or not copy_live got as far as listing it.
                core.payload.delete([output])
        except StorageError as exc:  # the copy's error is the one to report
            log.error("could not remove the output segment %d of a failed compaction "
                      "pass: %s", output, exc)
            if os.path.exists(core.payload.path_of(output)):
                # The record ([copying, output]) stays: the check accepts the file
                # and the next open discards it.
                return
        self._clear_record_quietly()


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cycle collector while a pass holds its per-message tables.

    A pass keeps a few objects per message it moves (references, keys, the
    old-to-new map), and PayloadRef tuples are never untracked by the
    collector, so each full collection would walk all of them: a third of
    the CPU time of a pass of 1 KiB messages. Nothing the pass builds forms
    a cycle; other threads' cycles are collected when it ends.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _count_moves(txn: Txn, fids: np.ndarray, frames: np.ndarray, output: int) -> int:
    """Count records of segments ``fids`` (``frames`` bytes each) moved to ``output``.

    The counters Txn.live would keep, summed per segment; returns how many.
    """
    segs, which = np.unique(fids, return_inverse=True)
    nbytes = np.zeros(len(segs), np.int64)
    np.add.at(nbytes, which, frames)
    counts = np.bincount(which, minlength=len(segs))
    for fid, b, c in zip(segs.tolist(), nbytes.tolist(), counts.tolist(), strict=True):
        txn.segment_delta(fid, -b, -c)
    txn.segment_delta(output, int(nbytes.sum()), len(fids))
    return len(fids)


def _garbage(size: int, live: int) -> float:
    body = size - HEADER_SIZE
    return 0.0 if body <= 0 else max(0.0, (body - live) / body)


def _check_threshold(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise InvalidArgument(f"threshold must be a number in [0, 1], not {value!r}")
    return float(value)


def _check_max_bytes(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(f"max_bytes must be a positive int, not {value!r}")
    return value
