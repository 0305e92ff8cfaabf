"""Fail the Nth file call of an operation, once and persistently, for every N (SQLite style).

For each operation (push, push_many, rotation, seal, compaction, snapshot)
the calls it makes are counted on a healthy run; then for every N the Nth
call fails (ENOSPC or EIO). The operation must raise StorageError or succeed
(a retried call), never a raw OSError; once the fault is gone the store
checks clean at once (not only after a reopen), every message whose push
returned reads back, no message acked before the fault comes back, and new
writes and a compaction pass succeed, in the same process.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

import qstore
from qstore._fs import calls
from qstore.payload import parse_segment_name

from ._inject import NAMES, FaultyCalls


@dataclass
class Prepared:
    """A store before the operation: what must read back, and what was acked."""

    store: qstore.Store
    kept: dict[tuple[str, int], bytes] = field(default_factory=dict)
    acked: set[tuple[str, int]] = field(default_factory=set)
    snapshot: str = ""  # where the snapshot operation writes


Op = Callable[[Prepared], None]


def _open(path: str) -> qstore.Store:
    return qstore.open(path, compactor=False, segment_max_bytes=512)


def _mixed(path: str) -> Prepared:
    """Queue ``q`` in three sealed segments and the active one, every other message acked."""
    p = Prepared(_open(path), snapshot=path + "-snap")
    q = p.store.create_queue("q")
    for i in range(12):
        body = b"base %02d" % i * 10
        p.kept[("q", q.push(body))] = body
        if i % 2:
            m = q.pop()
            assert m is not None
            q.ack(m)
            p.acked.add(("q", m.id))
            del p.kept[("q", m.id)]
    return p


def _live_sealed(path: str) -> Prepared:
    """Sealed segments half garbage (queue ``j`` acked), so a pass copies live records.

    ``q`` and ``j`` messages alternate in every segment; all of ``j`` is acked.
    """
    p = Prepared(_open(path))
    q, j = p.store.create_queue("q"), p.store.create_queue("j")
    for i in range(14):
        body = b"live %02d" % i * 8
        p.kept[("q", q.push(body))] = body
        j.push(b"junk %02d" % i * 8)
        m = j.pop()
        assert m is not None
        j.ack(m)
        p.acked.add(("j", m.id))
    sealed = [s for s in p.store.stats().segments if not s.active]
    assert len(sealed) >= 2 and all(s.live_count > 0 for s in sealed)
    return p


def _dead_active(path: str) -> Prepared:
    """Sealed segments all live; the active segment holds one record, acked: worth sealing."""
    p = Prepared(_open(path))
    q, j = p.store.create_queue("q"), p.store.create_queue("j")
    for i in range(8):
        body = b"kept %02d" % i * 10
        p.kept[("q", q.push(body))] = body
    j.push(b"x" * 400)  # does not fit in the active segment: a segment of its own
    m = j.pop()
    assert m is not None
    j.ack(m)
    p.acked.add(("j", m.id))
    return p


def _push(p: Prepared) -> None:
    # Three pushes: a push into reserved space copies into the segment's map and
    # makes no file call; these also reserve space (fallocate, a new map).
    q = p.store.queue("q")
    for i in range(3):
        body = b"one %d" % i * 30
        p.kept[("q", q.push(body))] = body


def _rotation(p: Prepared) -> None:
    q = p.store.queue("q")
    for i in range(6):
        body = b"rot %d" % i * 40
        p.kept[("q", q.push(body))] = body


def _push_many(p: Prepared) -> None:
    # Larger than two segments: the batch rotates twice, so a failure can leave
    # a whole segment of its records sealed. Ready messages: the hot path.
    q = p.store.queue("q")
    bodies = [b"many %02d" % i * 25 for i in range(4)]
    for mid, body in zip(q.push_many(bodies), bodies, strict=True):
        p.kept[("q", mid)] = body


def _push_many_delayed(p: Prepared) -> None:
    # The same through the general path (a delay, a TTL).
    q = p.store.queue("q")
    bodies = [b"late %02d" % i * 25 for i in range(4)]
    for mid, body in zip(q.push_many(bodies, delay=0.0, ttl=3600.0), bodies, strict=True):
        p.kept[("q", mid)] = body


def _seal(p: Prepared) -> None:
    result = p.store.compact(threshold=0.9)  # only the dead active segment is worth it
    assert result.sealed is not None and not result.segments_read


def _compaction(p: Prepared) -> None:
    result = p.store.compact(threshold=0.3)
    assert result.segments_read and result.messages_moved


def _snapshot(p: Prepared) -> None:
    p.store.snapshot(p.snapshot)


@dataclass(frozen=True)
class Case:
    op: Op
    prepare: Callable[[str], Prepared]
    # Whether writes through the active segment's writable map matter here.
    maps: bool = False


CASES = {
    "push": Case(_push, _mixed, maps=True),
    "rotation": Case(_rotation, _mixed, maps=True),
    "push_many": Case(_push_many, _mixed, maps=True),
    "push_many_delayed": Case(_push_many_delayed, _mixed),
    "seal": Case(_seal, _dead_active),
    "compaction": Case(_compaction, _live_sealed),
    "snapshot": Case(_snapshot, _mixed),
}
_ERRS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}


def _params() -> list[object]:
    """Every operation with ENOSPC and EIO, with and without the writable map where it
    matters. A quick subset (each operation, each writing mode and each error at
    least once: about 11 s on 2 busy cores with a tmpfs, the whole about 25 s) runs
    without the slow marker; the rest is marked slow.
    """
    out: list[object] = []
    for name, case in sorted(CASES.items()):
        if case.maps:
            combos = [("map", "ENOSPC", False), ("pwritev", "EIO", False),
                      ("map", "EIO", True), ("pwritev", "ENOSPC", True)]
        else:
            quick = "EIO" if name in ("compaction", "push_many_delayed") else "ENOSPC"
            combos = [("map", e, e != quick) for e in _ERRS]
        for writes, err, slow in combos:
            marks = [pytest.mark.slow] if slow else []
            out.append(pytest.param(name, writes, _ERRS[err], marks=marks,
                                    id=f"{name}-{writes}-{err}"))
    return out


def _calls_of(case: Case, path: str, monkeypatch: pytest.MonkeyPatch) -> int:
    with monkeypatch.context() as mp:
        faults = FaultyCalls(mp)
        p = case.prepare(path)
        try:
            faults.counting()
            case.op(p)
            return faults.count
        finally:
            p.store.close()


def _no_map(fd: int, size: int) -> object:
    raise OSError(errno.ENODEV, "no writable map here")


def _assert_intact(store: qstore.Store, p: Prepared) -> None:
    for (name, mid), body in p.kept.items():
        assert store.queue(name).get(mid).payload == body, (name, mid)
    for name, mid in p.acked:  # acked before the fault: never comes back
        with pytest.raises(qstore.MessageNotFound):
            store.queue(name).get(mid)


def _assert_no_dead_files(path: str, store: qstore.Store) -> None:
    """After a full pass: every segment file is the store's and holds live records.

    A dead segment whose unlink failed, or a failed batch's segment, is gone.
    """
    segments = store.stats().segments
    on_disk = {parse_segment_name(n) for n in os.listdir(os.path.join(path, "payload"))}
    assert on_disk - {None} == {s.file_id for s in segments}
    assert all(s.live_count for s in segments if not s.active), segments


@pytest.fixture
def sweep_dir(tmp_path: object) -> Iterator[str]:
    """Where a sweep's stores go: a tmpfs when one can be mounted (root), else ``tmp_path``.

    The faults are injected, not the disk's: on a real disk the sweep's
    thousands of fsyncs only make it slow (five times slower on a busy machine).
    Each store is removed once checked, so the tmpfs stays small.
    """
    where = os.path.join(str(tmp_path), "tmpfs")
    os.mkdir(where)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", where],
                              capture_output=True, check=False)
        mounted = done.returncode == 0
    except OSError:  # no mount command
        mounted = False
    try:
        yield where
    finally:
        if mounted:
            subprocess.run(["umount", "-l", where], check=False)


@pytest.mark.parametrize(("name", "writes", "err"), _params())
def test_every_failed_file_call_raises_storage_error_and_loses_nothing(
        sweep_dir: str, monkeypatch: pytest.MonkeyPatch, name: str, err: int,
        writes: str) -> None:
    if writes == "pwritev":  # a file system without writable maps: every append is a call
        monkeypatch.setattr(calls, "mmap_write", _no_map)
    case = CASES[name]
    total = _calls_of(case, f"{sweep_dir}/count", monkeypatch)
    assert total >= 1
    injected = 0
    assert total <= 80, total  # keep the sweep quick: shrink the operation instead
    for n in range(1, total + 1):
        for persistent in (False, True):
            path = f"{sweep_dir}/s{n}{'p' if persistent else 'o'}"
            with monkeypatch.context() as mp:
                # A persistent fault spares unlink: removing a file frees space, and
                # a failed one is retried (compaction) or cleaned at the next open.
                names = tuple(c for c in NAMES if not (persistent and c == "unlink"))
                faults = FaultyCalls(mp, names=names, err=err)
                p = case.prepare(path)
                store = p.store
                try:
                    faults.arm(n, persistent=persistent)
                    failed = False
                    try:
                        case.op(p)  # what returned an id was committed: p.kept has it
                    except qstore.StorageError as exc:
                        failed = True
                        assert exc.errno == err, exc
                    injected += bool(faults.failed)
                    faults.heal()
                    where = (n, persistent, faults.failed)
                    report = store.check()
                    assert report.ok, (where, report.summary())
                    if name == "snapshot" and failed:
                        assert not os.path.exists(p.snapshot), where
                    elif name == "snapshot":
                        assert os.path.exists(os.path.join(p.snapshot, "MANIFEST.json"))
                    _assert_intact(store, p)
                    q = store.queue("q")
                    p.kept[("q", q.push(b"after the fault"))] = b"after the fault"
                    store.compact(threshold=0.0)
                    assert store.check().ok, where
                    _assert_intact(store, p)
                    _assert_no_dead_files(path, store)
                finally:
                    store.close()
            with qstore.open(path, compactor=False) as again:
                _assert_intact(again, p)
                assert again.check().ok
            for done in (path, p.snapshot):
                if done:
                    shutil.rmtree(done, ignore_errors=True)
    assert injected >= 1



def test_a_failed_snapshot_into_an_empty_directory_leaves_it_empty(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _mixed(f"{tmp_path}/store")
    dest = f"{tmp_path}/snap"
    os.mkdir(dest)
    try:
        faults = FaultyCalls(monkeypatch, names=("link",), err=errno.EXDEV)
        faults.arm(2)  # the checkpoint and one segment's link are written by then
        with pytest.raises(qstore.StorageError, match="hard-link") as raised:
            p.store.snapshot(dest)
        assert raised.value.errno == errno.EXDEV
        assert os.path.isdir(dest) and os.listdir(dest) == []
        faults.heal()
        p.store.snapshot(dest)  # the same destination works once the fault is gone
        assert os.path.exists(os.path.join(dest, "MANIFEST.json"))
    finally:
        p.store.close()


def test_a_failed_first_batch_leaves_no_segment_of_its_records(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fresh store: the batch's records are the first in the active segment,
    # which the batch seals by rotating before its last write fails.
    store = _open(f"{tmp_path}/s")
    try:
        q = store.create_queue("q")
        faults = FaultyCalls(monkeypatch, names=("pwritev",), err=errno.EIO)
        faults.arm(2)  # the write into the segment the rotation started
        with pytest.raises(qstore.StorageError) as raised:
            q.push_many([b"a" * 200, b"b" * 200, b"c" * 200])
        assert raised.value.errno == errno.EIO
        faults.heal()
        assert store.check().ok
        assert [s.active for s in store.stats().segments] == [True]
        mid = q.push(b"after")
        assert q.get(mid).payload == b"after"
        assert store.check().ok
    finally:
        store.close()
