"""Run the driver's commit of an already staged backfill job in a child process.

    python _backfill_child.py STORE STAGING [FINGERPRINT]

The crash test sets ``QSTORE_BACKFILL_CRASH_AT=<step>`` so that this process
SIGKILLs itself at that step (see qstore/spark/_ingest.py). No Spark here: the
staged files come from a backfill that was killed at ``staged``.
"""

from __future__ import annotations

import sys

import qstore
from qstore.spark._ingest import commit_job


def main() -> int:
    store_path, staging = sys.argv[1], sys.argv[2]
    fingerprint = sys.argv[3] if len(sys.argv) > 3 else None
    with qstore.open(store_path, compactor=False) as store:
        commit_job(store, staging, fingerprint=fingerprint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
