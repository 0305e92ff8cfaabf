"""Case 13: bad configuration is refused with InvalidArgument, never accepted or crashed on."""

from __future__ import annotations

import time

import pytest

import qstore
from qstore._config import Config


@pytest.mark.parametrize(("name", "value"), [
    ("sync_interval", float("nan")),
    ("sync_interval", float("inf")),
    ("sweep_interval", float("inf")),
    ("compact_interval", float("nan")),
    ("compact_threshold", "0.5"),
    ("compact_threshold", True),
    ("compact_threshold", float("nan")),
    ("max_payload_bytes", 2**32),
])
def test_a_bad_option_is_an_invalid_argument(store_path: str, name: str, value: object) -> None:
    with pytest.raises(qstore.InvalidArgument):
        qstore.open(store_path, **{name: value})


def test_clock_none_means_the_default_clock(store_path: str) -> None:
    assert Config(clock=None).clock is time.time  # type: ignore[arg-type]
    with qstore.open(store_path, clock=None, compactor=False) as store:
        store.create_queue("q").push(b"x")
