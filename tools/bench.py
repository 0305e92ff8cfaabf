#!/usr/bin/env python3
"""Run qstore's benchmarks against its peers: the same as `qstore bench`.

    .venv/bin/python tools/bench.py --quick        # under a minute
    .venv/bin/python tools/bench.py                # the default run, ~5-10 minutes
    .venv/bin/python tools/bench.py --full         # 1,000,000-message churn and open

See docs/benchmarks.md.
"""

import sys

from qstore._bench import run

if __name__ == "__main__":
    sys.exit(run())
