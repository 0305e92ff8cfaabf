"""Case 9: raw OS errors at open become QStoreError subclasses with documented exit codes.

The tests make the real condition: a file where the store directory should
be, a path under a file, an empty path. The command line exits with the
documented code and never prints a traceback.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

import qstore
from qstore._errors import EXIT_ERROR

from ._inject import FaultyCalls


def test_a_file_where_the_store_should_be_is_a_storage_error(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "f")
    open(path, "wb").close()
    with pytest.raises(qstore.StorageError) as info:
        qstore.open(path)
    assert info.value.errno == errno.EEXIST
    with pytest.raises(qstore.StorageError) as info:
        qstore.open(os.path.join(path, "sub"))
    assert info.value.errno == errno.ENOTDIR
    with pytest.raises(qstore.QStoreError):
        qstore.open(path, readonly=True)


def test_an_empty_path_is_an_invalid_argument() -> None:
    with pytest.raises(qstore.InvalidArgument):
        qstore.open("")


def test_the_cli_exits_with_the_documented_code_and_no_traceback(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "f")
    open(path, "wb").close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "qstore.cli", "push", "--create", path, "q", "x"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == EXIT_ERROR, r.stderr
    assert "File exists" in r.stderr
    assert "Traceback" not in r.stderr


def test_an_unreadable_segment_is_a_storage_error_with_its_errno(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests run as root, for whom no file is unreadable: the permission error
    # is made by the fault layer, on the open of one sealed segment.
    path = os.path.join(str(tmp_path), "s")
    with qstore.open(path, compactor=False, segment_max_bytes=4096) as store:
        q = store.create_queue("q")
        ids = q.push_many([b"m%03d" % i * 40 for i in range(200)])
        assert store.core.payload.active_id > 2
    with monkeypatch.context() as mp:
        faults = FaultyCalls(mp, names=("open_fd",), err=errno.EACCES,
                             only=lambda name, args: str(args[0]).endswith("0000000001.seg"))
        faults.arm(1, persistent=True)
        for readonly in (False, True):
            with pytest.raises(qstore.StorageError) as info:
                qstore.open(path, readonly=readonly, compactor=False)
            assert info.value.errno == errno.EACCES
            assert "0000000001.seg" in str(info.value)  # it says which file
            assert not isinstance(info.value, qstore.Corruption)  # not damage: nothing set aside
        assert faults.failed
    with qstore.open(path, compactor=False) as store:  # readable again: all there
        q = store.queue("q")
        assert [q.get(m).payload for m in ids] == [b"m%03d" % i * 40 for i in range(200)]
        assert store.check().ok
