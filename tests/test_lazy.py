"""Lazily imported modules (qstore/_lazy.py) under Ctrl-C."""

from __future__ import annotations

import builtins
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from qstore._lazy import lazy

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


def test_a_module_another_thread_is_importing_is_waited_for(tmp_path: Any,
                                                            monkeypatch: Any) -> None:
    # The lazy stand-in took a module from sys.modules while another thread was
    # still importing it, and raised AttributeError for a name not set yet (a
    # review): the compactor's first numpy import raced a check on another thread.
    (tmp_path / "qstore_lazy_probe.py").write_text(textwrap.dedent("""
        import builtins
        first = 1
        builtins.qstore_probe_started.set()
        builtins.qstore_probe_go.wait(60)
        second = 2
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    started, go = threading.Event(), threading.Event()
    monkeypatch.setattr(builtins, "qstore_probe_started", started, raising=False)
    monkeypatch.setattr(builtins, "qstore_probe_go", go, raising=False)
    monkeypatch.delitem(sys.modules, "qstore_lazy_probe", raising=False)
    probe = lazy("qstore_lazy_probe")
    got: dict[str, Any] = {}

    def read(name: str) -> None:
        try:
            got[name] = getattr(probe, name)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            got[name] = exc

    importer = threading.Thread(target=read, args=("first",))
    importer.start()
    assert started.wait(60)
    reader = threading.Thread(target=read, args=("second",))
    reader.start()
    # Until the reader waits on the module's import lock (or has given up).
    while reader.is_alive() and not _waiting_on_import(reader):
        threading.Event().wait(0.001)
    go.set()
    importer.join(60)
    reader.join(60)
    assert got == {"first": 1, "second": 2}


def _waiting_on_import(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if "importlib._bootstrap" in frame.f_code.co_filename \
                and frame.f_code.co_name == "acquire":
            return True
        frame = frame.f_back
    return False
