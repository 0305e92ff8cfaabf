"""The time-driven passes: expiry, promotion of due delays and expired leases, aging.

Each runs under the writer lock in batches of :data:`PROMOTE_BATCH`, reading
only the time-ordered indexes (from the queue's time floor, past the
tombstones of earlier passes) and committing through the core. The queue
facade runs them lazily (a pop, peek or stats finds something due) and the
store's sweeper thread through :func:`promote_due`.
"""

from __future__ import annotations

from . import _aging as aging
from . import _states as states
from ._core import Core
from ._txn import NO_EVENT_US, STATE_COUNTER, QueueState, Txn
from .meta import keys, records

PROMOTE_BATCH = 1000  # messages per batch, to bound the time the writer lock is held
_READY = records.READY


def promote(core: Core, q: QueueState, now_us: int) -> int:
    """Move due delayed messages and expired leases of ``q`` (writer lock held).

    The scan and the batch happen under the writer lock, so nothing can ack
    or extend a message between the look and the action.
    """
    moved = _expire(core, q, now_us)
    for kind in (keys.INFLIGHT, keys.DELAYED):
        base = keys.prefix(kind, q.qid)
        # Start at the time floor, not at the prefix: everything before it was
        # promoted, acked or extended away, and its tombstones are not read again.
        lo = base + keys.U64.pack(q.time_floor_us)
        hi = base + keys.U64.pack(now_us + 1)
        while True:
            due = core.meta.scan_keys(lo, hi, PROMOTE_BATCH)
            if not due:
                break
            txn = Txn()
            for key, rec in zip(due, core.records_of(q, due), strict=True):
                mid = keys.trailing_id(key)
                txn.delete(key)
                txn.count(q, STATE_COUNTER[rec.state], -1)
                states.requeue(txn, q, mid, rec, now_us / 1e6, 0.0)
            core.commit(txn)
            moved += len(due)
            if len(due) < PROMOTE_BATCH:
                break
            lo = due[-1] + b"\x00"
    # Nothing due at or before now is left in either index; a later write of an
    # earlier time (a clock that went back) lowers the floor in commit().
    q.time_floor_us = max(q.time_floor_us, now_us + 1)
    if q.rec.aging is not None:
        moved += _age(core, q, now_us)
    core.refresh_next_event(q)
    return moved


def _expire(core: Core, q: QueueState, now_us: int) -> int:
    """Expire the messages of ``q`` whose TTL ran out by ``now_us``, in batches.

    Read through the expiry index from the time floor: nothing else of the
    backlog is read. Counts them in the ``E`` totals key, in the same batch.
    """
    base = keys.prefix(keys.EXPIRY, q.qid)
    lo = base + keys.U64.pack(q.time_floor_us)
    hi = base + keys.U64.pack(now_us + 1)
    expired = 0
    while True:
        due = core.meta.scan_keys(lo, hi, PROMOTE_BATCH)
        if not due:
            break
        txn = Txn()
        gone = []
        for key, rec in zip(due, core.records_of(q, due), strict=True):
            mid = keys.trailing_id(key)
            if rec.state == _READY:
                gone.append(q.index_key(mid, rec))
            states.expire(txn, q, mid, rec)
        total = q.expired + len(due)
        txn.put(keys.totals_key(q.qid), records.encode_totals(total))
        core.commit(txn)
        q.expired = total
        q.heads.removed(gone)
        expired += len(due)
        if len(due) < PROMOTE_BATCH:
            break
        lo = due[-1] + b"\x00"
    return expired


def _age(core: Core, q: QueueState, now_us: int) -> int:
    """Re-key the ready messages of ``q`` that gained levels by aging (see _aging.py)."""
    rec_q = q.rec
    assert rec_q.aging is not None
    now = now_us / 1e6
    next_us = NO_EVENT_US
    moved = 0
    for start in q.heads.discover_all(core.meta):
        front = q.heads.front(core.meta, start, aging.SCAN)
        if not front:
            continue
        recs = core.records_of(q, front)
        plan = aging.plan(rec_q, recs, now)
        next_us = min(next_us, plan.next_us)
        if len(plan.moves) == len(front) == aging.SCAN:
            next_us = now_us  # the level may hold more that are due: go on next time
        for i in range(0, len(plan.moves), PROMOTE_BATCH):
            txn = Txn()
            gone = []
            for j, priority, aged in plan.moves[i:i + PROMOTE_BATCH]:
                mid = keys.trailing_id(front[j])
                states.age(txn, q, front[j], mid, recs[j], priority, aged)
                gone.append(front[j])
            core.commit(txn)
            q.heads.removed(gone)
            moved += len(gone)
    q.aging_next_us = max(next_us, now_us + 1)
    return moved


def promote_due(core: Core) -> None:
    """Promote every queue with something due (the sweeper thread)."""
    with core.lock:
        if core.closed:
            return
        core.resume()  # after a failed metadata write: no client write may come to do it
        now_us = keys.to_us(core.clock())
        for q in list(core.queues.values()):
            if q.next_event_us <= now_us:
                promote(core, q, now_us)
