"""Tokens and TLS: the settings the server and both clients check alike (docs/server.md)."""

from __future__ import annotations

import logging
import os

from ._address import Address
from ._errors import InvalidArgument

# The longest token a server takes and a client sends: the handshake that carries
# it is read before authentication, in at most 64 KiB (a 70 KB token was accepted
# by `serve`, and no client could ever send it; a configuration audit). 60 KiB
# leaves the rest of the handshake room, and takes every token that worked before.
MAX_TOKEN_BYTES = 60 * 1024

log = logging.getLogger("qstore.auth")


def check_token(token: object, *, empty_ok: bool = False) -> str:
    """``token``, or InvalidArgument: a str of 1 (0 if ``empty_ok``) to
    MAX_TOKEN_BYTES bytes of UTF-8."""
    if not isinstance(token, str):
        raise InvalidArgument(f"token must be a str or None, not {type(token).__name__}")
    size = len(token.encode("utf-8", "surrogatepass"))
    if size > MAX_TOKEN_BYTES or (size == 0 and not empty_ok):
        raise InvalidArgument(f"a token must be 1 to {MAX_TOKEN_BYTES} bytes of UTF-8, "
                              f"not {size}")
    return token


def read_token_file(path: str) -> str:
    """The token in file ``path``, surrounding whitespace stripped (InvalidArgument,
    naming the file, if it cannot be read, is not UTF-8, or is empty or too long)."""
    try:
        # utf-8-sig: a byte-order mark an editor wrote is not part of the token.
        with open(path, encoding="utf-8-sig") as f:
            token = f.read(4 * MAX_TOKEN_BYTES + 1).strip()
            mode = os.fstat(f.fileno()).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"token file {path}: cannot read a UTF-8 token: {exc}") from None
    if mode & 0o077:
        # Not refused (a mounted secret is often 0644), but said: whoever can read
        # the file can use the server (a security audit found it unchecked).
        log.warning("token file %s has mode %04o: other users than its owner may read "
                    "it, and with it use the server; chmod 600 it", path, mode & 0o7777)
    try:
        return check_token(token)
    except InvalidArgument as exc:
        raise InvalidArgument(f"token file {path}: {exc}") from None


def check_tls(address: Address, ssl_context: object) -> None:
    """TLS goes over TCP only: a unix socket never leaves the machine, and its file's
    mode (0600) decides who may connect. (A TLS context on a unix address failed
    later with a raw ValueError about server_hostname; a configuration audit.)"""
    if ssl_context is not None and address.kind == "unix":
        raise InvalidArgument(f"TLS is for tcp:// addresses, not {address}: a unix socket "
                              "stays on this machine and its mode (0600) decides who "
                              "connects")
