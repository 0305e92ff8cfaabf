#!/usr/bin/env python
"""Crash harness: SIGKILL a busy qstore writer again and again, and check the store.

A child process opens a store with small segments, runs random pushes, pops,
acks, nacks, extends and redrives with compaction passes interleaved (and the
background compactor running), and journals every operation that returned
with one unbuffered ``os.write`` to an ``O_APPEND`` file, which survives
SIGKILL. The parent kills it, alternately at a random moment (sometimes while
it is still opening, i.e. during recovery) and at a named compaction step
(``qstore._compact.step_hook`` makes the child kill itself there), cycling
through every step. After each kill it reopens the store and checks:

- every push that returned is present, or its ack was journaled (returned or
  in flight at the kill); no ack that returned is undone;
- every payload reads back byte-exact (its digest was journaled), and every
  message in the store was pushed (at least attempted) by a child;
- ``store.check()`` finds nothing (every reference, CRC, index, counter and
  segment record; docs/check.md), and the in-memory counters equal the
  stored ones;
- no compaction record is left after open, and after one more ``compact()``
  no sealed segment without live records survives.

With ``--power-loss`` (``always`` only) each kill is also a power loss: before
the reopen, the bytes of the active segment past the durable mark
(``M synced``) are zeroed, as lost page cache leaves them; nothing that
returned may be lost even so (the payload journal, docs/meta-schema.md).

Usage::

    python tools/crash.py --kills 300 [--seed N] [--durability interval]
    python tools/crash.py --kills 100 --durability always --power-loss

It prints the kills survived per kill point and exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import qstore
from qstore import _compact
from qstore.meta import MetaDB, keys, records
from qstore.payload import PayloadRef, segment_name

STEPS = ("sealed", "copied", "repointed_chunk", "repointed", "deleting", "done")
QUEUE = "jobs"
SEGMENT_MAX_BYTES = 32 * 1024  # small, so segments rotate and get compacted all the time
STEP_TIMEOUT = 60.0  # seconds a child gets to reach its kill step
CHILD_MAX_SECONDS = 120.0  # a child never killed stops on its own (the parent reports it)


def digest(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=16).hexdigest()


# -- checks (also used by tests/compaction) -----------------------------------


def recount(store: qstore.Store) -> list[str]:
    """Problems found by ``store.check()``, plus in-memory counters that drifted from disk."""
    with store.core.lock:  # a consistent view: no sweep or pass changes anything meanwhile
        for name in store.queues():
            store.queue(name).stats()  # promotes due messages first
        problems = [str(f) for f in store.check().findings]
        problems += store.core.drift(segment_ends=False)
    return problems


def dead_sealed_segments(store: qstore.Store) -> list[int]:
    """Sealed segments without a single live record."""
    with store.core.lock:
        active = store.core.payload.active_id
        return [fid for fid in store.core.payload.file_ids()
                if fid != active and store.core.segments.get(fid, [0, 0, 0])[1] == 0]


def all_messages(store: qstore.Store) -> dict[int, bytes]:
    """id -> payload of every message of every queue, each read (and CRC-checked)."""
    out = {}
    with store.core.lock:
        for key, value in store.core.meta.scan(keys.MESSAGE, keys.prefix_end(keys.MESSAGE)):
            rec = records.MessageRecord.decode(value)
            ref = PayloadRef(rec.file_id, rec.offset, rec.length)
            out[keys.trailing_id(key)] = store.core.payload.read(ref)
    return out


# -- the journal ----------------------------------------------------------------


@dataclass
class Journal:
    """What the children said, read incrementally (a kill may cut the last line)."""

    path: str
    offset: int = 0
    lines: int = 0
    pushed: dict[int, str] = field(default_factory=dict)  # id -> payload digest
    attempted: Counter[str] = field(default_factory=Counter)  # digests of pushes in flight
    acked: set[int] = field(default_factory=set)  # acks that returned
    acking: set[int] = field(default_factory=set)  # acks begun, neither returned nor failed
    passes: int = 0
    pids: list[int] = field(default_factory=list)

    def read(self) -> None:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].decode().splitlines():
            self.lines += 1
            kind, *rest = line.split()
            if kind == "p":
                self.attempted[rest[0]] += 1
            elif kind == "P":
                self.pushed[int(rest[0])] = rest[1]
            elif kind == "a":
                self.acking.add(int(rest[0]))
            elif kind == "A":
                self.acked.add(int(rest[0]))
                self.acking.discard(int(rest[0]))
            elif kind == "x":
                self.acking.discard(int(rest[0]))
            elif kind == "C":
                self.passes += 1
            elif kind == "S":
                self.pids.append(int(rest[0]))

    def count_new_lines(self) -> int:
        """Lines written since the last read, without consuming them."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read().count(b"\n")


def check_journal(store: qstore.Store, journal: Journal) -> list[str]:
    problems = []
    messages = all_messages(store)
    for mid, body in messages.items():
        d = digest(body)
        want = journal.pushed.get(mid)
        if want is not None and want != d:
            problems.append(f"message {mid}: payload digest {d}, pushed {want}")
        elif want is None and d not in journal.attempted:
            problems.append(f"message {mid} was never pushed (digest {d})")
    present = set(messages)
    lost = set(journal.pushed) - present - journal.acked - journal.acking
    if lost:
        problems.append(f"{len(lost)} pushed message(s) lost: {sorted(lost)[:10]}")
    undone = journal.acked & present
    if undone:
        problems.append(f"{len(undone)} acked message(s) back: {sorted(undone)[:10]}")
    return problems


def check_store(path: str, journal: Journal, durability: str) -> tuple[list[str], str]:
    """Reopen after a kill and check everything; returns (problems, phase found at open)."""
    view = MetaDB(os.path.join(path, "meta"), readonly=True, store_path=path)
    try:
        raw = view.get(keys.COMPACTION_KEY)
    finally:
        view.close()
    phase = records.decode_compaction(raw)[0] if raw is not None else "none"
    problems = []
    with qstore.open(path, compactor=False, durability=durability,
                     segment_max_bytes=SEGMENT_MAX_BYTES) as store:
        if store.core.meta.get(keys.COMPACTION_KEY) is not None:
            problems.append("a compaction record survived open")
        problems += recount(store)
        problems += check_journal(store, journal)
        store.compact()
        left = dead_sealed_segments(store)
        if left:
            problems.append(f"sealed segments without live records after compact(): {left}")
        problems += recount(store)
    return problems, phase


# -- the child ------------------------------------------------------------------


def install_kill_step(step: str, nth: int) -> None:
    seen = 0

    def hook(name: str) -> None:
        nonlocal seen
        if name == step:
            seen += 1
            if seen == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    _compact.step_hook = hook


def run_child(args: argparse.Namespace) -> int:
    step = os.environ.get("QSTORE_CRASH_STEP")
    if step:
        install_kill_step(step, int(os.environ.get("QSTORE_CRASH_NTH", "1")))
    _compact.REPOINT_CHUNK = 8  # several chunks per pass, so a kill can land between them
    rng = random.Random(args.seed)
    fd = os.open(args.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(line: str) -> None:
        os.write(fd, line.encode())

    store = qstore.open(args.dir, durability=args.durability, segment_max_bytes=SEGMENT_MAX_BYTES,
                        compactor=True, compact_interval=0.05, sweep_interval=0.05)
    q = store.create_queue(QUEUE, max_attempts=3, exist_ok=True)
    note(f"S {os.getpid()}\n")
    held: list[Any] = []
    backlog = q.stats().total
    deadline = time.monotonic() + CHILD_MAX_SECONDS
    n = 0
    while time.monotonic() < deadline:
        n += 1
        r = rng.random()
        if n % 50 == 0:
            backlog = q.stats().total
        if r < (0.45 if backlog < 150 else 0.15):
            count = 1 if rng.random() < 0.8 else rng.randint(2, 5)
            bodies = [rng.randbytes(rng.choice((0, rng.randint(1, 1500), rng.randint(1, 1500),
                                                rng.randint(2000, 9000))))
                      for _ in range(count)]
            note("".join(f"p {digest(b)}\n" for b in bodies))
            delay = 0.05 if rng.random() < 0.1 else 0.0
            ids = q.push_many([(b, rng.randint(0, 9), delay) for b in bodies])
            note("".join(f"P {mid} {digest(b)}\n" for mid, b in zip(ids, bodies, strict=True)))
            backlog += count
        elif r < 0.65:
            held.extend(q.pop_many(rng.randint(1, 4), lease=rng.choice((0.1, 2.0))))
        elif r < 0.85 and held:
            batch = [held.pop(rng.randrange(len(held))) for _ in range(min(len(held),
                                                                          rng.randint(1, 3)))]
            note("".join(f"a {m.id}\n" for m in batch))
            try:
                q.ack_many(batch)
            except (qstore.LeaseExpired, qstore.MessageNotFound):
                note("".join(f"x {m.id}\n" for m in batch))
            else:
                note("".join(f"A {m.id}\n" for m in batch))
                backlog -= len(batch)
        elif r < 0.92 and held:
            m = held.pop(rng.randrange(len(held)))
            try:
                if rng.random() < 0.7:
                    q.nack(m, delay=rng.choice((0.0, 0.05)))
                else:
                    held.append(q.extend(m, lease=2.0))
            except (qstore.LeaseExpired, qstore.MessageNotFound):
                pass  # the lease expired, and maybe a later delivery acked it
        elif r < 0.94:
            q.redrive(5)
        elif r < 0.97:
            store.compact(threshold=0.2)
            note("C\n")
    store.close()
    return 0


# -- the parent -----------------------------------------------------------------


def wait_for_lines(journal: Journal, proc: subprocess.Popen[bytes], lines: int,
                   timeout: float) -> None:
    """Poll until the journal has ``lines`` new lines, the child dies, or time is up."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if journal.count_new_lines() >= lines:
            return
        time.sleep(0.002)


def lose_unsynced_payload(path: str) -> int:
    """Zero the active segment's bytes past the durable mark (M synced): what a power
    loss leaves of bytes that were never synced. Returns how many were zeroed."""
    try:
        view = qstore.open(path, readonly=True)
    except qstore.QStoreError:
        return 0  # killed before the store existed
    try:
        raw = view.core.meta.get(keys.SYNCED_KEY)
    finally:
        view.close()
    if raw is None:
        return 0
    _, fid, offset = records.unpack(raw, "synced")
    seg = os.path.join(path, "payload", segment_name(int(fid)))
    offset = int(offset)
    try:
        with open(seg, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            if size <= offset:
                return 0
            f.seek(offset)
            f.write(bytes(size - offset))
            return size - offset
    except FileNotFoundError:
        return 0


def run_parent(args: argparse.Namespace) -> int:
    if not args.verbose:  # recovery warnings are expected after every kill
        logging.getLogger("qstore").setLevel(logging.ERROR)
    rng = random.Random(args.seed)
    base = args.dir or tempfile.mkdtemp(prefix="qstore-crash-")
    store_dir = os.path.join(base, "store")
    journal_path = os.path.join(base, "journal")
    stderr_path = os.path.join(base, "child-stderr")
    open(journal_path, "ab").close()
    journal = Journal(journal_path)
    survived: Counter[str] = Counter()
    attempted: Counter[str] = Counter()
    phases: Counter[str] = Counter()
    violations: list[str] = []
    zeroed = 0  # --power-loss: unsynced payload bytes thrown away
    started = time.monotonic()
    print(f"crash harness: {args.kills} kills, seed {args.seed}, durability {args.durability}, "
          f"store {store_dir}", flush=True)
    for k in range(args.kills):
        point = "random" if k % 2 == 0 else STEPS[(k // 2) % len(STEPS)]
        attempted[point] += 1
        env = dict(os.environ)
        env.pop("QSTORE_CRASH_STEP", None)
        if point != "random":
            env["QSTORE_CRASH_STEP"] = point
            env["QSTORE_CRASH_NTH"] = str(rng.randint(1, 3))
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dir", store_dir,
               "--journal", journal_path, "--seed", str(rng.getrandbits(32)),
               "--durability", args.durability]
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
            if point == "random":
                if rng.random() < 0.1:
                    time.sleep(rng.uniform(0.0, 0.3))  # often still opening: kills recovery
                else:
                    wait_for_lines(journal, proc, rng.randint(1, 400), STEP_TIMEOUT)
                    time.sleep(rng.uniform(0.0, 0.02))
                proc.kill()
            try:
                rc = proc.wait(timeout=STEP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
                violations.append(f"kill {k} at {point}: the child never reached the step")
                continue
        journal.read()
        if rc != -signal.SIGKILL:
            with open(stderr_path, "rb") as f:
                tail = f.read()[-3000:].decode(errors="replace")
            violations.append(f"kill {k} at {point}: child exited with {rc}, not SIGKILL:\n{tail}")
            if rc != 0:
                break
            continue
        if args.power_loss:
            zeroed += lose_unsynced_payload(store_dir)
        problems, phase = check_store(store_dir, journal, args.durability)
        phases[phase] += 1
        if problems:
            violations.extend(f"kill {k} at {point}: {p}" for p in problems)
            break  # the store is damaged: later kills would only repeat it
        survived[point] += 1
    elapsed = time.monotonic() - started
    print(f"{'kill point':<16} {'kills':>6} {'survived':>9}")
    for point in ("random", *STEPS):
        print(f"{point:<16} {attempted[point]:>6} {survived[point]:>9}")
    print("compaction record found at reopen: "
          + ", ".join(f"{p} {phases[p]}" for p in ("none", "copying", "repointing", "deleting")))
    print(f"journal: {len(journal.pushed)} pushes, {len(journal.acked)} acks, "
          f"{journal.passes} explicit compaction passes returned, {len(journal.pids)} children")
    if args.power_loss:
        print(f"power loss: {zeroed:,} unsynced payload bytes zeroed after the kills")
    total = sum(survived.values())
    print(f"survived {total}/{args.kills} kills in {elapsed:.1f}s; {len(violations)} violation(s)")
    for v in violations:
        print("VIOLATION:", v)
    if not args.keep and not args.dir and not violations:
        shutil.rmtree(base)
    elif violations:
        print(f"store and journal kept in {base}")
    return 1 if violations or total != args.kills else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=300, help="kills to survive (default 300)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument("--durability", choices=("always", "interval", "none"), default="interval")
    p.add_argument("--dir", help="work directory (default: a fresh temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--verbose", action="store_true", help="show the recovery log of each reopen")
    p.add_argument("--power-loss", action="store_true",
                   help="also zero the unsynced payload after each kill (always mode)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--journal", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return run_child(args)
    if args.kills < 1:
        p.error("--kills must be at least 1")
    if args.power_loss and args.durability != "always":
        p.error("--power-loss needs --durability always: only there must nothing that "
                "returned be lost to a power loss")
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
