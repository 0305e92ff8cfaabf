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
- ``maybe``: keys may exist at or past the frontier;
- ``known``: live keys at or past the frontier that this process committed
  (pushes, returns, promotions) or read ahead (a seek reads up to
  ``READ_AHEAD`` keys past the ones a pop wants), sorted: a prefix of the
  level from the frontier on, so a pop takes them without a seek. ``exact`` says that
  ``known`` is the whole level past the frontier: it becomes true when a
  seek found the level drained, and false when a key could not be kept
  (the caps below); a level that is not exact seeks past its known keys.

Levels are learnt lazily: every level whose key prefix is below
``known_upto`` is either in ``levels`` or empty; past it, the index is read
to find the next level. Memory is bounded: at most ``RETURNS_CAP`` returned
keys per level (past that the frontier drops back to the smallest of them,
which costs seeks but loses nothing), and at most ``KNOWN_CAP`` known keys in
all the levels of a queue. Levels past ``LEVEL_CAP`` make the empty ones be
forgotten (a forgotten empty level is still known empty); a level holding
ready messages is kept (below ``known_upto`` a missing level means an empty
one), so a queue keeps one small ``Level`` (about 200 bytes) per distinct
priority it holds ready messages of, learnt so far. The search for empty
levels runs again only once the levels have doubled since the last one, so
many distinct priorities (timestamps, scores) cost no scan of all of them
per new level.

All of this is touched only under the store's writer lock, and changed only
after the batch it reflects has been committed. Ready keys leave the index
through a pop (:meth:`ReadyHeads.taken`), a purge (the heads are replaced),
or expiry and aging, which report the keys they deleted to
:meth:`ReadyHeads.removed`; so nothing known can go stale.
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
KNOWN_CAP = 32_768  # known keys per queue, all levels together (about 1.5 MB)
READ_AHEAD = 128  # keys a seek reads past the ones a pop wants, while under KNOWN_CAP
_ID_BYTES = 8


class Level:
    __slots__ = ("start", "end", "frontier", "returns", "maybe", "known", "k0", "exact")

    def __init__(self, start: bytes) -> None:
        self.start = start
        self.end = keys.prefix_end(start)
        self.frontier = start
        self.returns: list[bytes] = []
        self.maybe = False
        self.known: list[bytes] = []  # live keys are known[k0:] (popping from the front is O(1))
        self.k0 = 0
        self.exact = False

    @property
    def active(self) -> bool:
        return self.maybe or bool(self.returns)


class Plan:
    """The keys a pop would take, in order, and the levels it would drain."""

    __slots__ = ("keys", "drained", "known_runs", "mixed")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.drained: list[bytes] = []  # level starts with nothing past the keys taken
        # (level, count): runs of keys taken from the front of a level's known keys
        self.known_runs: list[tuple[Level, int]] = []
        self.mixed = False  # some keys are returns or were found by a seek


class ReadyHeads:
    def __init__(self, qid: int) -> None:
        self.base = keys.prefix(keys.READY, qid)
        self.base_end = keys.prefix_end(self.base)
        self.levels: dict[bytes, Level] = {}
        self._forget_at = LEVEL_CAP  # look for empty levels to forget at this many
        self.active: list[bytes] = []  # sorted starts of active levels
        self.known_upto = self.base
        self.known_total = 0  # len(known) - k0, summed over the levels
        # For aging (_timers._age): level start -> a key such that every live key
        # of the level below it (from its head on) belongs to a message at its
        # aging cap, which no round needs to read again. A level's entry goes
        # when a ready key is added below it (a nack, a promotion, a message
        # aged into the level); a push's key is above it (ids only grow).
        self.aging_skip: dict[bytes, bytes] = {}

    @classmethod
    def of_empty_queue(cls, qid: int) -> ReadyHeads:
        """Heads of a queue whose ready index is empty (new, or just purged)."""
        heads = cls(qid)
        heads.known_upto = heads.base_end
        return heads

    # -- learning ---------------------------------------------------------------

    def _level(self, start: bytes) -> Level:
        lv = self.levels.get(start)
        if lv is None:
            if len(self.levels) >= self._forget_at:
                self._forget_inactive()
                # Levels holding messages stay: look again only once there are
                # twice as many (a scan per new level made pushes quadratic).
                self._forget_at = max(LEVEL_CAP, 2 * len(self.levels))
            lv = self.levels[start] = Level(start)
            # Below known_upto a level missing from ``levels`` is empty: from now
            # on it holds exactly what this process adds.
            lv.exact = start < self.known_upto
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

    def added_one(self, key: bytes) -> None:
        """:meth:`added` for one key (a push)."""
        lv = self.levels.get(key[:-_ID_BYTES])
        if lv is not None and lv.maybe and key >= lv.frontier:
            known = lv.known
            if lv.exact and len(known) > lv.k0 and key > known[-1] \
                    and self.known_total < KNOWN_CAP:
                known.append(key)  # the usual push: the end of an active level
                self.known_total += 1
                return
        self.added((key,))

    def added(self, new_keys: Iterable[bytes]) -> None:
        """Ready keys that were just committed (push, nack, promotion, redrive)."""
        skip = self.aging_skip
        if skip:
            new_keys = list(new_keys)
            for key in new_keys:
                below = skip.get(key[:-_ID_BYTES])
                if below is not None and key < below:
                    del skip[key[:-_ID_BYTES]]
        for key in new_keys:
            start = key[:-_ID_BYTES]
            lv = self.levels.get(start)
            if lv is None:
                lv = self._level(start)
            elif lv.maybe and key >= lv.frontier:  # the usual push: an active level
                known = lv.known
                if lv.exact and len(known) > lv.k0 and key > known[-1] \
                        and self.known_total < KNOWN_CAP:
                    known.append(key)
                    self.known_total += 1
                else:
                    self._know(lv, key)
                continue
            if key < lv.frontier:
                insort(lv.returns, key)
                if len(lv.returns) > RETURNS_CAP:
                    lv.frontier = lv.returns[0]
                    lv.returns.clear()
                    self._forget_known(lv, lv.frontier)  # keys below the old frontier exist
                    # ...past the new one: a seek must look. Left unset on a level
                    # that pops had drained, the returns were invisible: pop() None
                    # with 65,537 nacked messages ready (a review).
                    lv.maybe = True
            else:
                self._know(lv, key)
                lv.maybe = True
            self._activate(lv)

    def _know(self, lv: Level, key: bytes) -> None:
        """Keep ``key`` (at or past the frontier) in ``known`` while that stays a prefix."""
        known = lv.known
        if not lv.exact and (len(known) == lv.k0 or key > known[-1]):
            return  # past what is known of a level that is not exact: a seek finds it
        if self.known_total >= KNOWN_CAP:
            self._forget_known(lv, key)
            return
        if len(known) == lv.k0 or key > known[-1]:
            known.append(key)  # the usual push: ids grow
        else:
            insort(known, key, lv.k0)
        self.known_total += 1

    def _forget_known(self, lv: Level, key: bytes) -> None:
        """Drop the known keys at or past ``key``; the level is no longer exact."""
        known = lv.known
        cut = max(lv.k0, bisect_left(known, key, lv.k0))
        self.known_total -= len(known) - cut
        del known[cut:]
        lv.exact = False

    def removed(self, gone: Iterable[bytes]) -> None:
        """Ready keys that were just deleted other than by a pop (expiry, aging).

        A returned or known key is forgotten; when it was the first live key
        of its level the frontier moves past it, so the next seek does not
        step over its tombstone.
        """
        for key in gone:
            start = key[:-_ID_BYTES]
            lv = self.levels.get(start)
            if lv is None:
                continue  # a level not learnt yet: a seek finds what is live
            j = bisect_left(lv.returns, key)
            if j < len(lv.returns) and lv.returns[j] == key:
                del lv.returns[j]
            elif key >= lv.frontier:
                known = lv.known
                j = bisect_left(known, key, lv.k0)
                if j < len(known) and known[j] == key:
                    if j == lv.k0:  # known[k0] is the first live key past the frontier
                        lv.frontier = key + b"\x00"
                        lv.k0 += 1
                        if lv.k0 == len(known):
                            known.clear()
                            lv.k0 = 0
                    else:
                        del known[j]
                    self.known_total -= 1
            if lv.exact and not lv.returns and len(lv.known) == lv.k0:
                lv.maybe = False  # exactly what this process added, and all of it is gone
            if not lv.active:
                self._deactivate(lv)

    def discover_all(self, db: MetaDB) -> list[bytes]:
        """Learn every level (one seek each); the starts of the active ones, in pop order."""
        while self.known_upto < self.base_end and self._discover(db):
            pass
        return list(self.active)

    def front(self, db: MetaDB, start: bytes, n: int) -> list[bytes]:
        """Up to ``n`` live keys from the head of one active level, in key order."""
        lv = self.levels[start]
        out = lv.returns[:n]
        if len(out) < n and lv.maybe:
            got = lv.known[lv.k0: lv.k0 + n - len(out)]
            out += got
            if len(out) < n and not lv.exact:
                seek_from = got[-1] + b"\x00" if got else lv.frontier
                out += db.scan_keys(seek_from, lv.end, n - len(out))
        return out

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
            if lv.returns:
                plan.keys.extend(lv.returns[:want])
                plan.mixed = True
            want = n - len(plan.keys)
            if want and lv.maybe:
                known, k0 = lv.known, lv.k0
                seek_from = lv.frontier
                if len(known) > k0:  # taken from memory, no seek
                    got = known[k0: k0 + want]
                    plan.keys.extend(got)
                    plan.known_runs.append((lv, len(got)))
                    want -= len(got)
                    seek_from = got[-1] + b"\x00"
                if want and lv.exact:
                    plan.drained.append(lv.start)
                elif want:
                    # Read ahead: the keys after the ones wanted are the level's next
                    # live keys, so the pops after this one need no seek.
                    ahead = READ_AHEAD if self.known_total + want + READ_AHEAD <= KNOWN_CAP else 0
                    if want == 1 and not ahead:  # a single pop: one seek, no list
                        first = db.first_key(seek_from, lv.end)
                        found = [] if first is None else [first]
                    else:
                        found = db.scan_keys(seek_from, lv.end, want + ahead)
                    if ahead and found:
                        # Consecutive live keys from where memory ended: known from
                        # now on, the ones taken included (taken() passes them).
                        known.extend(found)
                        self.known_total += len(found)
                        take = found[:want]
                        plan.keys.extend(take)
                        plan.known_runs.append((lv, len(take)))
                        if len(found) < want + ahead:
                            lv.exact = True  # the scan reached the level's end
                    else:
                        plan.keys.extend(found)
                        if found:
                            plan.mixed = True
                    if len(found) < want:
                        plan.drained.append(lv.start)
            i += 1
        return plan

    def known_head(self) -> bytes | None:
        """The key a single pop takes, when :meth:`plan` would find it in memory
        at the front of the first active level (no returns, no seek, nothing
        drained); else None. Follow a commit of it with :meth:`took_head`."""
        active = self.active
        if active and (self.known_upto >= self.base_end or self.known_upto > active[0]):
            lv = self.levels[active[0]]
            if not lv.returns and lv.maybe and len(lv.known) > lv.k0:
                return lv.known[lv.k0]
        return None

    # -- after a pop commits ----------------------------------------------------

    def took_head(self, key: bytes) -> None:
        """:meth:`taken` for the one key :meth:`known_head` returned."""
        lv = self.levels[self.active[0]]
        lv.frontier = key + b"\x00"
        self._pass_known(lv, 1)
        if not lv.maybe and not lv.returns:  # drained (lv.active, inlined: a hot path)
            del self.active[0]

    def _pass_known(self, lv: Level, n: int) -> None:
        """Forget the first ``n`` known keys of ``lv``: a pop took them. A level that
        is exact has nothing past them then: drained (its caller deactivates it).
        Left maybe-active, a level whose last key a pop took stayed in ``active``
        for good when later pops found their keys in levels before it (a queue
        whose priorities keep rising, in max order): one more per drain, and
        pops walked them all (a resource audit)."""
        known = lv.known
        k0 = lv.k0 + n
        self.known_total -= n
        if k0 == len(known):
            known.clear()
            k0 = 0
            if lv.exact:
                lv.maybe = False
        elif k0 >= 1024 and k0 * 2 >= len(known):  # drop the dead front now and then
            del known[:k0]
            k0 = 0
        lv.k0 = k0

    def taken(self, plan: Plan) -> None:
        if plan.mixed:
            self._taken_each(plan.keys)
            touched = {key[:-_ID_BYTES] for key in plan.keys}
        else:  # every key is from the front of a level's known keys: one step a level
            touched = set()
            for lv, n in plan.known_runs:
                # the smallest key after the last one taken
                lv.frontier = lv.known[lv.k0 + n - 1] + b"\x00"
                self._pass_known(lv, n)
                touched.add(lv.start)
        self._after_taken(plan, touched)

    def _taken_each(self, taken: list[bytes]) -> None:
        for key in taken:
            lv = self.levels[key[:-_ID_BYTES]]
            j = bisect_left(lv.returns, key)
            if j < len(lv.returns) and lv.returns[j] == key:
                del lv.returns[j]
                continue
            lv.frontier = key + b"\x00"  # the smallest key after it
            if len(lv.known) > lv.k0 and lv.known[lv.k0] == key:
                self._pass_known(lv, 1)

    def _after_taken(self, plan: Plan, touched: set[bytes]) -> None:
        for start in plan.drained:
            lv = self.levels[start]
            lv.maybe = False
            # Nothing lies past the keys taken: from now on the level is exactly
            # what this process adds to it.
            self.known_total -= len(lv.known) - lv.k0
            lv.known.clear()
            lv.k0 = 0
            lv.exact = True
            touched.add(start)
        for start in touched:
            lv = self.levels[start]
            if not lv.active:
                self._deactivate(lv)
