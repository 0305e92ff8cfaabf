"""``python -m bench`` with ``tools`` on the path (``make bench``): see docs/benchmarks.md."""

import sys

from bench import run

if __name__ == "__main__":
    sys.exit(run())
