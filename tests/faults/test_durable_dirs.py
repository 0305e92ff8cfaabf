"""What a power loss keeps: new directories and a snapshot's payload.

A power loss keeps a directory's entry only once its parent was fsynced, and
keeps file bytes only once they were synced. Each test records the fsyncs the
store makes (the file-call layer every fsync goes through) and checks that
what a returned call made is covered: before, a new store or snapshot whose
every file was synced could vanish (its directory never fsynced in its
parent), and a snapshot taken in interval mode named payload bytes that were
not yet on disk, a snapshot damaged for good by a power loss after it
returned (a power-loss audit that replayed the recorded syncs).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from typing import Any

import pytest

import qstore
from qstore import _fs
from qstore.meta import keys


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The paths this process fsyncs, in order."""
    paths: list[str] = []
    real = _fs.calls.fsync

    def recording(fd: int) -> None:
        real(fd)
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(_fs.calls, "fsync", recording)
    yield paths


def test_a_new_store_and_the_directories_made_for_it_are_durable_in_their_parents(
        tmp_path: Any, fsynced: list[str]) -> None:
    base = os.path.realpath(tmp_path)
    path = os.path.join(base, "a", "b", "store")
    with qstore.open(path, compactor=False) as store:
        store.create_queue("q").push(b"x")
    # a, b and store in their parents; meta/ and payload/ in the store's directory
    for parent in (base, os.path.join(base, "a"), os.path.join(base, "a", "b"), path):
        assert parent in fsynced, parent


def test_a_snapshot_directory_is_durable_in_its_parent(tmp_path: Any,
                                                         fsynced: list[str]) -> None:
    base = os.path.realpath(tmp_path)
    with qstore.open(os.path.join(base, "s"), compactor=False) as store:
        store.create_queue("q").push(b"x")
        del fsynced[:]
        dest = os.path.join(base, "snaps", "first")
        store.snapshot(dest)
    assert base in fsynced and os.path.join(base, "snaps") in fsynced
    with qstore.open(dest, readonly=True) as snap:
        assert [m.payload for m in snap.queue("q").peek(5)] == [b"x"]


@pytest.mark.parametrize("durability", ["interval", "none"])
def test_a_snapshot_syncs_the_payload_its_records_name_first(
        tmp_path: Any, durability: str) -> None:
    with qstore.open(str(tmp_path / "s"), compactor=False, durability=durability,
                     sync_interval=3600) as store:
        q = store.create_queue("q")
        q.push_many([b"m%d" % i for i in range(50)])
        payload = store.core.payload
        assert payload.unsynced  # the background sync is an hour away
        store.snapshot(str(tmp_path / "snap"))
        # The linked active segment is the store's file: its bytes that the
        # snapshot's records name are durable once snapshot() returns.
        assert not payload.unsynced
        fid, synced = payload.synced_position()
        assert fid == payload.active_id and synced == store.core.data_size(fid)


def test_a_path_through_a_symlink_s_parent_opens_where_the_kernel_says(
        tmp_path: Any, fsynced: list[str]) -> None:
    # ``link/..`` is the parent of the symlink's target, which only the kernel
    # knows: the walk normalised it to the link's own directory, made the store
    # there and then failed to open it, ENOENT (a review).
    base = os.path.realpath(tmp_path)
    os.makedirs(os.path.join(base, "elsewhere", "target"))
    os.makedirs(os.path.join(base, "here"))
    os.symlink(os.path.join(base, "elsewhere", "target"), os.path.join(base, "here", "link"))
    path = os.path.join(base, "here", "link", "..", "store")
    with qstore.open(path, compactor=False) as store:
        store.create_queue("q").push(b"x")
    assert os.path.isdir(os.path.join(base, "elsewhere", "store", "meta"))
    assert not os.path.exists(os.path.join(base, "here", "store"))
    assert os.path.join(base, "elsewhere") in fsynced


def test_a_relative_path_is_made_durable_in_the_working_directory(
        tmp_path: Any, fsynced: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with qstore.open("rel/store", compactor=False) as store:
        store.create_queue("q").push(b"x")
    base = os.path.realpath(tmp_path)
    assert base in fsynced and os.path.join(base, "rel") in fsynced


def test_files_written_durably_through_a_symlink_s_parent_are_synced_where_they_are(
        tmp_path: Any) -> None:
    # write_file_durably fsynced os.path.abspath's parent, which collapses
    # ``link/..`` by text: the snapshot's manifest (and the .cut file a recovery
    # keeps) were written, then the fsync of a directory that is not there
    # failed, ENOENT (a review).
    base = os.path.realpath(tmp_path)
    os.makedirs(os.path.join(base, "elsewhere", "target"))
    os.symlink(os.path.join(base, "elsewhere", "target"), os.path.join(base, "link"))
    with qstore.open(os.path.join(base, "s"), compactor=False) as store:
        store.create_queue("q").push(b"x")
        dest = store.snapshot(os.path.join(base, "link", "..", "snap"))
    with qstore.open(os.path.join(base, "elsewhere", "snap"), readonly=True) as snap:
        assert [m.payload for m in snap.queue("q").peek(5)] == [b"x"]
    assert os.path.samefile(dest, os.path.join(base, "elsewhere", "snap"))


def test_a_client_sends_a_relative_snapshot_path_without_collapsing_a_link(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Through a unix socket a relative destination is made absolute for the
    # server; os.path.abspath collapsed "link/.." by text, so the server wrote
    # the snapshot beside the link, not where the path leads (a review).
    from qstore import _client_base as base
    from qstore._address import parse_address

    monkeypatch.chdir(tmp_path)
    args = base.snapshot_args(parse_address(f"unix://{tmp_path}/s.sock"),
                              os.path.join("link", "..", "snap"))
    assert args == {"dest": os.path.join(os.getcwd(), "link", "..", "snap")}


def test_a_view_s_snapshot_syncs_the_newest_segment_it_links(tmp_path: Any,
                                                             fsynced: list[str]) -> None:
    # The writer's snapshot syncs its payload first; a read-only view's did not,
    # and its newest segment is the writer's active one, whose last appends that
    # process may not have synced (a review).
    base = os.path.realpath(tmp_path)
    with qstore.open(os.path.join(base, "s"), compactor=False, sync_interval=3600) as store:
        store.create_queue("q").push_many([b"a", b"b"])
        active = store.core.payload.active_id
        with qstore.open(os.path.join(base, "s"), readonly=True) as view:
            del fsynced[:]
            dest = view.snapshot(os.path.join(base, "snap"))
    assert os.path.join(dest, "payload", f"{active:010d}.seg") in fsynced


def test_an_always_mode_snapshot_leaves_no_journal_keys_its_sync_covered(
        tmp_path: Any) -> None:
    # The snapshot's own fdatasync covered the journaled appends, but their J keys
    # stayed until the next sync of new appends or the close (a review).
    with qstore.open(str(tmp_path / "s"), compactor=False, durability="always") as store:
        store.create_queue("q").push(b"journaled")
        meta = store.core.meta

        def journal() -> list[bytes]:
            return [k for k, _ in meta.scan(keys.JOURNAL, keys.prefix_end(keys.JOURNAL))]

        assert journal() != []
        store.snapshot(str(tmp_path / "snap"))
        assert journal() == []
    with qstore.open(str(tmp_path / "snap"), readonly=True) as snap:
        assert [m.payload for m in snap.queue("q").peek(5)] == [b"journaled"]
        assert snap.check().ok


def test_directories_made_for_a_failed_open_are_taken_away(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A new store under missing parents whose open failed as it fsynced a parent
    # left every directory it had made, and a retry, finding them, fsynced no
    # parent again (a faults audit).
    base = os.path.realpath(tmp_path)
    real, calls = _fs.fsync_dir, []

    def failing_second(path: str) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error", path)
        real(path)

    monkeypatch.setattr(_fs, "fsync_dir", failing_second)
    with pytest.raises(qstore.StorageError):
        qstore.open(os.path.join(base, "a", "b", "store"), compactor=False)
    monkeypatch.undo()
    assert os.listdir(base) == []
    with qstore.open(os.path.join(base, "a", "b", "store"), compactor=False) as store:
        store.create_queue("q").push(b"x")
