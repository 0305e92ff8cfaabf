"""Errors of the client/server protocol, in the same tree as every other qstore error::

    QStoreError
    ├── ConnectionLost          the connection dropped (or never came up); the
    │                           request may or may not have run; the next call
    │                           reconnects, nothing is retried on its own
    ├── ProtocolError           a malformed, oversized or unexpected frame
    ├── AuthenticationFailed    the server refused the token
    └── ServerBusy              a server limit (connections, waiting pops) was hit
"""

from __future__ import annotations

from ._errors import QStoreError


class ConnectionLost(QStoreError):
    """The connection to the server dropped or could not be made."""


class ProtocolError(QStoreError):
    """A frame broke the protocol (docs/protocol.md); the connection is closed."""


class AuthenticationFailed(QStoreError):
    """The server refused the token (or a token is needed); the connection is closed."""


class ServerBusy(QStoreError):
    """A server limit was reached: too many connections or waiting pops."""
