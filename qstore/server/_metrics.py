"""Prometheus metrics of a running server (``qstore serve --metrics-port P``).

Through ``prometheus_client``, on a registry of the server's own (never the
process-global one), served over HTTP by the library's own thread:

- ``qstore_requests_total{op,outcome}`` and ``qstore_request_seconds{op}``
  (a histogram: a waiting pop counts from its arrival to its answer; an op
  the protocol does not have counts as ``op="unknown"``);
- ``qstore_connections`` (open now);
- ``qstore_queue_messages{queue,state}`` and ``qstore_queue_bytes{queue}``,
  read from the store at each scrape;
- ``qstore_syncs_total`` and ``qstore_sync_seconds_total`` (durability syncs
  and the time they took), ``qstore_disk_bytes``, ``qstore_live_bytes`` and
  ``qstore_garbage_ratio`` (what compaction works on);
- ``qstore_compaction_passes_total``, ``..._failed_passes_total``,
  ``..._messages_moved_total``, ``..._bytes_freed_total`` and
  ``..._seconds_total`` (the passes since the server opened the store, read
  from the store's compactor at each scrape; each pass's ``bytes_freed`` is
  never negative, so that counter never goes down);
- ``qstore_leases_held`` (leases handed to open connections, not settled and
  not run out: what goes back to ready if their clients go away);
- ``qstore_connections_refused_total{reason}`` (connections the server closed
  with an error: ``auth`` a wrong or missing token, ``protocol`` a bad
  handshake or frame, ``busy`` over ``--max-connections``, ``evicted`` closed
  without a handshake to make room, ``no_handshake`` none in time, ``error``
  anything else), ``qstore_waiting_pops`` (pops parked now),
  ``qstore_queue_expired_total{queue}`` (messages a TTL ended) and
  ``qstore_space_low`` (1 while pushes are refused on a nearly full disk).
"""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .. import _wire as wire
from .._store import Store

# A request's op is a label value only if the protocol has it: an unknown op is
# counted as "unknown" (any string a client sends made a series and a histogram
# of its own, kept for the life of the process: 2,000 made-up names made a 12 MB
# scrape; an operations audit).
KNOWN_OPS = wire.QUEUE_OPS | wire.STORE_OPS | {"cancel"}

_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
            0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _StoreCollector(Collector):
    def __init__(self, store: Store) -> None:
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        store = self._store
        if store.core.closed:
            return
        stats = store.stats()
        depth = GaugeMetricFamily("qstore_queue_messages", "Messages by queue and state",
                                  labels=["queue", "state"])
        size = GaugeMetricFamily("qstore_queue_bytes", "Payload bytes by queue",
                                 labels=["queue"])
        expired = CounterMetricFamily("qstore_queue_expired", "Messages a TTL ended, by queue",
                                      labels=["queue"])
        for q in stats.queues:
            for state in ("ready", "delayed", "in_flight", "dead"):
                depth.add_metric([q.queue, state], getattr(q, state))
            size.add_metric([q.queue], q.bytes)
            expired.add_metric([q.queue], q.expired)
        yield depth
        yield size
        yield expired
        yield GaugeMetricFamily("qstore_space_low",
                                "1 while pushes are refused on a nearly full disk",
                                value=1 if store.core.space_low else 0)
        syncer = store.core.syncer
        yield CounterMetricFamily("qstore_syncs", "Durability syncs (WAL and payload)",
                                  value=syncer.syncs)
        yield CounterMetricFamily("qstore_sync_seconds", "Time spent in those syncs",
                                  value=syncer.sync_seconds)
        c = store.compactor
        if c is not None:
            yield CounterMetricFamily("qstore_compaction_passes", "Compaction passes done",
                                      value=c.passes)
            yield CounterMetricFamily("qstore_compaction_failed_passes",
                                      "Compaction passes that failed (rolled back)",
                                      value=c.failed_passes)
            yield CounterMetricFamily("qstore_compaction_messages_moved",
                                      "Live messages rewritten by compaction",
                                      value=c.messages_moved)
            yield CounterMetricFamily("qstore_compaction_bytes_freed",
                                      "Disk bytes compaction gave back", value=c.bytes_freed)
            yield CounterMetricFamily("qstore_compaction_seconds",
                                      "Time spent in compaction passes", value=c.seconds)
        yield GaugeMetricFamily("qstore_disk_bytes", "Payload segment bytes on disk",
                                value=stats.disk_bytes)
        yield GaugeMetricFamily("qstore_live_bytes", "Payload bytes still referenced",
                                value=stats.live_bytes)
        yield GaugeMetricFamily("qstore_garbage_ratio", "Dead over all payload bytes",
                                value=stats.garbage_ratio)


class Metrics:
    def __init__(self, store: Store) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("qstore_requests", "Requests answered", ["op", "outcome"],
                                registry=r)
        self.latency = Histogram("qstore_request_seconds", "Request time in the server",
                                 ["op"], buckets=_BUCKETS, registry=r)
        self.connections = Gauge("qstore_connections", "Open client connections", registry=r)
        self.leases_held = Gauge("qstore_leases_held",
                                 "Leases handed to open connections and not settled",
                                 registry=r)
        self.refused = Counter("qstore_connections_refused",
                               "Connections closed with an error (auth, protocol, busy, error)",
                               ["reason"], registry=r)
        self.waiting_pops = Gauge("qstore_waiting_pops", "Pops parked waiting for a message",
                                  registry=r)
        r.register(_StoreCollector(store))

    def request(self, op: str, seconds: float, ok: bool) -> None:
        if op not in KNOWN_OPS:
            op = "unknown"
        self.requests.labels(op, "ok" if ok else "error").inc()
        self.latency.labels(op).observe(seconds)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Serve /metrics over HTTP on ``host:port`` (prometheus_client's WSGI app, in
        a daemon thread, at most MAX_SCRAPERS connections at once)."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server = type("_Server", (_MetricsServer,), {"address_family": family})
        httpd: WSGIServer = make_server(host, port, make_wsgi_app(self.registry), server,
                            handler_class=_MetricsHandler)
        threading.Thread(target=httpd.serve_forever, name="qstore-metrics", daemon=True).start()


# prometheus_client's own server (start_http_server) starts a thread for each
# connection and keeps it while the connection stays open: any local user could
# pile up threads in the queue server's process, 800 idle connections 800
# threads (a security audit). Here a connection that sends nothing for
# SCRAPE_TIMEOUT is closed, and past MAX_SCRAPERS at once a new one is closed
# at once (a scraper retries at its next interval).
MAX_SCRAPERS = 16
SCRAPE_TIMEOUT = 10.0


class _MetricsHandler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a line per scrape on stderr, as prometheus_client's handler avoids too


class _MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_SCRAPERS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: closed, no thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a timed-out or dropped scraper: no traceback on stderr
