"""SIGKILL and restart with TTL and priority aging (contract section 10).

A real child process (``_features_kill_child.py``) pushes, pops, acks and
nacks on a TTL queue and an aging queue, on a clock of its own that it
journals; the test kills it with SIGKILL at several points, then reopens the
store at a later time and checks that TTLs and aging kept their wall-clock
meaning: every message's expiry is its push time plus the TTL, those whose
TTL ran out by then are dead letters with reason "expired" (and counted),
every ready message of the aging queue sits at its pushed priority plus one
level per aging period since its push (up to the cap), and the counters
equal a recount (``store.check()`` is clean). ``QSTORE_KILLS`` sets the
number of kills (default 5).
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import qstore
from tests.conftest import FakeClock

from . import _features_kill_child as child
from ._support import assert_consistent, kill_when_journaled

HERE = Path(__file__).resolve().parent
CHILD = HERE / "_features_kill_child.py"
KILLS = int(os.environ.get("QSTORE_KILLS", "5"))
START = 1_700_000_000.0


@dataclass
class Journal:
    pushed: dict[tuple[str, int], tuple[int, float]] = field(default_factory=dict)
    acked: set[tuple[str, int]] = field(default_factory=set)
    acking: set[tuple[str, int]] = field(default_factory=set)
    last_time: float = START


def read_journal(path: Path) -> Journal:
    out = Journal()
    for line in path.read_bytes().decode().split("\n")[:-1]:
        words = line.split()
        if words[0] == "time":
            out.last_time = max(out.last_time, float(words[1]))
        elif words[0] == "push":
            key = (words[1], int(words[2]))
            assert key not in out.pushed, f"id {key} was handed out twice"
            out.pushed[key] = (int(words[3]), float(words[4]))
        elif words[0] == "acking":
            out.acking.add((words[1], int(words[2])))
        elif words[0] == "ack":
            out.acked.add((words[1], int(words[2])))
    return out


def aged(priority: int, pushed_at: float, now: float) -> int:
    return priority + min(child.AGING_CAP, math.floor((now - pushed_at) / child.AGING))


def check_after_kill(store_path: str, journal: Journal, now: float) -> None:
    """Reopen at ``now`` (at or after every time the child used) and check the meaning
    of every TTL and every aged priority, and the counters against a recount."""
    with qstore.open(store_path, compactor=False, clock=FakeClock(now)) as store:
        ttl_q, age_q = store.queue("ttl"), store.queue("age")
        for (name, mid), (priority, pushed_at) in journal.pushed.items():
            q = store.queue(name)
            if (name, mid) in journal.acked:
                with pytest.raises(qstore.MessageNotFound):
                    q.get(mid)
                continue
            try:
                msg = q.get(mid)  # runs the expiry and aging passes at ``now`` first
            except qstore.MessageNotFound:
                assert (name, mid) in journal.acking, f"{name}:{mid} was lost"
                continue
            assert msg.enqueued_at == pushed_at
            if name == "ttl":
                assert msg.priority == priority  # no aging on this queue
                if now >= pushed_at + child.TTL:
                    assert (msg.state, msg.dead_reason, msg.expires_at) == (
                        "dead", "expired", None), f"ttl:{mid} outlived its TTL"
                else:
                    assert msg.state != "dead"
                    assert msg.expires_at == pushed_at + child.TTL
            else:
                assert msg.expires_at is None
                if msg.state == "ready":
                    assert msg.priority == aged(priority, pushed_at, now), (
                        f"age:{mid} pushed at {priority} has {msg.priority} after "
                        f"{now - pushed_at} s")
        letters = ttl_q.dead_letters(100_000)
        assert all(m.dead_reason == "expired" for m in letters)
        assert ttl_q.stats().expired == len(letters), "the expired count is not a recount"
        # The aging queue's pop order is plain key order of the aged priorities.
        ready = age_q.peek(100_000)
        assert [m.priority for m in ready] == sorted((m.priority for m in ready), reverse=True)
        for q in (ttl_q, age_q):
            assert_consistent(store, q)


@pytest.mark.parametrize("mode", ["always", "none"])
def test_ttl_and_aging_keep_their_meaning_across_sigkill(tmp_path: Path, mode: str) -> None:
    store_path = str(tmp_path / "store")
    journal_path = tmp_path / "journal"
    rng = random.Random(f"features-kill-{mode}-{os.getpid()}")
    start = START
    for kill in range(KILLS):
        before = journal_path.read_bytes().count(b"\n") if journal_path.exists() else 0
        target = before + rng.choice([2, rng.randint(3, 60), rng.randint(60, 300)])
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), store_path, str(journal_path), mode,
             f"{mode}-{kill}-{rng.random()}", repr(start)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        kill_when_journaled(proc, journal_path, target)
        journal = read_journal(journal_path)
        # Reopen at the child's last time, or later (some TTLs ran out meanwhile, some
        # messages gained levels, some leases ran out).
        now = journal.last_time + rng.choice([0.0, 0.5, 7.5, 31.0])
        check_after_kill(store_path, journal, now)
        start = now + 0.5  # the next child goes on from there
    # Much later: every TTL ran out, every aging message reached its cap.
    journal = read_journal(journal_path)
    check_after_kill(store_path, journal, journal.last_time + 1000.0)
