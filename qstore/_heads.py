"""Where a queue's ready messages start, per priority level, without wading through tombstones.

The ready index is ``r qid priority-key id``: plain key order is pop order.
Each ack deletes a key at the head of some priority level, leaving a RocksDB
tombstone that stays until the LSM tree compacts it away. A pop that seeks
from the start of the index, or from one queue-wide cursor, must step over
every tombstone between there and the first live key: with mixed priorities
that means every message ever acked at the levels it passes, and pops slow
down without bound as the queue is used.

So the queue keeps, per priority *level* (one priority-key value):

- ``frontier``: every live key of the level below it is in ``returns``;
  pops seek from here, past the tombstones of everything taken earlier;
- ``returns``: the sorted keys of messages given back below the frontier
  (a nack, an expired lease, a redrive return a message to its own place,
  which is behind the frontier); they are taken from memory, no seek;
- ``maybe``: keys may exist at or past the frontier.

Levels are learnt lazily: every level whose key prefix is below
``known_upto`` is either in ``levels`` or empty; past it, the index is read
to find the next level. Memory is bounded: at most ``RETURNS_CAP`` returned
keys per level (past that the frontier drops back to the smallest of them,
which costs seeks but loses nothing) and at most ``LEVEL_CAP`` levels (empty
ones are forgotten first; a forgotten empty level is still known empty).

All of this is touched only under the store's writer lock, and changed only
after the batch it reflects has been committed.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .meta import keys

if TYPE_CHECKING:
    from .meta import MetaDB

RETURNS_CAP = 65_536
LEVEL_CAP = 4_096
_ID_BYTES = 8


class Level:
    __slots__ = ("start", "end", "frontier", "returns", "maybe")

    def __init__(self, start: bytes) -> None:
        self.start = start
        self.end = keys.prefix_end(start)
        self.frontier = start
        self.returns: list[bytes] = []
        self.maybe = False

    @property
    def active(self) -> bool:
        return self.maybe or bool(self.returns)


class Plan:
    """The keys a pop would take, in order, and the levels it would drain."""

    __slots__ = ("keys", "drained")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.drained: list[bytes] = []  # level starts with nothing past the keys taken


class ReadyHeads:
    def __init__(self, qid: int) -> None:
        self.base = keys.prefix(keys.READY, qid)
        self.base_end = keys.prefix_end(self.base)
        self.levels: dict[bytes, Level] = {}
        self.active: list[bytes] = []  # sorted starts of active levels
        self.known_upto = self.base

    # -- learning ---------------------------------------------------------------

    def _level(self, start: bytes) -> Level:
        lv = self.levels.get(start)
        if lv is None:
            if len(self.levels) >= LEVEL_CAP:
                self._forget_inactive()
            lv = self.levels[start] = Level(start)
        return lv

    def _forget_inactive(self) -> None:
        for start in [s for s, lv in self.levels.items() if not lv.active]:
            del self.levels[start]

    def _activate(self, lv: Level) -> None:
        i = bisect_left(self.active, lv.start)
        if i == len(self.active) or self.active[i] != lv.start:
            self.active.insert(i, lv.start)

    def _deactivate(self, lv: Level) -> None:
        i = bisect_left(self.active, lv.start)
        if i < len(self.active) and self.active[i] == lv.start:
            del self.active[i]

    def added(self, new_keys: Iterable[bytes]) -> None:
        """Ready keys that were just committed (push, nack, promotion, redrive)."""
        for key in new_keys:
            lv = self.levels.get(key[:-_ID_BYTES])
            if lv is not None and lv.maybe and key >= lv.frontier:
                continue  # already active, nothing to learn: the common push
            lv = self._level(key[:-_ID_BYTES])
            if key < lv.frontier:
                insort(lv.returns, key)
                if len(lv.returns) > RETURNS_CAP:
                    lv.frontier = lv.returns[0]
                    lv.returns.clear()
                    lv.maybe = True
            else:
                lv.maybe = True
            self._activate(lv)

    def _discover(self, db: MetaDB) -> bool:
        """Learn the next level past ``known_upto``; False when there is none."""
        first = db.first_key(self.known_upto, self.base_end)
        if first is None:
            self.known_upto = self.base_end
            return False
        lv = self._level(first[:-_ID_BYTES])
        if not lv.returns and first > lv.frontier:
            lv.frontier = first  # nothing live lies before the first key found
        lv.maybe = True
        self.known_upto = lv.end
        self._activate(lv)
        return True

    # -- reading ----------------------------------------------------------------

    def plan(self, db: MetaDB, n: int) -> Plan:
        """Up to ``n`` ready keys in pop order. Changes knowledge, never the queue."""
        plan = Plan()
        i = 0
        while len(plan.keys) < n:
            nxt = self.active[i] if i < len(self.active) else None
            if self.known_upto < self.base_end and (nxt is None or self.known_upto <= nxt):
                self._discover(db)
                continue
            if nxt is None:
                break
            lv = self.levels[nxt]
            want = n - len(plan.keys)
            plan.keys.extend(lv.returns[:want])
            want = n - len(plan.keys)
            if want and lv.maybe:
                if want == 1:  # a single pop: one seek, no list
                    first = db.first_key(lv.frontier, lv.end)
                    found = [] if first is None else [first]
                else:
                    found = db.scan_keys(lv.frontier, lv.end, want)
                plan.keys.extend(found)
                if len(found) < want:
                    plan.drained.append(lv.start)
            i += 1
        return plan

    # -- after a pop commits ----------------------------------------------------

    def taken(self, plan: Plan) -> None:
        for key in plan.keys:
            lv = self.levels[key[:-_ID_BYTES]]
            j = bisect_left(lv.returns, key)
            if j < len(lv.returns) and lv.returns[j] == key:
                del lv.returns[j]
            else:
                lv.frontier = key + b"\x00"  # the smallest key after it
        touched = {key[:-_ID_BYTES] for key in plan.keys}
        for start in plan.drained:
            self.levels[start].maybe = False
            touched.add(start)
        for start in touched:
            lv = self.levels[start]
            if not lv.active:
                self._deactivate(lv)
