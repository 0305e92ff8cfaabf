"""``python -m qstore``: the ``qstore`` command line, for an environment whose
scripts directory is not on PATH."""

from .cli import main

main(prog_name="qstore")
