"""The Spark side of the backfill: two write-only Python data sources.

``df.write.format(SCAN).option(...).save()`` runs :func:`~._bulk.scan_partition`
on every partition (the counting pass of a dedup queue) and
``df.write.format(LOAD)...save()`` runs :func:`~._bulk.load_partition` (the
writing pass). Python data sources are used instead of ``mapInArrow`` because
they hand the task Arrow batches without needing pandas in the workers.

Each task returns a small commit message; :meth:`commit` runs (in some Python
worker, not in the driver program) only when every task succeeded, with the
messages of the successful attempts, and saves them durably in the job's
staging directory, where the driver reads them after ``save()`` returns.
Classes here must be importable by the workers, which is why they live in the
installed package.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

from .._fs import write_file_durably, write_json_durably
from ._bulk import PartitionPlan, load_partition, scan_partition
from ._rows import LoadSpec

SCAN = "qstore_backfill_scan"
LOAD = "qstore_backfill_load"
SCAN_RESULT = "scan.msgpack"
TASKS_RESULT = "tasks.json"
PLAN_DIR = "plan"


def plan_path(staging: str, pid: int) -> str:
    return os.path.join(staging, PLAN_DIR, f"p{pid:05d}.msgpack")


def write_plan(staging: str, plan: PartitionPlan) -> None:
    with open(plan_path(staging, plan.pid), "wb") as f:
        f.write(msgpack.packb([plan.pid, plan.rows, plan.first_id, plan.file_ids,
                               plan.duplicates], use_bin_type=True))


def read_plan(staging: str, pid: int) -> PartitionPlan | None:
    try:
        with open(plan_path(staging, pid), "rb") as f:
            raw = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
    except FileNotFoundError:
        return None  # the counting pass saw no rows in this partition
    return PartitionPlan(raw[0], raw[1], raw[2], raw[3], raw[4])


@dataclass
class TaskResult(WriterCommitMessage):
    summary: dict[str, Any]


def _task() -> tuple[int, str]:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    assert ctx is not None
    return ctx.partitionId(), f"a{ctx.taskAttemptId()}"


class _ScanWriter(DataSourceArrowWriter):
    def __init__(self, options: Mapping[str, str]) -> None:
        self.staging = options["staging"]
        self.spec = LoadSpec.from_json(options["spec"])

    def write(self, iterator: Iterator[Any]) -> TaskResult:
        pid, _ = _task()
        return TaskResult(scan_partition(iterator, self.spec, pid))

    def commit(self, messages: list[Any]) -> None:
        write_file_durably(os.path.join(self.staging, SCAN_RESULT), msgpack.packb(
            [m.summary for m in messages if m is not None], use_bin_type=True))

    def abort(self, messages: list[Any]) -> None:
        """Nothing to undo: the driver removes the job's staging directory."""


class _LoadWriter(DataSourceArrowWriter):
    def __init__(self, options: Mapping[str, str]) -> None:
        self.staging = options["staging"]
        self.spec = LoadSpec.from_json(options["spec"])

    def write(self, iterator: Iterator[Any]) -> TaskResult:
        pid, attempt = _task()
        plan = read_plan(self.staging, pid)
        if plan is None:
            plan = PartitionPlan(pid, 0, 0, [])
        return TaskResult(load_partition(iterator, self.spec, plan, self.staging, attempt))

    def commit(self, messages: list[Any]) -> None:
        write_json_durably(os.path.join(self.staging, TASKS_RESULT),
                           [m.summary for m in messages if m is not None])

    def abort(self, messages: list[Any]) -> None:
        """Nothing to undo: the driver removes the job's staging directory."""


class BackfillScanSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return SCAN

    def writer(self, schema: Any, overwrite: bool) -> DataSourceArrowWriter:
        return _ScanWriter(self.options)


class BackfillLoadSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return LOAD

    def writer(self, schema: Any, overwrite: bool) -> DataSourceArrowWriter:
        return _LoadWriter(self.options)
