"""A consumer process for the multi-process tests: pops and prints, acks or not.

argv: ADDRESS QUEUE MODE COUNT. MODE "ack": pop, print the payload hex, ack,
until COUNT messages or a 2 s wait finds nothing. MODE "hold": pop COUNT
messages without acking, print "held", then block until killed.
"""

from __future__ import annotations

import sys

import qstore


def main() -> None:
    address, queue, mode, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with qstore.connect(address) as client:
        q = client.queue(queue)
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
