"""Seal-then-compact: reclaim the space of acknowledged messages.

One pass (see docs/compaction.md for what each crash point leaves):

1. ``seal``: if the active segment is worth compacting, seal it; pushes go to a new one.
2. ``choose``: sealed segments whose garbage ratio is at least the threshold,
   oldest first, up to ``max_bytes`` of live payload. Segments with nothing
   live are deleted without copying.
3. ``copy``: the compaction record ``[copying, output, sources]`` is synced,
   then the live records (found through the metadata) are copied into the
   output segment, CRC-checked on the way, and fsynced.
4. ``repoint``: in chunked batches under the writer lock, each message's
   reference moves to the copy only if the message still exists and still
   points at the old bytes (compare-and-set): an ack, nack or purge racing
   the pass is never undone. The first chunk's batch also moves the record
   to ``repointing``, so from then on the output is never discarded.
5. ``delete``: after a sync makes the new references durable, the record
   moves to ``deleting``, the sources are unlinked, and the record is removed.
   Readers already holding a source's map keep it (POSIX keeps unlinked
   mapped files alive).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._txn import Txn
from .meta import keys, records
from .payload import PayloadRef
from .payload._format import HEADER_SIZE

if TYPE_CHECKING:
    from ._store import Store

log = logging.getLogger("qstore.compact")

REPOINT_CHUNK = 1000
# Test hook: called with the name of each step as it completes (the crash
# harness kills the process from here). None in normal use.
step_hook: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if step_hook is not None:
        step_hook(name)


@dataclass(frozen=True)
class CompactionResult:
    """What one pass did."""

    sealed: int | None
    segments_read: tuple[int, ...]
    segments_deleted: tuple[int, ...]
    output: int | None
    messages_moved: int
    bytes_copied: int
    bytes_freed: int
    seconds: float


class Compactor:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._pass_lock = threading.Lock()  # one pass at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0

    # -- crash recovery on open -----------------------------------------------

    def recover(self) -> None:
        """Finish or roll back a pass that a crash interrupted (store opening)."""
        store = self._store
        raw = store.meta.get(keys.COMPACTION_KEY)
        if raw is None:
            return
        _, phase, output, sources = records.unpack(raw, "compaction")
        log.warning("finishing an interrupted compaction (phase %s, output %s, sources %s)",
                    phase, output, sources)
        txn = Txn()
        txn.delete(keys.COMPACTION_KEY)
        if phase == "copying":
            # The output was never referenced; SegmentSet already removed its file.
            txn.delete(keys.segment_key(output))
        store.meta.write(txn.batch, sync=True)
        # Sources whose records all moved are now garbage; the next pass (or
        # this cleanup) deletes them. Partly repointed sources stay until a
        # later pass finishes moving them.
        self._delete_dead_segments()

    # -- background thread ----------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="qstore-compactor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._store.config.compact_interval):
            try:
                self.run_pass()
            except Exception:
                log.exception("background compaction pass failed; it will be retried")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- one pass -------------------------------------------------------------

    def run_pass(
        self,
        threshold: float | None = None,
        max_bytes: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> CompactionResult:
        """One seal-then-compact pass. ``progress(done, total)`` gets bytes copied."""
        store = self._store
        cfg = store.config
        threshold = cfg.compact_threshold if threshold is None else threshold
        max_bytes = cfg.compact_max_bytes if max_bytes is None else max_bytes
        with self._pass_lock:
            started = time.perf_counter()
            sealed = self._seal_if_worth(threshold)
            _step("sealed")
            freed = 0
            deleted = list(self._delete_dead_segments())
            freed += sum(size for _, size in deleted)
            sources = self._choose(threshold, max_bytes)
            output = None
            moved = copied = 0
            if sources:
                output, moved, copied, more = self._compact(sources, progress)
                deleted.extend(more)
                freed += sum(size for _, size in more)
            self.passes += 1
            return CompactionResult(
                sealed, tuple(sources), tuple(fid for fid, _ in deleted), output, moved,
                copied, freed, time.perf_counter() - started,
            )

    def _seal_if_worth(self, threshold: float) -> int | None:
        store = self._store
        with store._lock:
            store._check_writable()
            active = store.payload.active_id
            assert active is not None
            size = store.payload.segment_size(active)
            live = store.seg_live.get(active, [0, 0, 0])[0]
            if _garbage(size, live) < threshold:
                return None
            return store.payload.seal()

    def _sealed_segments(self) -> list[tuple[int, int, int]]:
        """(file id, size, live bytes) of every sealed segment, oldest first."""
        store = self._store
        with store._lock:
            active = store.payload.active_id
            return [(fid, store.payload.segment_size(fid), store.seg_live.get(fid, [0])[0])
                    for fid in store.payload.file_ids() if fid != active]

    def _delete_dead_segments(self) -> list[tuple[int, int]]:
        """Delete sealed segments nothing refers to; returns (file id, size) of each."""
        store = self._store
        dead = [(fid, size) for fid, size, _ in self._sealed_segments()
                if store.seg_live.get(fid, [0, 0])[1] == 0]
        if not dead:
            return []
        with store._lock:
            txn = Txn()
            for fid, _ in dead:
                txn.delete(keys.segment_key(fid))
            store.meta.write(txn.batch, sync=True)
            for fid, _ in dead:
                store.seg_live.pop(fid, None)
            store.payload.delete(fid for fid, _ in dead)
        return dead

    def _choose(self, threshold: float, max_bytes: int) -> list[int]:
        chosen: list[int] = []
        budget = 0
        for fid, size, live in self._sealed_segments():
            if _garbage(size, live) >= threshold:
                if chosen and budget + live > max_bytes:
                    break
                chosen.append(fid)
                budget += live
        return chosen

    def _compact(
        self, sources: list[int], progress: Callable[[int, int], None] | None
    ) -> tuple[int, int, int, list[tuple[int, int]]]:
        store = self._store
        wanted = set(sources)
        # Live records of the sources, from a point-in-time scan of the metadata.
        # Pushes only ever go to the active segment, so nothing new can appear
        # in a source after this scan; anything acked since is caught by the CAS.
        live: list[tuple[bytes, PayloadRef]] = []
        for key, value in store.meta.scan(keys.MESSAGE, keys.prefix_end(keys.MESSAGE)):
            rec = records.MessageRecord.decode(value)
            if rec.file_id in wanted:
                live.append((key, PayloadRef(rec.file_id, rec.offset, rec.length)))
        live.sort(key=lambda kv: kv[1])
        total = sum(ref.frame_bytes for _, ref in live)
        output = store.payload.reserve_file_id()
        txn = Txn()
        txn.put(keys.COMPACTION_KEY, _record("copying", output, sources))
        store.meta.write(txn.batch, sync=True)
        done = 0

        def on_copy(nbytes: int) -> None:
            nonlocal done
            done += nbytes
            if progress is not None:
                progress(done, total)

        mapping = store.payload.copy_live(output, [ref for _, ref in live], on_copy)
        _step("copied")
        out_end = store.payload.segment_size(output)
        moved = 0
        first = True
        for start in range(0, len(live), REPOINT_CHUNK) or [0]:
            chunk = live[start : start + REPOINT_CHUNK]
            with store._lock:
                txn = Txn()
                if first:
                    txn.put(keys.COMPACTION_KEY, _record("repointing", output, sources))
                    txn.seg_ends[output] = out_end
                    first = False
                raws = store.meta.multi_get([k for k, _ in chunk]) if chunk else []
                for (key, old), raw in zip(chunk, raws, strict=True):
                    if raw is None:
                        continue  # acked or purged since the scan
                    rec = records.MessageRecord.decode(raw)
                    if (rec.file_id, rec.offset, rec.length) != old:
                        continue  # not pointing at the bytes we copied
                    new = mapping[old]
                    rec.file_id, rec.offset = new.file_id, new.offset
                    txn.put(key, rec.encode())
                    txn.live(old, -1)
                    txn.live(new, 1)
                    moved += 1
                store._commit(txn)
            _step("repointed_chunk")
        # Make the new references durable before the old bytes can go.
        store.syncer.sync_now()
        _step("repointed")
        with store._lock:
            txn = Txn()
            txn.put(keys.COMPACTION_KEY, _record("deleting", output, sources))
            store.meta.write(txn.batch, sync=True)
        _step("deleting")
        deleted = self._delete_dead_segments()
        still = [fid for fid in sources if fid in store.seg_live]
        if still:
            log.error("segments %s still hold live records after repointing; kept", still)
        with store._lock:
            txn = Txn()
            txn.delete(keys.COMPACTION_KEY)
            store.meta.write(txn.batch, sync=True)
        _step("done")
        return output, moved, total, deleted


def _garbage(size: int, live: int) -> float:
    body = size - HEADER_SIZE
    return 0.0 if body <= 0 else (body - live) / body


def _record(phase: str, output: int, sources: list[int]) -> bytes:
    return records.pack([records.RECORD_VERSION, phase, output, sources])
