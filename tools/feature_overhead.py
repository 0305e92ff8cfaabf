"""Plain push and pop+ack of two qstore source trees, alternated, on a queue with no options.

    python tools/feature_overhead.py OLD_TREE NEW_TREE [--rounds 12] [--n 20000]

Each tree is a directory holding a ``qstore`` package, or ``git:REV`` for
the ``qstore`` package of a commit of this repository (extracted with ``git
archive``; without git or that commit the comparison is skipped, exit 0).
``make bench`` runs it twice: the commit that added the section 10 features
against its parent (the features' own cost), and this tree against that
parent. Rounds alternate the two trees (ABBA order), each in a fresh
interpreter on a fresh store, so that the load of a shared machine falls on
both alike; the result is the median time per operation of each, and the
median of the rounds' own after/before ratios (each round ran both trees
back to back). The contract's budget: the features may not slow these
paths by more than 5% on a queue that uses none of them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO

CHUNK = """
import json, sys, tempfile, time, qstore
n = int(sys.argv[1])
with tempfile.TemporaryDirectory() as d:
    with qstore.open(d + "/s", compactor=False) as store:
        q = store.create_queue("q")
        body = b"x" * 100
        for i in range(2000):  # warm up
            q.ack(q.pop(lease=30.0)) if i % 2 else q.push(body, priority=i % 10)
        t0 = time.perf_counter()
        for i in range(n):
            q.push(body, priority=i % 10)
        t1 = time.perf_counter()
        for _ in range(n):
            q.ack(q.pop(lease=30.0))
        t2 = time.perf_counter()
print(json.dumps({"push": (t1 - t0) / n, "pop_ack": (t2 - t1) / n}))
"""


def run_chunk(tree: str, n: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", CHUNK, str(n)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def tree(spec: str, scratch: str) -> str | None:
    """The directory holding the ``qstore`` package ``spec`` names; None if git cannot say."""
    if not spec.startswith("git:"):
        return spec
    rev = spec[len("git:"):]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        data = subprocess.run(["git", "-C", repo, "archive", rev, "qstore"], check=True,
                              capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"feature overhead: skipped, no {rev} here ({exc})")
        return None
    out = os.path.join(scratch, rev.replace("/", "_").replace("^", "-parent"))
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(out, filter="data")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--label", default="", help="what the comparison is, printed first")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        old, new = tree(args.old, scratch), tree(args.new, scratch)
        if old is None or new is None:
            return
        args.old, args.new = old, new
        compare(args)


def compare(args: argparse.Namespace) -> None:
    if args.label:
        print(f"feature overhead, {args.label}:")
    times: dict[str, dict[str, list[float]]] = {
        t: {"push": [], "pop_ack": []} for t in ("old", "new")}
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for which in order:
            got = run_chunk(getattr(args, which), args.n)
            for op, sec in got.items():
                times[which][op].append(sec)
    for op in ("push", "pop_ack"):
        print(summary(op, times["old"][op], times["new"][op]))


def summary(op: str, old_times: list[float], new_times: list[float]) -> str:
    """One line: each tree's median time, and the median of the rounds' own ratios.

    A round runs both trees back to back, so its ratio cancels the machine's
    speed at that moment; the ratio of the two medians does not, and on a
    shared machine whose speed wanders between rounds it moves far more.
    """
    old = statistics.median(old_times)
    new = statistics.median(new_times)
    paired = statistics.median(n / o for o, n in zip(old_times, new_times, strict=True))
    return (f"{op}: before {old * 1e6:.1f} us/op ({1 / old:,.0f}/s), "
            f"after {new * 1e6:.1f} us/op ({1 / new:,.0f}/s), "
            f"after/before {paired:.3f} (median of {len(old_times)} rounds' ratios; "
            f"ratio of the medians {new / old:.3f})")


if __name__ == "__main__":
    main()
