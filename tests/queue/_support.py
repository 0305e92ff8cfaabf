"""Shared checks of the queue tests: a recount straight from RocksDB, and store dumps.

``recount`` re-derives a queue's counters from its message records and checks
that every index (ready, delayed, in-flight, dead, dedup) holds exactly the
keys those records call for, and that the stored and in-memory counters agree.
``dump`` captures everything a bad call could have changed, so a test can
assert that it changed nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import astuple, dataclass
from typing import Any

import qstore
from qstore.meta import keys, records
from qstore.payload import PayloadRef


@dataclass(frozen=True)
class Counts:
    ready: int
    delayed: int
    in_flight: int
    dead: int
    bytes: int


def stats_counts(stats: qstore.QueueStats) -> Counts:
    return Counts(stats.ready, stats.delayed, stats.in_flight, stats.dead, stats.bytes)


def _scan(store: qstore.Store, kind: bytes, qid: int) -> list[tuple[bytes, bytes]]:
    lo = keys.prefix(kind, qid)
    return list(store.core.meta.scan(lo, keys.prefix_end(lo)))


def recount(store: qstore.Store, name: str) -> Counts:
    """Count queue ``name`` from RocksDB and check its indexes and counters agree.

    Does not promote due messages: call ``q.stats()`` first to compare with it.
    """
    with store.core.lock:
        state = store.core.queues[name]
        qid, rec_q = state.qid, state.rec
        msgs = {keys.trailing_id(k): records.MessageRecord.decode(v)
                for k, v in _scan(store, keys.MESSAGE, qid)}
        by_state: dict[int, list[int]] = {s: [] for s in range(4)}
        for mid, rec in msgs.items():
            by_state[rec.state].append(mid)

        ready = [k for k, _ in _scan(store, keys.READY, qid)]
        want_ready = sorted(
            keys.ready_key(qid, keys.priority_key(rec_q.order, rec_q.priority_type,
                                                  msgs[m].priority), m)
            for m in by_state[records.READY]
        )
        assert ready == want_ready, f"ready index of {name!r} disagrees with the records"
        for kind, st in ((keys.DELAYED, records.DELAYED), (keys.INFLIGHT, records.INFLIGHT)):
            got = [k for k, _ in _scan(store, kind, qid)]
            want = sorted(keys.timed_key(kind, qid, msgs[m].when_us, m) for m in by_state[st])
            assert got == want, f"{kind!r} index of {name!r} disagrees with the records"
        dead = [k for k, _ in _scan(store, keys.DEAD, qid)]
        assert dead == sorted(keys.dead_key(qid, m) for m in by_state[records.DEAD])
        dedup = {k: keys.U64.unpack(v)[0] for k, v in _scan(store, keys.DEDUP, qid)}
        want_dedup = {keys.dedup_key(qid, rec.digest): mid
                      for mid, rec in msgs.items() if rec.digest is not None}
        assert dedup == want_dedup, f"dedup index of {name!r} disagrees with the records"

        counted = [len(by_state[s]) for s in range(4)]
        counted.append(sum(rec.length for rec in msgs.values()))
        raw = store.core.meta.get(keys.counts_key(qid))
        assert raw is not None, f"no stored counters for {name!r}"
        assert records.decode_counts(raw) == counted, f"stored counters of {name!r} drifted"
        assert list(state.counts) == counted, f"in-memory counters of {name!r} drifted"
    return Counts(*counted)


def check_segments(store: qstore.Store) -> None:
    """Per-segment live bytes and counts (stored and in memory) equal a recount."""
    with store.core.lock:
        live: Counter[int] = Counter()
        nbytes: Counter[int] = Counter()
        for _, value in store.core.meta.scan(keys.MESSAGE, keys.prefix_end(keys.MESSAGE)):
            rec = records.MessageRecord.decode(value)
            live[rec.file_id] += 1
            nbytes[rec.file_id] += PayloadRef(rec.file_id, rec.offset, rec.length).frame_bytes
        stored = {keys.segment_id(k): records.decode_segment(v)
                  for k, v in store.core.meta.scan(keys.SEGMENT, keys.prefix_end(keys.SEGMENT))}
        for fid in set(stored) | set(live):
            b, n, _ = stored.get(fid, (0, 0, 0))
            assert (b, n) == (nbytes[fid], live[fid]), f"segment {fid} live counters drifted"
            if fid in store.core.segments:
                assert store.core.segments[fid][:2] == [b, n]


def assert_consistent(store: qstore.Store, q: qstore.Queue) -> Counts:
    """``q.stats()`` equals a full recount of the queue's indexes; returns the counts."""
    stats = stats_counts(q.stats())
    assert recount(store, q.name) == stats
    check_segments(store)
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
