"""The integrity check's segment-level part: ``S`` records and segment files against a recount.

Given what the message pass counted per segment (references, their bytes
with frames, the furthest record end), each segment id known from any side
(a file, an ``S`` record, a reference, a snapshot manifest) is checked:
the file is there and its header intact, it is not shorter than the data the
metadata refers to, its ``S`` record equals the recount, and a file that
nothing references or accounts for is an orphan.

The single checks are small functions of plain values (``missing_file``,
``header_finding``, ``manifest_truncation``, ``orphan_exempt``, ``orphan``, ``unlisted``,
``record_mismatch``, ``end_past_manifest``, ``records_past_end``) that the
Spark audit's driver (``qstore/spark/_audit_checks.py``) calls too: one
implementation, the same findings in the same words.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy loads with the first check, not with `import qstore`
    import numpy as np

from . import _check_report as k
from ._check_files import SegmentFiles
from ._check_report import Finding
from ._errors import StorageError
from .meta import MetaDB, keys, records
from .payload import _format as fmt

COPYING, DELETING = records.COPYING, records.DELETING


def check_segments(meta: MetaDB, files: SegmentFiles, recount: Mapping[int, list[int]],
                   active_id: int | None, compaction: tuple[str, int, list[int]] | None,
                   *, view: bool = False,
                   late: Mapping[int, list[int]] | None = None) -> list[Finding]:
    """Findings about segments. ``recount``: file id -> [bytes with frames, count, max end];
    ``late``: the same for the messages an ``S`` record's deferred pushes leave out of
    it (counted apart: they only count as references to the file).

    Not orphans: the active segment (a fresh one has no ``S`` record yet), a
    file holding no more than a header, the output of a compaction pass still
    copying (the next open discards it) and the sources of a pass that was
    deleting them (the next open finishes that). In a read-only ``view`` beside
    a writer, which does not know the writer's active segment, also every
    segment above those its metadata has ``S`` records of: made since its
    metadata's last account (the active one, which the writer appends to
    before it writes the records, and a pass's output, whose id is above it;
    taking the highest id for the active one made the active one an orphan
    while a pass copied).
    """
    findings: list[Finding] = []
    stored: dict[int, tuple[int, int, int]] = {}
    for key, value in meta.scan(keys.SEGMENT, keys.prefix_end(keys.SEGMENT)):
        if len(key) != 9:
            findings.append(Finding(k.SEGMENT_RECORD_MISMATCH,
                                    detail=f"S key {key.hex()} is not S file_id:u64"))
            continue
        fid = keys.segment_id(key)
        try:
            b, n, end = records.decode_segment(value)
            if not all(type(v) is int and v >= 0 for v in (b, n, end)):
                raise ValueError(f"fields {[b, n, end]!r} are not unsigned integers")
        except (StorageError, ValueError, TypeError, IndexError) as exc:
            findings.append(Finding(k.SEGMENT_RECORD_MISMATCH, file_id=fid,
                                    detail=f"S record: {exc}"))
            stored[fid] = (-1, -1, 0)  # compares unequal to any recount, reported once
            continue
        stored[fid] = (b, n, end)
    lengths = files.lengths
    phase, output, sources = compaction if compaction is not None else ("", None, [])
    late = late or {}
    fids = set(files.sizes) | set(stored) | set(recount) | set(late) | set(lengths or ())
    newest = max(stored, default=0) if view else None
    for fid in sorted(fids):
        active = fid if newest is not None and fid > newest else active_id
        findings += _check_one(fid, files, stored.get(fid), recount.get(fid, [0, 0, 0]),
                               late.get(fid, [0, 0, 0])[1], active, phase, output, sources)
    return findings


# -- one segment's checks, shared with the Spark audit (qstore/spark/_audit_checks.py) --
# Each takes plain values (sizes, lengths, the S record, the recount) and returns
# the finding, or None: the integrity check and the audit report the same problem
# in the same words.


def missing_file(fid: int, refs: int, has_record: bool, listed: bool) -> Finding | None:
    """No file for a segment that ``refs`` messages reference, that has an ``S`` record
    (``has_record``) or that a snapshot's manifest lists (``listed``)."""
    if not (refs or has_record or listed):
        return None
    why = [f"{refs} messages reference it"]
    if has_record:
        why.append("it has an S record")
    if listed:
        why.append("MANIFEST.json lists it")
    return Finding(k.MISSING_SEGMENT, file_id=fid,
                   detail=f"no file {fmt.segment_name(fid)}; " + ", ".join(why))


def header_finding(fid: int, problem: str | None) -> Finding | None:
    """A damaged header (``problem`` from ``payload.header_problem``)."""
    if problem is None:
        return None
    return Finding(k.BAD_SEGMENT_HEADER, file_id=fid, offset=0, detail=problem)


def manifest_truncation(fid: int, size: int, length: int) -> Finding | None:
    """The file is shorter than the data length a snapshot's manifest lists."""
    if size >= length:
        return None
    return Finding(k.SEGMENT_TRUNCATED, file_id=fid, offset=size,
                   detail=f"file has {size} bytes, the manifest says {length}")


def orphan_exempt(fid: int, data: int, active_id: int | None, copying_output: int | None,
                  deleting_sources: Collection[int] = ()) -> bool:
    """Files that may be unaccounted for: the active segment (a fresh one has no
    ``S`` record yet), a file of no more than a header, the output of a compaction
    pass still copying, the sources of one deleting them."""
    return (fid in (active_id, copying_output) or data <= fmt.HEADER_SIZE
            or fid in deleting_sources)


def orphan(fid: int, size: int, note: str = "") -> Finding:
    return Finding(k.ORPHAN_SEGMENT, file_id=fid, detail=(
        f"{size} bytes that no message references and no S record accounts for{note}"))


def unlisted(fid: int, count: int) -> Finding:
    return Finding(k.UNLISTED_SEGMENT, file_id=fid, detail=(
        f"{count} messages reference it but MANIFEST.json does not list it"))


def record_mismatch(fid: int, stored: tuple[int, int, int] | None, count: int, nbytes: int,
                    where: str = "", offset: int | None = None) -> Finding | None:
    """The ``S`` record's live count and bytes against the recount (``where``: what the
    caller can say about the difference)."""
    live_bytes, live_count = stored[:2] if stored is not None else (0, 0)
    if (live_bytes, live_count) == (nbytes, count):
        return None
    return Finding(k.SEGMENT_RECORD_MISMATCH, file_id=fid, offset=offset, detail=(
        f"S record says {live_count} live records / {live_bytes} bytes, recount finds "
        f"{count} / {nbytes}" + ("" if stored is not None else " (no S record)") + where))


def end_past_file(fid: int, size: int, end: int) -> Finding | None:
    """The file is shorter than the data its ``S`` record says it holds: it was cut."""
    if end <= size:
        return None
    return Finding(k.SEGMENT_TRUNCATED, file_id=fid, offset=size, detail=(
        f"file has {size} bytes, its S record says the data ends at {end}"))


def end_past_manifest(fid: int, end: int, length: int) -> Finding | None:
    if end <= length:
        return None
    return Finding(k.SEGMENT_RECORD_MISMATCH, file_id=fid, detail=(
        f"S record's data end {end} is past the manifest length {length}"))


def found(*maybe: Finding | None) -> list[Finding]:
    """The findings among ``maybe`` (the builders above return None for no problem)."""
    return [f for f in maybe if f is not None]


def _check_one(fid: int, files: SegmentFiles, stored: tuple[int, int, int] | None,
               counted: list[int], late: int, active_id: int | None, phase: str,
               output: int | None, sources: list[int]) -> list[Finding]:
    out: list[Finding] = []
    lengths = files.lengths
    size = files.sizes.get(fid)
    nbytes, count, max_end = counted
    listed = lengths is not None and fid in lengths
    if size is None:
        out += found(missing_file(fid, count + late, stored is not None, listed))
    else:
        out += found(header_finding(fid, files.header_problem(fid)))
        truncated = None
        if lengths is not None and listed:
            truncated = manifest_truncation(fid, size, lengths[fid])
            out += found(truncated)
        end = stored[2] if stored is not None else 0
        if truncated is None and end > size:
            out += found(end_past_file(fid, size, end))
        elif stored is not None and listed and lengths is not None:
            out += found(end_past_manifest(fid, end, lengths[fid]))
        data = lengths[fid] if lengths is not None and listed else size
        exempt = orphan_exempt(fid, data, active_id, output if phase == COPYING else None,
                               sources if phase == DELETING else ())
        if count == 0 and stored is None and not exempt:
            out.append(orphan(fid, size))
        if lengths is not None and not listed and count:
            out.append(unlisted(fid, count))
    if phase == COPYING and fid == output and count:
        out.append(Finding(k.BAD_COMPACTION_RECORD, file_id=fid, detail=(
            f"{count} messages refer to the output of a pass still copying")))
    if stored is not None and stored[0] < 0:
        return out  # an S record that does not decode: reported already
    out += found(record_mismatch(fid, stored, count, nbytes))
    if stored is not None:
        out += found(records_past_end(fid, max_end, stored[2]))
    return out


def records_past_end(fid: int, max_end: int, end: int) -> Finding | None:
    """Messages refer to records past the ``S`` record's data end."""
    if max_end <= end:
        return None
    return Finding(k.SEGMENT_RECORD_MISMATCH, file_id=fid, detail=(
        f"messages refer to records up to offset {max_end}, past the S record's data "
        f"end {end}"))


# Records that share bytes: per segment, ordered by offset then id (the Spark
# audit's tasks and driver, and the check, call these).
def _sorted(f: np.ndarray, o: np.ndarray, e: np.ndarray, m: np.ndarray
            ) -> tuple[np.ndarray, ...]:
    import numpy as np

    order = np.lexsort((m, o, f))
    return f[order], o[order], e[order], m[order]


def running_end(f: np.ndarray, e: np.ndarray) -> np.ndarray:
    """For each record (sorted by segment, offset), the largest end of the records
    before it in its segment; -1 for a segment's first record."""
    import numpy as np

    prev = np.full(len(f), -1, np.int64)
    starts = np.flatnonzero(np.r_[True, f[1:] != f[:-1]])
    for a, b in zip(starts, np.r_[starts[1:], len(f)], strict=True):
        prev[a + 1 : b] = np.maximum.accumulate(e[a : b - 1])
    return prev


def overlaps(f: np.ndarray, o: np.ndarray, e: np.ndarray, m: np.ndarray
             ) -> Iterator[tuple[str, int, int, int, str]]:
    """(kind, message id, file id, offset, detail) of every record that starts
    before an earlier record of its segment (ordered by offset, then id) ends."""
    import numpy as np

    f, o, e, m = _sorted(f, o, e, m)
    prev = running_end(f, e)
    for i in np.flatnonzero(o < prev).tolist():
        yield (k.OVERLAP, int(m[i]), int(f[i]), int(o[i]),
               f"record [{o[i]}, {e[i]}) overlaps an earlier record ending at {prev[i]} "
               f"(the record before it belongs to message {m[i - 1]})")
