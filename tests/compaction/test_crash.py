"""The crash harness, reduced: 30 SIGKILLs of a busy writer, half of them at compaction steps;
and 14 in always mode, each also a power loss (the unsynced payload zeroed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ._support import CRASH_TOOL

KILLS = 30


def _survives(tmp_path: object, kills: int, *extra: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(CRASH_TOOL), "--kills", str(kills), "--seed", "7",
         "--dir", str(tmp_path), *extra],
        capture_output=True, text=True, timeout=600,
    )

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"survived {kills}/{kills} kills" in proc.stdout
    table = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()
             if line.split() and line.split()[0] in ("random", "sealed", "copied",
                                                     "repointed_chunk", "repointed", "deleting",
                                                     "done")}
    assert len(table) == 7
    assert all(kills == survived and int(kills) > 0 for kills, survived in table.values())
    return proc.stdout


@pytest.mark.slow
def test_the_store_survives_kills_at_random_moments_and_at_every_compaction_step(
    tmp_path: object,
) -> None:
    _survives(tmp_path, KILLS)


@pytest.mark.slow
def test_always_mode_loses_nothing_that_returned_to_kills_that_are_power_losses(
    tmp_path: object,
) -> None:
    out = _survives(tmp_path, 14, "--durability", "always", "--power-loss")
    zeroed = next(line for line in out.splitlines() if line.startswith("power loss:"))
    assert int(zeroed.split()[2].replace(",", "")) > 0  # the journal had bytes to restore
