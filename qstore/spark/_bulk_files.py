"""The backfill's direct path for Parquet files: executors read their row groups themselves.

When the source is Parquet files on a filesystem every executor mounts (the
store must be on one anyway), Spark need not decode the rows in the JVM and
hand them to Python: each task reads its own row groups with pyarrow, straight
into the Arrow batches :func:`~._bulk.load_partition` works on, and Spark moves
one small summary per task. The tasks run as a plain RDD job (:func:`run_parts`);
the data source below runs them where there are no RDDs (Spark Connect).
Measured here, the JVM's decoding and hand-over was the largest cost of the
write pass (docs/backfill.md).

The driver plans from the files' footers alone: the rows of every row group
are known exactly, so there is no counting pass. Partitions are runs of
consecutive row groups, files in name order, each at most the rows of an
even split over the cores (and ``ROWS_PER_TASK``) unless one row group is
larger, so row ``n`` of the source in that
order gets the ``n``-th id: the FIFO rule is file order, then row order.

:func:`plan_files` returns None when the direct path does not apply (a
``scheme://`` path, a directory of Hive partitions, a column missing from
a file or of another type in another file), and the job goes through Spark's
own reader instead.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from .._errors import InvalidArgument
from ._bulk import PartitionPlan, load_partition
from ._bulk_source import read_plan
from ._rows import LoadSpec

FILES = "qstore_backfill_files"
ROWS_PER_TASK = 250_000  # a task reads about this many rows at most (whole row groups)
BATCH_ROWS = 10_000  # rows per Arrow batch read from a file, as Spark hands them over


@dataclass(frozen=True)
class FilePart:
    """One task's rows: consecutive row groups of one or more files, in order."""

    pid: int
    rows: int
    groups: tuple[tuple[str, tuple[int, ...]], ...]  # (file, row group indexes)


def list_parquet(paths: list[str]) -> list[str] | None:
    """The data files of ``paths`` in name order, as Spark lists them (hidden files and
    ``_``-files skipped); None if a path is not local or is a directory that holds
    directories (Hive partitions, or others), which Spark's listing decides.

    This path once walked every subdirectory, which Spark's reader does not: one
    directory loaded an ``archive/`` subdirectory's rows into a plain queue and
    not into a dedup queue, which Spark reads (a backfill audit).
    """
    out: list[str] = []
    for path in paths:
        if "://" in path or not os.path.exists(path):
            return None
        if os.path.isfile(path):
            out.append(os.path.abspath(path))
            continue
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name.startswith(("_", ".")):
                    continue
                if entry.is_dir():  # a symlink to one too
                    return None
                out.append(os.path.abspath(entry.path))
    return sorted(out) if out else None


def check_file_columns(files: list[str], columns: list[str], sources: list[str]) -> None:
    """Raise InvalidArgument if a local Parquet file of the source lacks one of the
    ``columns`` the job reads, or has one that a Hive partition directory in its
    path (``col=value/``) also names.

    Spark takes a Parquet source's schema from one file: a file without the
    priority column loaded its rows at priority 0, or the job refused the
    column as missing, depending on which file Spark looked at; and a
    partition directory's value silently replaced the rows' own column (a
    backfill audit). Only footers are read; files not on a local path are
    left to Spark. Partition directories are those below the source path the
    file is in, as Spark finds them (``day=1/`` above the source is no
    partition; a review); for a file under no source path given (a glob) any
    ``col=`` directory counts for the missing-column test, none for the other.
    """
    roots = [os.path.abspath(p) for p in sources]
    for uri in files:
        url = urllib.parse.urlparse(uri)
        if url.scheme not in ("", "file"):
            continue
        path = urllib.parse.unquote(url.path) if url.scheme else uri
        if not os.path.isfile(path):
            continue
        root = max((r for r in roots if path == r or path.startswith(r + os.sep)),
                   key=len, default=None)
        below = path[len(root):] if root is not None else path
        parts = {c.split("=", 1)[0] for c in below.split(os.sep)[:-1] if "=" in c}
        try:
            names = set(pq.read_schema(path).names)
        except (OSError, pa.ArrowException):
            continue  # not Parquet, or unreadable: Spark's read says what is wrong
        for col in columns:
            if col in parts and col in names and root is not None:
                raise InvalidArgument(
                    f"column {col!r} is both a column of the Parquet file {path} and a "
                    f"partition directory ({col}=...) above it: Spark would load the "
                    "directory's value in place of the rows' own")
            if col not in parts and col not in names:
                raise InvalidArgument(
                    f"the Parquet file {path} has no column {col!r}, which other files of "
                    "the source have: its rows would load with it null")


def plan_files(paths: list[str], columns: list[str], cores: int) -> list[FilePart] | None:
    """Partitions of whole row groups for the direct path, or None if it does not apply."""
    files = list_parquet(paths)
    if files is None:
        return None
    groups: list[tuple[str, int, int]] = []  # file, row group, rows
    types: dict[str, pa.DataType] = {}
    for path in files:
        try:
            meta = pq.ParquetFile(path)
        except (OSError, pa.ArrowException):
            return None  # not Parquet: let Spark say what is wrong
        schema = meta.schema_arrow
        for col in columns:
            if col not in schema.names:
                return None
            if types.setdefault(col, schema.field(col).type) != schema.field(col).type:
                return None
        groups.extend((path, i, meta.metadata.row_group(i).num_rows)
                      for i in range(meta.metadata.num_row_groups))
        meta.close()
    total = sum(n for _, _, n in groups)
    want = max(cores, math.ceil(total / ROWS_PER_TASK), 1)
    per_task = max(1, math.ceil(total / want))
    parts: list[FilePart] = []
    current: list[tuple[str, int]] = []
    rows = 0
    for path, index, n in groups:  # a part ends before the group that would overfill it
        if current and rows + n > per_task:
            parts.append(_part(len(parts), rows, current))
            current, rows = [], 0
        current.append((path, index))
        rows += n
    if current:
        parts.append(_part(len(parts), rows, current))
    return parts


def _part(pid: int, rows: int, picked: list[tuple[str, int]]) -> FilePart:
    by_file: dict[str, list[int]] = {}
    for path, index in picked:
        by_file.setdefault(path, []).append(index)
    return FilePart(pid, rows, tuple((p, tuple(ix)) for p, ix in by_file.items()))


def parts_to_json(parts: list[FilePart]) -> str:
    return json.dumps([[p.pid, p.rows, [[f, list(ix)] for f, ix in p.groups]] for p in parts])


def parts_from_json(text: str) -> list[FilePart]:
    return [FilePart(pid, rows, tuple((f, tuple(ix)) for f, ix in groups))
            for pid, rows, groups in json.loads(text)]


def read_part(part: FilePart, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """The part's rows as Arrow batches, in file then row order."""
    for path, indexes in part.groups:
        try:
            f = pq.ParquetFile(path, memory_map=True)
        except Exception as exc:
            raise _naming(exc, f"reading {path}") from exc
        try:
            groups = list(indexes)
            try:
                yield from f.iter_batches(batch_size=BATCH_ROWS, row_groups=groups,
                                          columns=columns)
            except Exception as exc:
                raise _naming(exc, f"reading {path} (row groups {groups[0]}-{groups[-1]})"
                              ) from exc
        finally:
            f.close()


def _naming(exc: Exception, where: str) -> Exception:
    """``exc`` again, its message led by the file it came from: a damaged source read
    here said only "Corrupt snappy compressed data." (a Spark fault audit), where
    Spark's own reader names the file."""
    text = f"{where}: {exc}"
    try:
        named = type(exc)(text)
    except Exception:
        named = RuntimeError(text)
    return named


def run_part(staging: str, spec_json: str, part_json: str) -> tuple[int, str]:
    """One task of the direct path: read the part's row groups, stage its files;
    returns (partition id, the summary as JSON)."""
    spec = LoadSpec.from_json(spec_json)
    (part,) = parts_from_json("[" + part_json + "]")
    plan = read_plan(staging, part.pid) or PartitionPlan(part.pid, 0, 0, [])
    summary = load_partition(read_part(part, spec.columns()), spec, plan, staging, _attempt())
    return part.pid, json.dumps(summary)


def run_parts(sc: Any, staging: str, spec: LoadSpec, parts: list[FilePart]) -> list[str]:
    """Run every part as one Spark task of a plain RDD job; the summaries, as JSON.

    A job over a Python data source costs a planning round trip to a Python
    worker on top of the tasks (about 0.06 s a job here, measured): an RDD of
    the parts' descriptions, one per partition, goes straight to the tasks.
    """
    spec_json = spec.to_json()
    items = [json.dumps([p.pid, p.rows, [[f, list(ix)] for f, ix in p.groups]]) for p in parts]

    def task(it: Iterator[str]) -> Iterator[tuple[int, str]]:
        for text in it:
            yield run_part(staging, spec_json, text)

    done = sc.parallelize(items, len(items)).mapPartitions(task).collect()
    return [summary for _, summary in done]


class _TaskPartition(InputPartition):
    def __init__(self, part: FilePart) -> None:
        super().__init__(part.pid)
        self.part = part


class _FilesReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        self.staging = options["staging"]
        self.spec = LoadSpec.from_json(options["spec"])
        self.parts = parts_from_json(options["parts"])

    def partitions(self) -> list[InputPartition]:
        return [_TaskPartition(p) for p in self.parts]

    def read(self, partition: InputPartition) -> Iterator[tuple[int, str]]:
        if not isinstance(partition, _TaskPartition):
            return
        part = partition.part
        plan = read_plan(self.staging, part.pid) or PartitionPlan(part.pid, 0, 0, [])
        summary = load_partition(read_part(part, self.spec.columns()), self.spec, plan,
                                 self.staging, _attempt())
        yield part.pid, json.dumps(summary)


def _attempt() -> str:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return f"a{ctx.taskAttemptId()}" if ctx is not None else "r" + secrets.token_hex(4)


class BackfillFilesSource(DataSource):
    """Options: ``staging``, ``spec`` (LoadSpec JSON), ``parts`` (the plan's partitions)."""

    @classmethod
    def name(cls) -> str:
        return FILES

    def schema(self) -> str:
        return "pid int, summary string"

    def reader(self, schema: Any) -> DataSourceReader:
        return _FilesReader(self.options)
