"""The qstore server: one process owns a store, clients reach it over a socket.

``qstore serve STORE`` runs :func:`serve`; the protocol is docs/protocol.md,
operations and security docs/server.md. Layers: :mod:`._conn` (one
connection as an asyncio protocol: frames in, answers out, flow control)
hands frames to :mod:`._server` (the handshake, rounds of requests, waiting
pops and their due-time wake-ups), which calls :mod:`._ops` (what each
request does to the :class:`~qstore.Store`, and the grouped pops and acks)
inline or through :mod:`._worker` (the store thread, for durability
"always"); :mod:`._metrics` exports Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import sys
from collections.abc import Callable

from .._address import LOOPS, Address, parse_address
from .._errors import InvalidArgument, QStoreError
from .._store import Store
from ._metrics import Metrics
from ._server import Limits, Server, default_max_frame

__all__ = ["LOOPS", "Limits", "Server", "default_max_frame", "loop_factory", "serve",
           "tls_context"]

log = logging.getLogger("qstore.server")


def loop_factory(loop: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop ``serve`` runs on: None for asyncio's own.

    "auto" is uvloop where it is installed (a dependency wherever it builds:
    it cuts the server's CPU time per request by 3-22%, see
    docs/benchmarks.md), else asyncio's; "uvloop" insists on it.
    """
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {', '.join(LOOPS)}, not {loop!r}")
    if loop == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise ValueError("the uvloop event loop is not installed") from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A server TLS context from a PEM certificate (chain) and key; InvalidArgument,
    naming them, if they cannot be loaded (a raw ssl.SSLError before)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise InvalidArgument(f"TLS certificate {cert} and key {key}: cannot load them as "
                              f"PEM: {exc}") from None
    return ctx


def serve(store: Store, listen: str | None = None, *, token: str | None = None,
          ssl_context: ssl.SSLContext | None = None, limits: Limits | None = None,
          metrics_port: int | None = None,
          ready: Callable[[str], None] | None = None, loop: str = "auto",
          ignore_later_signals: bool = False) -> None:
    """Serve ``store`` until SIGTERM or SIGINT; closes the store before returning.

    ``ready`` is called with the address clients use once the server listens;
    ``loop`` picks the event loop (:func:`loop_factory`). Signals that come
    while the server stops do nothing; once it has stopped, SIGTERM and SIGINT
    get the handlers they had before, or, with ``ignore_later_signals``, are
    ignored for the rest of the process (``qstore serve``: a second Ctrl-C or
    a supervisor's second SIGTERM as the process ends made a clean stop exit
    130 or 143, or print a traceback; a signals audit).
    """
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    factory = loop_factory(loop)
    address: Address = parse_address(listen if listen is not None else store.path)
    metrics = Metrics(store) if metrics_port is not None else None
    server = Server(store, address, token=token, ssl_context=ssl_context,
                    limits=limits or Limits(),
                    metrics=metrics)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            try:
                await server.start()
            except OSError as exc:  # the address is taken, not ours to bind...
                raise QStoreError(f"cannot listen on {address}: {exc.strerror or exc}") \
                    from exc
            if metrics is not None and metrics_port is not None:
                try:
                    metrics.serve(metrics_port)
                except OSError as exc:
                    raise QStoreError(f"cannot serve metrics on port {metrics_port}: "
                                      f"{exc.strerror or exc}") from exc
        except BaseException:
            await server.shutdown()  # the socket file goes, the store closes
            raise
        # Once all of it serves: logged before the metrics port was taken, a server
        # that then failed to start had said it was listening (a docs audit).
        log.info("qstore server listening on %s", server.listening_on)
        if ready is not None:
            ready(server.listening_on)
        try:
            await stop.wait()
            await server.shutdown()  # a signal meanwhile sets ``stop`` again: nothing
        finally:
            # Taken from the loop here: closing it would put the default handlers
            # back (a second SIGINT a KeyboardInterrupt, a SIGTERM the end).
            for sig in before:
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)

    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main())
    finally:
        if not store.core.closed:
            store.close()
        if not ignore_later_signals:
            for sig, handler in before.items():
                if handler is not None:  # None: not set from Python, nothing to restore
                    signal.signal(sig, handler)
        sys.stdout.flush()
