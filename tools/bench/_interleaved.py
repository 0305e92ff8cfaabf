"""The single-process ratios the targets compare, measured interleaved in chunks.

The other workloads time each peer on its own, one after the other; on a
shared machine whose speed moves within a second, a run of 0.1 s can land on
a slow moment and its peer on a fast one (docs/benchmarks.md). Here the two
sides of each ratio alternate in chunks of ``CHUNK`` messages in one process,
each chunk timed in thread CPU time, and the ratio is the median over the
chunks of the two sides' times: each pair of chunks sees the same moment.

- ``interleaved.push_vs_bare``: qstore's single push against the bare queue's;
- ``interleaved.pop_ack_vs_bare``: single pop+ack, from a backlog of ``n``;
- ``interleaved.push_many_vs_push``: qstore's ``push_many(batch)`` against its
  single push (per message);
- ``interleaved.pop_many_vs_pop_ack``: ``pop_many(batch)`` + ``ack_many``
  against single pop+ack.

Each is a ratio of rates (higher: qstore, or the batch, faster).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from ._peers import BY_NAME, Item, Peer
from ._plan import Params
from ._results import Metric
from ._workloads import make_items

CHUNK = 1_000


def _median_ratio(slow: list[float], fast: list[float]) -> float:
    """Median over chunks of slow time / fast time: the rate of ``fast`` over ``slow``'s."""
    return statistics.median(a / b for a, b in zip(slow, fast, strict=True) if b > 0)


def _timed(run: Callable[[], None]) -> float:
    t = time.thread_time()
    run()
    return time.thread_time() - t


def _pushes(peer: Peer, items: Sequence[Item]) -> Callable[[], None]:
    def run() -> None:
        for body, priority in items:
            peer.push(body, priority)
    return run


def _push_batches(peer: Peer, items: Sequence[Item], batch: int) -> Callable[[], None]:
    def run() -> None:
        for i in range(0, len(items), batch):
            peer.push_many(items[i:i + batch])
    return run


def _pop_acks(peer: Peer, n: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n):
            handle = peer.pop()
            if handle is None:
                raise RuntimeError("the backlog ran out")
            peer.ack(handle)
    return run


def _pop_batches(peer: Peer, n: int, batch: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n // batch):
            handles = peer.pop_many(batch)
            if len(handles) < batch:
                raise RuntimeError("the backlog ran out")
            peer.ack_many(handles)
    return run


def measure_interleaved(path: str, p: Params) -> list[Metric]:
    """The four ratios above, ``p.n`` messages of 1 KiB a side (chunks of ``CHUNK``)."""
    chunk = max(p.batch, CHUNK - CHUNK % p.batch)
    chunks = max(1, p.n // chunk)
    items = make_items(chunks * chunk, 1024, p.seed)
    parts = [items[i * chunk:(i + 1) * chunk] for i in range(chunks)]
    single = BY_NAME["qstore/interval"].make(path + "-single", False)
    batched = BY_NAME["qstore/interval"].make(path + "-batched", False)
    bare = BY_NAME["bare"].make(path + "-bare", False)
    try:
        push, push_bare, push_many = [], [], []
        for part in parts:
            push.append(_timed(_pushes(single, part)))
            push_bare.append(_timed(_pushes(bare, part)))
            push_many.append(_timed(_push_batches(batched, part, p.batch)))
        # The pushes above are each side's backlog: pop all of it back.
        pop, pop_bare, pop_many = [], [], []
        for _ in parts:
            pop.append(_timed(_pop_acks(single, chunk)))
            pop_bare.append(_timed(_pop_acks(bare, chunk)))
            pop_many.append(_timed(_pop_batches(batched, chunk, p.batch)))
    finally:
        for peer in (single, batched, bare):
            peer.close()
    note = f"{chunks} chunks of {chunk:,}, thread CPU time"
    return [
        Metric("interleaved.push_vs_bare", "push: qstore / bare queue, interleaved",
               _median_ratio(push_bare, push), "x", note),
        Metric("interleaved.pop_ack_vs_bare", "pop+ack: qstore / bare queue, interleaved",
               _median_ratio(pop_bare, pop), "x", note),
        Metric("interleaved.push_many_vs_push",
               f"push_many({p.batch}) / single push, interleaved",
               _median_ratio(push, push_many), "x", note),
        Metric("interleaved.pop_many_vs_pop_ack",
               f"pop_many+ack_many({p.batch}) / single pop+ack, interleaved",
               _median_ratio(pop, pop_many), "x", note),
    ]
