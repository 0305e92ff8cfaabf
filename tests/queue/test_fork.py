"""A forked child inherits its parent's open store and must leave it alone.

Each case runs in a fresh process that opens a store, forks, lets the child do
what a careless child would (use the store, close it, unwind a ``with`` block,
exit normally), goes on writing in the parent, and is killed with SIGKILL;
the store is then reopened here and checked.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import qstore

_PARENT = textwrap.dedent("""
    import json, os, sys, signal
    import qstore
    path, child_does = sys.argv[1], sys.argv[2]
    with qstore.open(path, sync_interval=0.01) as store:
        q = store.create_queue("q")
        q.push_many([b"before-%d" % i for i in range(100)])
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            os.read(r, 1)  # the parent has written more since the fork
            seen = {}
            for name, call in (("push", lambda: q.push(b"child")), ("pop", q.pop),
                               ("stats", q.stats), ("queues", store.queues)):
                try:
                    call()
                    seen[name] = "ran"
                except qstore.StoreClosed as exc:
                    seen[name] = str(exc)
            print(json.dumps(seen), flush=True)
            if child_does == "close":
                store.close()
                os._exit(0)
            sys.exit(0)  # unwinds the with block: Store.__exit__ closes it, in the child
        os.close(r)
        q.push_many([b"during-%d" % i for i in range(100)])
        os.write(w, b"x")
        _, status = os.waitpid(pid, 0)
        q.push_many([b"after-%d" % i for i in range(100)])  # into the same segment
        print(json.dumps({"child_exit": os.waitstatus_to_exitcode(status)}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("child_does", ["close", "exit"])
def test_a_forked_child_refuses_the_store_and_closes_nothing_of_the_parents(
        tmp_path: Any, child_does: str) -> None:
    path = str(tmp_path / "s")
    proc = subprocess.run([sys.executable, "-c", _PARENT, path, child_does],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    child, parent = (json.loads(line) for line in proc.stdout.splitlines())
    # A child that leaves through the interpreter's exit (not os._exit) is then
    # killed by RocksDB's own exit handler, which joins its background threads,
    # and a fork does not copy them (SIGSEGV): after every Python-level cleanup
    # ran, with nothing of the store's touched. multiprocessing's children, like
    # the "close" case here, end with os._exit.
    assert parent["child_exit"] == (0 if child_does == "close" else -signal.SIGSEGV)
    assert set(child) == {"push", "pop", "stats", "queues"}
    assert all("forked" in v and "qstore serve" in v for v in child.values()), child
    with qstore.open(path) as store:
        q = store.queue("q")
        got = sorted(m.payload for m in q.pop_many(1000))
        assert got == sorted([b"%s-%d" % (w, i) for w in (b"before", b"during", b"after")
                              for i in range(100)])
        assert store.check().ok
