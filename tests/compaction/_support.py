"""Helpers shared by the compaction tests (the recount lives in tools/crash.py)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import qstore
from qstore.meta import keys, records
from qstore.payload import PayloadRef

ROOT = Path(__file__).resolve().parents[2]
CRASH_TOOL = ROOT / "tools" / "crash.py"


def _load_crash_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("qstore_crash_tool", CRASH_TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


crash_tool = _load_crash_tool()


class SimulatedCrash(BaseException):
    """Raised from the step hook: a BaseException, so the pass does not roll back."""


def open_store(path: str, clock: Any, **options: Any) -> qstore.Store:
    """A store with small segments, so a few messages fill several."""
    opts: dict[str, Any] = {"compactor": False, "segment_max_bytes": 4096}
    opts.update(options)
    return qstore.open(path, clock=clock, **opts)


def recount(store: qstore.Store) -> list[str]:
    return list(crash_tool.recount(store))


def dead_sealed_segments(store: qstore.Store) -> list[int]:
    return list(crash_tool.dead_sealed_segments(store))


def ref_of(store: qstore.Store, queue: str, mid: int) -> PayloadRef:
    qid = store.core.queues[queue].qid
    raw = store.core.meta.get(keys.message_key(qid, mid))
    assert raw is not None, f"message {mid} has no record"
    rec = records.MessageRecord.decode(raw)
    return PayloadRef(rec.file_id, rec.offset, rec.length)


def record_of(store: qstore.Store, queue: str, mid: int) -> records.MessageRecord | None:
    raw = store.core.meta.get(keys.message_key(store.core.queues[queue].qid, mid))
    return None if raw is None else records.MessageRecord.decode(raw)


def files_on_disk(store: qstore.Store) -> dict[int, int]:
    """file id -> size of every segment file in payload/."""
    directory = os.path.join(store.path, "payload")
    out = {}
    for name in os.listdir(directory):
        stem, _, ext = name.partition(".")
        if ext == "seg":
            out[int(stem)] = os.path.getsize(os.path.join(directory, name))
    return out


def disk_bytes(store: qstore.Store) -> int:
    """Bytes of segment data (the active segment's preallocated zeros excluded)."""
    return store.stats().disk_bytes


def body(mid_hint: int, size: int) -> bytes:
    """A payload that is recognisable on disk and different for every hint."""
    stamp = f"<payload {mid_hint:08d}>".encode()
    return (stamp * (size // len(stamp) + 1))[:size]


def snapshot_messages(q: qstore.Queue, ids: list[int]) -> dict[int, tuple[Any, ...]]:
    """What must survive a pass unchanged: payload, priority, state, attempts, deadline."""
    out = {}
    for mid in ids:
        try:
            m = q.get(mid)
        except qstore.MessageNotFound:
            continue
        out[mid] = (m.payload, m.priority, m.state, m.attempts, m.enqueued_at, m.lease_deadline)
    return out


def compaction_record(store: qstore.Store) -> list[Any] | None:
    raw = store.core.meta.get(keys.COMPACTION_KEY)
    return None if raw is None else records.unpack(raw, "compaction")
