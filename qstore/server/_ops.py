"""What each request does to the store (runs in the store thread, _worker.py).

A request names an operation and passes its keyword arguments as a map; the
operation is the embedded :class:`~qstore.Store` or :class:`~qstore.Queue`
method of that name, so arguments are checked by the same code and raise
the same errors as in-process. Results are encoded by :mod:`qstore._wire`.

Each connection has a :class:`Leases` table of the receipts it was handed and
has not settled; when the connection ends they are nacked at once (attempts
kept, as when a lease expires), unless the client asked to keep them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .. import _wire as wire
from .._errors import InvalidArgument, LeaseExpired, MessageNotFound, QueueNotFound
from .._message import Message
from .._queue import MAX_SECONDS, Queue
from .._store import Store

PARK = object()  # a pop with wait that found nothing: the server parks it


class Leases:
    """Receipts handed to one connection and not yet acked or nacked through it."""

    def __init__(self) -> None:
        self.held: dict[str, str] = {}  # receipt -> queue name

    def took(self, queue: str, msgs: list[Message]) -> None:
        for m in msgs:
            if m.receipt is not None:
                self.held[m.receipt] = queue

    def release(self, store: Store) -> int:
        """Nack every lease still held (store thread); returns how many went back."""
        back = 0
        held, self.held = self.held, {}
        for receipt, name in held.items():
            try:
                store.queue(name).nack(receipt)
                back += 1
            except (LeaseExpired, MessageNotFound, QueueNotFound):
                pass  # acked through another connection, expired, or the queue is gone
        return back


def _wait(args: dict[str, Any]) -> float:
    wait = args.pop("wait", 0.0)
    if (isinstance(wait, bool) or not isinstance(wait, (int, float)) or not math.isfinite(wait)
            or not 0 <= wait <= MAX_SECONDS):
        raise InvalidArgument(f"wait must be a finite number of seconds >= 0, not {wait!r}")
    return float(wait)


def _receipt(args: dict[str, Any], key: str = "receipt") -> Any:
    if key not in args:
        raise InvalidArgument(f"missing argument {key!r}")
    return args.pop(key)


def queue_op(store: Store, leases: Leases, op: str, args: dict[str, Any], *,
             parked: bool = False) -> Any:
    """Run queue operation ``op``; a pop that should wait returns :data:`PARK`."""
    name = args.pop("queue", None)
    if not isinstance(name, str):
        raise InvalidArgument("a queue operation needs args['queue'], a str")
    q = store.queue(name)
    try:
        return _QUEUE_OPS[op](q, leases, args, parked)
    except TypeError as exc:  # an unknown or missing keyword argument
        raise InvalidArgument(f"{op}: {exc}") from None


def _pop(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    wait = _wait(args)
    got = q.pop_many(1, **args)
    if not got:
        return PARK if wait and not parked else None
    leases.took(q.name, got)
    return wire.encode_message(got[0])


def _pop_many(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    wait = _wait(args)
    got = q.pop_many(**args)
    if not got:
        return PARK if wait and not parked else []
    leases.took(q.name, got)
    return [wire.encode_message(m) for m in got]


def _ack(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    receipt = _receipt(args)
    q.ack(receipt, **args)
    leases.held.pop(receipt, None)


def _ack_many(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    receipts = _receipt(args, "receipts")
    n = q.ack_many(receipts, **args)
    for r in receipts:
        if isinstance(r, str):
            leases.held.pop(r, None)
    return n


def _nack(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    receipt = _receipt(args)
    q.nack(receipt, **args)
    leases.held.pop(receipt, None)


def _extend(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    return wire.encode_message(q.extend(_receipt(args), **args))


def _listing(method: str) -> Callable[[Queue, Leases, dict[str, Any], bool], Any]:
    def run(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
        return [wire.encode_message(m) for m in getattr(q, method)(**args)]
    return run


def _plain(method: str) -> Callable[[Queue, Leases, dict[str, Any], bool], Any]:
    def run(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
        return getattr(q, method)(**args)
    return run


def _get(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    return wire.encode_message(q.get(**args))


def _stats(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    return wire.encode_stats(q.stats(**args))


def _info(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    return queue_info(q)


def queue_info(q: Queue) -> dict[str, Any]:
    return {"name": q.name, "order": q.order, "priority_type": q.priority_type,
            "max_attempts": q.max_attempts, "dedup": q.dedup}


_QUEUE_OPS: dict[str, Callable[[Queue, Leases, dict[str, Any], bool], Any]] = {
    "push": _plain("push"),
    "push_many": _plain("push_many"),
    "pop": _pop,
    "pop_many": _pop_many,
    "ack": _ack,
    "ack_many": _ack_many,
    "nack": _nack,
    "extend": _extend,
    "peek": _listing("peek"),
    "get": _get,
    "dead_letters": _listing("dead_letters"),
    "redrive": _plain("redrive"),
    "purge": _plain("purge"),
    "stats": _stats,
    "queue": _info,
}
assert set(_QUEUE_OPS) == wire.QUEUE_OPS


def store_op(store: Store, op: str, args: dict[str, Any]) -> Any:
    """Run store operation ``op`` (``compact`` and ``snapshot`` may take long)."""
    try:
        if op == "create_queue":
            return queue_info(store.create_queue(**args))
        if op == "configure_queue":
            name = args.pop("name", None)
            return queue_info(store.configure_queue(name, **args))
        if op == "queues":
            return store.queues(**args)
        if op == "delete_queue":
            return store.delete_queue(**args)
        if op == "store_stats":
            return wire.encode_store_stats(store.stats(**args))
        if op == "compact":
            return wire.encode_compaction(store.compact(**args))
        if op == "snapshot":
            return store.snapshot(**args)
        if op == "ping":
            return None
    except TypeError as exc:
        raise InvalidArgument(f"{op}: {exc}") from None
    raise InvalidArgument(f"unknown operation {op!r}")

