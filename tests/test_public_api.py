"""The public surface is exactly what __init__ exports, and the error tree is as documented."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle

import pytest

import qstore
import qstore.aio


def test_all_is_exactly_the_public_surface() -> None:
    public = {n for n in dir(qstore) if not n.startswith("_")} - {
        "cli", "meta", "payload", "spark",  # subpackages/modules, imported lazily or by tools
        "server",  # what `qstore serve` runs; clients use qstore.connect and qstore.aio
    }
    assert set(qstore.__all__) - {"__version__"} == public
    assert qstore.__all__ == sorted(qstore.__all__)


@pytest.mark.parametrize("error", [
    qstore.StoreLocked, qstore.StoreClosed, qstore.ReadOnlyStore, qstore.QueueNotFound,
    qstore.QueueExists, qstore.InvalidArgument, qstore.PayloadTooLarge, qstore.MessageNotFound,
    qstore.LeaseExpired, qstore.Corruption, qstore.StorageError,
])
def test_every_error_derives_from_qstoreerror(error: type[Exception]) -> None:
    assert issubclass(error, qstore.QStoreError)


def _errors_with_fields() -> list[qstore.QStoreError]:
    full = qstore.StorageError("disk full")
    full.errno = 28
    return [
        qstore.StoreLocked("/s", served=True), qstore.StoreClosed("closed"),
        qstore.ReadOnlyStore("ro"), qstore.QueueNotFound("nope"), qstore.QueueExists("q"),
        qstore.InvalidArgument("bad"), qstore.PayloadTooLarge(5, 4),
        qstore.MessageNotFound("q", 7), qstore.LeaseExpired("late"),
        qstore.Corruption("/s/payload/1.seg", 24, "bad crc"), full,
        qstore.ConnectionLost("gone"), qstore.ServerBusy("busy"),
    ]


@pytest.mark.parametrize("copy_of", ["pickle", "deepcopy"])
def test_every_error_pickles_and_copies_with_its_message_and_fields(copy_of: str) -> None:
    # Exception's own reduce calls cls(*args): MessageNotFound and PayloadTooLarge
    # failed with a TypeError, QueueNotFound came back as "queue \"queue 'nope'
    # does not exist\" does not exist" (and so did errors sent to another process).
    for error in _errors_with_fields():
        back = (pickle.loads(pickle.dumps(error)) if copy_of == "pickle"
                else copy.deepcopy(error))
        assert type(back) is type(error)
        assert str(back) == str(error) and back.args == error.args
        assert vars(back) == vars(error)


def test_invalid_argument_is_a_value_error_and_payload_too_large_is_invalid_argument() -> None:
    assert issubclass(qstore.InvalidArgument, ValueError)
    assert issubclass(qstore.PayloadTooLarge, qstore.InvalidArgument)


def test_check_report_and_finding_are_frozen(store: qstore.Store) -> None:
    report = store.check()
    assert isinstance(report, qstore.CheckReport) and report.ok and report.findings == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.messages = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        qstore.Finding("crc_mismatch").kind = "x"  # type: ignore[misc]


def test_corruption_carries_path_offset_reason() -> None:
    exc = qstore.Corruption("payload/0000000001.seg", 24, "record checksum mismatch")
    assert (exc.path, exc.offset, exc.reason) == ("payload/0000000001.seg", 24,
                                                  "record checksum mismatch")
    assert "offset 24" in str(exc)


def test_message_and_stats_are_immutable(store: qstore.Store) -> None:
    q = store.create_queue("q")
    q.push(b"x", priority=1)
    msg = q.pop()
    assert msg is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.payload = b"y"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.stats().ready = 3  # type: ignore[misc]


def test_config_is_frozen_keyword_only_and_comparable() -> None:
    a = qstore.Config(durability="always")
    assert a == qstore.Config(durability="always")
    assert a != qstore.Config()
    assert "durability='always'" in repr(a)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.durability = "none"  # type: ignore[misc]
    with pytest.raises(TypeError):
        qstore.Config("always")  # type: ignore[misc]


@pytest.mark.parametrize("options, fragment", [
    ({"durabilty": "none"}, "unknown option"),
    ({"durability": "sometimes"}, "durability"),
    ({"sync_interval": 0}, "sync_interval"),
    ({"segment_max_bytes": -1}, "segment_max_bytes"),
    ({"compact_threshold": 1.5}, "compact_threshold"),
    ({"clock": 3}, "clock"),
    ({"readonly": "yes"}, "readonly"),
])
def test_bad_open_options_raise_invalid_argument(tmp_path, options, fragment) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(qstore.InvalidArgument, match=fragment):
        qstore.open(tmp_path / "s", **options)
    assert not (tmp_path / "s").exists()


def test_store_closed_raises_store_closed(store_path: str) -> None:
    store = qstore.open(store_path, compactor=False)
    q = store.create_queue("q")
    store.close()
    store.close()  # idempotent
    with pytest.raises(qstore.StoreClosed):
        q.push(b"x")
    with pytest.raises(qstore.StoreClosed):
        store.queues()


def test_the_package_ships_its_type_annotations() -> None:
    # PEP 561: without the marker a user's type checker treats qstore as untyped
    # (every call Any); with it, `q.push("text")` is an error and `q.pop()` is
    # `Message | None`. The package is checked with mypy --strict itself.
    import pathlib
    import tomllib

    root = pathlib.Path(qstore.__file__).parent
    project = tomllib.loads((root.parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert (root / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["qstore"]


def test_open_options_type_is_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # StoreOptions (what a type checker sees of qstore.open's options) and Config
    # (what the store checks at run time) must name the same options.
    from qstore._options import StoreOptions

    assert set(StoreOptions.__annotations__) == {f.name for f in dataclasses.fields(qstore.Config)}


USER_PROGRAM = """
import qstore

with qstore.open("s", durability="always", sync_interval=0.1, clock=None) as store:
    q = store.configure_queue("q", ttl=5.0)
    reveal_type(q.pop())
qstore.open("s", durabilty="always")
qstore.open("s", durability="sometimes")
qstore.open("s", compactor=1.5)
store.configure_queue("q", tll=5)
"""


def test_a_type_checker_sees_the_options_of_open_and_configure_queue(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # qstore.open(**options) was Any to mypy, so a misspelled option or a wrong
    # durability reached run time (an API audit). Run from the repository root so
    # that mypy reads this source tree (an editable install is invisible to it).
    import pathlib
    import subprocess
    import sys

    program = tmp_path / "user.py"
    program.write_text(USER_PROGRAM, encoding="utf-8")
    root = pathlib.Path(qstore.__file__).parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--cache-dir",
         str(tmp_path / "cache"), str(program)],
        cwd=root, capture_output=True, text=True, timeout=240)
    lines = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if ": " in line]
    assert 'note: Revealed type is "qstore._message.Message | None"' in lines, done.stdout
    errors = [line for line in done.stdout.splitlines() if ": error: " in line]
    flagged = sorted(int(line.split(":")[1]) for line in errors)
    assert flagged == [7, 8, 9, 10], done.stdout  # the four wrong calls, nothing else
    assert 'did you mean "durability"' in done.stdout
    assert '"tll"' in done.stdout


@pytest.mark.parametrize("path", [None, 5, b"/tmp/bytes-path", "", "nul\0byte"])
def test_a_path_that_is_not_a_text_path_is_invalid_argument(tmp_path, path) -> None:  # type: ignore[no-untyped-def]
    # None was a TypeError from os.fspath, bytes met str paths later in another
    # TypeError (an API audit).
    with pytest.raises(qstore.InvalidArgument, match="store path"):
        qstore.open(path)
    with pytest.raises(qstore.InvalidArgument, match="address"):
        qstore.connect(path)
    with qstore.open(str(tmp_path / "s"), compactor=False) as store, \
            pytest.raises(qstore.InvalidArgument, match="snapshot destination"):
        store.snapshot(path)
    assert os.listdir(tmp_path) == ["s"]


@pytest.mark.parametrize("settings, fragment", [
    ({"timeout": None}, "timeout"), ({"timeout": -1}, "timeout"),
    ({"timeout": float("inf")}, "timeout"), ({"timeout": "5"}, "timeout"),
    ({"timeout": True}, "timeout"), ({"keep_leases": "no"}, "keep_leases"),
    ({"token": 5}, "token"),
])
def test_bad_connect_settings_are_invalid_argument(tmp_path, settings, fragment) -> None:  # type: ignore[no-untyped-def]
    # Refused before any connection is tried: timeout=None was a TypeError from deep
    # in the link, -1 a ValueError of the socket module (an API audit).
    with pytest.raises(qstore.InvalidArgument, match=fragment):
        qstore.connect(str(tmp_path), **settings)
    with pytest.raises(qstore.InvalidArgument, match=fragment):
        qstore.aio.connect(str(tmp_path), **settings)


def test_compact_takes_its_options_by_name_and_checks_progress(store_path: str) -> None:
    # compact(**options) ran part of a pass before progress=5 raised "'int' object is
    # not callable", and compact(foo=1) named an internal class (an API audit).
    with qstore.open(store_path, compactor=False, segment_max_bytes=4096) as store:
        q = store.create_queue("q")
        q.push_many([bytes(500)] * 40)
        q.ack_many(q.pop_many(20))
        with pytest.raises(qstore.InvalidArgument, match="progress must be a callable"):
            store.compact(progress=5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"Store\.compact\(\) got an unexpected"):
            store.compact(foo=1)  # type: ignore[call-arg]
        assert store.compactor is not None and store.compactor.passes == 0  # none ran
        seen: list[tuple[int, int]] = []
        result = store.compact(threshold=0.1, progress=lambda d, t: seen.append((d, t)))
        assert result.messages_moved > 0 and seen and seen[-1][0] == seen[-1][1]


def test_every_public_client_method_has_a_docstring() -> None:
    # help(client.queue("q").pop) showed nothing (an API audit).
    from qstore._client import Client, RemoteQueue
    from qstore.aio import AsyncClient, AsyncQueue

    for cls, embedded in ((RemoteQueue, qstore.Queue), (AsyncQueue, qstore.Queue),
                          (Client, qstore.Store), (AsyncClient, qstore.Store)):
        for name, member in vars(cls).items():
            if name.startswith("_") or not callable(member):
                continue
            assert member.__doc__, f"{cls.__name__}.{name}"
            if f":meth:`qstore.{embedded.__name__}.{name}`" in member.__doc__:
                assert hasattr(embedded, name), f"{cls.__name__}.{name} names no embedded method"
