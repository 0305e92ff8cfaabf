"""Several processes: one writer (StoreLocked), read-only views, and SIGKILL at random.

The SIGKILL test is a real crash harness: a child process (``_kill_child.py``)
runs a random workload and journals each operation after it returned; the
test kills it with SIGKILL at a random point, reopens the store, and checks
that nothing that returned was lost or undone. ``QSTORE_KILLS`` sets the
number of kills per durability mode (default 5).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import qstore
from qstore.meta import keys
from tests.conftest import FakeClock

from ._support import assert_consistent, count_lines, dump, kill_when_journaled, store_view

HERE = Path(__file__).resolve().parent
KILL_CHILD = HERE / "_kill_child.py"
KILLS = int(os.environ.get("QSTORE_KILLS", "5"))


def run_child(code: str, *args: str, timeout: float = 60.0) -> Any:
    """Run ``code`` in a fresh interpreter; it prints one JSON document."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# -- one writer -------------------------------------------------------------------------

OPEN_RW = """
import json, sys, qstore
try:
    store = qstore.open(sys.argv[1], compactor=False)
except qstore.QStoreError as exc:
    print(json.dumps({"error": type(exc).__name__, "path": getattr(exc, "path", None),
                      "served": getattr(exc, "served", None), "message": str(exc)}))
else:
    store.queue("q").push(b"from the child")
    store.close()
    print(json.dumps({"error": None}))
"""


def test_a_second_writer_process_gets_store_locked_naming_the_path(store: qstore.Store,
                                                                   store_path: str) -> None:
    q = store.create_queue("q")
    q.push(b"owner")
    store.core.syncer.sync_now()  # the owner's own sync moves M synced: settle it first
    before = dump(store)
    got = run_child(OPEN_RW, store_path)
    assert got["error"] == "StoreLocked"
    assert got["path"] == store_path
    assert store_path in got["message"]
    assert got["served"] is False and "readonly=True" in got["message"]
    assert "server" not in got["message"]  # no server's socket in the store: none is named
    assert dump(store) == before
    q.push(b"still writable")  # the owner is undisturbed
    assert q.stats().ready == 2


def test_the_lock_is_released_on_close(store_path: str, clock: Any) -> None:
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        store.create_queue("q")
    assert run_child(OPEN_RW, store_path) == {"error": None}
    with qstore.open(store_path, clock=clock, compactor=False) as store:
        assert store.queue("q").pop().payload == b"from the child"  # type: ignore[union-attr]


def test_a_second_writer_in_the_same_process_gets_store_locked(store: qstore.Store,
                                                               store_path: str,
                                                               clock: Any) -> None:
    q = store.create_queue("q")
    q.push(b"x")
    before = dump(store)
    link = store_path + "-link"
    os.symlink(store_path, link)
    parent, name = os.path.split(store_path)
    spellings = [store_path, store_path + "/", Path(store_path), link,
                 os.path.join(parent, ".", name), os.path.relpath(store_path)]
    for path in spellings:
        with pytest.raises(qstore.StoreLocked) as info:
            qstore.open(path, compactor=False)
        assert os.fspath(path) in str(info.value)
        assert info.value.path == os.fspath(path)
    assert dump(store) == before
    assert q.pop() is not None
    store.close()
    with qstore.open(link, compactor=False, clock=clock) as again:  # close released it
        assert again.queue("q").stats().in_flight == 1


# -- read-only views --------------------------------------------------------------------

READONLY_VIEW = """
import json, sys
sys.path.insert(0, sys.argv[4])  # the repository, for the view shared with the owner
import qstore
from tests.queue._support import store_view

def view(store):
    return store_view(store, sys.argv[2].split(","))

store = qstore.open(sys.argv[1], readonly=True)
first = view(store)
errors = {}
q = store.queue("a")
for op, call in [("push", lambda: q.push(b"x")), ("push_many", lambda: q.push_many([b"x"])),
                 ("pop", q.pop), ("pop_many", lambda: q.pop_many(3)),
                 ("ack", lambda: q.ack(sys.argv[3])), ("nack", lambda: q.nack(sys.argv[3])),
                 ("extend", lambda: q.extend(sys.argv[3])), ("purge", q.purge),
                 ("redrive", q.redrive), ("create_queue", lambda: store.create_queue("z")),
                 ("delete_queue", lambda: store.delete_queue("a")),
                 ("compact", store.compact)]:
    try:
        call()
    except Exception as exc:
        errors[op] = type(exc).__name__
    else:
        errors[op] = None
print(json.dumps({"view": first, "errors": errors}), flush=True)
sys.stdin.readline()  # the owner writes meanwhile
second = view(store)
store.close()
print(json.dumps({"view": second}), flush=True)
"""


@pytest.fixture
def owned(store: qstore.Store, clock: Any) -> Iterator[dict[str, Any]]:
    """The owner's store with two queues and messages in every state."""
    a = store.create_queue("a", max_attempts=1)
    b = store.create_queue("ab")
    ids = a.push_many([(os.urandom(n), n % 7) for n in (0, 10, 1000, 5000, 20)])
    a.push(b"later", delay=60.0)
    held = a.pop(lease=600.0)
    dying = a.pop()
    assert held is not None and dying is not None
    a.nack(dying)
    acked = a.pop()
    assert acked is not None
    a.ack(acked)
    b.push(b"in ab")
    refs = [f"a:{mid}" for mid in ids] + [f"ab:{mid}" for mid in ids]
    yield {"store": store, "a": a, "held": held, "refs": refs}


def test_a_readonly_process_sees_a_consistent_view_while_the_owner_runs(
        owned: dict[str, Any]) -> None:
    store: qstore.Store = owned["store"]
    a: qstore.Queue = owned["a"]
    want = store_view(store, owned["refs"])
    proc = subprocess.Popen(
        [sys.executable, "-c", READONLY_VIEW, store.path, ",".join(owned["refs"]),
         owned["held"].receipt, str(Path(__file__).resolve().parents[2])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        first = json.loads(proc.stdout.readline() or "null")
        assert first is not None, proc.stderr.read() if proc.stderr else ""
        assert first["view"] == want
        assert first["errors"] == {op: "ReadOnlyStore" for op in first["errors"]}
        # The owner keeps working while the view is open ...
        a.push(b"new", priority=99)
        a.ack(owned["held"])
        a.purge()
        assert a.stats().total == 0
        proc.stdin.write("go\n")
        proc.stdin.flush()
        second = json.loads(proc.stdout.readline() or "null")
        # ... and the view stays the consistent one it opened, not a mix.
        assert second == {"view": want}
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    # A view opened now sees the owner's latest state.
    with qstore.open(store.path, readonly=True) as view:
        assert view.queue("a").stats().total == 0
        assert view.queue("ab").stats().ready == 1


def test_a_readonly_store_rejects_every_write(owned: dict[str, Any]) -> None:
    store: qstore.Store = owned["store"]
    before = dump(store)
    with qstore.open(store.path, readonly=True) as view:
        q = view.queue("a")
        held = owned["held"]
        assert q.get(held.id).state == "in_flight"
        for op in (lambda: q.push(b"x"), lambda: q.push_many([b"x"]), q.pop,
                   lambda: q.pop_many(2), lambda: q.ack(held), lambda: q.ack_many([held]),
                   lambda: q.nack(held), lambda: q.extend(held), q.purge, q.redrive,
                   lambda: view.create_queue("new"), lambda: view.delete_queue("a"),
                   view.compact):
            with pytest.raises(qstore.ReadOnlyStore):
                op()
        assert [m.id for m in q.peek(100)] == [m.id for m in owned["a"].peek(100)]
        assert len(q.dead_letters()) == 1
    assert dump(store) == before
    assert_consistent(store, owned["a"])


# -- SIGKILL ----------------------------------------------------------------------------


def journal_lines(path: Path) -> list[list[str]]:
    """The complete lines of the journal, split into words."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return [line.split() for line in data.decode().split("\n")[:-1]]


def self_checked(payload: bytes) -> bool:
    core, tag = payload[:-16], payload[-16:]
    return len(payload) >= 16 and hashlib.blake2b(core, digest_size=16).digest() == tag


def check_after_crash(store_path: str, journal: Path, *, clock: Any = None) -> int:
    """Reopen after a kill: nothing that returned is lost or undone. Returns live count."""
    pushed: dict[int, str] = {}
    acked: set[int] = set()
    acking: set[int] = set()  # an ack was called: the kill may have come before or after it
    attempts: dict[int, int] = {}
    for words in journal_lines(journal):
        kind = words[0]
        if kind == "push":
            mid = int(words[1])
            assert mid not in pushed, f"id {mid} was handed out twice"
            pushed[mid] = words[2]
        elif kind == "pop":
            mid = int(words[1])  # its push may have returned just before a kill, unjournaled
            assert mid not in acked
            assert int(words[2]) > attempts.get(mid, 0)
            attempts[mid] = int(words[2])
        elif kind == "acking":
            acking.add(int(words[1]))
        elif kind == "ack":
            mid = int(words[1])
            assert mid not in acked, f"id {mid} acked twice"
            acked.add(mid)
    options: dict[str, Any] = {"compactor": False}
    if clock is not None:
        options["clock"] = clock
    with qstore.open(store_path, **options) as store:
        q = store.queue("q")
        for mid, want in pushed.items():
            if mid in acked:
                with pytest.raises(qstore.MessageNotFound):
                    q.get(mid)  # an ack that returned is never undone
                continue
            if mid in acking:
                try:
                    msg = q.get(mid)
                except qstore.MessageNotFound:
                    continue  # the unjournaled ack happened
            else:
                msg = q.get(mid)  # a push that returned is never lost
            assert hashlib.blake2b(msg.payload, digest_size=16).hexdigest() == want
            assert msg.attempts >= attempts.get(mid, 0), "a delivery that returned was undone"
        live = 0
        prefix = keys.prefix(keys.MESSAGE, store.core.queues["q"].qid)
        for key, _ in store.core.meta.scan(prefix, keys.prefix_end(prefix)):
            msg = q.get(keys.trailing_id(key))
            assert self_checked(msg.payload), f"payload of {msg.id} is damaged"
            live += 1
        assert_consistent(store, q)
        assert q.stats().total == live
    return live


@pytest.mark.parametrize("mode", ["always", "interval", "none"])
def test_sigkill_loses_nothing_that_returned(tmp_path: Path, mode: str) -> None:
    store_path = str(tmp_path / "store")
    journal = tmp_path / "journal"
    rng = random.Random(f"kill-{mode}-{os.getpid()}")
    for kill in range(KILLS):
        start = count_lines(journal)
        target = start + rng.choice([1, 2, rng.randint(3, 40), rng.randint(40, 150)])
        proc = subprocess.Popen(
            [sys.executable, str(KILL_CHILD), store_path, str(journal), mode,
             f"{mode}-{kill}-{rng.random()}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        kill_when_journaled(proc, journal, target,
                            extra_wait=rng.choice([0.0, 0.0, rng.uniform(0.0, 0.01)]))
        assert count_lines(journal) > start
        check_after_crash(store_path, journal)
    # Finally, the store drains cleanly: every lease taken by a killed child runs out.
    later = FakeClock(time.time() + 10_000.0)
    check_after_crash(store_path, journal, clock=later)
    with qstore.open(store_path, compactor=False, clock=later) as store:
        q = store.queue("q")
        while batch := q.pop_many(100):
            for msg in batch:
                assert self_checked(msg.payload)
            q.ack_many(batch)
        assert q.stats().total == 0
        assert_consistent(store, q)
