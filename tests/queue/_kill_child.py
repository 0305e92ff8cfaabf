"""The child of the SIGKILL test: a random workload that journals what returned.

usage: python _kill_child.py STORE JOURNAL DURABILITY SEED

After each operation returns, one ``os.write`` on an ``O_APPEND`` descriptor
(no buffering in this process) appends its lines to JOURNAL:

    open                           the store is open and queue "q" exists
    push ID DIGEST                 a push (or one item of a push_many) returned ID
    pop ID ATTEMPTS                a pop returned message ID on its ATTEMPTS-th delivery
    acking ID                      an ack of ID is about to be called (it may or may not
                                   happen before a kill)
    ack ID                         an ack (or one item of an ack_many) returned
    nack ID                        a nack returned

Every payload ends with the 16-byte BLAKE2b of what precedes it, so a reader
can check any payload byte for byte, journaled or not. The parent kills this
process with SIGKILL at a random moment; it never exits by itself.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys

import qstore

LEASE = 3600.0  # real seconds: leases taken here outlive the test


def make_payload(rng: random.Random) -> bytes:
    core = rng.randbytes(rng.choice([0, 1, 50, 700, 3000]))
    return core + hashlib.blake2b(core, digest_size=16).digest()


def digest(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def main() -> None:
    path, journal, durability, seed = sys.argv[1:5]
    rng = random.Random(seed)
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(*lines: str) -> None:
        os.write(fd, "".join(line + "\n" for line in lines).encode())

    store = qstore.open(path, durability=durability, compactor=False,
                        segment_max_bytes=64 * 1024)
    q = store.create_queue("q", max_attempts=1000, exist_ok=True)
    held: list[qstore.Message] = []
    log("open")
    while True:
        r = rng.random()
        if r < 0.3:
            body = make_payload(rng)
            mid = q.push(body, priority=rng.randrange(10))
            log(f"push {mid} {digest(body)}")
        elif r < 0.4:
            bodies = [make_payload(rng) for _ in range(rng.randint(1, 5))]
            ids = q.push_many([(b, rng.randrange(10)) for b in bodies])
            log(*(f"push {mid} {digest(b)}" for mid, b in zip(ids, bodies, strict=True)))
        elif r < 0.65:
            got = q.pop_many(rng.randint(1, 3), lease=LEASE)
            held.extend(got)
            log(*(f"pop {m.id} {m.attempts}" for m in got))
        elif r < 0.8 and held:
            msg = held.pop(rng.randrange(len(held)))
            log(f"acking {msg.id}")
            q.ack(msg if rng.random() < 0.5 else msg.receipt)  # type: ignore[arg-type]
            log(f"ack {msg.id}")
        elif r < 0.88 and held:
            batch = [held.pop(rng.randrange(len(held))) for _ in range(min(3, len(held)))]
            log(*(f"acking {m.id}" for m in batch))
            q.ack_many(batch)
            log(*(f"ack {m.id}" for m in batch))
        elif held:
            msg = held.pop(rng.randrange(len(held)))
            q.nack(msg, delay=rng.choice([0.0, 0.0, 0.5]))
            log(f"nack {msg.id}")


if __name__ == "__main__":
    main()
