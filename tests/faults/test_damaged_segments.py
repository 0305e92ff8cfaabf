"""Case 8: small damage to segment files never takes the whole store offline.

One flipped byte in a segment header (a sealed one, or the active one), a
0-byte segment (sealed or active), the active one zeroed or cut below the
mark the metadata knows to be durable, two swapped segments, a segment
renamed to a later id or away:
the store opens read-write and read-only; only the messages in the damaged
files are affected (a read raises Corruption, a pop moves them to the dead
letters), every other message reads back, the damaged file is kept as it is,
and the check names it.
"""

from __future__ import annotations

import logging
import os

import pytest

import qstore


def _make(path: str) -> list[int]:
    with qstore.open(path, compactor=False, segment_max_bytes=4096) as s:
        return s.create_queue("q").push_many([b"m%04d" % i * 100 for i in range(100)])


def _body(i: int) -> bytes:
    return b"m%04d" % i * 100


def _damage(path: str, case: str) -> list[str]:
    """Damage the store at ``path``; the segment files that must be kept."""
    d = os.path.join(path, "payload")
    segs = sorted(n for n in os.listdir(d) if n.endswith(".seg"))
    seg = [os.path.join(d, n) for n in segs]
    if case in ("flip_sealed", "flip_active"):
        target = seg[1] if case == "flip_sealed" else seg[-1]
        with open(target, "r+b") as f:
            f.seek(5)
            b = f.read(1)
            f.seek(5)
            f.write(bytes([b[0] ^ 1]))
        return [target]
    if case == "zero":
        open(seg[1], "wb").close()
        return [seg[1]]
    if case in ("zero_active", "zeros_active"):  # what a crash creating a file leaves,
        with open(seg[-1], "wb") as f:           # but the metadata names data in it
            f.write(b"" if case == "zero_active" else bytes(10))
        return [seg[-1]]
    if case == "cut_active":  # the last segment cut below its durable mark (a clean close)
        os.truncate(seg[-1], os.path.getsize(seg[-1]) - 100)
        return []  # readable, so compacted as sealed ones are: its bytes copied as they are
    if case == "swap":
        os.rename(seg[1], seg[1] + ".t")
        os.rename(seg[2], seg[1])
        os.rename(seg[1] + ".t", seg[2])
        return [seg[1], seg[2]]
    if case == "rename_later":
        later = os.path.join(d, f"{99:010d}.seg")
        os.rename(seg[1], later)
        return [later]
    assert case == "rename_away"
    os.rename(seg[1], seg[1] + ".bak")
    return [seg[1] + ".bak"]


CASES = ["flip_sealed", "flip_active", "zero", "zero_active", "zeros_active", "cut_active",
         "swap", "rename_later", "rename_away"]


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_segment_file_affects_only_its_own_messages(
        store_path: str, case: str) -> None:
    ids = _make(store_path)
    kept = _damage(store_path, case)

    with qstore.open(store_path, readonly=True) as view:
        q = view.queue("q")
        readable = []
        for i, mid in enumerate(ids):
            try:
                assert q.get(mid).payload == _body(i)
                readable.append(mid)
            except qstore.Corruption:
                pass
        assert 0 < len(ids) - len(readable) <= 2 * 9  # at most the damaged files' share
        assert not view.check().ok  # the check names the damage

    with qstore.open(store_path, compactor=False) as store:
        q = store.queue("q")
        popped = []
        while batch := q.pop_many(30):
            popped += [m.id for m in batch]
        assert popped == readable  # every undamaged message, in order
        assert q.stats().dead == len(ids) - len(readable)
        new = q.push(b"after")
        assert q.get(new).payload == b"after"
        store.compact(threshold=0.0)  # the compactor neither fails on it nor deletes it
    for path in kept:
        assert os.path.exists(path), f"{path} was deleted"
    with qstore.open(store_path, compactor=False) as store:  # and it opens again
        assert store.queue("q").stats().dead == len(ids) - len(readable)


@pytest.mark.parametrize("acked", [False, True])
@pytest.mark.parametrize("readonly", [False, True])
def test_a_deleted_sealed_segment_is_logged_once_at_open_with_its_messages(
        store_path: str, caplog: pytest.LogCaptureFixture, acked: bool, readonly: bool) -> None:
    with qstore.open(store_path, compactor=False, segment_max_bytes=4096) as store:
        q = store.create_queue("q")
        q.push_many([(_body(i), 0) for i in range(100)])
        if acked:  # the first sealed segments hold nothing live: dead, awaiting a pass
            q.ack_many(q.pop_many(30))
        seg = next(g for g in store.stats().segments if g.file_id == 2)
    path = os.path.join(store_path, "payload", "0000000002.seg")
    os.remove(path)

    with caplog.at_level(logging.ERROR, logger="qstore"), \
            qstore.open(store_path, compactor=False, readonly=readonly):
        pass
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1, lines
    (line,) = lines
    assert path in line and "is missing" in line
    if acked:
        assert seg.live_count == 0
        assert "no message refers to it" in line
        assert "--repair` removes the record" in line
    else:
        assert seg.live_count > 0
        assert f"{seg.live_count} live message(s) ({seg.live_bytes} bytes)" in line
        assert "pops move them to the dead letters" in line


@pytest.mark.parametrize("call", ["pop_many", "peek"])
def test_the_messages_of_a_deleted_segment_moved_aside_are_one_error_line_per_call(
        store_path: str, caplog: pytest.LogCaptureFixture, call: str) -> None:
    with qstore.open(store_path, compactor=False, segment_max_bytes=4096) as store:
        ids = store.create_queue("q").push_many([(_body(i), 0) for i in range(100)])
        counts = {g.file_id: g.live_count for g in store.stats().segments}
    first, lost = counts[1], counts[2]
    gone = ids[first:first + lost]  # segment 2's messages, in push order
    os.remove(os.path.join(store_path, "payload", "0000000002.seg"))

    with qstore.open(store_path, compactor=False) as store:
        q = store.queue("q")
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="qstore"):
            # 10 at a time: segment 2 is met over several rounds of the one call.
            got = q.pop_many(10) if call == "pop_many" else q.peek(10)
        moved = [r for r in caplog.records if "moved to the dead letters" in r.getMessage()]
        errors = [r.getMessage() for r in moved if r.levelno == logging.ERROR]
        assert len(errors) == 1, errors
        assert (f"queue 'q': {lost} messages of segment 2 moved to the dead letters: "
                f"damaged payload: segment file is missing (ids {gone[0]} to {gone[-1]}; "
                in errors[0])
        details = [r.getMessage() for r in moved if r.levelno == logging.DEBUG]
        assert details == [f"queue 'q': message {mid} moved to the dead letters: damaged "
                           f"payload: segment file is missing (corruption in "
                           f"{store_path}/payload/0000000002.seg at offset 0: segment file "
                           f"is missing)" for mid in gone]
        assert [m.id for m in got] == [*ids[:first], *ids[first + lost:]][:10]
        dead = q.dead_letters(100)
        assert [m.id for m in dead] == gone
        assert {m.dead_reason for m in dead} == {"damaged payload: segment file is missing"}
