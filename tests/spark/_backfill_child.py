"""Run the driver's commit of an already staged backfill job in a child process.

    python _backfill_child.py STORE STAGING [FINGERPRINT [kill-before-close]]

The crash test sets ``QSTORE_BACKFILL_CRASH_AT=<step>`` so that this process
SIGKILLs itself at that step (see qstore/spark/_ingest.py). No Spark here: the
staged files come from a backfill that was killed at ``staged``.
"""

from __future__ import annotations

import os
import signal
import sys

import qstore
from qstore.spark._ingest import commit_job


def main() -> int:
    store_path, staging = sys.argv[1], sys.argv[2]
    fingerprint = sys.argv[3] if len(sys.argv) > 3 else None
    at_close = len(sys.argv) > 4 and sys.argv[4] == "kill-before-close"
    with qstore.open(store_path, compactor=False) as store:
        commit_job(store, staging, fingerprint=fingerprint, marker_at_close=at_close)
        if at_close:  # as run_backfill does, killed as it closes the store
            os.kill(os.getpid(), signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
