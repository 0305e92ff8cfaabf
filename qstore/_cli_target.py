"""What a ``qstore`` command works on: the store itself, or the server that owns it.

Contract section 6: every command that reads or changes a store also works
while a server owns it. A command given a store directory whose server
answers on ``STORE/qstore.sock`` goes through that server (a client with the
store's methods); given ``unix:///path`` or ``tcp://host:port`` it goes
through the server there; otherwise it opens the store itself. A socket file
left by a server that died (nothing answers) is ignored: the store opens.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ._address import SOCKET_NAME, unix_socket_answers
from ._auth import read_token_file
from ._client import Client, connect
from ._lazy import lazy
from ._net_errors import ConnectionLost

if TYPE_CHECKING:
    from . import _core, _store
else:  # only a command that opens the store itself loads it (qstore/_lazy.py)
    _core = lazy("qstore._core")
    _store = lazy("qstore._store")

CONNECT_TIMEOUT = 10.0


def is_address(target: str) -> bool:
    return target.startswith(("unix://", "tcp://"))


def read_token(token_file: str | None) -> str | None:
    """The token in ``token_file``, surrounding whitespace stripped (as ``qstore serve``)."""
    if token_file is None:
        return None
    return read_token_file(token_file)


def server_answers(store_path: str) -> bool:
    """True when a server answers on ``STORE/qstore.sock`` (a connect succeeds;
    no handshake, so no token is needed to tell)."""
    return unix_socket_answers(os.path.join(store_path, SOCKET_NAME), CONNECT_TIMEOUT)


def server_of(target: str, token: str | None, keep_leases: bool = False, *,
              tls: bool = False, cafile: str | None = None) -> Client | None:
    """A client of the server at ``target`` or of the one owning store ``target``; None if none.

    ``tls``/``cafile``: as :func:`qstore.connect`'s, for a ``tcp://`` address
    of a server started with ``--tls-cert``.
    """
    if is_address(target):
        try:
            return connect(target, token=token, timeout=CONNECT_TIMEOUT,
                           keep_leases=keep_leases, tls=tls, cafile=cafile)
        except ConnectionLost as exc:
            if tls or cafile or not target.startswith("tcp://"):
                raise
            # A TLS server closes a connection that does not start a TLS handshake,
            # which says only "connection closed": name the likely cause.
            raise ConnectionLost(f"{exc} (if the server runs with TLS, pass --tls, and "
                                 "--cafile when its certificate is not signed by a CA "
                                 "this machine trusts)") from None
    if not os.path.exists(os.path.join(target, SOCKET_NAME)):
        return None
    try:
        return connect(target, token=token, timeout=CONNECT_TIMEOUT, keep_leases=keep_leases)
    except ConnectionLost:
        return None  # a stale socket file: no server runs


@contextmanager
def open_target(target: str, token_file: str | None = None, *, readonly: bool = False,
                keep_leases: bool = False, create: bool = False, tls: bool = False,
                cafile: str | None = None) -> Iterator[Any]:
    """A :class:`~qstore.Client` of the running server, else the store opened here.

    ``keep_leases``: leases taken through the server outlive this command
    (``pop --no-ack``). ``tls``/``cafile``: see :func:`server_of`. Unless
    ``create``, a path that holds no store is an error (``require_store``)
    and nothing is created: a mistyped path must not become a new empty store.
    """
    client = server_of(target, read_token(token_file), keep_leases, tls=tls, cafile=cafile)
    if client is not None:
        with client:
            yield client
        return
    if not create:
        _core.require_store(target)
    with _store.open_store(target, readonly=readonly, compactor=False) as store:
        yield store
