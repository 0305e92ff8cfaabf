"""The bulk reads of message records (compaction's scan and repoint) agree with msgpack.

``message_refs`` and ``repoint_many`` walk the encoded records a field at a
time with numpy instead of decoding them; on any record they cannot walk they
fall back to msgpack. Either way they must give exactly what ``message_ref``
and ``repoint`` give one record at a time.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qstore import StorageError
from qstore.meta import records

from .test_bulk import DIGEST, INTS, NOW, UINTS

# Every kind a record holds, at its encoding boundaries: int and str priorities
# (fixstr, str 8, str 16), digests or none, TTLs, aged levels and reasons.
PRIORITY = st.one_of(INTS, st.text(max_size=40), st.text(min_size=200, max_size=300))
REASON = st.one_of(st.none(), st.text(max_size=40), st.text(min_size=300, max_size=400))
SMALL = st.integers(min_value=0, max_value=2**40)


@st.composite
def encoded_record(draw: st.DrawFn) -> bytes:
    state = draw(st.sampled_from([records.READY, records.DELAYED, records.INFLIGHT,
                                  records.DEAD]))
    fields = (state, draw(PRIORITY), draw(UINTS), draw(UINTS), draw(SMALL), draw(SMALL),
              draw(SMALL), draw(NOW), draw(UINTS), draw(DIGEST))
    if draw(st.booleans()):
        return records.encode_message(*fields)
    return records.encode_message_v2(*fields, draw(UINTS), draw(SMALL), draw(REASON))


@settings(max_examples=300, deadline=None)
@given(vs=st.lists(encoded_record(), max_size=30), file_id=UINTS,
       offsets=st.lists(UINTS, min_size=30, max_size=30))
def test_bulk_reads_give_what_one_record_at_a_time_gives(
    vs: list[bytes], file_id: int, offsets: list[int]
) -> None:
    ks = [b"m%08d" % i for i in range(len(vs))]
    if vs:  # records as this module writes them are walked, not left to msgpack
        assert records._fields(*records._joined(vs)) is not None
    refs = records.message_refs(ks, vs)
    assert refs.shape == (len(vs), 3)
    assert [tuple(r) for r in refs.tolist()] == [records.message_ref(v) for v in vs]
    moved = records.repoint_many(vs, file_id, offsets[:len(vs)])
    assert moved == [records.repoint(v, file_id, o) for v, o in zip(vs, offsets, strict=False)]


def test_a_record_the_walk_cannot_read_is_decoded_by_msgpack_and_named() -> None:
    good = records.encode_message(records.READY, 5, 3, 100, 10, 0, 0, 1.0, 0, None)
    damaged = good[:-3]  # cut short: its fields end past the record
    with pytest.raises(StorageError, match=b"m00000001".hex()):
        records.message_refs([b"m00000000", b"m00000001"], [good, damaged])


def test_records_of_another_layout_still_give_their_refs() -> None:
    # A record the walk does not know (a map where a field should be) but msgpack reads.
    odd = msgpack.packb([1, 0, {"a": 1}, 7, 24, 10, 0, 0, 1.0, 0, None])
    good = records.encode_message(records.READY, 5, 3, 100, 10, 0, 0, 1.0, 0, None)
    ks = [b"m1", b"m2"]
    assert records.message_refs(ks, [good, odd]).tolist() == [[3, 100, 10], [7, 24, 10]]
    assert records.repoint_many([good, odd], 9, [500, 600]) == [
        records.repoint(good, 9, 500), records.repoint(odd, 9, 600)]
