"""The bulk (numpy) forms of the key builders and the record encoder write the same bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from qstore.meta import keys, records

Row = tuple[Any, ...]  # late, priority, file id, offset, length, due us, digest, expires us
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
U63 = st.integers(min_value=0, max_value=2**63 - 1)
# msgpack picks the smallest encoding of an int: hit every boundary, not just random values.
EDGES = [0, 1, 31, 32, 127, 128, 255, 256, 65535, 65536, 2**31, 2**32 - 1, 2**32, 2**63 - 1,
         -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)]
INTS = st.one_of(st.sampled_from(EDGES), INT64)
UINTS = st.one_of(st.sampled_from([e for e in EDGES if e >= 0]), U63)
DIGEST = st.one_of(st.none(), st.binary(min_size=16, max_size=16))
NOW = st.one_of(st.sampled_from([0.0, 1.7e9, 1700000000.123456]),
                st.floats(min_value=0, max_value=4e9, allow_nan=False))


@st.composite
def message_rows(draw: st.DrawFn, priorities: st.SearchStrategy[int | str]) -> list[Row]:
    n = draw(st.integers(min_value=1, max_value=40))
    row = st.tuples(st.booleans(), priorities, UINTS, UINTS,
                    st.integers(min_value=0, max_value=2**32 - 1), UINTS, DIGEST,
                    st.one_of(st.just(0), UINTS))  # 0: no TTL, a version 1 record
    return draw(st.lists(row, min_size=n, max_size=n))


def _single(rows: list[Row], file_ids: list[int], now: float) -> list[bytes]:
    """What push writes: a version 2 record for a message with a TTL (_states.enqueue)."""
    out = []
    for (late, prio, _, at, n, when, dg, exp), fid in zip(rows, file_ids, strict=True):
        state = records.DELAYED if late else records.READY
        out.append(records.encode_message_v2(state, prio, fid, at, n, 0, 0, now,
                                             when if late else 0, dg, exp, 0, None) if exp
                   else records.encode_message(state, prio, fid, at, n, 0, 0, now,
                                               when if late else 0, dg))
    return out


def _bulk(rows: list[Row], file_ids: int | list[int], now: float, str_prios: bool
          ) -> list[bytes]:
    late = np.array([r[0] for r in rows])
    prios = (np.array([r[1] for r in rows], object) if str_prios
             else np.array([r[1] for r in rows], np.int64))
    when = np.where(late, np.array([r[5] for r in rows], np.int64), 0)
    return records.encode_messages(
        np.where(late, records.DELAYED, records.READY), prios, file_ids,
        np.array([r[3] for r in rows], np.int64), np.array([r[4] for r in rows], np.int64),
        when, [r[6] for r in rows], now, np.array([r[7] for r in rows], np.int64))


@settings(max_examples=300, deadline=None)
@given(rows=message_rows(INTS), now=NOW, one_file=st.booleans())
def test_bulk_records_of_int_priorities_are_encode_message_byte_for_byte(
        rows: list[Row], now: float, one_file: bool) -> None:
    fids = [rows[0][2]] * len(rows) if one_file else [r[2] for r in rows]
    assert _bulk(rows, fids[0] if one_file else fids, now, False) == _single(rows, fids, now)


@settings(max_examples=100, deadline=None)
@given(rows=message_rows(st.text(max_size=20)), now=NOW)
def test_bulk_records_of_str_priorities_are_encode_message_byte_for_byte(
        rows: list[Row], now: float) -> None:
    fids = [r[2] for r in rows]
    assert _bulk(rows, fids, now, True) == _single(rows, fids, now)


def test_bulk_records_decode_to_the_fields_given() -> None:
    """Not only equal to the single form: the bytes say what was asked for."""
    [raw] = records.encode_messages(np.array([records.DELAYED]), np.array([-200], np.int64), 3,
                                    np.array([24]), np.array([70000]), np.array([2**40]),
                                    [b"d" * 16], 1.5)
    rec = records.MessageRecord.decode(raw)
    assert (rec.state, rec.priority, rec.file_id, rec.offset, rec.length, rec.attempts,
            rec.deliveries, rec.enqueued_at, rec.when_us, rec.digest) == (
        records.DELAYED, -200, 3, 24, 70000, 0, 0, 1.5, 2**40, b"d" * 16)
    [raw] = records.encode_messages(np.array([records.READY]), np.array([7], np.int64), 3,
                                    np.array([24]), np.array([5]), np.array([0]), [None], 1.5,
                                    np.array([2**50]))
    rec = records.MessageRecord.decode(raw)
    assert (rec.state, rec.priority, rec.expires_us, rec.aged, rec.reason) == (
        records.READY, 7, 2**50, 0, None)


@settings(max_examples=200, deadline=None)
@given(qid=st.integers(min_value=0, max_value=2**32 - 1),
       pairs=st.lists(st.tuples(INTS, UINTS, UINTS, st.binary(min_size=16, max_size=16)),
                      min_size=1, max_size=30),
       order=st.sampled_from(["min", "max"]))
def test_key_rows_are_the_single_key_builders_byte_for_byte(
        qid: int, pairs: list[tuple[int, int, int, bytes]], order: str) -> None:
    prios = np.array([p[0] for p in pairs], np.int64)
    whens = np.array([p[1] for p in pairs], np.int64)
    mids = np.array([p[2] for p in pairs], np.int64)
    digests = np.frombuffer(b"".join(p[3] for p in pairs), np.uint8).reshape(len(pairs), 16)
    split, rows = keys.split_rows, keys.key_rows
    assert split(rows(keys.MESSAGE, qid, mids)) == [
        keys.message_key(qid, int(m)) for m in mids]
    assert split(rows(keys.DEAD, qid, mids)) == [keys.dead_key(qid, int(m)) for m in mids]
    assert split(rows(keys.DELAYED, qid, whens, mids)) == [
        keys.timed_key(keys.DELAYED, qid, int(w), int(m)) for w, m in zip(whens, mids, strict=True)]
    assert split(rows(keys.READY, qid, keys.int_priority_keys(prios, order), mids)) == [
        keys.ready_key(qid, keys.priority_key(order, "int", int(p)), int(m))
        for p, m in zip(prios, mids, strict=True)]
    assert split(rows(keys.READY, qid, mids)) == [
        keys.ready_key(qid, keys.priority_key("fifo", "int", 0), int(m)) for m in mids]
    assert split(rows(keys.DEDUP, qid, digests, mids)) == [
        keys.dedup_key(qid, p[3]) + keys.U64.pack(p[2]) for p in pairs]
