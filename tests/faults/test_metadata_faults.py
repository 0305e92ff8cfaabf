"""Case 15, the metadata half: a read-only filesystem, and damage inside an SST file.

- ``readonly=True`` on a store that sits on a read-only filesystem (a small
  tmpfs the test mounts and remounts read-only; skipped where mounting is
  not permitted): RocksDB's read-only open and rocksdict write into the
  database directory, so the view opens a private copy of ``meta/`` that
  links the table files, and removes it on close.
- Bytes flipped inside a real ``.sst`` under ``meta/``: RocksDB's
  "Corruption:" status becomes :class:`qstore.Corruption`, and an iteration
  that meets the damaged block raises instead of ending early as if the
  keys behind it did not exist.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

import qstore
from qstore.meta import MetaDB, keys


def _sh(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(list(args), capture_output=True, check=False)


@pytest.fixture
def small_tmpfs(tmp_path: Any) -> Iterator[str]:
    mnt = os.path.join(str(tmp_path), "mnt")
    os.mkdir(mnt)
    mounted = _sh("mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", mnt)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        _sh("umount", "-l", mnt)


def _scratch_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "qstore-meta-*")))


def test_readonly_opens_a_store_on_a_read_only_filesystem(small_tmpfs: str,
                                                          clock: Any) -> None:
    path = os.path.join(small_tmpfs, "store")
    with qstore.open(path, clock=clock, compactor=False) as store:
        q = store.create_queue("q", dedup=True, max_attempts=1)
        ids = q.push_many([b"one", b"two", b"three"])
        q.nack(q.pop())  # type: ignore[arg-type]
        q.pop(lease=60.0)
    listing = sorted(os.listdir(os.path.join(path, "meta")))
    remount = _sh("mount", "-o", "remount,ro", small_tmpfs)
    assert remount.returncode == 0, remount.stderr
    with pytest.raises(OSError), open(os.path.join(path, "probe"), "wb"):
        pass  # the filesystem really is read-only
    before = _scratch_dirs()
    with qstore.open(path, readonly=True, clock=clock) as view:
        q = view.queue("q")
        assert [m.payload for m in q.peek(5)] == [b"three"]
        assert q.get(ids[1]).state == "in_flight"
        assert [m.id for m in q.dead_letters()] == [ids[0]]
        assert (q.stats().ready, q.stats().in_flight, q.stats().dead) == (1, 1, 1)
        assert view.check().ok
        with pytest.raises(qstore.ReadOnlyStore):
            q.push(b"no")
    assert _scratch_dirs() == before, "the private copy of meta/ is removed on close"
    assert sorted(os.listdir(os.path.join(path, "meta"))) == listing
    # The command line reads it too; a read-write open is a clear error, not an OSError.
    run = subprocess.run([sys.executable, "-m", "qstore.cli", "stats", path, "--json"],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    with pytest.raises(qstore.StorageError):
        qstore.open(path, compactor=False)


N = 2000


@pytest.fixture
def damaged_sst(tmp_path: Any) -> str:
    """A closed store of N messages whose one metadata table has 8 bytes flipped
    inside its data blocks."""
    path = os.path.join(str(tmp_path), "store")
    with qstore.open(path, compactor=False) as store:
        store.create_queue("q").push_many([b"x" * 50] * N)
    [sst] = glob.glob(os.path.join(path, "meta", "*.sst"))
    size = os.path.getsize(sst)
    with open(sst, "r+b") as f:
        f.seek(size // 2)  # data blocks: the index and footer are at the end
        data = f.read(8)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    return path


@pytest.mark.parametrize("readonly", [True, False], ids=["readonly", "read-write"])
def test_damage_inside_a_metadata_sst_is_corruption(damaged_sst: str, readonly: bool) -> None:
    with (pytest.raises(qstore.Corruption) as info,
          qstore.open(damaged_sst, readonly=readonly, compactor=False) as store):
        store.check()
    assert "metadata is damaged" in info.value.reason and "Corruption" in info.value.reason
    assert info.value.path.endswith("meta")


def test_a_scan_over_a_damaged_block_raises_instead_of_ending_early(damaged_sst: str) -> None:
    meta = MetaDB(os.path.join(damaged_sst, "meta"), readonly=True, store_path=damaged_sst)
    try:
        for scan in (meta.scan, meta.items, meta.scan_keys):
            with pytest.raises(qstore.Corruption):
                # Without the status check rocksdict stopped at the damaged block,
                # and a pass saw only the messages before it.
                for _ in scan(keys.MESSAGE, keys.prefix_end(keys.MESSAGE)):
                    pass
    finally:
        meta.close()


def test_the_cli_reports_a_damaged_sst_with_exit_5(damaged_sst: str) -> None:
    run = subprocess.run([sys.executable, "-m", "qstore.cli", "check", damaged_sst],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 5, run.stdout + run.stderr
    assert "corruption" in run.stderr.lower() and "Traceback" not in run.stderr


@pytest.mark.parametrize("readonly", [True, False], ids=["readonly", "read-write"])
def test_a_missing_rocksdb_manifest_is_corruption(tmp_path: Any, readonly: bool) -> None:
    path = str(tmp_path / "store")
    with qstore.open(path, compactor=False) as store:
        store.create_queue("q").push(b"x")
    for manifest in glob.glob(os.path.join(path, "meta", "MANIFEST-*")):
        os.unlink(manifest)
    with pytest.raises(qstore.Corruption) as info:
        qstore.open(path, readonly=readonly, compactor=False)
    assert "metadata is damaged: a file of the database is missing" in info.value.reason
    assert "MANIFEST" in info.value.reason and info.value.path.endswith("meta")
    run = subprocess.run([sys.executable, "-m", "qstore.cli", "check", path],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 5 and "Traceback" not in run.stderr
    assert "metadata is damaged" in run.stderr.replace("\n", " ")
