"""The server part of ``qstore demo``: many processes on one store through ``qstore serve``.

A server process owns a store; producer processes push through
``qstore.connect`` while consumer processes pop and ack. One more consumer
leases a few messages with a one-hour lease and is SIGKILLed holding them:
the server gives them back at once (not after the hour), the other consumers
take them, and every message is acked exactly once with its exact bytes.
The server then stops on SIGTERM and the store opens embedded.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from ._client import connect
from ._store import open_store

PRODUCERS = 3
CONSUMERS = 2
HELD = 5  # messages the killed consumer holds
QUEUE = "work"
HOUR = 3600.0


def _body(producer: int, k: int) -> bytes:
    """A payload whose bytes the consumer can check from its first line alone."""
    head = b"p%d-%d\n" % (producer, k)
    return head + hashlib.sha256(head).digest() * (1 + k % 64)


def _produce(address: str, producer: int, count: int) -> None:
    with connect(address) as client:
        q = client.queue(QUEUE)
        k = 0
        while k < count:
            n = min(1 + k % 25, count - k)
            q.push_many([(_body(producer, k + j), (k + j) % 10) for j in range(n)])
            k += n


def _hold(address: str, out: Any) -> None:
    client = connect(address)
    q = client.queue(QUEUE)
    got: list[Any] = []
    while len(got) < HELD:  # a waiting pop answers with what is ready, maybe fewer
        got += q.pop_many(HELD - len(got), lease=HOUR, wait=30.0)
    out.put(("held", [m.id for m in got]))
    signal.pause()  # holds its leases until the demo kills it


def _consume(address: str, out: Any, stop: Any) -> None:
    with connect(address) as client:
        q = client.queue(QUEUE)
        while not stop.is_set():
            msgs = q.pop_many(20, lease=60.0, wait=0.2)
            if not msgs:
                continue
            q.ack_many(msgs)
            head = [m.payload.split(b"\n", 1)[0] for m in msgs]
            exact = [_body(*map(int, h[1:].split(b"-"))) == m.payload
                     for h, m in zip(head, msgs, strict=True)]
            out.put(("acked", [(m.id, m.attempts, ok, time.monotonic())
                               for m, ok in zip(msgs, exact, strict=True)]))


def _start_server(store: str) -> tuple[subprocess.Popen[bytes], str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "qstore.cli", "serve", store],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("listening on "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"qstore serve did not start: {line!r}")
    return proc, line[len("listening on "):]


def run_server_part(directory: str, check: Callable[..., bool], say: Callable[[str], None],
                    per_producer: int = 400) -> list[bool]:
    store = os.path.join(directory, "served")
    server, address = _start_server(store)
    say(f"server: {address}; {PRODUCERS} producer and {CONSUMERS} consumer processes, "
        f"one more consumer SIGKILLed holding {HELD} leases of {HOUR:.0f} s")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # The victim reports on a queue of its own: killed, it may still hold the
    # queue's write lock, which would block every other writer of that queue.
    held_out = ctx.Queue()
    stop = ctx.Event()
    procs: list[Any] = []
    results: list[bool] = []
    try:
        with connect(address) as client:
            client.create_queue(QUEUE)
            total = PRODUCERS * per_producer
            producers = [ctx.Process(target=_produce, args=(address, i, per_producer))
                         for i in range(PRODUCERS)]
            victim = ctx.Process(target=_hold, args=(address, held_out))
            procs += [*producers, victim]
            for p in procs:
                p.start()
            kind, held = held_out.get(timeout=60)
            assert kind == "held"
            victim.kill()  # SIGKILL, holding its leases
            killed_at = time.monotonic()
            victim.join(30)
            consumers = [ctx.Process(target=_consume, args=(address, out, stop))
                         for _ in range(CONSUMERS)]
            procs += consumers
            for p in consumers:
                p.start()
            acked: list[tuple[int, int, bool, float]] = []
            deadline = time.monotonic() + 120
            while len(acked) < total and time.monotonic() < deadline:
                with contextlib.suppress(queue_mod.Empty):
                    acked += out.get(timeout=1.0)[1]
            stop.set()
            for p in procs:
                p.join(30)
            st = client.queue(QUEUE).stats()
        ids = [a[0] for a in acked]
        results.append(check("server: every message acked exactly once, by processes",
                             len(ids) == len(set(ids)) == total,
                             f"{len(set(ids)):,} of {total:,}"))
        results.append(check("server: payloads byte-exact", all(a[2] for a in acked)))
        again = {a[0]: a for a in acked if a[0] in set(held)}
        waited = max((a[3] for a in again.values()), default=killed_at) - killed_at
        results.append(check(
            "server: a SIGKILLed consumer's leases were redelivered at once",
            len(held) == HELD and set(again) == set(held)
            and all(a[1] == 2 for a in again.values()) and waited < HOUR / 2,
            f"{len(again)} of {len(held)} redelivered with attempts 2, last acked "
            f"{waited:.2f} s after the kill (lease: {HOUR:.0f} s)"))
        results.append(check("server: counters match", st.total == 0 and st.in_flight == 0))
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        with open_store(store, compactor=False) as embedded:
            left = embedded.queue(QUEUE).stats().total
        results.append(check("server: SIGTERM stops it cleanly; the store opens embedded",
                             code == 0 and left == 0, f"exit {code}"))
    finally:
        stop.set()
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(30)
        if server.poll() is None:
            server.kill()
        server.wait(30)
        for f in (server.stdout, server.stderr):
            if f is not None:
                f.close()
    return results
