"""Stores written by the previous version (store format 1) open and behave correctly.

``tests/data/format1-store.tar.gz`` was written by the format 1 code (the
version before the dedup namespaces, issue 11 case 14), clock 1,700,000,000,
durability "none", closed cleanly, RocksDB's LOG removed::

    q = s.create_queue("jobs", dedup=True, max_attempts=1); plain = s.create_queue("plain")
    1 = q.push(b"alpha")                        # payload hash, ready
    2 = q.push(b"beta", dedup_key="job-1")      # explicit key, ready
    3 = q.push(b"other", dedup_key="foo")       # and q.push(b"kfoo") returned 3 (collision)
    4 = q.push(b"gamma", priority=9)            # payload hash; popped, nacked: dead
    5 = q.push(b"delta", priority=9, dedup_key="job-2")  # explicit key; dead the same way
    6 = q.push(b"eps", priority=8)              # popped with lease 10,000: in flight "1-6-1"
    7 = q.push(b"later", delay=5_000)           # payload hash, delayed
    8 = plain.push(b"alpha")
"""

from __future__ import annotations

import os
import shutil
import tarfile
from typing import Any

import pytest

import qstore
from qstore import _migrate
from qstore.meta import MetaDB, keys, new_batch, records

FIXTURE = os.path.join(os.path.dirname(__file__), os.pardir, "data", "format1-store.tar.gz")
T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0 + 10.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def old_store(tmp_path: Any) -> str:
    with tarfile.open(FIXTURE) as tar:
        # The "data" filter exists from Python 3.11.4 (and refuses links out of
        # the directory); the fixture is our own file either way.
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp_path, filter="data")
        else:
            tar.extractall(tmp_path)
    return os.path.join(str(tmp_path), "store")


def _format(store: qstore.Store) -> int:
    raw = store.core.meta.get(keys.FORMAT_KEY)
    assert raw is not None
    return int(records.unpack(raw, "format")[1])


def test_a_format_1_store_opens_read_only_as_it_is_and_checks_clean(old_store: str) -> None:
    with qstore.open(old_store, readonly=True) as view:
        assert _format(view) == 1
        report = view.check()
        assert report.ok, report.findings  # format 1 dead letters keep their key: expected
        q = view.queue("jobs")
        assert [m.payload for m in q.peek(5)] == [b"alpha", b"beta", b"other"]
        assert [m.id for m in q.dead_letters()] == [4, 5]


def test_a_read_write_open_migrates_to_format_3_and_dedup_keeps_working(old_store: str) -> None:
    clock = Clock()
    with qstore.open(old_store, clock=clock, compactor=False) as store:
        assert _format(store) == records.STORE_FORMAT == 3
        assert store.check().ok
        q = store.queue("jobs")
        before = q.stats()
        # Live messages still dedup, by payload hash (migrated) and by explicit key.
        assert q.push(b"alpha") == 1
        assert q.push(b"anything", dedup_key="job-1") == 2
        assert q.push(b"x", dedup_key="foo") == 3
        assert q.push(b"eps") == 6
        assert q.push(b"later") == 7
        assert q.stats() == before
        # The format 1 collision is gone: the payload b"kfoo" is its own message...
        kfoo = q.push(b"kfoo")
        assert kfoo > 8
        # ...and the dead letters released their keys.
        gamma = q.push(b"gamma")
        delta = q.push(b"again", dedup_key="job-2")
        assert len({kfoo, gamma, delta}) == 3 and min(gamma, delta) > 8
        assert q.push(b"gamma") == gamma
        # Everything else is as it was: the lease, the dead letters, the other queue.
        held = q.get(6)
        assert held.state == "in_flight" and held.attempts == 1
        q.ack("1-6-1")
        assert q.push(b"eps") > delta  # acked: its key is free
        assert [m.id for m in q.dead_letters()] == [4, 5]
        assert store.queue("plain").pop().payload == b"alpha"  # type: ignore[union-attr]
        assert store.check().ok
    with qstore.open(old_store, clock=clock, compactor=False) as again:
        assert _format(again) == 3 and again.check().ok
        assert again.queue("jobs").push(b"alpha") == 1


def test_an_interrupted_migration_runs_again_and_changes_nothing_twice(
        old_store: str, monkeypatch: Any) -> None:
    """A crash between two chunks leaves format 1: the next open finishes the job."""
    real = _migrate._rewrite
    calls = []

    def crash_after_first_chunk(*args: Any) -> int:
        if calls:
            raise KeyboardInterrupt("simulated crash between two synced chunks")
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(_migrate, "CHUNK", 2)
    monkeypatch.setattr(_migrate, "_rewrite", crash_after_first_chunk)
    with pytest.raises(KeyboardInterrupt):
        qstore.open(old_store, compactor=False)
    with qstore.open(old_store, readonly=True) as view:
        assert _format(view) == 1  # the format key is written last
    monkeypatch.setattr(_migrate, "_rewrite", real)
    with qstore.open(old_store, clock=Clock(), compactor=False) as store:
        assert _format(store) == 3 and store.check().ok
        q = store.queue("jobs")
        assert q.push(b"alpha") == 1 and q.push(b"eps") == 6 and q.push(b"later") == 7
        assert q.push(b"gamma") > 8


def test_a_store_of_an_unknown_format_is_refused(tmp_path: Any, old_store: str) -> None:
    dest = os.path.join(str(tmp_path), "future")
    shutil.copytree(old_store, dest)
    db = MetaDB(os.path.join(dest, "meta"), readonly=False, store_path=dest)
    batch = new_batch()
    batch.put(keys.FORMAT_KEY, records.pack([records.RECORD_VERSION, 9]))
    db.write(batch, sync=True)
    db.close()
    for readonly in (False, True):
        with pytest.raises(qstore.StorageError, match="unsupported store format 9"):
            qstore.open(dest, readonly=readonly)


def _set_format(path: str, fmt: int) -> None:
    meta = MetaDB(os.path.join(path, "meta"), readonly=False, store_path=path)
    try:
        batch = new_batch()
        batch.put(keys.FORMAT_KEY, records.pack([records.RECORD_VERSION, fmt]))
        meta.write(batch, sync=True)
    finally:
        meta.close()


def test_a_format_2_store_moves_to_3_by_its_format_key_and_a_format_2_build_refuses_it(
        tmp_path: Any, monkeypatch: Any) -> None:
    # Format 3 gave a dead letter's kept digest its meaning; a format 2 build read
    # it as owning the k key and its ack of a redriven letter deleted a live copy's
    # key (a cross-version audit). A format 2 store needs no rewrite, only the
    # number; a build that reads 1 and 2 refuses 3.
    path = str(tmp_path / "s")
    with qstore.open(path, compactor=False) as store:
        q = store.create_queue("d", dedup=True, max_attempts=1)
        first = q.push(b"P")
        q.nack(q.pop())  # a dead letter keeping its digest
        second = q.push(b"P")  # the letter holds no key: a new live copy
        assert second != first
    _set_format(path, 2)
    with qstore.open(path, readonly=True) as view:
        assert _format(view) == 2 and view.check().ok  # read as it is
    with qstore.open(path, compactor=False) as store:
        assert _format(store) == 3 and store.check().ok
        q = store.queue("d")
        assert q.push(b"P") == second
        assert q.redrive() == 1  # the letter is ready again, without the key (held)
        popped = q.pop()
        assert popped is not None and popped.id == first  # the older pops first
        q.ack(popped)  # a format 2 build deleted the live copy's key here
        assert q.push(b"P") == second and store.check().ok
    monkeypatch.setattr(records, "READABLE_FORMATS", (1, 2))  # a format 2 build
    with pytest.raises(qstore.StorageError, match="unsupported store format 3"):
        qstore.open(path, compactor=False)
    with pytest.raises(qstore.StorageError, match="unsupported store format 3"):
        qstore.open(path, readonly=True)
