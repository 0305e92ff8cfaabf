"""A client process for the multi-process tests: pops and prints, acks or not; or pushes.

argv: ADDRESS QUEUE MODE COUNT. MODE "ack": pop, print the payload hex, ack,
until COUNT messages or a 2 s wait finds nothing. MODE "until-stop": pop,
print the payload hex, ack, until the payload is b"STOP" (not printed).
MODE "hold": pop COUNT messages without acking, print "held", then block
until killed. MODE "produce:K": push :func:`produced` (K, COUNT), single
pushes and batches mixed.
"""

from __future__ import annotations

import sys

import qstore


def produced(k: int, count: int) -> list[bytes]:
    """The payloads producer ``k`` pushes: distinct, of varied lengths."""
    return [b"p%d-%d-" % (k, i) * (1 + i % 40) for i in range(count)]


def main() -> None:
    address, queue, mode, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with qstore.connect(address) as client:
        q = client.queue(queue)
        if mode.startswith("produce:"):
            bodies = produced(int(mode.split(":")[1]), count)
            for i in range(0, count, 20):
                q.push_many(bodies[i:i + 10])
                for b in bodies[i + 10:i + 20]:
                    q.push(b)
            return
        if mode == "until-stop":
            while True:
                m = q.pop(lease=60.0, wait=60.0)
                if m is None:
                    sys.exit("no STOP within 60 s")
                q.ack(m)
                if m.payload == b"STOP":
                    return
                print(m.payload.hex(), flush=True)
        if mode == "hold":
            got = q.pop_many(count, lease=3600.0)
            print("held", len(got), flush=True)
            sys.stdin.read()  # until the test kills us
            return
        for _ in range(count):
            m = q.pop(lease=60.0, wait=2.0)
            if m is None:
                break
            print(m.payload.hex(), flush=True)
            q.ack(m)


if __name__ == "__main__":
    main()
