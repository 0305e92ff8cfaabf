"""Lazily imported modules (qstore/_lazy.py) under Ctrl-C."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# A child process: numpy is imported for the first time through qstore's lazy
# stand-in, and a real SIGINT arrives at the Nth function call inside numpy's
# import. The interrupt must come out after the import, and numpy must work.
CHILD = textwrap.dedent("""
    import os, signal, sys
    from qstore._lazy import np
    target, seen = int(sys.argv[1]), [0]
    def hook(frame, event, arg):
        if event == "call" and "numpy" in frame.f_code.co_filename:
            seen[0] += 1
            if seen[0] == target:
                sys.setprofile(None)
                os.kill(os.getpid(), signal.SIGINT)
    sys.setprofile(hook)
    try:
        np.arange(3)
        print("no interrupt")
    except KeyboardInterrupt:
        print("interrupted")
    sys.setprofile(None)
    assert seen[0] >= target, seen
    print("sum", int(np.arange(4).sum()))
""")


@pytest.mark.parametrize("target", [20, 50, 120, 400])
def test_ctrl_c_during_numpys_first_import_leaves_it_usable(target: int) -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, str(target)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # The interrupt is delivered, once the import is complete; numpy then works.
    assert done.stdout.split("\n")[:2] == ["interrupted", "sum 6"], done.stdout


def test_an_import_in_another_thread_changes_no_handler() -> None:
    code = textwrap.dedent("""
        import signal, threading
        from qstore._lazy import np
        handler = signal.getsignal(signal.SIGINT)
        seen = []
        def run():
            np.arange(1)
            seen.append(signal.getsignal(signal.SIGINT))
        t = threading.Thread(target=run); t.start(); t.join()
        assert seen == [handler], (seen, handler)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr
