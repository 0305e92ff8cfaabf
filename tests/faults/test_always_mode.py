"""durability="always": an operation never returns before an fdatasync covering its payload.

The compactor syncs the payload outside the writer lock; a group-commit waiter
that finds the unsynced flag already taken by it must wait for that fdatasync.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

import qstore
from qstore._fs import calls


def test_a_sync_finding_the_compactors_fdatasync_in_progress_waits_for_it(
        store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = qstore.open(store_path, durability="always", compactor=False)
    try:
        q = store.create_queue("q")
        core = store.core
        entered, release = threading.Event(), threading.Event()
        order: list[str] = []
        real = calls.fdatasync

        def gated(fd: int) -> Any:
            if threading.current_thread().name == "compactor":
                entered.set()
                assert release.wait(60)
                order.append("compactor fdatasync done")
            return real(fd)

        monkeypatch.setattr(calls, "fdatasync", gated)
        # A push's bytes are written (the flag set), then the compactor takes the
        # flag and blocks in its fdatasync before the push's waiter syncs.
        core.payload.append(b"must be durable when the push returns")
        compactor = threading.Thread(target=core.payload.sync, name="compactor")
        compactor.start()
        assert entered.wait(60) and not core.payload.unsynced
        waiter = threading.Thread(target=lambda: (core.syncer.sync_now(),
                                                  order.append("waiter returned")))
        waiter.start()
        waiter.join(0.5)  # the broken code returns here at once; the fixed one waits
        release.set()
        compactor.join(60)
        waiter.join(60)
        assert order == ["compactor fdatasync done", "waiter returned"]
        assert q.push(b"x") >= 1
    finally:
        store.close()
