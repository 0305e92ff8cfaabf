"""Shared fixtures: an injectable clock, store factories, and one SparkSession per run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

import qstore


class FakeClock:
    """A clock the test moves by hand: no test sleeps to let time pass."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store_path(tmp_path: Any) -> str:
    return os.path.join(str(tmp_path), "store")


@pytest.fixture
def store(store_path: str, clock: FakeClock) -> Iterator[qstore.Store]:
    s = qstore.open(store_path, clock=clock, compactor=False)
    yield s
    s.close()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local SparkSession for the whole test run (Spark tests are marked `spark`)."""
    from qstore.spark import get_session

    session = get_session("local[2]", "qstore-tests", fast_start=True,
                          extra={"spark.sql.shuffle.partitions": "2"})
    yield session
    session.stop()
