"""The audit's index pass: a small PySpark data source, ``qstore_index``.

One partition per (queue id, index). Each task fingerprints the entries
(key bytes then value bytes) of its index (:mod:`._index_hash`); the audit
compares that with the fingerprint of the entries the messages imply. For
the indexes the audit names in the ``verify`` option (those whose
fingerprints differed), the task also checks every key against its message
and yields one row per key that no message owns.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from .._errors import InvalidArgument
from ..meta import keys, records
from ._datasource import spark_schema
from ._index_hash import fingerprint, to_signed
from ._scan import checked_records, expected_index_key
from ._snapshot_view import Snapshot

# Index kinds by the name the audit uses; the dedup index ``k`` and the expiry
# index ``e`` (messages with a TTL) included.
KINDS = {"ready": keys.READY, "delayed": keys.DELAYED, "in_flight": keys.INFLIGHT,
         "dead": keys.DEAD, "dedup": keys.DEDUP, "expiry": keys.EXPIRY}
VERIFY_CHUNK = 1000

INDEX_SCHEMA = pa.schema([
    pa.field("qid", pa.int64()),
    pa.field("kind", pa.string()),
    pa.field("keys", pa.int64()),  # set on the one fingerprint row of each partition
    pa.field("hash", pa.int64()),  # the fingerprint's hash sum, as int64
    pa.field("message_id", pa.int64()),  # set on each stray-key row
    pa.field("detail", pa.string()),
])


class IndexSource(DataSource):
    """Options: ``path``; ``verify``: JSON list of ``"qid:kind"`` to check key by key."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        opts = {k.lower(): v for k, v in options.items()}
        if set(opts) - {"path", "verify"} or "path" not in opts:
            raise InvalidArgument(f"qstore_index takes path and verify, not {sorted(opts)}")
        self.path = opts["path"]
        self.verify: list[str] = json.loads(opts.get("verify", "[]"))

    @classmethod
    def name(cls) -> str:
        return "qstore_index"

    def schema(self) -> Any:
        return spark_schema(INDEX_SCHEMA)

    def reader(self, schema: Any) -> IndexReader:
        return IndexReader(self.path, set(self.verify))


class IndexPartition(InputPartition):
    def __init__(self, qid: int, kind: str, verify: bool) -> None:
        super().__init__((qid, kind))
        self.qid = qid
        self.kind = kind
        self.verify = verify


class IndexReader(DataSourceReader):
    def __init__(self, path: str, verify: set[str]) -> None:
        self.path = path
        self.verify = verify

    def partitions(self) -> list[InputPartition]:
        with Snapshot(self.path) as snap:
            qids = sorted(snap.queues)
        if self.verify:  # a second look: only the indexes named
            return [IndexPartition(int(q), k, True) for q, k in
                    (v.split(":") for v in sorted(self.verify))]
        return [IndexPartition(qid, kind, False) for qid in qids for kind in KINDS]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, IndexPartition):
            return iter(())
        return self._read(partition)

    def _read(self, part: IndexPartition) -> Iterator[pa.RecordBatch]:
        with Snapshot(self.path) as snap:
            n, h = index_fingerprint(snap, part.qid, KINDS[part.kind])
            rows: list[tuple[Any, ...]] = [(part.qid, part.kind, n, to_signed(h), None, None)]
            if part.verify:
                rows += [(part.qid, part.kind, None, None, mid, why)
                         for mid, why in stray_keys(snap, part.qid, KINDS[part.kind])]
        yield pa.RecordBatch.from_arrays(
            [pa.array(col, f.type) for col, f in zip(zip(*rows, strict=True), INDEX_SCHEMA,
                                                       strict=True)],
            schema=INDEX_SCHEMA)


def index_fingerprint(snap: Snapshot, qid: int, kind: bytes) -> tuple[int, int]:
    """The fingerprint of the entries (key + value) of one index of one queue."""
    lo = keys.prefix(kind, qid)
    items = snap.meta.items(lo, keys.prefix_end(lo))
    try:
        return fingerprint([k + v for k, v in items])
    finally:
        del items


def stray_keys(snap: Snapshot, qid: int, kind: bytes) -> Iterator[tuple[int | None, str]]:
    """(message id, why) of every key of the index that no message owns."""
    info = snap.queues[qid]
    lo = keys.prefix(kind, qid)
    chunk: list[tuple[bytes, bytes]] = []
    for key, value in snap.meta.scan(lo, keys.prefix_end(lo)):
        chunk.append((key, value))
        if len(chunk) >= VERIFY_CHUNK:
            yield from _check_chunk(snap, qid, info.rec, kind, chunk)
            chunk = []
    if chunk:
        yield from _check_chunk(snap, qid, info.rec, kind, chunk)


def _check_chunk(snap: Snapshot, qid: int, qrec: records.QueueRecord, kind: bytes,
                 chunk: list[tuple[bytes, bytes]]) -> Iterator[tuple[int | None, str]]:
    well_formed = []
    for key, value in chunk:
        why = keys.index_key_problem(kind, key, value)
        if why is None:
            well_formed.append((key, value))
        else:
            yield None, f"index key {key.hex()}: {why}"
    chunk = well_formed
    if not chunk:
        return
    if kind == keys.DEDUP:
        mids = [keys.U64.unpack(v)[0] if len(v) == 8 else None for _, v in chunk]
    else:
        mids = [keys.trailing_id(k) for k, _ in chunk]
    raws = snap.meta.multi_get([keys.message_key(qid, m or 0) for m in mids])
    for (key, _), mid, raw in zip(chunk, mids, raws, strict=True):
        if mid is None:
            yield None, f"dedup key {key.hex()} holds no message id"
            continue
        if raw is None:
            yield mid, f"index key {key.hex()} names a message that does not exist"
            continue
        mkey = keys.message_key(qid, mid)
        _, rows, _ = checked_records([mkey], [raw], qrec.priority_type)
        if not rows:  # the message record is unusable: a bad_record finding of the message pass
            continue
        rec = records.MessageRecord(*rows[0][1:])
        if kind == keys.DEDUP:
            owned = (rec.digest is not None and keys.dedup_key(qid, rec.digest) == key
                     and (rec.state != records.DEAD or snap.dead_keep_dedup))
        elif kind == keys.EXPIRY:
            owned = bool(rec.expires_us) and keys.expiry_key(qid, rec.expires_us, mid) == key
        else:
            owned = expected_index_key(qid, qrec, mid, rec.state, rec.priority,
                                       rec.when_us) == key
        if not owned:
            state = records.STATE_NAMES[rec.state]
            yield mid, f"index key {key.hex()} does not match the message ({state})"
