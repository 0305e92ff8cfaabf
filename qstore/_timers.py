"""The time-driven passes: expiry, promotion of due delays and expired leases, aging.

A pass works in batches of at most :data:`PROMOTE_BATCH` keys, one commit
each, and one call of :func:`promote` does at most :data:`BUDGET` keys of
work with the writer lock held, so a large due backlog (a million expired
messages) never holds the lock for long: each index keeps a resume point
(``QueueState.cursors``), so the next call goes on where this one stopped,
past the tombstones it left, and a queue with work left keeps its next event
at "now", so the next caller goes on even if the clock has not moved.

Who calls: the queue facade lazily (a pop, peek, stats or get finds
something due); :func:`catch_up` (stats, get, peek, the dedup push, the
sweeper thread) runs whole passes taking and releasing the writer lock per
call of :func:`promote`, so pushes and pops interleave with it. A pop that
finds the pass unfinished expires the expired messages at the head of the
queue itself (:func:`expire_head`) before it delivers: an expired message is
never delivered, whatever the pass got to.

Only the time-ordered indexes are read (from the queue's time floor or the
resume point), and aging reads the heads of the priority levels
(see _aging.py). Memory is bounded by the batch size.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from . import _aging as aging
from . import _states as states
from ._core import Core
from ._errors import StorageError
from ._txn import STATE_COUNTER, QueueState, Txn
from .meta import keys, records

PROMOTE_BATCH = 1000  # keys per commit
BUDGET = 1000  # keys one promote() call handles with the writer lock held (about 25 ms)
_READY = records.READY
_TIMED = (keys.EXPIRY, keys.INFLIGHT, keys.DELAYED)  # in this order: a TTL wins a tie


def promote(core: Core, q: QueueState, now_us: int, budget: int | None = None) -> bool:
    """Do up to ``budget`` (default :data:`BUDGET`) keys of the work of ``q`` due by
    ``now_us`` (writer lock held).

    Returns True when nothing due is left (the queue's next event is then
    recomputed from the indexes); False when there is more, and then the
    queue's next event is ``now_us``, so that the next caller goes on.
    The scan and the batch happen under the writer lock, so nothing can ack
    or extend a message between the look and the action.
    """
    left = BUDGET if budget is None else budget
    if q.cursors and (q.next_event_us < q.pass_mark_us or now_us < q.pass_mark_us):
        # Since the last call a key was written with a time before the one this
        # pass had reached (a commit lowered the next event), or the clock went
        # back: it may sit behind a resume point, so start again from the floor.
        q.cursors.clear()
    for kind in _TIMED:
        left -= _timed(core, q, kind, now_us, left)
        if q.cursors.get(kind) is not None:
            q.next_event_us = q.pass_mark_us = now_us
            return False
    # Nothing due at or before now is left in the three indexes; a later write of
    # an earlier time (a clock that went back) lowers the floor in commit().
    q.time_floor_us = max(q.time_floor_us, now_us + 1)
    if q.rec.aging is not None and not _age(core, q, now_us, left):
        q.next_event_us = now_us
        return False
    core.refresh_next_event(q)
    return True


def promote_all(core: Core, q: QueueState, now_us: int) -> None:
    """Everything due by ``now_us``, holding the writer lock throughout (after catch_up:
    what is left is what fell due since)."""
    while not promote(core, q, now_us):
        pass


def catch_up(core: Core, q: QueueState) -> None:
    """Run the due passes of ``q`` to the end, one :func:`promote` call per hold of the
    writer lock (not held by the caller), so other operations interleave."""
    while True:
        with core.settling:
            if core.closed or core.readonly or q.deleted:
                return
            now_us = keys.to_us(core.clock())
            if q.next_event_us > now_us or promote(core, q, now_us):
                return
        # Yield the GIL: a thread blocked on the writer lock gets it now, instead
        # of this loop taking it back at once (Python's locks are not fair).
        time.sleep(0)


def catch_up_to_read(core: Core, q: QueueState) -> None:
    """:func:`catch_up` before an inspection (stats, get, peek, dead_letters): see
    :func:`past_failed_writes`."""
    with past_failed_writes(core):
        catch_up(core, q)


def promote_all_to_read(core: Core, q: QueueState, now_us: int) -> None:
    """:func:`promote_all` for an inspection (writer lock held): see
    :func:`past_failed_writes`. Memory is as before a failed batch: every pass
    changes it only after its write (the next writer reopens and reads
    everything back, :meth:`Core.resume`)."""
    with past_failed_writes(core):
        promote_all(core, q, now_us)


@contextmanager
def past_failed_writes(core: Core) -> Iterator[None]:
    """While metadata writes fail (a full disk), the passes cannot run: an inspection
    goes on without them and shows what the database holds; a write after it
    raises the failure."""
    try:
        yield
    except StorageError:
        if core.meta.failed is None:
            raise


def _timed(core: Core, q: QueueState, kind: bytes, now_us: int, limit: int) -> int:
    """Handle up to ``limit`` due keys of one time index; how many were handled.

    Leaves ``q.cursors[kind]`` set if the index may hold more due keys.
    """
    base = keys.prefix(kind, q.qid)
    floor = base + keys.U64.pack(q.time_floor_us)
    hi = base + keys.U64.pack(now_us + 1)
    cursor = q.cursors.get(kind)
    lo = cursor if cursor is not None and cursor > floor else floor
    used = 0
    while True:
        want = min(PROMOTE_BATCH, limit - used)
        if want <= 0:
            q.cursors[kind] = lo
            return used
        due = core.meta.scan_keys(lo, hi, want)
        scanned = len(due)
        if due:
            lo = due[-1] + b"\x00"
            if any(len(k) != keys.TIMED_KEY_SIZE for k in due):
                # Damage (qstore check names it, --repair deletes it): a key too short
                # or too long names no message; stepped over, not a struct.error
                # that stopped every pass of the queue.
                due = [k for k in due if len(k) == keys.TIMED_KEY_SIZE]
        if due:
            if kind == keys.EXPIRY:
                expire_records(core, q, [keys.trailing_id(k) for k in due],
                               core.records_of(q, due))
            else:
                _requeue(core, q, due, now_us)
        used += scanned
        if scanned < want:
            q.cursors.pop(kind, None)
            return used


def _requeue(core: Core, q: QueueState, due: list[bytes], now_us: int) -> None:
    """Due delayed messages and expired leases go back to ready (or dead), one batch."""
    txn = Txn()
    for key, rec in zip(due, core.records_of(q, due), strict=True):
        mid = keys.trailing_id(key)
        txn.delete(key)
        txn.count(q, STATE_COUNTER[rec.state], -1)
        states.requeue(txn, q, mid, rec, now_us / 1e6, 0.0)
    core.commit(txn)


def expire_records(core: Core, q: QueueState, mids: list[int],
                   recs: list[records.MessageRecord]) -> None:
    """Expire these messages (their TTL ran out) in one batch, counted in the ``E`` key."""
    txn = Txn()
    gone = []
    expired = 0
    for mid, rec in zip(mids, recs, strict=True):
        if rec.state == _READY:
            gone.append(q.index_key(mid, rec))
        expired += states.expire(txn, q, mid, rec)
    total = q.expired + expired
    txn.put(keys.totals_key(q.qid), records.encode_totals(total))
    core.commit(txn)
    q.expired = total
    q.heads.removed(gone)


def expire_head(core: Core, q: QueueState, now_us: int, n: int) -> None:
    """Expire the messages whose TTL ran out at the head of the pop order until the
    first ``n`` hold none (a pop while the expiry pass is unfinished).

    Reads the first ``n``; if any expired, clears a batch of the head at a time.
    """
    want = n
    while True:
        ready_keys = q.heads.plan(core.meta, want).keys
        if not ready_keys:
            return
        recs = core.records_of(q, ready_keys)
        due = []
        live = 0
        for key, rec in zip(ready_keys, recs, strict=True):
            if 0 < rec.expires_us <= now_us:
                due.append((keys.trailing_id(key), rec))
            else:
                live += 1
                if live == n:
                    break  # the first n live ones are found: nothing past them matters
        if due:
            expire_records(core, q, [m for m, _ in due], [r for _, r in due])
        if live == n or len(ready_keys) < want:
            return
        want = max(n, PROMOTE_BATCH)


def _age(core: Core, q: QueueState, now_us: int, limit: int) -> bool:
    """Re-key the ready messages of ``q`` that gained levels by aging (see _aging.py).

    One round visits each level active when it began, reading from its head
    up to the first message too young to have gained a level; it may span
    several calls (``q.aging_round`` keeps the levels left and where to
    resume). True when the round is over.
    """
    rec_q = q.rec
    assert rec_q.aging is not None
    rnd = q.aging_round
    if not isinstance(rnd, aging.Round) or rnd.rec is not rec_q:
        rnd = q.aging_round = aging.Round(rec_q, q.heads.discover_all(core.meta))
        skips = q.heads.aging_skip
        if len(skips) > len(rnd.levels):
            # Skips of levels that emptied since (a skip only spares a read): with
            # distinct priorities they piled up, two entries a message drained,
            # 162,000 on an empty queue (a resource audit).
            active = set(rnd.levels)
            for start in [s for s in skips if s not in active]:
                del skips[start]
    else:
        rnd.spanned = True
    used = 0
    while rnd.levels:
        start = rnd.levels[0]
        want = min(aging.SCAN, limit - used)
        if want <= 0:
            return False
        resume = rnd.cursors.get(start)
        lv = q.heads.levels.get(start)
        skip = q.heads.aging_skip.get(start)
        if resume is not None:
            front = core.meta.scan_keys(resume, keys.prefix_end(start), want)
        elif lv is not None and skip is not None and skip > lv.frontier:
            # Past the capped messages at the head, which an earlier round read.
            front = core.meta.scan_keys(skip, lv.end, want)
        elif lv is not None:
            front = q.heads.front(core.meta, start, want)
        else:
            front = []  # purged meanwhile
        used += len(front)
        plan = aging.Plan()
        if front:
            recs = core.records_of(q, front)
            plan = aging.plan(rec_q, recs, now_us)
            rnd.next_us = min(rnd.next_us, plan.next_us)
            for i in range(0, len(plan.moves), PROMOTE_BATCH):
                txn = Txn()
                gone = []
                for j, priority, aged in plan.moves[i:i + PROMOTE_BATCH]:
                    mid = keys.trailing_id(front[j])
                    states.age(txn, q, front[j], mid, recs[j], priority, aged)
                    gone.append(front[j])
                core.commit(txn)
                q.heads.removed(gone)
            _skip_capped(q, rnd, start, front, recs, plan)
        if plan.stopped or len(front) < want:
            rnd.levels.pop(0)
            rnd.cursors.pop(start, None)
        else:
            rnd.cursors[start] = front[-1] + b"\x00"
    # A round that let go of the lock may have missed messages returned to ready
    # meanwhile (a nack, a due delay): the next microsecond starts a new round.
    q.aging_next_us = now_us + 1 if rnd.spanned else max(rnd.next_us, now_us + 1)
    q.aging_round = None
    return True


def _skip_capped(q: QueueState, rnd: aging.Round, start: bytes, front: list[bytes],
                 recs: list[records.MessageRecord], plan: aging.Plan) -> None:
    """Move the level's aging skip past the capped messages this read found at its head.

    Only while the round has read the level without a gap from its head (or
    from its skip) and found nothing but capped messages and ones it moved
    away: the first other message ends the run for this round.
    """
    cap = q.rec.aging_cap
    if cap is None or start in rnd.broken:
        return
    moved = {j for j, _, _ in plan.moves}
    last = None
    for i, rec in enumerate(recs):
        if i not in moved and rec.aged < cap:
            rnd.broken.add(start)
            break
        last = front[i]
    if last is not None:
        q.heads.aging_skip[start] = last + b"\x00"


def promote_due(core: Core) -> None:
    """Run the passes of every queue with something due (the sweeper thread)."""
    with core.settling:
        if core.closed:
            return
        core.resume()  # after a failed metadata write: no client write may come to do it
        now_us = keys.to_us(core.clock())
        due = [q for q in core.queues.values() if q.next_event_us <= now_us]
    for q in due:
        catch_up(core, q)

