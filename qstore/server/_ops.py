"""What each request does to the store (runs in the store thread, _worker.py).

A request names an operation and passes its keyword arguments as a map; the
operation is the embedded :class:`~qstore.Store` or :class:`~qstore.Queue`
method of that name, so arguments are checked by the same code and raise
the same errors as in-process. Results are encoded by :mod:`qstore._wire`.

Each connection has a :class:`Leases` table of the receipts it was handed and
that were not settled since (through it or another connection: the server's
:class:`LeaseBook`); when the connection ends they are nacked at once
(attempts kept, as when a lease expires), unless the client asked to keep
them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from .. import _wire as wire
from .._errors import (
    InvalidArgument,
    LeaseExpired,
    MessageNotFound,
    QStoreError,
    QueueNotFound,
)
from .._queue import MAX_SECONDS, Queue
from .._store import Store
from ..meta import keys

PARK = object()  # a pop with wait that found nothing: the server parks it
# The lease book drops expired receipts once it holds more than this many and
# has doubled since it last did (LeaseBook.sweep).
SWEEP_MIN = 10_000


class LeaseBook:
    """Which connection's table holds each receipt handed out and not settled (one
    per server).

    A receipt may be acked or nacked through any connection (threads sharing a
    client use several), so settling one drops it from the table of the
    connection that popped it, not only from the settling one's; and a message
    delivered again (its lease ran out) drops its earlier receipt, which can
    no longer be settled. A table then holds only leases its connection may
    still hand back: it does not grow with work settled elsewhere.


    A message can also leave its lease without a settle: its lease runs out
    and the timers make it a dead letter, or it is purged or its queue
    deleted. Such a receipt can never be given back (a nack of it raises),
    so once the book has doubled since it last looked, it drops every
    receipt whose lease deadline has passed (``clock``: the store's). The
    book stays within about twice the leases that are live.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.owner: dict[str, Leases] = {}  # receipt -> the table that holds it
        self.latest: dict[tuple[str, int], str] = {}  # (queue, id) -> its newest receipt
        self.clock = clock
        self.sweep_above = SWEEP_MIN  # the size at which hold() next drops expired leases

    def settle(self, receipt: str) -> None:
        """``receipt`` was acked or nacked, through whichever connection."""
        owner = self.owner.pop(receipt, None)
        if owner is not None:
            key = owner.held.pop(receipt)[:2]
            if self.latest.get(key) == receipt:
                del self.latest[key]

    def extended(self, receipt: str, deadline: float) -> None:
        """``receipt``'s lease now runs to ``deadline`` (an extend, through any connection)."""
        owner = self.owner.get(receipt)
        held = None if owner is None else owner.held.get(receipt)
        if held is not None:
            owner.held[receipt] = (held[0], held[1], deadline)  # type: ignore[union-attr]

    def forget_queue(self, queue: str) -> None:
        """Drop the receipts of ``queue``, just purged or deleted: none can be settled
        any more, and with long leases they stayed until their deadlines (about
        1 KB each; a resource audit). One pass over the book: purges and deletes
        are rare, and a per-queue index would cost every pop."""
        # A copy first, as in sweep: the store thread may run this while the loop
        # changes the book.
        for receipt in [r for (name, _), r in list(self.latest.items()) if name == queue]:
            self.settle(receipt)

    def live(self) -> int:
        """How many receipts still hold their lease (the deadline not passed): the
        ``qstore_leases_held`` gauge, read from the metrics thread (copies first).
        The book keeps run-out ones until its next sweep: counted, they showed 300
        leases held for messages ready again (an observability audit)."""
        now = self.clock()
        n = 0
        for receipt, owner in list(self.owner.items()):
            held = owner.held.get(receipt)
            if held is not None and held[2] > now:
                n += 1
        return n

    def sweep(self) -> int:
        """Drop every receipt whose lease deadline has passed; returns how many."""
        now = self.clock()
        # A copy first: with durability="always" a closing connection forgets its
        # leases on the event loop while this runs in the store thread.
        gone = []
        for receipt, owner in list(self.owner.items()):
            held = owner.held.get(receipt)
            if held is not None and held[2] <= now:
                gone.append(receipt)
        for receipt in gone:
            self.settle(receipt)
        self.sweep_above = max(SWEEP_MIN, 2 * len(self.owner))
        return len(gone)


class Leases:
    """Receipts handed to one connection and not yet settled (through any connection)."""

    def __init__(self, book: LeaseBook) -> None:
        self.book = book
        # receipt -> (queue name, message id, lease deadline)
        self.held: dict[str, tuple[str, int, float]] = {}
        # What release gave back: leases, and of them, messages that went to the
        # dead letters (their last attempt); the server logs both.
        self.given_back = 0
        self.buried = 0

    def hold(self, queue: str, fields: tuple[Any, ...]) -> tuple[Any, ...]:
        """Hold the receipt of a popped message given as its wire fields (encoded
        first: a pop's receipt is written when read); returns ``fields``."""
        receipt, key = fields[7], (queue, fields[0])
        book = self.book
        earlier = book.latest.get(key)
        if earlier is not None:  # delivered before: that receipt is void now
            book.settle(earlier)
        book.latest[key] = receipt
        owner = book.owner
        owner[receipt] = self
        self.held[receipt] = (queue, fields[0], fields[6])
        if len(owner) > book.sweep_above:
            book.sweep()
        return fields

    def forget(self) -> None:
        """Take every receipt off the table and the book, nacking none (a
        connection that keeps its leases, or whose release failed, has ended)."""
        settle = self.book.settle
        for receipt in list(self.held):
            settle(receipt)

    def release(self, store: Store, most: int) -> int:
        """Nack up to ``most`` of the leases still held (store thread); returns how
        many it took off the table (the caller repeats until none is held)."""
        taken = list(itertools.islice(self.held, most))
        given, buried = self.give_back(store, taken)
        self.given_back += given
        self.buried += buried
        return len(taken)

    def give_back(self, store: Store, receipts: Iterable[str]) -> tuple[int, int]:
        """Take ``receipts`` (those still held) off the table and nack them; how many
        were given back, and how many of those went to the dead letters."""
        held = self.held
        given = buried = 0
        for receipt in receipts:
            lease = held.get(receipt)
            if lease is None:
                continue
            self.book.settle(receipt)
            # Expired, dead-lettered, or the queue is gone (InvalidArgument: its name
            # now belongs to a queue created since, which the receipt is not of):
            # nothing to give back. Raising here would leave every lease after
            # this one held until its deadline.
            with contextlib.suppress(LeaseExpired, MessageNotFound, QueueNotFound,
                                     InvalidArgument):
                q = store.queue(lease[0])
                q.nack(receipt)
                given += 1
                # That was its last attempt? Its dead-letter key says, with no read of
                # the body (get() copied each one: 50 times slower for 16 MiB ones).
                dead = keys.dead_key(q._q.qid, lease[1])
                with contextlib.suppress(QStoreError):
                    if store.core.meta.get(dead) is not None:
                        buried += 1
        return given, buried


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
    q = _queue_of(store, name, args.pop("qid", None))
    try:
        return _QUEUE_OPS[op](q, leases, args, parked)
    except TypeError as exc:  # an unknown or missing keyword argument
        raise InvalidArgument(f"{op}: {exc}") from None


def _pop(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    wait = _wait(args)
    got = q.pop_many(1, **args)
    if not got:
        return PARK if wait and not parked else None
    return leases.hold(q.name, wire.encode_message(got[0]))


def _pop_many(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    wait = _wait(args)
    got = q.pop_many(**args)
    if not got:
        return PARK if wait and not parked else []
    name = q.name
    return [leases.hold(name, wire.encode_message(m)) for m in got]


def _purge(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    n = q.purge(**args)
    leases.book.forget_queue(q.name)
    return n


def _ack(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    receipt = _receipt(args)
    q.ack(receipt, **args)
    if type(receipt) is str:
        leases.book.settle(receipt)


def _ack_many(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    receipts = _receipt(args, "receipts")
    n = q.ack_many(receipts, **args)
    settle = leases.book.settle
    for r in receipts:
        if type(r) is str:
            settle(r)
    return n


def _nack(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    receipt = _receipt(args)
    q.nack(receipt, **args)
    if type(receipt) is str:
        leases.book.settle(receipt)


def _extend(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    receipt = _receipt(args)
    m = q.extend(receipt, **args)
    if type(receipt) is str and m.lease_deadline is not None:
        leases.book.extended(receipt, m.lease_deadline)
    return wire.encode_message(m)


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


def _no_args(op: str, args: dict[str, Any]) -> None:
    if args:  # what a Python call with an unknown keyword raises
        raise InvalidArgument(f"{op}: unexpected argument(s) {', '.join(map(repr, args))}")


def _info(q: Queue, leases: Leases, args: dict[str, Any], parked: bool) -> Any:
    _no_args("queue", args)
    return queue_info(q)


def queue_info(q: Queue) -> dict[str, Any]:
    return {"name": q.name, "order": q.order, "priority_type": q.priority_type,
            "max_attempts": q.max_attempts, "dedup": q.dedup, "qid": q._q.qid}


def _queue_of(store: Store, name: str, qid: object) -> Queue:
    """Queue ``name``; with ``qid`` (a client's handle sends the id its queue_info
    gave), ``QueueNotFound`` once that queue was deleted, even if a queue of the
    same name was created since: as an embedded handle of a deleted queue."""
    q = store.queue(name)
    if qid is not None and qid != q._q.qid:
        raise QueueNotFound(name)
    return q


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
    "purge": _purge,
    "stats": _stats,
    "queue": _info,
}
assert set(_QUEUE_OPS) == wire.QUEUE_OPS


# -- rounds: consecutive single pops or acks of one queue run as one batch ---------

_POP_KEYS = frozenset({"queue", "lease", "wait", "qid"})
_ACK_KEYS = frozenset({"queue", "receipt", "qid"})


def group_key(op: str, args: dict[str, Any]) -> tuple[Any, ...] | None:
    """What a request must share with its neighbours to run in one batch with them.

    Only plain ``pop`` (same queue and lease, a valid wait) and ``ack`` (same
    queue, a str receipt) requests group; anything unusual runs on its own, so
    its error is exactly the embedded one.
    """
    if op == "pop":
        if args.keys() <= _POP_KEYS and type(args.get("queue")) is str:
            lease, wait = args.get("lease", 30.0), args.get("wait", 0.0)
            # An int lease too (pop(lease=30) sends 30): it grouped only as a float.
            if (type(lease) in (int, float) and 0 < lease <= MAX_SECONDS
                    and type(wait) in (int, float) and 0 <= wait <= MAX_SECONDS):
                return ("pop", args["queue"], float(lease), args.get("qid"))
    elif (op == "ack" and args.keys() <= _ACK_KEYS and type(args.get("queue")) is str
          and type(args.get("receipt")) is str):
        return ("ack", args["queue"], args.get("qid"))
    return None


def pop_group(store: Store, name: str, lease: float, qid: object,
              takers: list[Leases]) -> list[Any]:
    """``len(takers)`` pops in a row as one ``pop_many``: the i-th gets the i-th message.

    A pop past the end gets None, as the same pops one after another would.
    """
    got = _queue_of(store, name, qid).pop_many(len(takers), lease=lease)
    out: list[Any] = [None] * len(takers)
    for i, m in enumerate(got):
        out[i] = takers[i].hold(name, wire.encode_message(m))
    return out


def ack_group(store: Store, name: str, qid: object, receipts: list[str],
              takers: list[Leases]) -> None:
    """Acks in a row as one ``ack_many``: all or nothing, so on an error the caller
    runs them one by one to give each its own answer."""
    _queue_of(store, name, qid).ack_many(receipts)
    settle = takers[0].book.settle
    for r in receipts:
        settle(r)


def store_op(store: Store, op: str, args: dict[str, Any], book: LeaseBook | None = None) -> Any:
    """Run store operation ``op`` (``compact`` and ``snapshot`` may take long);
    ``book``: the server's, which forgets the receipts of a deleted queue."""
    try:
        if op == "create_queue":
            return queue_info(store.create_queue(**args))
        if op == "configure_queue":
            name = args.pop("name", None)
            return queue_info(store.configure_queue(name, **args))
        if op == "queues":
            return store.queues(**args)
        if op == "delete_queue":
            name = args.get("name")
            store.delete_queue(**args)
            if book is not None and isinstance(name, str):
                book.forget_queue(name)
            return None
        if op == "store_stats":
            return wire.encode_store_stats(store.stats(**args))
        if op == "compact":
            return wire.encode_compaction(store.compact(**args))
        if op == "snapshot":
            # The clients send an absolute path (through a unix socket they make
            # a relative one absolute); a relative one would be the server's cwd.
            dest = args.get("dest")
            if not isinstance(dest, str) or not os.path.isabs(dest):
                raise InvalidArgument(f"snapshot needs dest, an absolute path on the "
                                      f"server's machine, not {dest!r:.100}")
            return store.snapshot(**args)
        if op == "check":
            return wire.encode_check(store.check(**args))
        if op == "backfill":  # Spark in this process: loaded only for a backfill
            from ..spark.backfill import serve_backfill

            return serve_backfill(store, args)
        if op == "ping":
            _no_args(op, args)
            return None
    except TypeError as exc:
        raise InvalidArgument(f"{op}: {exc}") from None
    raise InvalidArgument(f"unknown operation {op!r}")

