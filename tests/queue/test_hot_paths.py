"""The hot paths (Core.push_one, deliver_one, remove_one) write exactly what the
general transitions (_states + Core.commit) write, byte for byte.

Two stores get the same operations at the same fake times: one through the
single-message calls that take the hot paths, the other through the batch
forms, which build a Txn from the state machine. Their whole databases, their
in-memory counters and segment accounting must be identical after each step;
the one difference allowed is the ``S`` record a single push leaves behind
(it defers pushes, _seg_accounts.py): what it accounts for once the deferred
pushes are counted must be the same.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest

import qstore
from qstore import _hot, _txn
from qstore.meta import keys, new_batch
from tests.conftest import FakeClock

from ._support import dump


def _pair(tmp_path: Any, **queue: Any) -> tuple[list[qstore.Store], list[qstore.Queue], FakeClock]:
    clock = FakeClock()
    stores = [qstore.open(os.path.join(str(tmp_path), name), clock=clock, compactor=False,
                          durability="none") for name in ("hot", "general")]
    queues = [s.create_queue("q", **queue) for s in stores]
    queues[1]._q.hot_paths = False  # batches through the state machine
    return stores, queues, clock


def _same(stores: list[qstore.Store]) -> None:
    hot, general = (dump(s) for s in stores)
    for d in (hot, general):
        d["db"] = [(k, v) for k, v in d["db"] if not k.startswith(keys.SEGMENT)]
    assert hot == general
    assert stores[0].core.segments == stores[1].core.segments
    assert stores[0].core.stored_segments() == stores[1].core.stored_segments() == \
        stores[0].core.segments


@pytest.mark.parametrize("queue", [{}, {"order": "min"}, {"order": "fifo"},
                                   {"priority_type": "str"}, {"dedup": True}])
def test_hot_paths_write_what_the_state_machine_writes(tmp_path: Any,
                                                       queue: dict[str, Any]) -> None:
    stores, (hot, general), clock = _pair(tmp_path, **queue)
    try:
        prio = "p" if queue.get("priority_type") == "str" else 3
        for i in range(6):
            assert hot.push(b"body %d" % i, prio) == general.push_many([(b"body %d" % i, prio)])[0]
            clock.advance(0.5)
            _same(stores)
        for _ in range(2):
            # pop_many(2) builds one Txn from states.deliver; pop() twice takes deliver_one.
            popped = [hot.pop(lease=10.0), hot.pop(lease=10.0)]
            assert popped == general.pop_many(2, lease=10.0)
            _same(stores)
            clock.advance(1.0)
            for m in popped:
                assert m is not None
                hot.ack(m)
            assert general.ack_many([m.receipt for m in popped if m is not None]) == 2
            _same(stores)
        # A message given back is popped again at its own place, with the same batches.
        m_hot = hot.pop(lease=10.0)
        (m_gen, _) = general.pop_many(2, lease=10.0)
        hot.pop(lease=10.0)
        assert m_hot is not None and m_hot == m_gen
        hot.nack(m_hot)
        general.nack(m_gen)
        _same(stores)
        (again,) = general.pop_many(1, lease=10.0)
        assert again.id == m_hot.id and again.attempts == 2
        assert hot.pop(lease=10.0) == again
        _same(stores)
    finally:
        for s in stores:
            s.close()


@pytest.mark.parametrize("queue", [{}, {"order": "fifo"}, {"priority_type": "str"},
                                   {"dedup": True}, {"ttl": 100.0}])
def test_the_batch_hot_paths_write_what_the_state_machine_writes(
        tmp_path: Any, queue: dict[str, Any], monkeypatch: Any) -> None:
    # Batches that rotate segments (small segments) and move the id high-water
    # mark more than once (a small ID_BLOCK): Core.push_ready, deliver_many and
    # remove_many against states.enqueue, deliver and remove + commit, which
    # the general store is made to take.
    monkeypatch.setattr(_hot, "ID_BLOCK", 7)
    clock = FakeClock()
    stores = [qstore.open(os.path.join(str(tmp_path), name), clock=clock, compactor=False,
                          durability="none", segment_max_bytes=400) for name in ("hot", "general")]
    try:
        hot, general = (s.create_queue("q", **queue) for s in stores)
        general._q.hot_paths = False  # batches through the state machine
        prio = (lambda i: f"p{i % 3}") if queue.get("priority_type") else (lambda i: i % 3)
        for size in (1, 5, 23, 2):
            batch = [(b"body %d %d" % (size, i) * 3, prio(i)) for i in range(size)]
            assert hot.push_many(batch) == general.push_many(batch)
            bodies = [b"plain %d %d" % (size, i) for i in range(size)]
            assert hot.push_many(bodies) == general.push_many(bodies)
            clock.advance(0.5)
            _same(stores)
        for n in (7, 1, 30):
            popped = hot.pop_many(n, lease=5.0)
            assert popped == general.pop_many(n, lease=5.0)
            _same(stores)
            clock.advance(0.5)
            assert hot.ack_many(popped[::2]) == general.ack_many(popped[::2])
            _same(stores)
            for m in popped[1::2]:  # an ack of a record a batch pop left decoded
                hot.ack(m)
                general.ack(m.receipt)
            _same(stores)
        assert stores[0].check().ok
    finally:
        for s in stores:
            s.close()


def test_the_record_cache_stays_bounded_and_right(tmp_path: Any, monkeypatch: Any) -> None:
    """Past its cap the cache keeps the newer half; every read still sees the database."""
    monkeypatch.setattr(_hot, "RECORD_CACHE", 8)
    clock = FakeClock()
    with qstore.open(os.path.join(str(tmp_path), "s"), clock=clock, compactor=False) as s:
        q = s.create_queue("q")
        ids = [q.push(b"m%d" % i, i % 3) for i in range(30)]
        cache = s.core._records
        assert 4 <= len(cache) <= 8
        for key, value in cache.items():  # a push keeps its fields beside the bytes
            assert isinstance(value, tuple)
            assert s.core.meta.get(key) == _hot._from_push(value).encode()
        popped = q.pop_many(30, lease=10.0)
        assert sorted(m.id for m in popped) == ids
        for m in popped[::2]:
            q.nack(m)
        for m in popped[1::2]:
            q.ack(m)
        assert len(s.core._records) <= 8
        m = q.pop(lease=10.0)  # a single pop leaves its record decoded in the cache
        assert m is not None
        for key, value in s.core._records.items():
            if isinstance(value, tuple):
                encoded = _hot._from_push(value).encode()
            else:
                encoded = value if isinstance(value, bytes) else value.encode()
            assert s.core.meta.get(key) == encoded  # nothing cached differs from the database
        assert s.check().ok


@pytest.fixture
def store(tmp_path: Any) -> Iterator[qstore.Store]:
    s = qstore.open(str(tmp_path / "s"), compactor=False, durability="none")
    yield s
    s.close()


class _Recording:
    """A WriteBatch that also keeps the keys it was given, in order."""

    def __init__(self) -> None:
        self.batch = new_batch()
        self.keys: list[bytes] = []
        written.append(self.keys)

    def put(self, key: bytes, value: bytes) -> None:
        self.keys.append(key)
        self.batch.put(key, value)

    def delete(self, key: bytes) -> None:
        self.keys.append(key)
        self.batch.delete(key)

    def delete_range(self, start: bytes, end: bytes) -> None:
        self.keys.append(b"range " + start)
        self.batch.delete_range(start, end)


written: list[list[bytes]] = []


def _record_batches(store: qstore.Store, monkeypatch: Any, module: Any) -> list[list[bytes]]:
    """From now on, the keys of each batch ``module`` makes, in order (a list a batch)."""
    real_write = store.core.meta.write
    monkeypatch.setattr(store.core.meta, "write",
                        lambda b, *a: real_write(getattr(b, "batch", b), *a))
    monkeypatch.setattr(module, "new_batch", _Recording)
    written.clear()
    return written


def _runs(batch_keys: list[bytes]) -> list[list[bytes]]:
    """The keys cut into runs of one table (their first byte), in batch order."""
    return [list(run) for _, run in itertools.groupby(batch_keys, key=lambda k: k[:1])]


@pytest.mark.parametrize("queue", [{}, {"order": "min"}, {"order": "fifo"}])
def test_batch_hot_paths_write_each_table_in_key_order(store: qstore.Store,
                                                       queue: dict[str, Any],
                                                       monkeypatch: Any) -> None:
    # RocksDB's memtable inserts keys in order far cheaper than keys that jump
    # between tables (qstore/_hot.py): a batch's keys go table by table, each
    # table's keys sorted, whatever order the messages were given, popped or
    # acked in.
    q = store.create_queue("q", **queue)
    written = _record_batches(store, monkeypatch, _hot)
    q.push_many([(b"m%d" % i, (i * 7) % 5) for i in range(40)])
    popped = q.pop_many(25, lease=30.0)
    q.ack_many(popped[::-1])  # acked in the reverse of the pop order
    assert len(written) == 3
    for batch_keys in written:
        runs = _runs(batch_keys)
        tables = [run[0][:1] for run in runs]
        assert len(tables) == len(set(tables)), tables  # each table in one run
        for run in runs:
            assert run == sorted(run)
    push, pop, ack = written
    assert sum(len(run) for run in _runs(push) if len(run) == 40) == 80  # message, ready
    assert [len(run) for run in _runs(pop) if len(run) > 1] == [25, 25, 25]
    assert [len(run) for run in _runs(ack) if len(run) > 1] == [25, 25]
    assert len(q.pop_many(40, lease=30.0)) == 15
    assert store.check().ok


def test_an_ordered_txn_sorts_its_keys_and_keeps_what_they_mean(store: qstore.Store,
                                                                monkeypatch: Any) -> None:
    # Txn(ordered=True) holds its operations back and writes them sorted by key
    # (a stable sort: two on one key keep their order); a range delete goes
    # after everything before it and before everything after it.
    written = _record_batches(store, monkeypatch, _txn)
    txn = _txn.Txn(ordered=True)
    txn.put(b"zz-b", b"1")
    txn.delete(b"zz-b")
    txn.put(b"zz-d", b"4")
    txn.put(b"zz-a", b"2")
    txn.put(b"zz-c", b"x")
    txn.delete_range(b"zz-b", b"zz-d")
    txn.put(b"zz-c", b"3")
    txn.put_record(b"zz-e", b"5")
    txn.delete_record(b"zz-a0")
    batch = txn.seal()
    assert written == [[b"zz-a", b"zz-b", b"zz-b", b"zz-c", b"zz-d", b"range zz-b",
                        b"zz-a0", b"zz-c", b"zz-e"]]
    store.core.meta.write(batch)
    got = {k: store.core.meta.get(k) for k in (b"zz-a", b"zz-b", b"zz-c", b"zz-d", b"zz-e")}
    assert got == {b"zz-a": b"2", b"zz-b": None, b"zz-c": b"3", b"zz-d": b"4",
                   b"zz-e": b"5"}
    assert txn.records == [(b"zz-e", b"5"), (b"zz-a0", None)]


def test_a_general_push_many_writes_each_table_in_key_order(store: qstore.Store,
                                                           monkeypatch: Any) -> None:
    # push_many with a TTL or a delay takes the state machine (one Txn, ordered):
    # its message, ready, delayed and expiry keys go table by table, sorted.
    q = store.create_queue("q", order="max")
    written = _record_batches(store, monkeypatch, _txn)
    items = [(b"m%d" % i, (i * 7) % 5) for i in range(30)]
    ids = q.push_many(items, ttl=60.0)
    q.push_many(items, delay=30.0)
    assert len(written) == 2
    for batch_keys, tables in zip(written, ([keys.MESSAGE, keys.READY, keys.EXPIRY],
                                            [keys.MESSAGE, keys.DELAYED]), strict=True):
        for table in tables:
            mine = [i for i, k in enumerate(batch_keys) if k[:1] == table]
            assert len(mine) == 30
            assert mine == list(range(mine[0], mine[0] + 30))  # one run
            run = [batch_keys[i] for i in mine]
            assert run == sorted(run)
    assert [m.id for m in q.pop_many(30, lease=30.0)] == \
        [i for _, i in sorted(((-p, i) for (_, p), i in zip(items, ids, strict=True)))]
    assert store.check().ok
