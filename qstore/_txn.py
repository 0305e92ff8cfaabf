"""One atomic change to the store: a WriteBatch plus the counter deltas it carries.

Counters (per queue and per payload segment) are written only here, in the
same batch as the change they count, so ``stats()`` always equals a recount.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .meta import keys, new_batch, records
from .payload import PayloadRef

if TYPE_CHECKING:
    from ._store import QueueState, Store

# Indexes into a queue's counter list.
READY, DELAYED, INFLIGHT, DEAD, BYTES = range(5)
STATE_COUNTER = {records.READY: READY, records.DELAYED: DELAYED,
                 records.INFLIGHT: INFLIGHT, records.DEAD: DEAD}


class Txn:
    __slots__ = ("batch", "queues", "segments", "seg_ends", "ready_keys", "events", "id_hwm")

    def __init__(self) -> None:
        self.batch = new_batch()
        self.queues: dict[int, tuple[QueueState, list[int]]] = {}
        self.segments: dict[int, list[int]] = {}  # file_id -> [live bytes, live count]
        self.seg_ends: dict[int, int] = {}
        self.ready_keys: dict[QueueState, list[bytes]] = {}  # ready keys written per queue
        self.events: dict[QueueState, int] = {}  # earliest due time / deadline written (us)
        self.id_hwm: int | None = None

    def put(self, key: bytes, value: bytes) -> None:
        self.batch.put(key, value)

    def delete(self, key: bytes) -> None:
        self.batch.delete(key)

    def count(self, q: QueueState, index: int, n: int) -> None:
        entry = self.queues.get(q.qid)
        if entry is None:
            entry = self.queues[q.qid] = (q, [0, 0, 0, 0, 0])
        entry[1][index] += n

    def add_ready(self, q: QueueState, key: bytes) -> None:
        self.batch.put(key, b"")
        added = self.ready_keys.get(q)
        if added is None:
            self.ready_keys[q] = [key]
        else:
            added.append(key)

    def add_event(self, q: QueueState, when_us: int) -> None:
        low = self.events.get(q)
        if low is None or when_us < low:
            self.events[q] = when_us

    def live(self, ref: PayloadRef, sign: int) -> None:
        """Count one record as referenced (+1) or released (-1) in its segment."""
        entry = self.segments.get(ref.file_id)
        if entry is None:
            entry = self.segments[ref.file_id] = [0, 0]
        entry[0] += sign * ref.frame_bytes
        entry[1] += sign

    def written(self, ref: PayloadRef) -> None:
        """A new record: counts it live and moves the segment's committed end."""
        self.live(ref, 1)
        end = ref.offset + ref.frame_bytes
        if end > self.seg_ends.get(ref.file_id, 0):
            self.seg_ends[ref.file_id] = end

    def commit(self, store: Store) -> None:
        store._commit(self)


def apply_counts(old: list[int], delta: list[int]) -> list[int]:
    return [a + b for a, b in zip(old, delta, strict=True)]


__all__ = ["Txn", "keys"]
