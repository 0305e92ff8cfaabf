"""Segment accounting as stored: the ``S`` records, completed by the pushes they defer.

A single push does not rewrite the ``S`` record of the segment it appends to
(one key fewer in the hot batch, about 12% of a push). That record carries a
``covered`` id instead: it counts exactly the messages of the segment with
ids below it. Messages of that segment with higher ids were pushed after the
record was written; whoever reads the records adds them, from the message
records (docs/meta-schema.md, "S records and deferred pushes"). The writer
rewrites the record, moving ``covered`` on, every ``DEFER_MAX`` pushes and
with every other change to the segment, so that scan stays short.

Used by the store's open (and its reopen after a failed write), by the
integrity check (which compares a record with the messages below its
``covered`` id) and by the test and crash-harness helpers that compare what
is stored with what a process holds in memory.
"""

from __future__ import annotations

from collections.abc import Iterator

from .meta import MetaDB, keys, records
from .payload import FRAME_SIZE

# Single pushes between two writes of the active segment's S record: bounds
# the scan an open after a crash does (at most this many message records).
DEFER_MAX = 1024


def stored_segments(meta: MetaDB) -> tuple[dict[int, list[int]], dict[int, int]]:
    """The S records as written: file id -> [live bytes, live count, end], and
    file id -> ``covered`` id for the records that defer pushes."""
    segments: dict[int, list[int]] = {}
    covered: dict[int, int] = {}
    for key, value in meta.scan(keys.SEGMENT, keys.prefix_end(keys.SEGMENT)):
        fid = keys.segment_id(key)
        segments[fid] = list(records.decode_segment(value))
        c = records.segment_covered(value)
        if c is not None:
            covered[fid] = c
    return segments, covered


def covered_ids(meta: MetaDB) -> dict[int, int]:
    """File id -> ``covered`` id of the S records that defer pushes; a record that
    does not decode is left out (the integrity check and the audit report it)."""
    out: dict[int, int] = {}
    for key, value in meta.scan(keys.SEGMENT, keys.prefix_end(keys.SEGMENT)):
        try:
            c = records.segment_covered(value)
        except Exception:  # msgpack's errors have no common base
            continue
        if c is not None and len(key) == 9:
            out[keys.segment_id(key)] = c
    return out


def late_records(meta: MetaDB, covered: dict[int, int]) -> Iterator[tuple[int, int, int, int]]:
    """(id, file id, offset, length) of each message a record of ``covered`` defers:
    in a segment of ``covered``, with an id at or above that segment's ``covered``.

    Reads the message records with ids from the smallest ``covered`` id up, one
    seek per queue. A record that does not decode is skipped (the integrity
    check reports it).
    """
    if not covered:
        return
    low = keys.U64.pack(min(covered.values()))
    end = keys.prefix_end(keys.MESSAGE)
    key = meta.first_key(keys.MESSAGE, end)
    while key is not None:
        if len(key) < 5:  # not a per-queue key of this layout: step over it
            key = meta.first_key(key + b"\x00", end)
            continue
        prefix = key[:5]
        for mkey, value in meta.scan(prefix + low, keys.prefix_end(prefix)):
            try:
                rec = records.MessageRecord.decode(value)
            except Exception:  # msgpack's errors have no common base
                continue
            if len(mkey) != 13:
                continue
            mid = keys.trailing_id(mkey)
            c = covered.get(rec.file_id)
            if c is not None and mid >= c:
                yield mid, rec.file_id, rec.offset, rec.length
        key = meta.first_key(keys.prefix_end(prefix), end)


def load_segments(meta: MetaDB) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Every segment's [live bytes, live count, end] with the deferred pushes added,
    and the ``covered`` ids that were found (empty after a clean close)."""
    segments, covered = stored_segments(meta)
    for _, fid, offset, length in late_records(meta, covered):
        seg = segments[fid]
        frame = FRAME_SIZE + length
        seg[0] += frame
        seg[1] += 1
        seg[2] = max(seg[2], offset + frame)
    return segments, covered
