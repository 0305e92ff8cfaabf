"""The crash harness, reduced: 30 SIGKILLs of a busy writer, half of them at compaction steps."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ._support import CRASH_TOOL

KILLS = 30


@pytest.mark.slow
def test_the_store_survives_kills_at_random_moments_and_at_every_compaction_step(
    tmp_path: object,
) -> None:
    proc = subprocess.run(
        [sys.executable, str(CRASH_TOOL), "--kills", str(KILLS), "--seed", "7",
         "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"survived {KILLS}/{KILLS} kills" in proc.stdout
    table = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()
             if line.split() and line.split()[0] in ("random", "sealed", "copied",
                                                     "repointed_chunk", "repointed", "deleting",
                                                     "done")}
    assert len(table) == 7
    assert all(kills == survived and int(kills) > 0 for kills, survived in table.values())
