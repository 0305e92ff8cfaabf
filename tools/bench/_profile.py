"""cProfile of qstore's hot paths: the single push loop and the single pop+ack loop.

The output lists the top functions by cumulative time, per operation, so a
change to a hot path can be judged in microseconds per push or per pop+ack.
"""

from __future__ import annotations

import cProfile
import os
import pstats
from collections.abc import Callable
from typing import Any

from ._peers import QstorePeer
from ._plan import KiB
from ._workloads import make_items


def _table(prof: cProfile.Profile, ops: int, top: int) -> str:
    stats: Any = pstats.Stats(prof)
    entries = []
    for (filename, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        entries.append((cumtime, tottime, ncalls, f"{func} ({_short(filename)}:{line})"))
    entries.sort(reverse=True)
    total = max((e[0] for e in entries), default=0.0)
    out = [f"{ops:,} ops, {total / ops * 1e6:.1f} µs/op under the profiler",
           f"{'cum µs/op':>10} {'self µs/op':>10} {'calls/op':>8}  function"]
    for cumtime, tottime, ncalls, name in entries[:top]:
        out.append(f"{cumtime / ops * 1e6:10.2f} {tottime / ops * 1e6:10.2f} "
                   f"{ncalls / ops:8.2f}  {name}")
    return "\n".join(out)


def _short(filename: str) -> str:
    for marker in ("/qstore/", "/site-packages/", "/lib/python"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return os.path.basename(filename) if filename != "~" else "builtin"


def _profiled(loop: Callable[[], None]) -> cProfile.Profile:
    prof = cProfile.Profile()
    prof.enable()
    try:
        loop()
    finally:
        prof.disable()
    return prof


def profile_hot_paths(directory: str, n: int, seed: int, top: int = 15) -> dict[str, str]:
    """Profiles of ``n`` single pushes and ``n`` single pop+acks, durability="interval"."""
    items = make_items(n, KiB, seed)
    out = {}
    peer = QstorePeer(os.path.join(directory, "push"), "interval")
    try:
        q = peer.queue

        def push_loop() -> None:
            for body, priority in items:
                q.push(body, priority)

        out["qstore/interval single push"] = _table(_profiled(push_loop), n, top)

        def pop_loop() -> None:
            for _ in range(n):
                msg = q.pop(lease=3600.0)
                assert msg is not None, "the backlog ran out"
                q.ack(msg)

        out["qstore/interval single pop+ack"] = _table(_profiled(pop_loop), n, top)
    finally:
        peer.close()
    return out
