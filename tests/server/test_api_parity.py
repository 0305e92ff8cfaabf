"""The clients' public methods have the embedded store's names and signatures.

Behaviour is held equal by test_contract.py; this holds the surface equal, so
an option added to ``Store``/``Queue`` fails here until ``qstore.connect`` and
``qstore.aio`` carry it too.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import qstore
import qstore.aio

# Embedded-only: the core is in-process; close is the
# store's own (the clients have close() too, with the same signature).
EMBEDDED_ONLY = {"core"}
CLIENT_ONLY = {"ping"}
SYNC_CLIENT_ONLY = CLIENT_ONLY | {"pipeline"}  # asyncio tasks pipeline on their own
# The embedded compact takes the compactor's keywords (threshold, max_bytes,
# progress); a progress callback cannot cross the wire.
DIFFERENT = {"compact"}


def _public(cls: type) -> dict[str, Any]:
    return {n: v for n, v in vars(cls).items()
            if not n.startswith("_") and callable(v)}


def _params(fn: Any) -> list[tuple[str, Any, Any]]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


PAIRS = [
    (qstore.Store, qstore.Client, EMBEDDED_ONLY, SYNC_CLIENT_ONLY),
    (qstore.Queue, qstore.RemoteQueue, set(), set()),
    (qstore.Store, qstore.aio.AsyncClient, EMBEDDED_ONLY, CLIENT_ONLY),
    (qstore.Queue, qstore.aio.AsyncQueue, set(), set()),
]


@pytest.mark.parametrize(("embedded", "remote", "only_here", "only_there"), PAIRS,
                         ids=lambda v: getattr(v, "__name__", ""))
def test_client_has_the_embedded_methods_and_signatures(
        embedded: type, remote: type, only_here: set[str], only_there: set[str]) -> None:
    mine, theirs = _public(embedded), _public(remote)
    assert set(mine) - only_here == set(theirs) - only_there
    for name, member in mine.items():
        if name in only_here or name in DIFFERENT:
            continue
        assert _params(member) == _params(theirs[name]), name


@pytest.mark.parametrize("remote", [qstore.RemoteQueue, qstore.aio.AsyncQueue])
def test_queue_attributes_are_those_of_the_embedded_queue(remote: type) -> None:
    props = {n for n, v in vars(qstore.Queue).items() if isinstance(v, property)}
    info = {"name": "q", "order": "min", "priority_type": "str", "max_attempts": 3,
            "dedup": True}
    handle = remote(None, info)  # the queue info the server sends; no link is used
    for name in props:
        assert getattr(handle, name) == info[name], name


def test_messages_with_expiry_cross_the_wire() -> None:
    from qstore import _wire as wire

    m = qstore.Message(3, "q", 1, b"x", 2, 10.0, None, None, "dead", expires_at=20.0,
                       dead_reason="expired")
    assert wire.decode_message(wire.unpack(wire.pack(wire.encode_message(m))[4:])) == m
    plain = qstore.Message(4, "q", 1, b"y", 1, 10.0, 40.0, "r", "in_flight")
    assert len(wire.encode_message(plain)) == 9
    assert wire.decode_message(wire.encode_message(plain)) == plain


def test_values_of_a_newer_server_with_more_fields_decode() -> None:
    # Within protocol version 1 the values grow (docs/protocol.md, "Values"): a
    # client that built them from every field it got raised TypeError against a
    # server newer than itself (a cross-version audit).
    from qstore import _wire as wire

    m = qstore.Message(3, "q", 1, b"x", 2, 10.0, None, None, "dead", expires_at=20.0,
                       dead_reason="expired")
    assert wire.decode_message([*wire.encode_message(m), "later", 7]) == m
    stats = qstore.QueueStats("q", 1, 2, 3, 4, 5, expired=6, ttl=7.0, rate=(5, 2.0))
    sent = {**wire.encode_stats(stats), "rate": [5, 2.0], "later": {"x": 1}}
    assert wire.decode_stats(sent) == stats
    store = wire.decode_store_stats({"queues": [sent], "segments": [
        {"file_id": 1, "size": 100, "live_bytes": 50, "live_count": 2, "active": True,
         "later": 0}]})
    assert store.queues == (stats,) and store.segments[0].live_count == 2
    result = wire.decode_compaction({"sealed": None, "segments_read": [1],
                                     "segments_deleted": [1], "output": 2,
                                     "messages_moved": 3, "bytes_copied": 4,
                                     "bytes_freed": 5, "seconds": 0.5, "later": [1]})
    assert (result.segments_read, result.bytes_freed) == ((1,), 5)
    report = wire.decode_check({"findings": [["bad_crc", "q", 1, 2, 3, "d", "later"]],
                                "notes": [], "repairs": [], "queues": 1, "messages": 1,
                                "segments": 1, "payload_bytes": 1, "later": True})
    assert [(f.kind, f.detail) for f in report.findings] == [("bad_crc", "d")]
