"""Batches against single ops, interleaved in one process (docs/benchmarks.md).

usage: python tools/batch_ratio.py [--messages N] [--chunk C] [--size BYTES]

Two stores in one temporary directory, durability ``interval``: chunks of C
single pushes into one alternate with chunks of C pushed by ``push_many(100)``
into the other, then likewise single pop+ack against ``pop_many(100)`` +
``ack_many``. Each chunk is timed in thread CPU time; the ratio printed is the
median over the chunks of (single-op time / batch time), so both sides of
each ratio see the same moment of a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import qstore  # noqa: E402  (the repository's, not an installed one)

BATCH = 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--chunk", type=int, default=1_000)
    ap.add_argument("--size", type=int, default=1024)
    args = ap.parse_args()
    chunk = args.chunk - args.chunk % BATCH or BATCH
    body = os.urandom(args.size)
    items = [(body, i % 10) for i in range(BATCH)]
    work = tempfile.mkdtemp(prefix="qstore-batch-ratio-")
    try:
        with qstore.open(os.path.join(work, "single"), compactor=False) as single, \
                qstore.open(os.path.join(work, "batch"), compactor=False) as batch:
            qs, qb = single.create_queue("q"), batch.create_queue("q")
            push, push_many, pop_ack, pop_ack_many = [], [], [], []
            rounds = max(1, args.messages // chunk)
            for _ in range(rounds):
                t = time.thread_time()
                for i in range(chunk):
                    qs.push(body, i % 10)
                push.append(time.thread_time() - t)
                t = time.thread_time()
                for _ in range(chunk // BATCH):
                    qb.push_many(items)
                push_many.append(time.thread_time() - t)
            for _ in range(rounds):
                t = time.thread_time()
                for _ in range(chunk):
                    m = qs.pop()
                    assert m is not None
                    qs.ack(m)
                pop_ack.append(time.thread_time() - t)
                t = time.thread_time()
                for _ in range(chunk // BATCH):
                    qb.ack_many(qb.pop_many(BATCH))
                pop_ack_many.append(time.thread_time() - t)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = statistics.median(a / b for a, b in zip(push, push_many, strict=True))
    ratio_pop = statistics.median(a / b for a, b in zip(pop_ack, pop_ack_many, strict=True))
    per = statistics.median(push_many) / chunk * 1e6
    print(f"push_many({BATCH}) / push: {ratio:.2f}x  ({statistics.median(push) / chunk * 1e6:.1f}"
          f" us a push, {per:.1f} us a batched message)")
    print(f"pop_many({BATCH})+ack_many / pop+ack: {ratio_pop:.2f}x")


if __name__ == "__main__":
    main()
