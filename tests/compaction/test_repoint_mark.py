"""A repoint chunk takes the scanned records as they are only while nothing else wrote.

The scan's view and the metadata's write mark are taken together under the
writer lock; the pass's own batches move the mark on. A chunk that finds the
mark unchanged writes the new records without reading them again; once
anything else wrote, every later chunk reads its records again and compares
(the compare-and-set of test_cas.py). These tests count the reads and race
changes against the chunks of a pass.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qstore
from qstore import _compact
from tests.conftest import FakeClock

from ._support import body, compaction_record, open_store, recount

N = 8
CHUNK = 2  # REPOINT_CHUNK in these tests: N messages are 4 chunks


def count_rereads(store: qstore.Store, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many records each multi_get of the store reads (the compare-and-set's rereads)."""
    calls: list[int] = []
    real = store.core.meta.multi_get

    def multi_get(keys: list[bytes]) -> list[bytes | None]:
        calls.append(len(keys))
        return real(keys)

    monkeypatch.setattr(store.core.meta, "multi_get", multi_get)
    return calls


def act_at(monkeypatch: pytest.MonkeyPatch, actions: dict[int, Callable[[], None]]) -> None:
    """Run ``actions[k]`` once k repoint chunks are committed (0: at the "copied" step)."""
    done = [0]

    def hook(step: str) -> None:
        if step == "repointed_chunk":
            done[0] += 1
        elif step != "copied":
            return
        action = actions.pop(done[0], None)
        if action is not None:
            action()

    monkeypatch.setattr(_compact, "step_hook", hook)


def setup(store_path: str, clock: Any) -> tuple[qstore.Store, qstore.Queue, list[int]]:
    store = open_store(store_path, clock)
    q = store.create_queue("q", order="fifo", max_attempts=5)
    ids = [q.push(body(i, 1000)) for i in range(N)]
    return store, q, ids


def compact_all(store: qstore.Store, calls: list[int] | None = None) -> qstore.CompactionResult:
    """One pass; ``calls`` keeps only the rereads of the pass (the checks after read too)."""
    result = store.compact(threshold=0.0)
    pass_calls = list(calls or [])
    assert result.output is not None
    assert compaction_record(store) is None
    assert recount(store) == []
    assert store.check().ok
    if calls is not None:
        calls[:] = pass_calls
    return result


def test_an_idle_pass_reads_no_record_again(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, q, ids = setup(store_path, clock)
    calls = count_rereads(store, monkeypatch)

    result = compact_all(store, calls)

    assert result.messages_moved == N
    assert calls == []
    assert [q.get(mid).payload for mid in ids] == [body(i, 1000) for i in range(N)]
    store.close()


def test_a_write_before_the_first_chunk_makes_every_chunk_read_its_records_again(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, q, ids = setup(store_path, clock)
    other = store.create_queue("other")
    monkeypatch.setattr(_compact, "REPOINT_CHUNK", CHUNK)
    calls = count_rereads(store, monkeypatch)
    act_at(monkeypatch, {0: lambda: other.push(b"unrelated")})

    result = compact_all(store, calls)

    assert result.messages_moved == N
    assert calls == [CHUNK] * (N // CHUNK)
    store.close()


def test_a_message_acked_between_chunks_is_not_resurrected(
    store_path: str, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, q, ids = setup(store_path, clock)
    popped = q.pop_many(N)
    by_id = {m.id: m for m in popped}
    monkeypatch.setattr(_compact, "REPOINT_CHUNK", CHUNK)
    calls = count_rereads(store, monkeypatch)
    # After the first chunk went in without a reread: ack a message of the last
    # chunk, nack one of the third (its record changes, its payload stays).
    act_at(monkeypatch, {1: lambda: (q.ack(by_id[ids[-1]]), q.nack(by_id[ids[4]], delay=60.0))})

    result = compact_all(store, calls)

    assert calls == [CHUNK] * (N // CHUNK - 1)  # every chunk after the first
    assert result.messages_moved == N - 1
    with pytest.raises(qstore.MessageNotFound):
        q.get(ids[-1])
    nacked = q.get(ids[4])
    assert nacked.payload == body(4, 1000)
    assert q.stats().delayed == 1
    assert q.stats().total == N - 1
    store.close()


_ACTIONS = st.sampled_from(["ack", "nack", "extend", "none"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.lists(st.tuples(st.integers(0, N // CHUNK), st.integers(0, N - 1), _ACTIONS),
                     max_size=6))
def test_changes_raced_against_any_chunk_are_never_undone(
    plan: list[tuple[int, int, str]]
) -> None:
    """Acks, nacks and lease extensions at any point of the repoint: the pass undoes none.

    A model of each message (gone, leased or delayed) is kept as the actions
    run; after the pass every message reads back as the model says, with its
    payload, and the store recounts and checks clean.
    """
    mp = pytest.MonkeyPatch()
    with tempfile.TemporaryDirectory() as tmp, mp.context() as m:
        store, q, ids = setup(os.path.join(tmp, "store"), FakeClock())
        try:
            check_race(store, q, ids, plan, m)
        finally:
            store.close()


def check_race(store: qstore.Store, q: qstore.Queue, ids: list[int],
           plan: list[tuple[int, int, str]], m: pytest.MonkeyPatch) -> None:
    held = {msg.id: msg for msg in q.pop_many(N, lease=30.0)}
    model = {mid: "leased" for mid in ids}
    m.setattr(_compact, "REPOINT_CHUNK", CHUNK)

    def act(index: int, what: str) -> None:
        mid = ids[index]
        if model[mid] != "leased" or what == "none":
            return
        if what == "ack":
            q.ack(held[mid])
            model[mid] = "gone"
        elif what == "nack":
            q.nack(held[mid], delay=600.0)
            model[mid] = "delayed"
        else:
            held[mid] = q.extend(held[mid], lease=300.0)

    actions: dict[int, list[tuple[int, str]]] = {}
    for at, index, what in plan:
        actions.setdefault(at, []).append((index, what))
    act_at(m, {at: (lambda todo=todo: [act(i, w) for i, w in todo])
               for at, todo in actions.items()})

    result = compact_all(store)

    live = [mid for mid in ids if model[mid] != "gone"]
    assert result.messages_moved <= N
    for i, mid in enumerate(ids):
        if model[mid] == "gone":
            with pytest.raises(qstore.MessageNotFound):
                q.get(mid)
        else:
            assert q.get(mid).payload == body(i, 1000)
    stats = q.stats()
    assert stats.total == len(live)
    assert stats.delayed == sum(model[mid] == "delayed" for mid in live)
    assert stats.in_flight == sum(model[mid] == "leased" for mid in live)
    # Every surviving message now lives in the output (nothing was left behind).
    assert {s.file_id for s in store.stats().segments if s.live_count} <= {
        result.output, store.core.payload.active_id}
