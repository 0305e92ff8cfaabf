"""Snapshots shared by the Spark tests: a store with every message state, and its snapshot."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

import qstore
from tests.conftest import FakeClock


@dataclass(frozen=True)
class Snap:
    """A snapshot and what the store said at the moment it was taken."""

    path: str
    stats: dict[str, qstore.QueueStats]
    payloads: dict[tuple[str, int], bytes]  # (queue, id) -> payload


def populate(store: qstore.Store) -> dict[tuple[str, int], bytes]:
    """Messages in every state, int and str priorities, dedup keys, several segments."""
    payloads: dict[tuple[str, int], bytes] = {}

    def push_many(q: qstore.Queue, items: list[tuple[Any, ...]]) -> None:
        for mid, item in zip(q.push_many(items), items, strict=True):
            payloads[(q.name, mid)] = item[0]

    jobs = store.create_queue("jobs", max_attempts=3)
    push_many(jobs, [(b"job %d " % i + b"x" * (i * 7 % 90), i % 10) for i in range(60)])
    push_many(jobs, [(b"later %d" % i, 5, 100.0) for i in range(3)])  # delayed
    leased = jobs.pop_many(6, lease=30.0)  # in flight
    jobs.ack_many(leased[:2])
    for m in leased[:2]:
        del payloads[("jobs", m.id)]
    jobs.nack(leased[2], delay=50.0)  # delayed again
    tags = store.create_queue("tags", order="min", priority_type="str", dedup=True)
    push_many(tags, [(b"tag %d" % i, f"p{i % 3}") for i in range(12)])
    # dedup: its dead letter keeps its digest but owns no k key (the audit must agree)
    poison = store.create_queue("poison", max_attempts=1, dedup=True)
    push_many(poison, [(b"poison", 1), (b"fine", 0)])
    dead = poison.pop()
    assert dead is not None
    poison.nack(dead)  # attempts reached max_attempts: a dead letter
    store.create_queue("empty")
    return payloads


@pytest.fixture(scope="session")
def clean_snap(tmp_path_factory: pytest.TempPathFactory) -> Snap:
    base = tmp_path_factory.mktemp("clean")
    with qstore.open(os.path.join(base, "store"), clock=FakeClock(), compactor=False,
                     segment_max_bytes=1024) as store:
        payloads = populate(store)
        stats = {name: store.queue(name).stats() for name in store.queues()}
        path = store.snapshot(os.path.join(base, "snap"))
    return Snap(path, stats, payloads)
