from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import qstore

from ._support import ServerProcess, running


@pytest.fixture
def server(tmp_path: Any) -> Iterator[ServerProcess]:
    """A real server process on the store's default unix socket."""
    with running(str(tmp_path / "store")) as srv:
        yield srv


@pytest.fixture(params=["embedded", "unix", "tcp-asyncio"])
def store(request: Any, tmp_path: Any) -> Iterator[Any]:
    """The contract suite's store: embedded, or a client of a real server process.

    The unix-socket server runs on the default event loop (uvloop), the TCP one
    on asyncio's own: the suite holds on both loops without running twice.
    """
    path = str(tmp_path / "store")
    if request.param == "embedded":
        with qstore.open(path) as s:
            yield s
        return
    args = () if request.param == "unix" else ("--listen", "tcp://127.0.0.1:0",
                                               "--loop", "asyncio")
    with running(path, *args) as srv, qstore.connect(srv.address) as client:
        assert srv.loop == ("uvloop" if request.param == "unix" else "asyncio")
        yield client
