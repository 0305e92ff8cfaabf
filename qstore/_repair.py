"""``store.check(repair=True)``, ``qstore check --repair``: set damage aside, rebuild the rest.

A repair runs the integrity check (``_check.py``) under the writer lock and
then, from the primary records (queue ``Q`` and message ``m`` records) only:

1. moves every message whose payload is damaged to the dead letters with
   the reason ``"damaged payload: <what is wrong>"``, as a pop does (case 7);
   a dead letter whose payload is damaged gets that reason recorded. The
   bytes stay where they are: the check then reports them as
   ``damaged_set_aside`` notes, not findings;
2. checks again, and rewrites what is derived from the message records in
   one synced batch: missing index keys are put, stray ones deleted, each
   queue's ``C`` counters and each segment's ``S`` record set to the
   recount, ``M id_hwm`` raised above every id;
3. retires a segment whose header is damaged once no message refers to it
   (``_retire_damaged``): renamed to ``<segment>.damaged``, bytes kept, its
   ``S`` record dropped, so the check no longer reports it for good;
4. checks a last time: the report it returns is that check's, with
   ``repairs`` listing every action.

It deletes no payload and no message record, ever (a retired segment is
renamed, not deleted). What it cannot rebuild
from the primary records stays a finding: a message record that does not
decode, a message without its queue, keys of a queue id without a ``Q``
record, an orphan segment file, a dedup key two messages claim, and an
``S`` record counting more live records than messages refer to (lowering it
would let compaction delete a file that may hold messages whose records were
lost, once it moved the others).
"""

from __future__ import annotations

import dataclasses
import logging
import os

from . import _check_report as k
from . import _states as states
from ._check import Check, inspect_store
from ._check_report import CheckReport, Finding
from ._core import Core
from ._errors import StorageError
from ._hot import ID_BLOCK
from ._txn import QueueState, Txn
from .meta import keys, records

log = logging.getLogger("qstore.repair")

# What a repair did (the ``kind`` of each entry of ``CheckReport.repairs``).
MOVED_ASIDE = "moved_aside"  # a message with a damaged payload went to the dead letters
REASON_RECORDED = "reason_recorded"  # a damaged dead letter got the damaged-payload reason
INDEX_KEY_ADDED = "index_key_added"
INDEX_KEY_REMOVED = "index_key_removed"
COUNTERS_REBUILT = "counters_rebuilt"
SEGMENT_RECORD_REBUILT = "segment_record_rebuilt"
SEGMENT_RECORD_REMOVED = "segment_record_removed"
# A damaged segment nothing refers to, renamed to <segment>.damaged (kept, not listed)
SEGMENT_RETIRED = "segment_retired"
ID_HWM_RAISED = "id_hwm_raised"


def repair(core: Core, payload_dir: str) -> CheckReport:
    """Repair the store of ``core`` (writer lock held); the check after it, with ``repairs``."""
    done: list[Finding] = []
    active = core.payload.active_id
    core.settle_segments()  # S records as this process counts them: none defers a push
    _, first = inspect_store(core.meta, payload_dir, active_id=active)
    _set_aside(core, first.damaged, done)
    checked, second = inspect_store(core.meta, payload_dir, active_id=active)
    _rebuild(core, second, done)
    _retire_damaged(core, checked, second, done)
    report, _ = inspect_store(core.meta, payload_dir, active_id=active)
    # One line says what changed; each action is at INFO (the command line prints
    # each on stdout already, and printed them twice when they were warnings).
    if done:
        kinds: dict[str, int] = {}
        for entry in done:
            kinds[entry.kind] = kinds.get(entry.kind, 0) + 1
        log.warning("repair: %d actions (%s)", len(done),
                    ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())))
    for entry in done:
        log.info("repair: %s", entry)
    return dataclasses.replace(report, repairs=tuple(done))


def _set_aside(core: Core, damaged: list[tuple[int, int, str]], done: list[Finding]) -> None:
    by_qid = {q.qid: q for q in core.queues.values()}
    txn = Txn()
    for qid, mid, problem in damaged:
        q = by_qid.get(qid)
        if q is None:
            continue  # a message without its queue: reported, left as it is
        key = keys.message_key(qid, mid)
        raw = core.meta.get(key)
        if raw is None:
            continue
        rec = records.MessageRecord.decode(raw)
        reason = f"{records.DAMAGED_REASON}: {problem}"
        where = {"queue": q.name, "message_id": mid, "file_id": rec.file_id,
                 "offset": rec.offset}
        if rec.state == records.DEAD:
            was = rec.reason
            rec.reason = reason
            txn.put_record(key, rec.encode())
            done.append(Finding(REASON_RECORDED, **where,  # type: ignore[arg-type]
                                detail=f"dead letter's reason {was!r} -> {reason!r}"))
            continue
        was_state = records.STATE_NAMES[rec.state]
        states.bury(txn, q, mid, rec, reason)
        done.append(Finding(MOVED_ASIDE, **where,  # type: ignore[arg-type]
                            detail=f"{was_state} -> dead letters: {reason}"))
    if done:
        core.commit(txn)


def _rebuild(core: Core, check: Check, done: list[Finding]) -> None:
    puts = list(check.missing_keys)
    deletes = list(check.stray_keys)
    for key in deletes:
        done.append(Finding(INDEX_KEY_REMOVED, detail=f"key {key.hex()} (no message implies it)"))
    for key, _ in puts:
        done.append(Finding(INDEX_KEY_ADDED, detail=f"key {key.hex()}"))
    counts = _counters(core, check.counts, done)
    puts.extend(_totals(core, done))
    recount = {fid: list(seg) for fid, seg in check.segs.items()}
    for fid, (nbytes, count, end) in check.late.items():  # none after settle_segments
        seg = recount.setdefault(fid, [0, 0, 0])
        seg[0] += nbytes
        seg[1] += count
        seg[2] = max(seg[2], end)
    segments = _segments(core, recount, check.files.sizes, done)
    hwm = _id_hwm(core, check.max_id, done)
    if puts or deletes or counts or segments or hwm is not None:
        core.rebuild_derived(puts, deletes, counts, segments, hwm)


def _counters(core: Core, recount: dict[int, list[int]], done: list[Finding]
              ) -> dict[QueueState, list[int]]:
    out: dict[QueueState, list[int]] = {}
    for q in sorted(core.queues.values(), key=lambda s: s.name):
        want = recount.get(q.qid, [0, 0, 0, 0, 0])
        raw = core.meta.get(q.counts_key)
        try:
            stored = None if raw is None else list(records.decode_counts(raw))
        except (StorageError, ValueError, TypeError):
            stored = None
        if stored != want:
            out[q] = want
            done.append(Finding(COUNTERS_REBUILT, queue=q.name, detail=(
                f"[ready, delayed, in_flight, dead, bytes] {stored} -> {want}")))
    return out


def _totals(core: Core, done: list[Finding]) -> list[tuple[bytes, bytes]]:
    """A queue's E totals record that does not decode, written again with what the
    open counts from (0 expired: a lifetime total, not derivable from messages).
    It stayed a finding after every repair (a check-vs-audit differential)."""
    out = []
    for q in sorted(core.queues.values(), key=lambda s: s.name):
        raw = core.meta.get(keys.totals_key(q.qid))
        if raw is None:
            continue
        try:
            records.decode_totals(raw)
        except StorageError:
            out.append((keys.totals_key(q.qid), records.encode_totals(q.expired)))
            done.append(Finding(COUNTERS_REBUILT, queue=q.name, detail=(
                f"E record: did not decode; expired -> {q.expired}")))
    return out


def _segments(core: Core, recount: dict[int, list[int]], sizes: dict[int, int],
              done: list[Finding]) -> dict[int, tuple[int, int, int] | None]:
    stored: dict[int, tuple[int, int, int] | None] = {}
    for key, value in core.meta.scan(keys.SEGMENT, keys.prefix_end(keys.SEGMENT)):
        if len(key) != 9:
            continue  # not an S key of this layout: reported, left as it is
        try:
            b, n, end = records.decode_segment(value)
            ok = all(type(v) is int and v >= 0 for v in (b, n, end))
        except (StorageError, ValueError, TypeError, IndexError):
            ok = False
        stored[keys.segment_id(key)] = (b, n, end) if ok else None
    active = core.payload.active_id
    out: dict[int, tuple[int, int, int] | None] = {}
    for fid in sorted(set(stored) | set(recount)):
        nbytes, count, max_end = recount.get(fid, [0, 0, 0])
        old = stored.get(fid)
        size = sizes.get(fid)
        if old is not None and count < old[1] and size is not None:
            # Live records that no message refers to: maybe messages whose records
            # were lost. Lowering the count would let compaction delete the file
            # (once it moved the messages left, or at once if none is): left.
            continue
        if fid in stored and size is None and count == 0:
            out[fid] = None  # the record of a file that is gone and that nothing needs
            done.append(Finding(SEGMENT_RECORD_REMOVED, file_id=fid, detail=(
                f"S record {old} of a missing file that no message refers to")))
            continue
        if fid not in stored and count == 0:
            continue  # an unreferenced file (the active one, or an orphan): nothing derived
        end = old[2] if old is not None else max_end
        if size is not None and fid != active:
            end = min(end, size)  # a sealed file's data ends at its size
        want = (nbytes, count, max(end, max_end))
        if want != old:
            out[fid] = want
            done.append(Finding(SEGMENT_RECORD_REBUILT, file_id=fid, detail=(
                f"[live bytes, live count, end] "
                f"{list(old) if old is not None else None} -> {list(want)}")))
    return out


def _retire_damaged(core: Core, report: CheckReport, check: Check,
                    done: list[Finding]) -> None:
    """Rename damaged segments that nothing refers to out of the way; drop their S records.

    A segment whose header is damaged is kept while a message (a dead letter
    set aside for it) refers to it. Once none does, nothing can ever read it
    and the check would report it for good: it becomes ``<segment>.damaged``
    (``SegmentSet.retire_damaged``: its bytes kept, never listed again), then
    its ``S`` record goes. In that order: a crash between leaves an ``S``
    record of a missing file that nothing refers to, which the next repair
    removes; the file is never deleted. Nothing is retired while a message
    record does not decode or validate (it may refer to any segment). Left: a
    file whose ``S`` record counts live records (messages whose records were
    lost may be in it: a finding stays), one a compaction pass names, one the
    payload journal holds records of, and the active segment.
    """
    if any(f.kind == k.BAD_RECORD for f in report.findings):
        # A record that does not decode or validate may name any segment and is
        # counted in none: retire nothing while one is there (a review).
        return
    headers = {f.file_id for f in report.findings
               if f.kind == k.BAD_SEGMENT_HEADER and f.file_id is not None}
    busy = {fid for fid, _ in check.journal} | set(check.segs) | set(check.late)
    raw = core.meta.get(keys.COMPACTION_KEY)
    if raw is not None:
        _, output, sources = records.decode_compaction(raw)
        busy |= {output, *sources}
    for fid in sorted(headers & set(core.payload.damaged) - busy):
        seg = core.segments.get(fid)
        if fid == core.payload.active_id or (seg is not None and seg[1] > 0):
            continue
        reason = core.payload.damaged[fid]
        path = core.payload.path_of(fid)
        kept = core.payload.retire_damaged(fid)
        if seg is not None:
            core.write_synced(deletes=[keys.segment_key(fid)])
            core.segments.pop(fid, None)
        record = f", its S record {seg} removed" if seg is not None else ""
        done.append(Finding(SEGMENT_RETIRED, file_id=fid, detail=(
            f"header damaged ({reason}) and no message refers to it: "
            f"{os.path.basename(path)} renamed to {os.path.basename(kept)}{record}")))


def _id_hwm(core: Core, max_id: int, done: list[Finding]) -> int | None:
    raw = core.meta.get(keys.ID_HWM_KEY)
    hwm = records.unpack(raw, "id")[1] if raw is not None else 0
    if max_id < hwm:
        return None
    new = max_id + 1 + ID_BLOCK
    done.append(Finding(ID_HWM_RAISED, detail=f"M id_hwm {hwm} -> {new} (above message {max_id})"))
    return new
