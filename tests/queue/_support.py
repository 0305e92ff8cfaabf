"""Shared checks of the queue tests: the store's integrity check, and store dumps.

``recount`` runs ``store.check()`` (every index, counter, segment record and
payload against the message records) and also compares the in-memory
counters with the stored ones, which the check cannot see.
``dump`` captures everything a bad call could have changed, so a test can
assert that it changed nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import qstore
from qstore.meta import keys, records


@dataclass(frozen=True)
class Counts:
    ready: int
    delayed: int
    in_flight: int
    dead: int
    bytes: int


def stats_counts(stats: qstore.QueueStats) -> Counts:
    return Counts(stats.ready, stats.delayed, stats.in_flight, stats.dead, stats.bytes)


def recount(store: qstore.Store, name: str) -> Counts:
    """Queue ``name``'s counters, after ``store.check()`` found the whole store consistent.

    The check recounts every queue and segment from the message records and
    checks every index; on top, the in-memory counters must equal the stored
    ones. Does not promote due messages: call ``q.stats()`` first to compare.
    """
    with store.core.lock:
        report = store.check()
        assert report.ok, "\n".join(map(str, report.findings))
        drift = store.core.drift()
        assert not drift, "\n".join(drift)
        raw = store.core.meta.get(keys.counts_key(store.core.queues[name].qid))
        assert raw is not None, f"no stored counters for {name!r}"
    return Counts(*records.decode_counts(raw))


def assert_consistent(store: qstore.Store, q: qstore.Queue) -> Counts:
    """``q.stats()`` equals the stored counters, and ``store.check()`` finds nothing."""
    stats = stats_counts(q.stats())
    assert recount(store, q.name) == stats
    return stats


def dump(store: qstore.Store) -> dict[str, Any]:
    """Every RocksDB key and value, the counters and the payload sizes of ``store``."""
    with store.core.lock:
        stats = [astuple(stats_counts(s)) for s in store.stats().queues]  # promotes first
        db = list(store.core.meta.scan(b"", b"\xff\xff"))
        payload = store.core.payload
        segments = {fid: payload.segment_size(fid) for fid in payload.file_ids()}
        queues = {name: list(state.counts) for name, state in store.core.queues.items()}
        return {"db": db, "segments": segments, "queues": queues, "stats": stats}


def store_view(store: qstore.Store, ids: list[str]) -> dict[str, Any]:
    """What a reader sees: queues, counters, the messages ``queue:id`` in ``ids``, queue
    ``a``'s head. Run by the owner and by a read-only process, to compare the two."""
    out: dict[str, Any] = {"queues": store.queues(), "stats": {}, "messages": {}}
    for name in store.queues():
        s = store.queue(name).stats()
        out["stats"][name] = [s.ready, s.delayed, s.in_flight, s.dead, s.bytes]
    for item in ids:
        name, mid = item.split(":")
        try:
            m = store.queue(name).get(int(mid))
        except qstore.MessageNotFound:
            out["messages"][item] = None
        else:
            out["messages"][item] = [m.state, m.attempts, m.payload.hex()]
    out["peek"] = [m.id for m in store.queue("a").peek(100)]
    return out


def count_lines(path: Path) -> int:
    """Lines of a child's journal so far (0 before it exists)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def kill_when_journaled(proc: subprocess.Popen[bytes], journal: Path, lines: int,
                        extra_wait: float = 0.0) -> None:
    """SIGKILL ``proc`` once its journal holds ``lines`` lines (then ``extra_wait`` s more).

    A real process harness: it polls the journal the child writes. The child
    must still be running when it is killed (its stderr says why if not).
    """
    try:
        give_up = time.monotonic() + 60.0
        while count_lines(journal) < lines and proc.poll() is None \
                and time.monotonic() < give_up:
            time.sleep(0.002)
        time.sleep(extra_wait)
        assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
