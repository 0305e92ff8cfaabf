"""A store of another user, met by a process without root's privileges.

The suite runs as root, which may read and write every file, so permission
problems never showed in it (a non-root audit found them by hand). These
tests run the child that meets the store as root without its capabilities
(``setpriv``: no CAP_DAC_OVERRIDE), so the files' owners and modes decide,
as for any user, while the interpreter under root's home stays reachable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import qstore

NOBODY = 65534

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to drop root's file capabilities")


def _run_unprivileged(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-all",
                           sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, env=env, timeout=120)


def _give_away(path: str) -> None:
    """Make ``path`` another user's: owned by nobody, writable by nobody else."""
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            entry = os.path.join(root, name)
            if os.lstat(entry).st_nlink == 1 or os.path.isdir(entry):
                os.lchown(entry, NOBODY, NOBODY)
    os.chown(path, NOBODY, NOBODY)
    subprocess.run(["chmod", "-R", "go-w", path], check=True)


def test_a_view_of_a_store_this_user_may_read_but_not_write(tmp_path: Any) -> None:
    # Every read-only open rewrote rocksdict's config file in meta/: a user who
    # may read a store but not write it (another user's store, a snapshot root
    # made) could open no view, nor run stats, peek or check (a non-root audit).
    path = str(tmp_path / "store")
    with qstore.open(path) as store:
        store.create_queue("q").push_many([b"a", b"b"])
        store.snapshot(str(tmp_path / "snap"))
    _give_away(path)
    _give_away(str(tmp_path / "snap"))
    for target in (path, str(tmp_path / "snap")):
        r = _run_unprivileged(f"""
            import qstore
            with qstore.open({target!r}, readonly=True) as v:
                print(sorted(m.payload for m in v.queue("q").peek(5)), v.check().ok)
            """)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split("\n")[0] == "[b'a', b'b'] True"
        r = _run_unprivileged(f"""
            import sys
            from qstore.cli import main
            sys.argv = ["qstore", "check", {target!r}]
            main()
            """)
        assert r.returncode == 0, r.stdout + r.stderr


def test_a_lock_file_this_user_may_not_open_is_not_another_writer(tmp_path: Any) -> None:
    # RocksDB's "While open a file for lock: .../LOCK: Permission denied" was
    # taken for a second writer: StoreLocked, exit 3 (a non-root audit).
    path = str(tmp_path / "store")
    with qstore.open(path) as store:
        store.create_queue("q").push(b"a")
    lock = os.path.join(path, "meta", "LOCK")
    os.chown(lock, NOBODY, NOBODY)
    os.chmod(lock, 0o644)
    r = _run_unprivileged(f"""
        import qstore
        try:
            qstore.open({path!r})
        except qstore.QStoreError as exc:
            print(type(exc).__name__, exc)
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("StorageError") and "LOCK" in r.stdout, r.stdout
    assert "Permission denied" in r.stdout


def test_a_root_session_on_another_user_s_store_gives_its_files_to_that_user(
        tmp_path: Any, caplog: Any) -> None:
    # A compaction, a rotation, any new table made by root stayed root's, and the
    # store's owner could open it no more (a cron job as root; a non-root audit).
    path = str(tmp_path / "store")
    with qstore.open(path) as store:
        store.create_queue("q").push(b"first")
    _give_away(path)
    with qstore.open(path, segment_max_bytes=64 * 1024, compactor=False) as store:
        q = store.queue("q")
        for _ in range(3):
            q.push_many([b"x" * 1000] * 100)  # new segments
        q.ack_many(q.pop_many(300))
        store.compact(threshold=0.0)
        new = [n for n in os.listdir(os.path.join(path, "payload")) if n.endswith(".seg")]
        assert any(os.stat(os.path.join(path, "payload", n)).st_uid == 0 for n in new)
    assert "as root: the files this session creates are handed" in caplog.text
    owners = {os.lstat(os.path.join(root, name)).st_uid
              for root, dirs, files in os.walk(path) for name in [*dirs, *files]}
    assert owners == {NOBODY}


def test_a_snapshot_the_kernel_refuses_to_link_says_why(tmp_path: Any) -> None:
    # With fs.protected_hardlinks, linking another user's segment is EPERM, and the
    # error said the snapshot must be on the store's filesystem (it was).
    with open("/proc/sys/fs/protected_hardlinks") as f:
        if f.read().strip() != "1":
            pytest.skip("fs.protected_hardlinks is off")
    path = str(tmp_path / "store")
    with qstore.open(path) as store:
        store.create_queue("q").push(b"a")
    _give_away(path)
    r = _run_unprivileged(f"""
        import qstore
        with qstore.open({path!r}, readonly=True) as v:
            try:
                v.snapshot({str(tmp_path / "snap")!r})
            except qstore.StorageError as exc:
                print(exc)
        """)
    assert r.returncode == 0, r.stderr
    assert "fs.protected_hardlinks" in r.stdout and "filesystem" not in r.stdout, r.stdout


def test_the_hand_over_follows_no_link_out_of_the_store(tmp_path: Any) -> None:
    # The walk resolved each path again, and lchown'd what a hard link named: the
    # store's owner could have root give it any file of root's (a review).
    path = str(tmp_path / "store")
    with qstore.open(path) as store:
        store.create_queue("q").push(b"first")
    victim = tmp_path / "roots-file"
    victim.write_text("root's")
    os.link(victim, os.path.join(path, "payload", "linked"))
    os.symlink(victim, os.path.join(path, "payload", "pointing"))
    _give_away(path)
    os.lchown(os.path.join(path, "payload", "pointing"), 0, 0)  # a link root owns
    with qstore.open(path, compactor=False) as store:
        store.queue("q").push(b"second")
    assert os.stat(victim).st_uid == 0
