"""Shared fixtures: an injectable clock, store factories, and one SparkSession per run."""

from __future__ import annotations

import errno
import math
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import settings

import qstore

# Hypothesis fails an example that runs over its deadline (200 ms by default).
# The suite runs on shared, loaded machines where a pause of that length says
# nothing about the code: no deadline anywhere (a test's own settings may still
# set one), the same as the tests that already said deadline=None.
settings.register_profile("qstore", deadline=None)
settings.load_profile("qstore")


class FakeClock:
    """A clock the test moves by hand: no test sleeps to let time pass.

    It takes part in the store's waits (qstore/_waits.py): a ``pop(wait=...)``
    is measured by this clock, so on its own it blocks until something wakes it:
    a push, or :meth:`advance` from another thread (the store subscribes to the
    moves). With ``autojump`` it instead jumps to the time the store waits for,
    and a wait's outcome is decided at once; ``jumps`` records each jump.
    Assigning ``now`` moves it without waking anyone. :meth:`wait_blocks` lets a
    test wait (for a thread, not for time) until pops have blocked on it.
    """

    def __init__(self, start: float = 1_700_000_000.0, *, autojump: bool = False) -> None:
        self.now = start
        self.autojump = autojump
        self.jumps: list[float] = []  # seconds of each autojump
        self._subscribers: list[Callable[[], None]] = []
        self._blocks = 0  # waits that blocked until woken (not autojump)
        self._blocked = threading.Condition()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self._moved()

    def _moved(self) -> None:
        for callback in list(self._subscribers):
            callback()

    # -- the store's optional clock protocol (qstore/_waits.py) -------------------------

    def subscribe(self, callback: Callable[[], None]) -> None:
        self._subscribers.append(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        self._subscribers.remove(callback)

    def deadline_to_sleep_time(self, deadline: float) -> float:
        if not self.autojump:
            with self._blocked:
                self._blocks += 1
                self._blocked.notify_all()
            return math.inf  # it moves only when the test moves it
        if deadline > self.now:
            self.jumps.append(deadline - self.now)
            self.now = deadline
            self._moved()
        return 0.0


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


def wait_blocks(clock: FakeClock, n: int, timeout: float = 30.0) -> None:
    """Return once ``n`` waits in all have blocked on ``clock`` (the waiting thread
    holds the writer lock until it blocks: what the test does next comes after)."""
    with clock._blocked:
        assert clock._blocked.wait_for(lambda: clock._blocks >= n, timeout), \
            f"{clock._blocks} of {n} waits blocked on the clock"


@pytest.fixture
def small_disk(tmp_path: object) -> Iterator[str]:
    """A 16 MiB tmpfs (a real full disk for the fault tests), unmounted at the end
    whatever happened."""
    where = os.path.join(str(tmp_path), "disk")
    os.mkdir(where)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", where],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.strip()}): "
                    "the real disk-full tests need root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], check=False)


def fill_disk(path: str) -> None:
    """A file at ``path`` that takes every free byte left on its disk (down to single bytes)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for chunk in (1 << 20, 1 << 16, 4096, 1):
            data = b"f" * chunk
            while True:
                try:
                    os.write(fd, data)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
