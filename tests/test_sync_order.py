"""The order of syncs: payload segments reach the disk before the metadata that relies on
them, and the metadata writes meant to be synced are.

The file calls go through ``qstore._fs.calls`` (the layer tests/faults inject
faults into); the metadata writes are seen under ``MetaDB``, at the RocksDB
handle, with the write options each one passes. A mutation audit found both
orders unchecked.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

import qstore
from qstore._fs import calls
from qstore.meta import MetaDB, keys, records
from tests.conftest import FakeClock

SEGMENT_MAX = 4096


class _RecordingDB:
    """Stands in for a MetaDB's RocksDB handle: each write goes through, then
    ``on_write(sync)`` is called with whether its options asked for a sync."""

    def __init__(self, real: Any, on_write: Callable[[bool], None]) -> None:
        self._real = real
        self._on_write = on_write

    def write(self, batch: Any, opts: Any = None) -> None:
        self._real.write(batch, opts)
        self._on_write(bool(opts is not None and opts.sync))

    def __getitem__(self, key: Any) -> Any:  # multi_get: db[keys]
        return self._real[key]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _record_writes(meta: MetaDB, on_write: Callable[[bool], None]) -> Callable[[], None]:
    """Wrap ``meta``'s handle; returns the call that puts the real one back."""
    real = meta._db
    meta._db = _RecordingDB(real, on_write)  # type: ignore[assignment]

    def restore() -> None:
        meta._db = real

    return restore


def _segment_of(fd_or_path: int | str) -> int | None:
    """The file id of the payload segment a call names (by path or descriptor), or None."""
    path = fd_or_path if isinstance(fd_or_path, str) else os.readlink(f"/proc/self/fd/{fd_or_path}")
    name = os.path.basename(path)
    if not name.endswith(".seg") or os.path.basename(os.path.dirname(path)) != "payload":
        return None
    return int(name[:-4])


def _record_file_calls(monkeypatch: pytest.MonkeyPatch, events: list[tuple[Any, ...]]) -> None:
    """Append ("sync", fid) for each fsync/fdatasync of a segment and ("write", fid) for
    each call that changes one (a write, a cut), in the order they happen."""
    def wrap(name: str, kind: str) -> None:
        real = getattr(calls, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            fid = _segment_of(args[0])
            result = real(*args, **kwargs)
            if fid is not None:
                events.append((kind, fid))
            return result

        monkeypatch.setattr(calls, name, call)

    for name in ("fsync", "fdatasync"):
        wrap(name, "sync")
    for name in ("pwritev", "pwrite", "write", "ftruncate", "truncate"):
        wrap(name, "write")


def _synced_before(events: list[tuple[Any, ...]], fid: int, at: int) -> bool:
    """Whether segment ``fid`` was synced after its last change before event ``at``."""
    last_sync = max((i for i, e in enumerate(events[:at]) if e == ("sync", fid)), default=-1)
    last_write = max((i for i, e in enumerate(events[:at]) if e == ("write", fid)), default=-1)
    return last_sync > last_write


def test_sealed_segments_and_compaction_output_are_synced_before_the_metadata(
        store_path: str, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    # A sealed segment is trusted whole after a crash (only the active one is
    # scanned for a torn tail), and a compaction's output replaces its sources:
    # each must be on disk before a metadata batch names it so (the synced
    # mark naming a later active segment; message records pointing into the
    # output). durability="none": nothing else syncs a segment meanwhile.
    events: list[tuple[Any, ...]] = []
    with qstore.open(store_path, clock=clock, compactor=False, durability="none",
                     segment_max_bytes=SEGMENT_MAX) as store:
        meta = store.core.meta

        def on_write(sync: bool) -> None:
            # What the database says once the batch is in: the active segment of
            # its synced mark, and the segments message records point into.
            raw = meta.get(keys.SYNCED_KEY)
            active = None if raw is None else records.unpack(raw, "synced")[1]
            pointed = {records.MessageRecord.decode(v).file_id
                       for _, v in meta.scan(keys.MESSAGE, keys.prefix_end(keys.MESSAGE))}
            events.append(("meta", active, frozenset(pointed)))

        _record_file_calls(monkeypatch, events)
        restore = _record_writes(meta, on_write)
        try:
            q = store.create_queue("q")
            ids = [q.push(bytes([65 + i]) * 1500) for i in range(3)]  # 2 a segment
            first = store.core.payload.active_id
            assert first is not None and first > 1  # the third push rotated
            m = q.pop()
            assert m is not None and m.id == ids[0]
            q.ack(m)  # segment 1 is half garbage
            result = store.compact(threshold=0.3)
            assert result.output is not None and 1 in result.segments_deleted
            assert result.messages_moved == 1
        finally:
            restore()
    metas = [(i, e) for i, e in enumerate(events) if e[0] == "meta"]
    sealed = [1]
    if result.sealed is not None:
        sealed.append(result.sealed)  # the pass sealed the active segment first
    for fid in sealed:
        # The first batch whose synced mark names a later segment: fid is sealed.
        at = next(i for i, e in metas if e[1] is not None and e[1] > fid)
        assert _synced_before(events, fid, at), \
            f"segment {fid} not synced after its last change before it was sealed in the " \
            f"metadata: {events[:at + 1]}"
    out = result.output
    at = next(i for i, e in metas if out in e[2])
    assert any(e == ("write", out) for e in events[:at])  # it was written, then...
    assert _synced_before(events, out, at), \
        f"compaction output {out} not synced before the records pointing into it: " \
        f"{events[:at + 1]}"


def test_writes_meant_to_be_synced_ask_the_database_to_sync(
        store_path: str, clock: FakeClock) -> None:
    # Compaction records, id reservations and a repair's rebuild are written
    # with sync=True; the database must be asked to sync each (a MetaDB that
    # dropped the flag passed every other test).
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        q = store.create_queue("q")
        mid = q.push(b"x")
        qid = store.core.queues["q"].qid
    # Something for a repair to rebuild: wrong counters and a stray dead-letter key.
    meta = MetaDB(os.path.join(store_path, "meta"), readonly=False, store_path=store_path)
    try:
        batch = qstore.meta.new_batch()
        batch.put(keys.counts_key(qid), records.encode_counts([5, 0, 0, 0, 1]))
        batch.put(keys.dead_key(qid, mid + 1000), b"")
        meta.write(batch, sync=True)
    finally:
        meta.close()
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        syncs: list[bool] = []
        restore = _record_writes(store.core.meta, syncs.append)
        try:
            store.core.write_synced(deletes=[keys.COMPACTION_KEY])
            assert syncs == [True]
            syncs.clear()
            first = store.core.reserve_ids(10)
            assert first > mid and syncs == [True]
            syncs.clear()
            report = store.check(repair=True)
            assert report.ok, report.findings
            assert {r.kind for r in report.repairs} == {"counters_rebuilt",
                                                        "index_key_removed"}
            assert syncs and all(syncs), syncs
        finally:
            restore()
