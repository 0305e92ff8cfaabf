"""The two Spark targets: backfill vs push_many, and the audit vs a plain scan.

Both are timed with a warm session (started, and run once on a small load,
untimed): the contract compares the jobs, and Spark's start-up and first job
(10 s and more here) are a fixed cost that says nothing about either. The
backfill loads a Parquet file of ``n`` rows (1 KiB payloads, priorities
0..9; row groups of 50,000 rows, no dictionary, no compression: written like
real, incompressible data, so Spark and the backfill can split it across the
cores, where the 64 repeated payload variants would otherwise shrink into one
tiny dictionary-encoded row group read by one task) into a fresh store;
``push_many`` pushes the same rows in batches of 1,000 into another fresh
store, in the same process.

Fairness. The warm-up backfill reads a file of one row group per core, so
that every Python worker the timed job uses has started and imported qstore
(a warm-up of one task left the second worker cold: about 0.9 s of the
timed 200,000-row job here was that worker starting). Dirty pages are written
back (``os.sync()``, untimed) before each timed part, so that neither side
pays for the writeback of what was written before it (the source file, the
other side's store): up to 2 GB at ``--full``. The audit runs on a
snapshot of the backfilled store; the scan is
``qstore.spark._scan.scan_snapshot`` of the same snapshot, the plain
single-process Python scan (records only, as docs/spark.md measures it).
"""

from __future__ import annotations

import os
import time

from ._plan import KiB, MiB, Params
from ._results import Metric
from ._scaling import disk_write_rate
from ._workloads import make_items

BATCH = 1_000
WARM = 2_000  # rows of the untimed warm-up job
ROW_GROUP = 50_000  # rows per row group of the source file
PARQUET = {"row_group_size": ROW_GROUP, "use_dictionary": False, "compression": "none"}


def _tree_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (their sizes, not their blocks)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
               for f in files)


def measure_spark(path: str, p: Params) -> list[Metric]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql import SparkSession

    import qstore
    from qstore.spark import get_session
    from qstore.spark._scan import scan_snapshot
    from qstore.spark.audit import run_audit
    from qstore.spark.backfill import run_backfill

    n = p.spark_messages
    os.makedirs(path)
    items = make_items(n, KiB, p.seed)
    source = os.path.join(path, "source.parquet")
    pq.write_table(pa.table({"payload": pa.array([b for b, _ in items], pa.binary()),
                             "priority": pa.array([pr for _, pr in items], pa.int64())}), source,
                   **PARQUET)

    os.sync()  # the source file's pages: written back before, not during, push_many
    with qstore.open(os.path.join(path, "pushed"), compactor=False) as store:
        q = store.create_queue("q")
        started = time.perf_counter()
        for i in range(0, n, BATCH):
            q.push_many(items[i: i + BATCH])
        push_s = time.perf_counter() - started

    stop = SparkSession.getActiveSession() is None  # never stop a session we did not start
    spark = get_session("local[2]", "qstore-bench", fast_start=True)
    try:
        # Warm up, untimed: the first job of a session starts the Python workers
        # and the JVM compiles its hot code (10 s and more here, once). One row
        # group per core: one task each, so every worker starts now.
        cores = max(1, int(spark.sparkContext.defaultParallelism))
        warm = os.path.join(path, "warm.parquet")
        pq.write_table(pa.table({"payload": pa.array([b for b, _ in items[:WARM]], pa.binary()),
                                 "priority": pa.array([pr for _, pr in items[:WARM]],
                                                      pa.int64())}), warm,
                       row_group_size=-(-WARM // cores))
        run_backfill(warm, into=os.path.join(path, "warm"), queue="q", priority_col="priority",
                     spark=spark)
        with qstore.open(os.path.join(path, "warm"), compactor=False) as store:
            store.snapshot(os.path.join(path, "warm-snapshot"))
        run_audit(os.path.join(path, "warm-snapshot"), out=os.path.join(path, "warm-audit"),
                  spark=spark, quiet=True)
        into = os.path.join(path, "loaded")
        os.sync()  # push_many's store: written back before, not during, the backfill
        started = time.perf_counter()
        result = run_backfill(source, into=into, queue="q", priority_col="priority", spark=spark)
        backfill_s = time.perf_counter() - started
        if result.loaded != n:
            raise RuntimeError(f"the backfill loaded {result.loaded:,} of {n:,} rows")
        # The backfill is durable when it returns (every file it wrote fsynced),
        # push_many in `interval` mode is not: set the load against the disk.
        loaded_bytes = _tree_bytes(into)
        os.sync()
        disk = disk_write_rate(path, p.disk_bytes)
        snap = os.path.join(path, "snapshot")
        with qstore.open(into, compactor=False) as store:
            store.snapshot(snap)
        started = time.perf_counter()
        table = scan_snapshot(snap)
        scan_s = time.perf_counter() - started
        if table.num_rows != n:
            raise RuntimeError(f"the scan saw {table.num_rows:,} of {n:,} messages")
        started = time.perf_counter()
        audit = run_audit(snap, out=os.path.join(path, "audit"), spark=spark, quiet=True)
        audit_s = time.perf_counter() - started
        if audit.exit_code != 0:
            raise RuntimeError(f"the audit of a clean snapshot exited {audit.exit_code}")
    finally:
        if stop:
            spark.stop()
    return [
        Metric("spark.push_many_rate", f"push_many of {n:,} x 1 KiB (batches of {BATCH:,})",
               n / push_s, "msgs/s"),
        Metric("spark.backfill_rate", f"Spark backfill of the same {n:,} rows from Parquet",
               n / backfill_s, "msgs/s"),
        Metric("spark.backfill_ratio", "backfill rate / push_many rate",
               push_s / backfill_s, "x"),
        Metric("spark.backfill_mib_s", "backfill: bytes of the loaded store (payload "
               "segments and tables) / backfill time", loaded_bytes / MiB / backfill_s, "MiB/s"),
        Metric("spark.disk_mib_s", f"disk sequential write + fsync ({p.disk_bytes // MiB} MiB, "
               "right after)", disk, "MiB/s"),
        Metric("spark.backfill_disk_ratio", "backfill write rate / disk write rate",
               loaded_bytes / MiB / backfill_s / disk, "x"),
        Metric("spark.needed_disk_ratio", "write rate a backfill at 3x push_many would need, "
               "/ disk write rate", 3 * (n / push_s) * (loaded_bytes / n) / MiB / disk, "x"),
        Metric("spark.scan_s", f"plain single-process scan of a {n:,}-message snapshot",
               scan_s, "s"),
        Metric("spark.audit_s", "Spark audit of the same snapshot", audit_s, "s"),
        Metric("spark.audit_ratio", "audit time / scan time", audit_s / scan_s, "x"),
    ]
