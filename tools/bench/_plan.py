"""What a benchmark run measures and how big: the workloads and the three modes."""

from __future__ import annotations

from dataclasses import dataclass

KiB = 1024
MiB = 1024 * KiB

# Workload names accepted by --only, in the order they run.
WORKLOADS: tuple[str, ...] = (
    "push",          # single push, 1 KiB
    "pop_ack",       # single pop + ack from a backlog, 1 KiB
    "push_64k",      # single push, 64 KiB
    "pop_ack_64k",   # single pop + ack, 64 KiB
    "batch",         # push_many / pop_many + ack_many in batches of 100
    "interleaved",   # the push, pop+ack and batch ratios, both sides alternating in chunks
    "mixed",         # producer and consumer threads at once
    "group_commit",  # durability "always", 1 vs 8 producer threads
    "churn",         # pop rate on a fresh queue vs after N push/pop/ack cycles
    "open",          # open time and RSS of a fresh process, N-message backlog
    "compaction",    # compaction rate vs the disk's sequential write rate
    "spark",         # Spark backfill vs push_many, Spark audit vs a plain scan
    "server",        # qstore serve vs beanstalkd, 4 client processes (_server.py)
    "features",      # expiry and aging of a backlog of `backlog` messages (_features.py)
)


@dataclass(frozen=True, kw_only=True)
class Params:
    """The sizes of one run. Every measurement stops at ``n`` ops or ``budget`` seconds."""

    mode: str
    repeat: int
    n: int  # ops per throughput measurement (and the pop backlog)
    n_large: int  # the same for 64 KiB payloads
    budget: float  # seconds per throughput measurement, whichever ends first
    batch: int  # messages per push_many / pop_many / ack_many
    mixed_threads: int  # producers and, as many, consumers
    group_threads: int  # producer threads in the group-commit workload
    cycles: int  # push/pop/ack cycles before the second churn probe
    cycle_cap: float  # seconds the churn cycles may take at most
    backlog: int  # messages in the store whose open is measured
    compact_messages: int  # 1 KiB messages pushed before the compaction pass (half acked)
    disk_bytes: int  # size of the sequential-write probe file
    spark_messages: int  # rows backfilled and messages audited by the Spark workload
    seed: int = 7


MODES: dict[str, Params] = {
    # Under a minute: mechanics and a rough picture, one repeat.
    "quick": Params(mode="quick", repeat=1, n=2_000, n_large=300, budget=0.4, batch=100,
                    mixed_threads=2, group_threads=8, cycles=10_000, cycle_cap=10.0,
                    backlog=10_000,
                    compact_messages=10_000, disk_bytes=32 * MiB, spark_messages=20_000),
    # About 5-10 minutes on 2 cores: the figures the targets are read from.
    "default": Params(mode="default", repeat=3, n=20_000, n_large=2_000, budget=1.5, batch=100,
                      mixed_threads=2, group_threads=8, cycles=100_000, cycle_cap=30.0,
                      backlog=100_000,
                      compact_messages=100_000, disk_bytes=256 * MiB,
                      spark_messages=200_000),
    # The contract's scale for churn and open (1,000,000 messages).
    "full": Params(mode="full", repeat=3, n=20_000, n_large=2_000, budget=1.5, batch=100,
                   mixed_threads=2, group_threads=8, cycles=1_000_000, cycle_cap=900.0,
                   backlog=1_000_000,
                   compact_messages=200_000, disk_bytes=256 * MiB,
                   spark_messages=1_000_000),
}

CONTRACT_SCALE = 1_000_000  # messages named by the contract's churn and open targets
