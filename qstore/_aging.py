"""Priority aging: which ready messages gain levels, read from the head of each level.

A queue created with ``aging=a`` (int priorities, order "max" or "min")
raises a ready message one priority level for every ``a`` seconds since it
was pushed (``enqueued_at``), up to ``aging_cap`` levels (default: no
bound), and never past the int64 range. The pop order stays plain key order
of the ready index: aging re-keys a message (delete its ready key, write one
at the better level, record the new priority and the levels gained in its
record, version 2) in batches under the writer lock (``Core._age``).

Cost. A round reads, per priority level holding ready messages, one seek
(the ready heads remember the levels) and the messages at the head of the
level up to the first one pushed less than ``a`` seconds ago: every message
after it in key order has a larger id, so it was pushed later and is not due
either. It reads them in chunks of ``SCAN`` and may span several calls of
the pass (``Round``; each call does a bounded amount of work under the
writer lock, see _timers.py), so messages that reached ``aging_cap`` at the
head of a level never hide due messages behind them, and a round finishes
on a clock that does not move. The capped messages a round finds at the
head of a level (with nothing else before them) are not read again: the
ready heads keep, per level, the key past them (``aging_skip``), dropped
when a ready key is added below it (a nack, a promotion, a message aged
into the level). Messages not yet due for their next level are read again
by each round (once per round); rounds run when the earliest head may be
due (the queue's next event), not on every pop.

Guarantee. With ``aging_cap`` unset, a message of priority ``p`` pushed at
``t`` sits at level ``p + k`` (order "max") from ``t + k*a`` on (that time
cut to whole microseconds, the grain the store reads its clock in, as for
TTLs and delays), and a level is popped in id order: it pops before every
message pushed after ``t`` at a priority up to ``p + k``. So if the highest
priority pushed is ``P``, it pops no later than the moment it reaches ``P``
(``t + (P - p) * a``) plus the time consumers need to pop the messages
already ahead of it at that level (older ids: at most the backlog of level
``P`` present at ``t``, plus older messages that aged into ``P`` too).
With a cap ``c`` it reaches ``p + c`` and no further: it may starve behind
a steady stream above ``p + c``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._txn import NO_EVENT_US
from .meta import keys, records

SCAN = 1000  # messages read from the head of one level per pass


class Plan:
    __slots__ = ("moves", "next_us", "stopped")

    def __init__(self) -> None:
        self.moves: list[tuple[int, int, int]] = []  # (index, new priority, levels gained)
        self.next_us = NO_EVENT_US  # when the next of these messages gains a level
        self.stopped = False  # reached a message too young: nothing later in the level is due


class Round:
    """One aging round of a queue: each active level read once from its head.

    A round may span several calls of the pass (each does a bounded amount of
    work under the writer lock): ``levels`` holds the levels left (those active
    when it began: messages moved up land in levels already visited, or in new
    ones), ``cursors`` where an unfinished level goes on, ``next_us`` the
    earliest next gain seen.
    A round belongs to one queue record: changing the options starts a new one.
    """

    __slots__ = ("rec", "levels", "cursors", "next_us", "spanned", "broken")

    def __init__(self, rec: records.QueueRecord, levels: list[bytes]) -> None:
        self.rec = rec
        self.levels = levels  # the starts of the levels left, in pop order
        self.cursors: dict[bytes, bytes] = {}
        self.next_us = NO_EVENT_US
        self.spanned = False  # True once the round went on in a later call
        # levels whose run of capped messages from the head ended in this round
        self.broken: set[bytes] = set()


MAX_LEVELS = keys.INT_MAX - keys.INT_MIN  # the span of int priorities


def level_due_us(enqueued_at: float, aging: float, k: int) -> int:
    """The time (whole microseconds, as the store's clock is read) from which a
    message pushed at ``enqueued_at`` has gained ``k`` levels: TTLs and delays
    fall due the same way, at ``to_us`` of the time in seconds."""
    return keys.to_us(enqueued_at + k * aging)


def levels_gained(rec_q: records.QueueRecord, enqueued_at: float, now_us: int) -> int:
    """How many levels a message pushed at ``enqueued_at`` has gained by ``now_us``:
    the largest ``k`` whose :func:`level_due_us` is at or before it."""
    a = rec_q.aging
    assert a is not None
    waited = now_us / 1e6 - enqueued_at
    levels = waited / a if waited > 0 else 0.0  # inf for a tiny aging (5e-324 s)
    # More levels than the whole priority range cannot move a message further,
    # and must still encode (as u64) in its record: a tiny aging (1e-300 s)
    # would otherwise gain numbers msgpack cannot hold, or int() could not make.
    gained = MAX_LEVELS if levels >= MAX_LEVELS else int(levels)
    if gained < MAX_LEVELS:
        # The estimate may be one off either way (two roundings to microseconds).
        if level_due_us(enqueued_at, a, gained + 1) <= now_us:
            gained += 1
        elif gained > 0 and level_due_us(enqueued_at, a, gained) > now_us:
            gained -= 1
    gained = min(gained, MAX_LEVELS)
    return gained if rec_q.aging_cap is None else min(gained, rec_q.aging_cap)


def aged_priority(rec_q: records.QueueRecord, priority: int, old_gain: int,
                  new_gain: int) -> int:
    """``priority`` (which includes ``old_gain`` levels) with ``new_gain`` levels instead."""
    if rec_q.order == "min":
        return max(keys.INT_MIN, priority + old_gain - new_gain)
    return min(keys.INT_MAX, priority - old_gain + new_gain)


def plan(rec_q: records.QueueRecord, recs: Sequence[records.MessageRecord],
         now_us: int) -> Plan:
    """The moves for the head of one level (``recs`` in key order) at ``now_us``."""
    a = rec_q.aging
    assert a is not None
    cap = rec_q.aging_cap
    out = Plan()
    for i, rec in enumerate(recs):
        first_us = level_due_us(rec.enqueued_at, a, 1)
        if now_us < first_us:
            out.next_us = min(out.next_us, first_us)
            out.stopped = True
            break  # every later message of the level was pushed later
        gain = levels_gained(rec_q, rec.enqueued_at, now_us)
        if gain > rec.aged:
            assert isinstance(rec.priority, int)
            new = aged_priority(rec_q, rec.priority, rec.aged, gain)
            if new != rec.priority:
                out.moves.append((i, new, gain))
        if (cap is None or gain < cap) and gain < MAX_LEVELS:  # else it gains no more
            out.next_us = min(out.next_us, level_due_us(rec.enqueued_at, a, gain + 1))
    return out
