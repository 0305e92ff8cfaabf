"""qstore's benchmark harness: qstore against its peers, and the contract's targets.

It is a development tool, not part of the installed package. Run it from the
repository root with ``tools`` on the path (``make bench`` does this)::

    PYTHONPATH=tools .venv/bin/python -m bench --quick

Modules, in the order a run uses them:

- ``_plan``: the workload names and the quick / default / full sizes.
- ``_peers``: one adapter per system under test (qstore in each durability
  mode, a bare rocksdict queue with and without sync, persist-queue's
  SQLiteAckQueue and PriorityQueue, litequeue), all with one interface.
- ``_workloads``: throughput and latency loops run against every peer.
- ``_interleaved``: the push, pop+ack and batch ratios again, both sides of
  each alternating in chunks in one process (steadier on a noisy machine).
- ``_scaling``: qstore-only churn, open-time/RSS and compaction measurements.
- ``_results``: samples, medians over repeats, the JSON document.
- ``_targets``: CONTRACT.md section 7 as data, checked against the medians.
- ``_report``: the rich tables, rendered from the JSON document alone.
- ``_profile``: cProfile of the single push and pop+ack loops.
- ``_runner``: the command line, :func:`run`; ``__main__`` calls it.

docs/benchmarks.md says what each workload measures and how to read the tables.
"""

from ._runner import run

__all__ = ["run"]
