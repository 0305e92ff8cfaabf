"""The ``qstore`` PySpark data source: one row per message of a snapshot.

    spark.read.format("qstore").load("snap/")                  # metadata columns
    spark.read.format("qstore").option("payload", "true").load("snap/")

Executors import this module from the installed package and read their
partition with :mod:`qstore.spark._scan`, which yields Arrow record batches
(PySpark's fast path for Python data sources). See docs/spark.md for the
schema, the options and the partitioning.

Options ``queue`` and ``state`` (comma-separated) restrict a read: queues
not asked for are never opened. Filters (``where(...)``) are not pushed down
on purpose: PySpark 4.3 keeps the reader planned for one query's pushed
filters on the DataFrame and reuses it for the next query that pushes none,
so ``df.where("state = 'dead'").count()`` followed by ``df.count()`` returned
the dead count twice (see docs/spark.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from .._errors import InvalidArgument
from ..meta import records
from ._scan import message_schema, scan_range
from ._snapshot_view import ROWS_PER_PARTITION, ScanRange, Snapshot, plan_ranges

OPTIONS = ("path", "payload", "verify", "check_index", "queue", "state", "partitions",
           "rows_per_partition", "bad_records")
BAD_RECORDS = ("fail", "skip")


@dataclass(frozen=True)
class ReadSettings:
    """The options of one read, checked (an unknown or malformed option is an error)."""

    path: str
    payload: bool = False
    verify: bool = False
    check_index: bool = False
    queues: frozenset[str] | None = None
    states: frozenset[str] | None = None
    partitions: int | None = None
    rows_per_partition: int = ROWS_PER_PARTITION
    skip_bad: bool = False

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> ReadSettings:
        opts = {k.lower(): v for k, v in options.items()}
        unknown = sorted(set(opts) - set(OPTIONS))
        if unknown:
            raise InvalidArgument(f"unknown option(s) {unknown} for the qstore data source; "
                                  f"known: {', '.join(OPTIONS)}")
        path = opts.get("path")
        if not path:
            raise InvalidArgument('the qstore data source needs a snapshot: .load("snap/")')
        return cls(
            path=os.path.abspath(path),  # resolved on the driver; executors get it as is
            payload=_flag(opts, "payload"),
            verify=_flag(opts, "verify"),
            check_index=_flag(opts, "check_index"),
            queues=_names(opts.get("queue")),
            states=_states(opts.get("state")),
            partitions=_count(opts, "partitions"),
            rows_per_partition=_count(opts, "rows_per_partition") or ROWS_PER_PARTITION,
            skip_bad=_choice(opts, "bad_records", BAD_RECORDS) == "skip",
        )

    def arrow_schema(self) -> pa.Schema:
        return message_schema(payload=self.payload, verify=self.verify,
                              check_index=self.check_index)


class QStoreDataSource(DataSource):
    """``spark.read.format("qstore").load(snapshot_dir)``: the messages of a snapshot."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.settings = ReadSettings.from_options(options)

    @classmethod
    def name(cls) -> str:
        return "qstore"

    def schema(self) -> StructType:
        return spark_schema(self.settings.arrow_schema())

    def reader(self, schema: StructType) -> QStoreReader:
        if schema != self.schema():
            raise InvalidArgument("the qstore data source has a fixed schema (see docs/spark.md);"
                                  " do not pass .schema(...)")
        return QStoreReader(self.settings)


class RangePartition(InputPartition):
    """One range of the message prefix (a queue id and an id range)."""

    def __init__(self, rng: ScanRange) -> None:
        super().__init__(rng)
        self.range = rng


class QStoreReader(DataSourceReader):
    def __init__(self, settings: ReadSettings) -> None:
        self.settings = settings

    def partitions(self) -> list[InputPartition]:
        with Snapshot(self.settings.path) as snap:
            unknown = sorted((self.settings.queues or frozenset())
                             - {q.name for q in snap.queues.values()})
            if unknown:
                raise InvalidArgument(f"option queue: no queue(s) {unknown} in the snapshot; "
                                      f"it has {sorted(q.name for q in snap.queues.values())}")
            ranges = plan_ranges(snap, partitions=self.settings.partitions,
                                 rows_per_partition=self.settings.rows_per_partition,
                                 queues=self.settings.queues)
        return [RangePartition(r) for r in ranges]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, RangePartition):
            return iter(())  # Spark's placeholder partition when there is nothing to read
        return self._read(partition.range)

    def _read(self, rng: ScanRange) -> Iterator[pa.RecordBatch]:
        s = self.settings
        with Snapshot(s.path) as snap:
            yield from scan_range(snap, rng, payload=s.payload, verify=s.verify,
                                  check_index=s.check_index, states=s.states,
                                  skip_bad=s.skip_bad)


_SPARK_TYPES: dict[pa.DataType, DataType] = {
    pa.string(): StringType(),
    pa.int64(): LongType(),
    pa.float64(): DoubleType(),
    pa.binary(): BinaryType(),
    pa.bool_(): BooleanType(),
}


def spark_schema(schema: pa.Schema) -> StructType:
    """The Spark schema whose Arrow form is exactly ``schema`` (all columns nullable)."""
    return StructType([StructField(f.name, _SPARK_TYPES[f.type], True) for f in schema])


def _flag(opts: Mapping[str, str], name: str) -> bool:
    value = opts.get(name, "false").strip().lower()
    if value not in ("true", "false"):
        raise InvalidArgument(f"option {name} must be true or false, not {value!r}")
    return value == "true"


def _choice(opts: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    value = opts.get(name, choices[0]).strip().lower()
    if value not in choices:
        raise InvalidArgument(f"option {name} must be one of {', '.join(choices)}, not {value!r}")
    return value


def _count(opts: Mapping[str, str], name: str) -> int | None:
    value = opts.get(name)
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise InvalidArgument(f"option {name} must be a positive integer, not {value!r}")
    return n


def _states(value: str | None) -> frozenset[str] | None:
    states = _names(value)
    bad = sorted((states or frozenset()) - set(records.STATE_NAMES))
    if bad:
        raise InvalidArgument(f"option state: unknown state(s) {bad}; "
                              f"known: {', '.join(records.STATE_NAMES)}")
    return states


def _names(value: str | None) -> frozenset[str] | None:
    """A comma-separated option value as a set (queue names cannot be split this way
    if they contain commas: use a filter, ``where("queue = 'a,b'")``, for those)."""
    if value is None:
        return None
    names = frozenset(v.strip() for v in value.split(",") if v.strip())
    if not names:  # "" or " , ": a typo, not "no rows"
        raise InvalidArgument(f"an option naming queues or states needs at least one name, "
                              f"not {value!r}")
    return names
