"""The backfill job: bulk-load messages from any Spark-readable source into a store.

Python::

    from qstore.spark.backfill import run_backfill
    result = run_backfill("events.parquet", into="data/", queue="emails",
                          payload_col="body", priority_col="prio")
    result = run_backfill(["a.parquet", "b/"], into="data/", queue="emails")  # several
    result = run_backfill(df, into="data/", queue="emails")     # a DataFrame

Command line: ``qstore backfill`` (qstore.cli), which ``spark-submit
spark/backfill.py`` also runs::

    qstore backfill SOURCE... --queue NAME --into STORE [--format parquet|json|csv]
        [--payload-col C] [--priority-col P] [--delay-col D] [--dedup-col K]
        [--ttl-col T] [--master URL] [--rejects DIR] [--order O] [--priority-type T]
        [--max-attempts N] [--dedup/--no-dedup]

How it works (docs/backfill.md has the whole story): the driver opens the
store read-write and keeps its lock for the whole job, counts the rows of
every partition, reserves their message ids (durably) and segment file ids;
the executors write payload segments and sorted SST files into
``<store>/staging/<job>/``; the driver then ingests everything in one atomic
RocksDB ingestion. Loaded messages are exactly what ``push_many`` would have
written. Among equal priorities, pop order is partition order, then row order
within a partition. Rows that cannot be loaded go to a Parquet rejects table
with a reason, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from .._errors import InvalidArgument, QStoreError
from .._store import Store
from .._store import open_store as _open_store
from ..meta import keys
from ..payload import _format as fmt
from . import _ingest
from ._bulk import PARTITION_COL, REASON_COL, ROW_COL, PartitionPlan
from ._rows import LoadSpec
from ._task_errors import task_input_error, task_storage_error

if TYPE_CHECKING:
    from ._bulk_files import FilePart

log = logging.getLogger("qstore.backfill")

FORMATS = ("parquet", "json", "csv")
QUEUE_OPTIONS = ("order", "priority_type", "max_attempts", "dedup")
LOOKUP_CHUNK = 10_000  # dedup keys fetched from the store per multi-get
# Segment file ids reserved per partition when its payload size is unknown (the
# count reads no payload): segments roll at segment_max_bytes while they last.
SEGMENT_IDS_PER_PARTITION = 4
# Parquet files on a local (or shared) filesystem are read by the tasks themselves
# (_bulk_files.py) unless this is False: then Spark's reader decodes every source.
DIRECT_PARQUET = True


@dataclass(frozen=True)
class BackfillResult:
    """What one backfill did. Ids ``first_id <= id < end_id`` were reserved for it."""

    job_id: str
    store: str
    queue: str
    partitions: int
    rows: int  # rows read from the source
    loaded: int
    rejected: int  # bad rows plus duplicates, all in the rejects table
    duplicates: int
    ready: int
    delayed: int
    bytes: int  # payload bytes loaded
    first_id: int
    end_id: int
    segments: tuple[int, ...]  # file ids of the new payload segments
    rejects_path: str | None  # the rejects table (a Parquet directory), if written
    seconds: float
    phases: tuple[tuple[str, float], ...]  # (phase, seconds): count, write, commit

    @property
    def rate(self) -> float:
        """Messages loaded per second, end to end."""
        return self.loaded / self.seconds if self.seconds > 0 else 0.0


# Stores (by real path) a backfill of this process is loading into: one at a time
# each, since a job's start removes what earlier jobs left in the staging area.
_running: set[str] = set()
_running_lock = threading.Lock()


def _close_own(store: Store, result: BackfillResult | None) -> None:
    """Close the store a backfill opened for itself. Its job's marker goes in the
    close's last batch (``_ingest.commit_job``): once the job is in, a close that
    fails, or cannot delete the marker, is said in the log and the result stands
    (the rows are in: it raised, and the command said nothing was loaded)."""
    try:
        store.close()
    except QStoreError as exc:
        if result is None:
            raise
        log.error("backfill %s: its %d rows are in, but closing the store failed: %s",
                  result.job_id, result.loaded, exc)
    if result is not None and store.core.kept_at_close:
        log.warning("backfill %s: its rows are in, but the store's close could not delete "
                    "the job's marker: a run of the same job is refused until one is given "
                    "again=True (--again)", result.job_id)


def run_backfill(
    source: Any,
    *,
    into: str | os.PathLike[str] | Store,
    queue: str,
    fmt: str = "parquet",
    payload_col: str = "payload",
    priority_col: str | None = None,
    delay_col: str | None = None,
    dedup_col: str | None = None,
    ttl_col: str | None = None,
    master: str | None = None,
    spark: Any = None,
    create_queue_options: dict[str, Any] | None = None,
    rejects: str | os.PathLike[str] | None = None,
    again: bool = False,
) -> BackfillResult:
    """Load every row of ``source`` into queue ``queue`` of the store at ``into``.

    ``source`` is a path (or list of paths) read with ``spark.read.format(fmt)``
    (CSV with a header row and inferred types), or a DataFrame. The payload
    column is binary or string (stored as UTF-8). ``priority_col`` holds ints
    (or integral numbers or numeric strings) for an ``int`` queue, strings for a
    ``str`` queue; ``delay_col`` seconds from now; ``dedup_col`` the dedup key
    (a dedup queue only; without it the payload's hash is the key, as in push);
    ``ttl_col`` seconds after which the message expires (``push(ttl=...)``).
    Nulls mean the push defaults (priority 0 or "", no delay, payload hash,
    the queue's default TTL if it has one).

    The queue is created if missing, with ``create_queue_options`` (``order``,
    ``priority_type``, ``max_attempts``, ``dedup``; ``dedup`` defaults to True
    when ``dedup_col`` is given). Bad rows and duplicates are written to the
    Parquet directory ``rejects`` (default ``<into>/rejects/<job id>/``, only
    when there are any), which must be new or empty.

    A job an earlier run loaded before it was killed (the same sources,
    format, queue and columns) is refused, ``AlreadyLoaded``, nothing loaded,
    for as long as its marker stays in the store; ``again=True`` loads its
    rows a second time (docs/backfill.md).

    ``spark`` is the session to use; otherwise one is built (or the active one
    reused) for ``master``, default ``local[2]``. Raises ``StoreLocked`` if
    another process has the store open read-write: the store stays locked by
    this call until it returns.

    ``into`` may also be a store open read-write in this process (how
    ``qstore serve`` runs a backfill for a client): other threads go on using
    it meanwhile, and the commit then checks again, under the writer lock,
    that no message pushed during the job holds a dedup key the job loads
    (if one does, nothing is loaded). One backfill at a time per store.
    """
    started = time.perf_counter()
    if type(again) is not bool:
        raise InvalidArgument(f"again must be a bool, not {again!r}")
    options = _check_args(queue, fmt, payload_col, priority_col, delay_col, dedup_col,
                          ttl_col, master, spark, create_queue_options)
    rejects_dest = None if rejects is None else os.path.abspath(os.fspath(rejects))
    if rejects_dest is not None:
        _ingest.check_rejects_dest(rejects_dest)
    shared = isinstance(into, Store)
    store = into if isinstance(into, Store) else _open_store(os.fspath(into), compactor=False)
    key = os.path.realpath(store.path)
    result: BackfillResult | None = None
    try:
        with _running_lock:
            if key in _running:
                raise QStoreError(f"a backfill into {store.path!r} is already running in "
                                  "this process; run one at a time")
            _running.add(key)
        try:
            if spark is None:
                spark = backfill_session(master)
            job = _Job(store, spark, source, fmt, queue, options, rejects_dest,
                       (payload_col, priority_col, delay_col, dedup_col, ttl_col),
                       dict(create_queue_options or {}), shared, again)
            try:
                result = job.run(started)
            except QStoreError:
                raise
            except Exception as exc:
                # A full disk or an I/O error met by a task: the storage failed
                # (exit 5, one line naming the file), not the job; nothing was loaded.
                failed = task_storage_error(exc) or task_input_error(exc)
                if failed is None:
                    raise
                raise failed from None
        finally:
            with _running_lock:
                _running.discard(key)
    finally:
        if not shared:
            _close_own(store, result)
    log.info("backfill %s: %d rows loaded into %r, %d rejected, in %.1fs", result.job_id,
             result.loaded, queue, result.rejected, result.seconds)
    return result


def serve_backfill(store: Store, args: dict[str, Any]) -> dict[str, Any]:
    """The ``backfill`` operation of ``qstore serve``: :func:`run_backfill` into the
    server's own store, the Spark driver in the server's process; the result as
    a map. A session this call started is stopped when it returns; PySpark's
    JVM (its gateway process, about 380 MB resident) stays in the server for
    the next backfill: ``SparkSession.stop`` does not end it."""
    from pyspark.sql import SparkSession

    sources = args.pop("sources", None)
    if (not isinstance(sources, list) or not sources
            or not all(isinstance(p, str) and os.path.isabs(p) for p in sources)):
        raise InvalidArgument("backfill: sources must be a non-empty list of absolute paths "
                              "on the server's machine")
    rejects = args.get("rejects")
    if rejects is not None and (not isinstance(rejects, str) or not os.path.isabs(rejects)):
        raise InvalidArgument("backfill: rejects must be an absolute path on the server's "
                              "machine")
    unknown = sorted(set(args) - SERVED_ARGS)
    if unknown:
        raise InvalidArgument(f"backfill: unexpected argument(s) {unknown}")
    had_session = SparkSession.getActiveSession() is not None
    try:
        result = run_backfill(sources[0] if len(sources) == 1 else sources, into=store,
                              **args)
    except QStoreError:
        raise
    except Exception as exc:  # the Spark run failed: the client exits 3 on spark_failed
        err = QStoreError(f"backfill failed, nothing was loaded: the Spark run failed: {exc}")
        err.spark_failed = True  # type: ignore[attr-defined]  # an error field on the wire
        raise err from exc
    finally:
        active = SparkSession.getActiveSession()
        if active is not None and not had_session:
            active.stop()
    out = dataclasses.asdict(result)
    out["rate"] = result.rate
    return out


# The keyword arguments of run_backfill a client may send (besides ``sources``).
SERVED_ARGS = frozenset({"queue", "fmt", "payload_col", "priority_col", "delay_col",
                         "dedup_col", "ttl_col", "master", "rejects", "create_queue_options",
                         "again"})


def backfill_session(master: str | None) -> Any:
    """The session to run on: the active one, spark-submit's, or a new local one."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None and master is None:
        return active
    if master is None and "PYSPARK_GATEWAY_PORT" in os.environ:
        # Launched by spark-submit: keep its --master and configuration.
        return SparkSession.builder.appName("qstore-backfill").getOrCreate()
    from ._session import get_session

    return get_session(master, "qstore-backfill")


def _check_args(queue: object, fmt: object, payload_col: object, priority_col: object,
                delay_col: object, dedup_col: object, ttl_col: object, master: object,
                spark: object, create_queue_options: object) -> dict[str, Any]:
    if not isinstance(queue, str) or not queue:
        raise InvalidArgument(f"queue must be a non-empty str, not {queue!r}")
    if not isinstance(fmt, str) or not fmt:
        raise InvalidArgument(f"fmt must be a Spark source format such as {FORMATS}, not {fmt!r}")
    if not isinstance(payload_col, str) or not payload_col:
        raise InvalidArgument(f"payload_col must be a column name, not {payload_col!r}")
    for what, col in (("priority_col", priority_col), ("delay_col", delay_col),
                      ("dedup_col", dedup_col), ("ttl_col", ttl_col)):
        if col is not None and (not isinstance(col, str) or not col):
            raise InvalidArgument(f"{what} must be a column name or None, not {col!r}")
    if master is not None and spark is not None:
        raise InvalidArgument("pass either spark (a session) or master, not both")
    if create_queue_options is not None and not isinstance(create_queue_options, dict):
        raise InvalidArgument("create_queue_options must be a dict or None")
    options: dict[str, Any] = dict(create_queue_options or {})
    unknown = sorted(set(options) - set(QUEUE_OPTIONS))
    if unknown:
        raise InvalidArgument(f"unknown create_queue_options {unknown}; "
                              f"known: {list(QUEUE_OPTIONS)}")
    if dedup_col is not None:
        options.setdefault("dedup", True)
    return options


def _quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


class _Job:
    """One backfill run (the store is open and locked by the caller)."""

    def __init__(self, store: Store, spark: Any, source: Any, fmt: str, queue: str,
                 options: dict[str, Any], rejects_dest: str | None,
                 columns: tuple[str, str | None, str | None, str | None, str | None],
                 explicit_options: dict[str, Any], shared: bool = False,
                 again: bool = False) -> None:
        self.store = store
        self.again = again  # load a job an earlier, killed run had loaded
        # Others may push meanwhile (a server's store): the digests the job loads
        # are checked again at the commit.
        self.shared = shared
        self.loaded_digests: list[bytes] = []
        self.spark = spark
        self.queue = queue
        self.job_id = time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(4)
        # The default is relative: inside the store directory, wherever it is moved.
        self.rejects_dest = rejects_dest or os.path.join("rejects", self.job_id)
        self.explicit_rejects = rejects_dest is not None
        (self.payload_col, self.priority_col, self.delay_col, self.dedup_col,
         self.ttl_col) = columns
        self.options = options
        # CSV has no types: its columns are inferred, so "007" would be the int 7.
        # The payload, the dedup key and a str queue's priority are text as written.
        text = [self.payload_col, self.dedup_col]
        exact = []  # read as text if inferred as float or decimal (see _read)
        if self._queue_kind()[0] == "str":
            text.append(self.priority_col)
        else:
            exact.append(self.priority_col)
        self.df, self.malformed_col = _read(spark, source, fmt,
                                            [c for c in text if c is not None],
                                            [c for c in exact if c is not None])
        self.malformed_format = fmt.upper()  # what a malformed line's reject reason names
        self.paths = _paths(source) if fmt == "parquet" else None
        self.fingerprint = _ingest.job_fingerprint(source, fmt, queue, columns)
        self.explicit_options = explicit_options
        self.phases: list[tuple[str, float]] = []
        self.first_id = self.end_id = 0

    def run(self, started: float) -> BackfillResult:
        from ._bulk_files import BackfillFilesSource, plan_files
        from ._bulk_source import BackfillLoadSource, BackfillScanSource

        self.spark.dataSource.register(BackfillScanSource)
        self.spark.dataSource.register(BackfillLoadSource)
        self.spark.dataSource.register(BackfillFilesSource)
        store = self.store
        # First: refused, it writes nothing (no queue created, no marker settled).
        _ingest.refuse_if_space_low(store)
        ptype, dedup = self._queue_kind()
        self._check_schema(ptype, dedup)
        q = self._target_queue()
        for job_id, rows in _ingest.settle_loaded(store, self.fingerprint, self.again):
            log.warning("backfill %s had loaded its %d rows before it was killed; its rejects "
                        "directory is marked %s now", job_id, rows, _ingest.SUCCESS_FILE)
        for leftover in _ingest.clean_staging(store):
            log.warning("removed staging/%s, left by a backfill that did not finish", leftover)
        staging = _ingest.new_job_dir(store, self.job_id)
        try:
            spec = LoadSpec(
                qid=store.core.queues[self.queue].qid, order=q.order,
                priority_type=q.priority_type, dedup=q.dedup, now=store.core.clock(),
                max_payload_bytes=store.config.max_payload_bytes,
                segment_max_bytes=store.config.segment_max_bytes,
                payload_col=self.payload_col, priority_col=self.priority_col,
                delay_col=self.delay_col, dedup_col=self.dedup_col, ttl_col=self.ttl_col,
                default_ttl=store.core.queues[self.queue].rec.ttl,
                malformed_col=self.malformed_col, malformed_format=self.malformed_format)
            selected = self.df.select(*[_quoted(c) for c in spec.columns()])
            t = time.perf_counter()
            files = None
            if DIRECT_PARQUET and self.paths is not None and not spec.dedup:
                files = plan_files(self.paths, spec.columns(), _cores(self.spark))
            if files is not None:  # the tasks read their row groups: no counting pass
                plans = self._reserve({p.pid: (p.rows, None) for p in files}, {}, spec,
                                      staging)
                self.phases.append(("plan", time.perf_counter() - t))
                t = time.perf_counter()
                job = self._write_files(selected, files, spec, staging, plans)
                self.phases.append(("write", time.perf_counter() - t))
            else:
                with _static_partitions(self.spark, csv=self.malformed_format == "CSV"):
                    plans = self._plan(selected, spec, staging)
                    self.phases.append(("count", time.perf_counter() - t))
                    t = time.perf_counter()
                    job = self._write(selected, spec, staging, plans)
                    self.phases.append(("write", time.perf_counter() - t))
            t = time.perf_counter()
            # With a store of its own, the marker goes in the store's closing batch:
            # closing it (a sync, a flush: many syncs) came after the marker's
            # delete, and a crash meanwhile left the rows in, no marker, and no
            # word to the caller: a rerun loaded them twice (a power-loss audit).
            _ingest.commit_job(store, staging,
                               self.loaded_digests if self.shared else None, self.fingerprint,
                               marker_at_close=not self.shared)
            self.phases.append(("commit", time.perf_counter() - t))
        except BaseException:
            if os.path.isdir(staging):
                _ingest.clean_staging(store)
            raise
        parts = job.partitions
        rejected = job.total("rejected")
        return BackfillResult(
            job_id=self.job_id, store=store.path, queue=self.queue, partitions=len(parts),
            rows=job.total("rows"), loaded=job.total("loaded"), rejected=rejected,
            duplicates=job.total("duplicates"), ready=job.total("ready"),
            delayed=job.total("delayed"), bytes=job.total("bytes"), first_id=job.first_id,
            end_id=job.end_id, segments=tuple(s["file_id"] for s in job.segments()),
            rejects_path=_ingest.rejects_dir(store, job) if rejected or self.explicit_rejects
            else None,
            seconds=time.perf_counter() - started, phases=tuple(self.phases))

    # -- checks ---------------------------------------------------------------

    def _target_queue(self) -> Any:
        """The queue, created with the options if missing; given options must match it."""
        state = self.store.core.queues.get(self.queue)
        if state is None:
            return self.store.create_queue(self.queue, **self.options)
        rec = state.rec
        have = {"order": rec.order, "priority_type": rec.priority_type,
                "max_attempts": rec.max_attempts, "dedup": rec.dedup}
        differ = {k: v for k, v in self.explicit_options.items() if have[k] != v}
        if differ:
            raise InvalidArgument(f"queue {self.queue!r} exists with {have}, which differs "
                                  f"from create_queue_options {differ}")
        return self.store.queue(self.queue)

    def _queue_kind(self) -> tuple[str, bool]:
        state = self.store.core.queues.get(self.queue)
        if state is not None:
            return state.rec.priority_type, state.rec.dedup
        ptype = self.options.get("priority_type", "int")
        if ptype not in ("int", "str"):
            raise InvalidArgument(f"priority_type must be 'int' or 'str', not {ptype!r}")
        return ptype, bool(self.options.get("dedup", False))

    def _check_schema(self, ptype: str, dedup: bool) -> None:
        from pyspark.sql import types as T

        fields = {f.name: f.dataType for f in self.df.schema.fields
                  if f.name != self.malformed_col}

        if not fields:
            # Every line malformed, or only empty files: "payload column 'payload' is
            # not in the source; its columns are []" sent users looking for a
            # misspelt column (a backfill audit).
            raise InvalidArgument(
                f"no column could be read from the {self.malformed_format} source: its "
                "files are empty, or no line parses"
                + (" (JSON sources are read as JSON Lines: one object per line, UTF-8; "
                   "a pretty-printed document or an array over several lines is not)"
                   if self.malformed_format == "JSON" else ""))

        def need(col: str | None, what: str, allowed: tuple[type, ...], hint: str) -> None:
            if col is None:
                return
            if col not in fields:
                raise InvalidArgument(f"{what} column {col!r} is not in the source; its "
                                      f"columns are {sorted(fields)}")
            if not isinstance(fields[col], allowed):
                raise InvalidArgument(f"{what} column {col!r} has type "
                                      f"{fields[col].simpleString()}; it must be {hint}")

        need(self.payload_col, "payload", (T.BinaryType, T.StringType), "binary or string")
        numeric = (T.IntegralType, T.FloatType, T.DoubleType, T.DecimalType)
        if ptype == "int":
            need(self.priority_col, "priority", (*numeric, T.StringType, T.NullType),
                 f"integral (queue {self.queue!r} has int priorities)")
        else:
            need(self.priority_col, "priority", (T.StringType, T.NullType),
                 f"string (queue {self.queue!r} has str priorities)")
        need(self.delay_col, "delay", (*numeric, T.StringType, T.NullType), "seconds (numeric)")
        need(self.ttl_col, "ttl", (*numeric, T.StringType, T.NullType), "seconds (numeric)")
        need(self.dedup_col, "dedup", (T.StringType, T.BinaryType, T.IntegralType, T.NullType),
             "string, binary or integral")
        if self.dedup_col is not None and not dedup:
            raise InvalidArgument(f"queue {self.queue!r} was not created with dedup=True, so "
                                  "it takes no dedup column")
        if self.paths is not None:  # Parquet files: each must have the columns read
            from ._bulk_files import check_file_columns

            used = [self.payload_col, self.priority_col, self.delay_col, self.ttl_col,
                    self.dedup_col]
            check_file_columns(self.df.inputFiles(), [c for c in used if c is not None],
                               self.paths)

    # -- pass 1: count, reserve -------------------------------------------------

    def _plan(self, selected: Any, spec: LoadSpec, staging: str) -> dict[int, PartitionPlan]:
        """Count each partition, pick duplicates, reserve ids and file ids; write the plans."""
        if spec.dedup:
            counts, dups = self._scan_dedup(selected, spec, staging)
        else:
            counts, dups = self._count(selected), {}
        return self._reserve(counts, dups, spec, staging)

    def _reserve(self, counts: dict[int, tuple[int, int | None]],
                 dups: dict[int, dict[int, str]], spec: LoadSpec, staging: str
                 ) -> dict[int, PartitionPlan]:
        """Reserve the ids and segment file ids of each partition; write the plans."""
        store = self.store
        first = _ingest.reserve_ids(store, sum(rows for rows, _ in counts.values()))
        capacity = spec.segment_max_bytes - fmt.HEADER_SIZE
        plans: dict[int, PartitionPlan] = {}
        next_id = first
        from ._bulk_source import write_plan

        for pid in sorted(counts):
            rows, nbytes = counts[pid]
            if nbytes is None:
                nseg = SEGMENT_IDS_PER_PARTITION if rows else 0
            else:  # enough for greedy filling: two neighbours hold more than `capacity`
                nseg = 0 if nbytes == 0 else 1 if nbytes <= capacity else 2 * nbytes // capacity + 2
            plans[pid] = PartitionPlan(pid, rows, next_id, _ingest.reserve_file_ids(store, nseg),
                                       dups.get(pid, {}))
            next_id += rows
            write_plan(staging, plans[pid])
        self.first_id, self.end_id = first, next_id
        _ingest.step("reserved")
        return plans

    def _count(self, selected: Any) -> dict[int, tuple[int, int | None]]:
        """Rows per partition, counted in the JVM without reading any column's data.

        The partitions are those of ``selected``, which the writing pass writes
        (same plan, so same partitioning; the tasks check the counts anyway).
        """
        from pyspark.sql import functions as F

        rows = selected.select(F.spark_partition_id().alias("p")).groupBy("p").count().collect()
        return {int(r["p"]): (int(r["count"]), None) for r in rows}

    def _scan_dedup(self, selected: Any, spec: LoadSpec, staging: str
                    ) -> tuple[dict[int, tuple[int, int | None]], dict[int, dict[int, str]]]:
        """Counting pass of a dedup queue, then the dedup rule (docs/backfill.md).

        The first row (partition order, then row order) with a given dedup
        digest is loaded unless a message of the queue already has it; every
        other row with that digest is rejected as a duplicate.
        """
        from ._bulk_source import SCAN, SCAN_RESULT

        (selected.write.format(SCAN).mode("append").option("staging", staging)
         .option("spec", spec.to_json()).save())
        with open(os.path.join(staging, SCAN_RESULT), "rb") as f:
            scans = msgpack.unpackb(f.read(), raw=False)
        counts: dict[int, tuple[int, int | None]] = {s["pid"]: (s["rows"], s["bytes"])
                                                     for s in scans}
        first: dict[bytes, tuple[int, int]] = {}
        later: list[tuple[int, int, bytes]] = []
        for s in sorted(scans, key=lambda s: s["pid"]):
            d = s["digests"]
            for i, row in enumerate(s["valid"]):
                dg = d[16 * i: 16 * i + 16]
                if dg in first:
                    later.append((s["pid"], row, dg))
                else:
                    first[dg] = (s["pid"], row)
        live = self._live_digests(spec.qid, list(first))
        self.loaded_digests = [dg for dg in first if dg not in live]
        dups: dict[int, dict[int, str]] = {}
        for dg, mid in live.items():
            pid, row = first[dg]
            dups.setdefault(pid, {})[row] = f"duplicate: message {mid} of the queue has this key"
        for pid, row, dg in later:
            if dg in live:
                reason = f"duplicate: message {live[dg]} of the queue has this key"
            else:
                p0, r0 = first[dg]
                reason = f"duplicate: row {r0} of partition {p0} has this key"
            dups.setdefault(pid, {})[row] = reason
        return counts, dups

    def _live_digests(self, qid: int, digests: list[bytes]) -> dict[bytes, int]:
        """The digests that live messages of the queue already hold, with their ids."""
        found = {}
        with self.store.core.lock:
            for i in range(0, len(digests), LOOKUP_CHUNK):
                chunk = digests[i: i + LOOKUP_CHUNK]
                raws = self.store.core.meta.multi_get([keys.dedup_key(qid, d) for d in chunk])
                for dg, raw in zip(chunk, raws, strict=True):
                    if raw is not None:
                        found[dg] = keys.U64.unpack(raw)[0]
        return found

    # -- pass 2: write ----------------------------------------------------------

    def _write(self, selected: Any, spec: LoadSpec, staging: str,
               plans: dict[int, PartitionPlan]) -> _ingest.StagedJob:
        import json

        from ._bulk_source import LOAD, TASKS_RESULT

        (selected.write.format(LOAD).mode("append").option("staging", staging)
         .option("spec", spec.to_json()).save())
        with open(os.path.join(staging, TASKS_RESULT), encoding="utf-8") as f:
            tasks = json.load(f)
        return self._staged(selected, tasks, staging, spec, plans)

    def _write_files(self, selected: Any, files: list[FilePart], spec: LoadSpec, staging: str,
                     plans: dict[int, PartitionPlan]) -> _ingest.StagedJob:
        """The writing pass of the direct path: one summary per task.

        A plain RDD job of the parts (measured in the same warm session, 1,000,000
        rows: median 1.56 s against 2.39 s through the data source, whose job also
        plans in a Python worker; and a first job in a fresh session 3.4 s against
        7-10 s). Spark Connect has no RDDs: there the data source runs the tasks.
        """
        import json

        from ._bulk_files import FILES, parts_to_json, run_parts

        sc = _context(self.spark)
        if sc is not None:
            tasks = [json.loads(t) for t in run_parts(sc, staging, spec, files)]
        else:  # Spark Connect: no RDDs, the data source runs the same tasks
            rows = (self.spark.read.format(FILES).option("staging", staging)
                    .option("spec", spec.to_json()).option("parts", parts_to_json(files))
                    .load().collect())
            tasks = [json.loads(r["summary"]) for r in rows]
        return self._staged(selected, tasks, staging, spec, plans)

    def _staged(self, selected: Any, tasks: list[dict[str, Any]], staging: str, spec: LoadSpec,
                plans: dict[int, PartitionPlan]) -> _ingest.StagedJob:
        """Check the task summaries against the plans and save the staged job."""
        tasks = sorted(tasks, key=lambda s: s["pid"])
        seen = {t["pid"]: t for t in tasks}
        for pid, plan in plans.items():
            got = seen.get(pid)
            if plan.rows and (got is None or got["rows"] != plan.rows):
                raise QStoreError(f"backfill: partition {pid} was counted with {plan.rows} "
                                  f"rows but written with {got and got['rows']}; nothing "
                                  "was loaded (is the source deterministic?)")
        job = _ingest.StagedJob(self.job_id, self.queue, spec.qid, self.first_id, self.end_id,
                                tasks, self.rejects_dest)
        if self.explicit_rejects and not job.total("rejected"):
            self._empty_rejects(selected, staging)
        job.save(staging)
        _ingest.step("staged")
        return job

    def _empty_rejects(self, selected: Any, staging: str) -> None:
        """An explicit rejects directory always gets a table, even an empty one."""
        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyspark.sql.pandas.types import to_arrow_schema

        schema = to_arrow_schema(selected.schema)
        for name, typ in ((REASON_COL, pa.string()), (PARTITION_COL, pa.int32()),
                          (ROW_COL, pa.int64())):
            schema = schema.append(pa.field(name, typ))
        pq.write_table(schema.empty_table(),
                       os.path.join(staging, "rejects", "rejects-empty.parquet"))


@contextmanager
def _static_partitions(spark: Any, csv: bool = False) -> Iterator[None]:
    """Adaptive execution off while the job runs, restored after.

    The counting pass must see the writing pass's partitions. AQE sizes shuffle
    partitions from the bytes they carry, and the count carries no payload, so
    with AQE a source that shuffles (``df.orderBy(...)``) could be cut one way
    for the count and another for the write. Without it, partitioning follows
    from the plan alone.

    ``csv``: the CSV parser's column pruning off too. With it, a job that reads
    some of a file's columns parses only those, and no line is ever found
    malformed (:func:`_csv_source`).
    """
    settings = {"spark.sql.adaptive.enabled": "false"}
    if csv:
        settings["spark.sql.csv.parser.columnPruning.enabled"] = "false"
    before = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, old in before.items():
            if old is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, old)


MALFORMED_COL = "malformed_line"


def _csv_source(reader: Any, df: Any, paths: Any, text_cols: list[str]) -> tuple[Any, str]:
    """``df`` (read by the CSV ``reader`` with inferred types) read again with
    ``text_cols`` as strings, the other columns as inferred (the cells of those
    columns exactly as written), and a column that holds each malformed line.

    Spark's default PERMISSIVE mode loads a line with too few fields with
    nulls (so a missing priority became priority 0), drops the extra fields
    of one with too many, and reads an unclosed quote to the end of its line:
    each loaded as if it were well formed. With ``columnNameOfCorruptRecord``
    those lines carry their text in the returned column (named
    ``malformed_line``, with ``_`` added while a source column has that name),
    and the job rejects them.
    """
    from pyspark.sql import types as T

    name = MALFORMED_COL
    while name in df.columns:
        name += "_"
    schema = _text_schema(df, text_cols, T.StructField(name, T.StringType(), True))
    # A given schema: no second inference.
    return reader.schema(schema).option("columnNameOfCorruptRecord", name).load(paths), name


def _json_source(spark: Any, reader: Any, df: Any, paths: Any,
                 text_cols: list[str]) -> tuple[Any, str]:
    """``df`` (read by the JSON ``reader`` with inferred types) read again with
    ``text_cols`` as strings and a column that holds each malformed line, as
    :func:`_csv_source` does for CSV.

    A line that does not parse as JSON was loaded in Spark's PERMISSIVE mode
    with every column null: a reject "payload: null", its text lost. The
    inference's own column for such lines (``_corrupt_record``, Spark's
    ``spark.sql.columnNameOfCorruptRecord``) is left out; the returned column
    (``malformed_line``, with ``_`` added while a source key has that name)
    takes the text, and the job rejects the line as "malformed JSON line".
    """
    from pyspark.sql import types as T

    inferred_corrupt = spark.conf.get("spark.sql.columnNameOfCorruptRecord", "_corrupt_record")
    fields = [f for f in df.schema.fields
              if not (f.name == inferred_corrupt and isinstance(f.dataType, T.StringType))]
    name = MALFORMED_COL
    while name in [f.name for f in fields]:
        name += "_"
    schema = T.StructType([
        *(T.StructField(f.name, T.StringType(), True) if f.name in text_cols else f
          for f in fields), T.StructField(name, T.StringType(), True)])
    # A given schema: no second inference.
    return reader.schema(schema).option("columnNameOfCorruptRecord", name).load(paths), name


def _fractional(df: Any, cols: list[str]) -> list[str]:
    """Those of ``cols`` in ``df`` whose inferred type is a float or a decimal."""
    from pyspark.sql import types as T

    return [f.name for f in df.schema.fields if f.name in cols
            and isinstance(f.dataType, (T.FloatType, T.DoubleType, T.DecimalType))]


def _text_schema(df: Any, text_cols: list[str], *extra: Any) -> Any:
    """``df``'s schema with ``text_cols`` as strings (a read with it takes each cell
    of those as written), the other columns as inferred, then ``extra`` fields."""
    from pyspark.sql import types as T

    return T.StructType([
        *(T.StructField(f.name, T.StringType(), True) if f.name in text_cols else f
          for f in df.schema.fields), *extra])


def _widened(reader: Any, df: Any, paths: Any) -> Any:
    """``df`` (Parquet, its schema taken from one file) read again with its
    narrower numbers widened: integers to 64 bits, floats to doubles.

    Spark takes a Parquet source's schema from one of its files and cannot
    merge ``int`` with ``bigint`` (``mergeSchema`` refuses it), so files that
    wrote the same column as int32 and int64 (one written by pandas from
    ``int32``, another from ``int64``) failed the whole job. Read as the wider
    type, every file is widened as it is read (Spark 4 widens int32 to int64
    and float to double; an int64 column read as double it does not, so files
    that disagree on integer against float still fail, and say so).
    """
    from pyspark.sql import types as T

    narrow_ints = (T.ByteType, T.ShortType, T.IntegerType)
    fields = [T.StructField(f.name, T.LongType(), f.nullable)
              if isinstance(f.dataType, narrow_ints)
              else T.StructField(f.name, T.DoubleType(), f.nullable)
              if isinstance(f.dataType, T.FloatType) else f
              for f in df.schema.fields]
    if all(f1.dataType == f2.dataType for f1, f2 in zip(fields, df.schema.fields,
                                                         strict=True)):
        return df
    return reader.schema(T.StructType(fields)).load(paths)  # a given schema: no inference


def _paths(source: Any) -> list[str] | None:
    """The source's paths, if it is a path or a list of paths (not a DataFrame)."""
    if isinstance(source, (str, os.PathLike)):
        return [os.fspath(source)]
    if isinstance(source, (list, tuple)) and source and all(
            isinstance(s, (str, os.PathLike)) for s in source):
        return [os.fspath(s) for s in source]
    return None


def _context(spark: Any) -> Any:
    """The session's SparkContext, or None (Spark Connect has none)."""
    try:
        return spark.sparkContext
    except Exception:
        return None


def _cores(spark: Any) -> int:
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:  # Spark Connect has no SparkContext
        return 2


# CSV as Python's csv module, pandas and spreadsheets write it (RFC 4180), not
# Spark's defaults (an audit of real files): a quote inside a quoted field is
# doubled, not backslashed (`"say ""hi"""` loaded as those very bytes, and a JSON
# body's `"{""id"": 7}"` was split at its comma); a quoted field may hold line
# breaks (its second half loaded as a message of its own); and each file's header
# is checked against the columns (files of one source whose headers list them in
# another order were read by position: payload and priority swapped, exit 0).
CSV_OPTIONS = {"escape": '"', "multiLine": "true", "enforceSchema": "false"}


def _read(spark: Any, source: Any, fmt: str, text_cols: list[str] | None = None,
          int_cols: list[str] | None = None) -> tuple[Any, str | None]:
    """The source as a DataFrame, and the name of its malformed-line column (CSV
    and JSON files; None otherwise).

    Spark infers the types of CSV and JSON files. A CSV file's ``text_cols``
    are read as text whatever they look like. ``int_cols`` inferred as float
    or decimal (a column that also holds ``2.5`` is inferred as double, which
    rounds integers past 2**53: ``9007199254740993`` loaded as ``...992``, no
    reject) are read as text too, in CSV and JSON, and each cell is read
    exactly (_rows.py).
    """
    if isinstance(source, (str, os.PathLike)) or (
            isinstance(source, (list, tuple)) and source
            and all(isinstance(s, (str, os.PathLike)) for s in source)):
        paths = os.fspath(source) if isinstance(source, (str, os.PathLike)) else [
            os.fspath(s) for s in source]
        reader = spark.read.format(fmt)
        if fmt == "csv":
            reader = (reader.option("header", "true").option("inferSchema", "true")
                      .options(**CSV_OPTIONS))
        from pyspark.errors import AnalysisException

        try:
            df = reader.load(paths)
            fractional = _fractional(df, int_cols or [])
            if fmt == "csv":
                return _csv_source(reader, df, paths, [*(text_cols or []), *fractional])
            if fmt == "json":
                # Only the fractional ones as text: JSON has types, and a payload or key
                # column of the wrong one (an object, a number) stays a usage error
                # (_check_schema).
                return _json_source(spark, reader, df, paths, fractional)
            if fmt == "parquet":
                df = _widened(reader, df, paths)
            return df, None
        except AnalysisException as exc:  # a missing path, an unknown format, ...
            # (anything else, such as a cluster that cannot run the schema inference,
            # is a failed Spark run, not bad usage)
            raise InvalidArgument(f"cannot read {paths!r} as {fmt}: {exc}") from None
    if hasattr(source, "schema") and hasattr(source, "write") and hasattr(source, "select"):
        return source, None
    raise InvalidArgument(f"source must be a path, a list of paths or a DataFrame, "
                          f"not {type(source).__name__}")


__all__ = ["BackfillResult", "run_backfill"]
