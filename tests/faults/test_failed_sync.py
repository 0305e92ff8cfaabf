"""A failed fdatasync of a payload segment ("fsyncgate").

Linux reports a writeback error to an fdatasync once and may drop the dirty
pages, so the next fdatasync of the same file can succeed although the bytes
the failed one should have covered never reached the disk. Retrying the sync
proves nothing; the store instead copies the live messages of such a segment
to a new one (written and synced after the failure) and deletes it: the
segment is "in doubt" until the compactor has done so.
"""

from __future__ import annotations

import errno
import threading
from typing import Any

import pytest

import qstore
from qstore._compact import Compactor

from ._inject import FaultyCalls


def _fill(q: qstore.Queue, n: int) -> list[bytes]:
    bodies = [bytes([i]) * (100 + i) for i in range(n)]
    for body in bodies:
        q.push(body)
    return bodies


def test_a_segment_whose_fdatasync_failed_is_rewritten_by_the_next_pass(
        store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    faults = FaultyCalls(monkeypatch, ("fdatasync",), err=errno.EIO)
    with qstore.open(store_path, sync_interval=3600, compactor=False) as store:
        q = store.create_queue("q")
        payload = store.core.payload
        bodies = _fill(q, 30)
        doubted = payload.active_id
        faults.arm(1)
        with pytest.raises(qstore.StorageError, match="Input/output error"):
            store.core.syncer.sync_now()
        assert faults.failed == ["fdatasync"]
        # The retry succeeds, as Linux's does once the error was reported: it
        # does not bring back what the failed one lost.
        q.push(b"after")
        store.core.syncer.sync_now()
        assert payload.in_doubt == {doubted}
        # Nothing in it is garbage, yet the pass seals and rewrites it.
        result = store.compact()
        assert result.sealed == doubted and doubted in result.segments_read
        assert doubted in result.segments_deleted and doubted not in payload.file_ids()
        assert result.messages_moved == 31
        assert payload.in_doubt == frozenset()
        assert [m.payload for m in q.pop_many(40)] == [*bodies, b"after"]
        assert store.check().ok


def test_a_seal_whose_fsync_failed_leaves_its_segment_in_doubt(
        store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with qstore.open(store_path, sync_interval=3600, compactor=False) as store:
        q = store.create_queue("q")
        payload = store.core.payload
        bodies = _fill(q, 10)
        first = payload.active_id
        writer_fd = payload._writer.fileno()  # type: ignore[union-attr]
        faults = FaultyCalls(monkeypatch, ("fsync",), err=errno.EIO,
                             only=lambda name, args: args[0] == writer_fd)
        faults.arm(1)
        with pytest.raises(qstore.StorageError):
            payload.seal()
        assert faults.failed == ["fsync"]
        assert payload.active_id == first  # the old segment still takes the pushes
        assert payload.in_doubt == {first}
        q.push(b"more")
        faults.heal()
        result = store.compact()
        assert result.sealed == first and first in result.segments_deleted
        assert payload.in_doubt == frozenset()
        assert [m.payload for m in q.pop_many(20)] == [*bodies, b"more"]
        assert store.check().ok


def test_the_background_compactor_is_woken_by_a_failed_sync(
        store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pass runs at once, not at the end of compact_interval (an hour here).
    passes: list[Any] = []
    done = threading.Event()
    real = Compactor.run_pass

    def counted(self: Compactor, *args: Any, **kwargs: Any) -> Any:
        result = real(self, *args, **kwargs)
        passes.append(result)
        if result.segments_deleted:
            done.set()
        return result

    monkeypatch.setattr(Compactor, "run_pass", counted)
    faults = FaultyCalls(monkeypatch, ("fdatasync",), err=errno.EIO)
    with qstore.open(store_path, sync_interval=3600, compact_interval=3600) as store:
        q = store.create_queue("q")
        payload = store.core.payload
        bodies = _fill(q, 5)
        doubted = payload.active_id
        faults.arm(1)
        with pytest.raises(qstore.StorageError):
            store.core.syncer.sync_now()
        assert done.wait(60), passes
        assert doubted not in payload.file_ids() and payload.in_doubt == frozenset()
        assert [m.payload for m in q.pop_many(10)] == bodies
