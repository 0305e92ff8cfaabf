"""The integrity check of a store or a snapshot in one process: ``store.check()``.

One pass over every message record (streamed: nothing per message is kept
but small per-queue and per-segment recounts) checks that it decodes, that
its payload reference resolves to an intact record (through
:class:`qstore.payload.SegmentReader`), and that the one index key its state
implies (``keys.index_key``), its dedup key (a live message's; a dead letter
holds none from store format 2) and, with a TTL, its expiry key
(``keys.expiry_key``) exist. A pass over each index
then checks that every key belongs to a message that implies exactly that key.
Finally the ``C`` counters and ``S`` segment records are compared with the
recounts, and the segment files with what refers to them. docs/check.md lists
every finding kind.

The tests (``tests/queue/_support.py``), ``tools/crash.py`` and the backfill
tests use this check rather than recounting by hand.
"""

from __future__ import annotations

import array
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from . import _check_report as k
from ._check_files import SegmentFiles
from ._check_report import CheckReport, Finding
from ._check_segments import check_segments, overlaps
from ._core import writer_running
from ._errors import Corruption, InvalidArgument, StorageError
from ._seg_accounts import covered_ids
from ._snapshot import MANIFEST, read_manifest
from ._snapshot import unfinished as unfinished_snapshot
from .meta import MetaDB, keys, records
from .payload import PayloadRef, SegmentReader
from .payload import _format as fmt

BATCH = 1024  # keys per multi_get
PHASES = (records.COPYING, records.REPOINTING, records.DELETING)  # of M"compaction"
_INDEX_NAMES = {keys.READY: "ready", keys.DELAYED: "delayed", keys.INFLIGHT: "in_flight",
                keys.DEAD: "dead", keys.DEDUP: "dedup", keys.EXPIRY: "expiry"}


def check_path(path: str | os.PathLike[str]) -> CheckReport:
    """Check the store or snapshot (a directory with ``MANIFEST.json``) at ``path``.

    Opens the metadata read-only, so it works beside a running writer (it then
    checks the state of the moment it opened). Raises ``InvalidArgument`` if
    ``path`` is neither, ``Corruption`` if payload segments lie there without
    metadata.
    """
    path = os.fspath(path)
    meta_path = os.path.join(path, "meta")
    payload_dir = os.path.join(path, "payload")
    lengths: dict[int, int] | None = None
    active: int | None = None
    if os.path.exists(os.path.join(path, MANIFEST)):
        manifest = read_manifest(path)
        lengths = {int(s["file_id"]): int(s["length"]) for s in manifest["segments"]}
        active = manifest.get("active_id")
    if unfinished_snapshot(path):
        raise InvalidArgument(f"{path!r} holds a snapshot whose taking was cut short (its "
                              "process was killed): nothing in it is to be read; remove "
                              "it, or take the snapshot to it again (which replaces it)")
    if not os.path.isdir(meta_path):
        if os.path.isdir(payload_dir) and any(
                fmt.parse_segment_name(n) is not None for n in os.listdir(payload_dir)):
            raise Corruption(meta_path, 0, "metadata directory is missing")
        raise InvalidArgument(f"{path!r} is not a qstore store or snapshot")
    # Beside a running writer, its active segment is not known here (a pass's
    # output may have a higher id): checked as a view's check is.
    beside = lengths is None and writer_running(path)
    files = SegmentFiles(payload_dir, lengths)  # before the metadata: see _check_files
    try:
        if active is None and lengths is None:
            active = max(files.sizes, default=None)
        with _readonly_meta(meta_path, path) as meta:
            return Check(meta, files, active, view=beside).run()
    finally:
        files.close()


@contextmanager
def _readonly_meta(meta_path: str, store_path: str) -> Iterator[MetaDB]:
    meta = MetaDB(meta_path, readonly=True, store_path=store_path)
    try:
        yield meta
    finally:
        meta.close()


def run_check(meta: MetaDB, payload_dir: str, lengths: Mapping[int, int] | None = None, *,
              active_id: int | None = None,
              pinned: Mapping[int, SegmentReader] | None = None) -> CheckReport:
    """Check the store whose metadata is ``meta`` (already open) and payload is ``payload_dir``.

    ``lengths``: a snapshot's segment data lengths (its manifest), or None for
    a store (bounds are the file sizes). ``active_id``: the segment being
    appended to, which may hold bytes no record refers to yet (default: the
    highest id on disk). The caller keeps ``meta`` from changing meanwhile
    (``Store.check`` holds the writer lock). ``pinned``: a read-only view's
    open segment readers, which stand for files the writer deleted since.
    """
    return inspect_store(meta, payload_dir, lengths, active_id=active_id, pinned=pinned)[0]


def inspect_store(meta: MetaDB, payload_dir: str, lengths: Mapping[int, int] | None = None, *,
                  active_id: int | None = None,
                  pinned: Mapping[int, SegmentReader] | None = None) -> tuple[CheckReport, Check]:
    """:func:`run_check`, also returning the :class:`Check` (its recounts, for a repair)."""
    files = SegmentFiles(payload_dir, lengths, pinned)
    try:
        if active_id is None:
            active_id = max(files.sizes, default=None)
        check = Check(meta, files, active_id, view=pinned is not None)
        return check.run(), check
    finally:
        files.close()


def decode_message(value: bytes, rec_q: records.QueueRecord | None
                   ) -> records.MessageRecord | str:
    """The record, or why it is not a valid message record (for ``rec_q``'s queue)."""
    try:
        rec = records.MessageRecord.decode(value)
    except (StorageError, ValueError, TypeError, IndexError) as exc:
        return f"message record does not decode: {exc}"
    problem = message_problem(rec, rec_q.priority_type if rec_q is not None else None)
    return rec if problem is None else problem


_UNSIGNED = ("file_id", "offset", "length", "attempts", "deliveries", "when_us", "expires_us",
             "aged")


def message_problem(rec: records.MessageRecord, priority_type: str | None) -> str | None:
    """Why a decoded message record is not valid for a queue of ``priority_type``
    (None: no queue record, any priority type), or None. The Spark audit uses it too."""
    if type(rec.state) is not int or not 0 <= rec.state <= records.DEAD:
        return f"unknown state {rec.state!r}"
    for name in _UNSIGNED:
        v = getattr(rec, name)
        if type(v) is not int or not 0 <= v < 2**64:
            return f"field {name} is {v!r:.30}, not an unsigned integer"
    if type(rec.enqueued_at) not in (int, float) or not math.isfinite(rec.enqueued_at):
        return f"field enqueued_at is {rec.enqueued_at!r:.30}, not a finite number"
    if rec.digest is not None and (type(rec.digest) is not bytes or len(rec.digest) != 16):
        return f"dedup digest is not 16 bytes: {rec.digest!r:.60}"
    if rec.reason is not None and type(rec.reason) is not str:
        return f"dead-letter reason is {rec.reason!r:.30}, not a str"
    if rec.expires_us and rec.state == records.DEAD:
        return "a dead letter has an expiry time (dead letters do not expire)"
    if priority_type == "int" and (type(rec.priority) is not int
                                   or not keys.INT_MIN <= rec.priority <= keys.INT_MAX):
        return f"priority {rec.priority!r:.60} is not a signed 64-bit int"
    if priority_type == "str" and type(rec.priority) is not str:
        return f"priority {rec.priority!r:.60} is not a str"
    return None


class Check:
    """One run of the check; after :meth:`run` its recounts and lists feed a repair."""

    def __init__(self, meta: MetaDB, files: SegmentFiles, active_id: int | None,
                 view: bool = False) -> None:
        self.meta = meta
        self.files = files
        self.active_id = active_id
        self.view = view  # a read-only view's check, beside a writer
        self.findings: list[Finding] = []
        self.notes: list[Finding] = []
        self.queues: dict[int, tuple[str, records.QueueRecord]] = {}
        self.counts: dict[int, list[int]] = {}  # qid -> [ready, delayed, in_flight, dead, bytes]
        self.segs: dict[int, list[int]] = {}  # fid -> [bytes with frames, count, max end]
        # The S records that defer pushes (file id -> covered id, _seg_accounts.py):
        # their messages with ids from it up are counted apart, in ``late``.
        self.covered = covered_ids(meta)
        self.late: dict[int, list[int]] = {}
        self.messages = 0
        self.verified = 0
        self.max_id = -1
        self._pending: list[tuple[bytes, bytes | None, str, int, str]] = []
        # Format 1 dead letters keep their dedup key; from format 2 they hold none.
        self.dead_keep_dedup = records.dead_letters_own_dedup_keys(
            records.readable_store_format(meta.get(keys.FORMAT_KEY), meta.path))
        # What a repair (_repair.py) needs, beyond the findings:
        # messages with damaged payloads not yet set aside: (qid, id, reason)
        self.damaged: list[tuple[int, int, str]] = []
        self.missing_keys: list[tuple[bytes, bytes]] = []  # index keys to put (key, value)
        self.stray_keys: list[bytes] = []  # index keys no message implies
        # file id -> messages with damaged payloads in it: [set aside, not set aside]
        self.damage_by_segment: dict[int, list[int]] = {}
        # (file id, offset) -> body length of the records the payload journal holds
        self.journal = {keys.journal_parts(key): len(body) for key, body in
                        meta.scan(keys.JOURNAL, keys.prefix_end(keys.JOURNAL))}

    def add(self, kind: str, **where: object) -> None:
        self.findings.append(Finding(kind, **where))  # type: ignore[arg-type]

    def run(self) -> CheckReport:
        self._read_queues()
        compaction = self._read_compaction()
        self._messages()
        for qid, (name, rec_q) in self.queues.items():
            for kind in (keys.READY, keys.DELAYED, keys.INFLIGHT, keys.DEAD, keys.DEDUP,
                         keys.EXPIRY):
                self._index(qid, name, rec_q, kind)
        self._orphan_queue_keys()
        self._counters()
        journaled_files = {fid for fid, _ in self.journal}
        for f in check_segments(self.meta, self.files, self.segs, self.active_id, compaction,
                                view=self.view, late=self.late):
            if f.kind == k.SEGMENT_TRUNCATED and f.file_id in journaled_files:
                self.notes.append(Finding(k.JOURNALED, file_id=f.file_id, detail=(
                    f"{f.kind}: {f.detail}; the payload journal holds records of it, which "
                    "the next read-write open writes back")))
            elif f.kind in k.SEGMENT_DAMAGE and f.file_id is not None and self._all_set_aside(
                    f.file_id):
                self.notes.append(Finding(k.DAMAGED_SET_ASIDE, file_id=f.file_id,
                                          offset=f.offset, detail=(
                    f"{f.kind}: {f.detail}; every message damaged by it was moved to the "
                    "dead letters")))
            else:
                self.findings.append(f)
        return CheckReport(tuple(sorted(self.findings, key=Finding.sort_key)),
                           tuple(self.notes), len(self.queues), self.messages,
                           len(self.files.sizes), self.verified)

    def _all_set_aside(self, file_id: int) -> bool:
        aside, not_aside = self.damage_by_segment.get(file_id, (0, 0))
        return aside > 0 and not_aside == 0

    # -- queues and the compaction record -----------------------------------

    def _read_queues(self) -> None:
        for key, value in self.meta.scan(keys.QUEUE, keys.prefix_end(keys.QUEUE)):
            name = key[1:].decode("utf-8", "replace")
            try:
                rec = records.QueueRecord.decode(value)
                if type(rec.qid) is not int or rec.qid < 0 or rec.qid >= 2**32:
                    raise ValueError(f"queue id {rec.qid!r}")
                keys.priority_key(rec.order, rec.priority_type, 0 if rec.priority_type ==
                                  "int" else "")
            except (StorageError, ValueError, TypeError, IndexError) as exc:
                self.add(k.BAD_QUEUE_RECORD, queue=name, detail=f"Q record: {exc}")
                continue
            self.queues[rec.qid] = (name, rec)

    def _read_compaction(self) -> tuple[str, int, list[int]] | None:
        raw = self.meta.get(keys.COMPACTION_KEY)
        if raw is None:
            return None
        try:
            phase, output, sources = records.decode_compaction(raw)
            if phase not in PHASES or type(output) is not int or not all(
                    type(s) is int for s in sources):
                raise ValueError(f"phase {phase!r}, output {output!r}, sources {sources!r}")
        except (StorageError, ValueError, TypeError, IndexError) as exc:
            self.add(k.BAD_COMPACTION_RECORD, detail=f"M compaction: {exc}")
            return None
        self.notes.append(Finding(k.COMPACTION_IN_PROGRESS, file_id=output, detail=(
            f"a compaction pass was interrupted in phase {phase!r} (output {output}, sources "
            f"{sources}); the next read-write open finishes or rolls it back")))
        return phase, output, list(sources)

    # -- messages --------------------------------------------------------------

    def _messages(self) -> None:
        raw_hwm = self.meta.get(keys.ID_HWM_KEY)
        hwm = None
        if raw_hwm is not None:
            try:
                hwm = records.unpack(raw_hwm, "id")[1]
                if type(hwm) is not int:
                    raise ValueError(f"the mark {hwm!r:.40} is not an int")
            except (StorageError, ValueError, TypeError, IndexError) as exc:
                self.add(k.BAD_RECORD, detail=f"M id_hwm record does not decode: {exc}")
                hwm = None
        # (file id, offset, end, id, queue id) of every record, for _overlaps.
        spans = array.array("q")
        for key, value in self.meta.scan(keys.MESSAGE, keys.prefix_end(keys.MESSAGE)):
            self.messages += 1
            if len(key) != keys.QID_ID.size + 1:
                self.add(k.BAD_RECORD, detail=f"message key {key.hex()} is not m qid:u32 id:u64")
                continue
            qid, mid = keys.QID_ID.unpack_from(key, 1)
            known = self.queues.get(qid)
            name = known[0] if known is not None else None
            if mid >= 2**63:
                # As the audit says it (spark/_scan.py): no push hands such an id out.
                # Counted as a message, a repair raised M id_hwm past 2**63, and every
                # later push was an audit finding (a check-vs-audit differential).
                self.add(k.BAD_RECORD, queue=name, message_id=mid, detail=(
                    f"message key {key.hex()}: id {mid} is 2**63 or more, which no push "
                    "hands out"))
                continue
            rec = decode_message(value, known[1] if known is not None else None)
            if isinstance(rec, str):
                self.add(k.BAD_RECORD, queue=name, message_id=mid, detail=rec)
                continue
            if hwm is not None and mid >= hwm:
                self.add(k.ID_ABOVE_HWM, queue=name, message_id=mid,
                         detail=f"ids below {hwm} may have been handed out (M id_hwm)")
            counts = self.counts.setdefault(qid, [0, 0, 0, 0, 0])
            counts[rec.state] += 1
            counts[4] += rec.length
            ref = PayloadRef(rec.file_id, rec.offset, rec.length)
            # (a bigger one is out of bounds, which files.check below reports)
            if rec.offset + ref.frame_bytes < 2**63 and rec.file_id < 2**63:
                spans.extend((rec.file_id, rec.offset, rec.offset + ref.frame_bytes, mid, qid))
            c = self.covered.get(rec.file_id)
            tally = self.segs if c is None or mid < c else self.late
            seg = tally.setdefault(rec.file_id, [0, 0, 0])
            seg[0] += ref.frame_bytes
            seg[1] += 1
            seg[2] = max(seg[2], rec.offset + ref.frame_bytes)
            self.max_id = max(self.max_id, mid)
            problem = self.files.check(ref)
            if problem is None:
                self.verified += rec.length
            else:
                self._damaged_payload(qid, mid, name, rec, problem)
            if known is None:
                self.add(k.MESSAGE_WITHOUT_QUEUE, message_id=mid, file_id=rec.file_id,
                         offset=rec.offset, detail=f"its queue id {qid} has no Q record")
                continue
            rec_q = known[1]
            pkey = keys.priority_key(rec_q.order, rec_q.priority_type, rec.priority)
            want = keys.index_key(rec.state, qid, mid, pkey, rec.when_us)
            self._expect(want, None, name or "", mid, records.STATE_NAMES[rec.state])
            if rec.digest is not None and (rec.state != records.DEAD or self.dead_keep_dedup):
                self._expect(keys.dedup_key(qid, rec.digest), keys.U64.pack(mid), name or "",
                             mid, "dedup")
            if rec.expires_us:
                self._expect(keys.expiry_key(qid, rec.expires_us, mid), None, name or "", mid,
                             "expiry")
        self._flush()
        self._overlaps(spans)

    def _overlaps(self, spans: array.array[int]) -> None:
        """Two messages whose records share bytes (one points at another's record):
        each record read intact, so nothing else here saw it, and ``get`` of one
        returned the other's bytes (a check-vs-audit differential: the audit
        found it, the check called the store clean). The audit's own test."""
        if not spans:
            return
        import numpy as np  # with the first check that has messages, not at open

        table = np.frombuffer(spans, np.int64).reshape(-1, 5)
        names = {qid: name for qid, (name, _) in self.queues.items()}
        queue_of = dict(zip(map(tuple, table[:, [3, 0, 1]].tolist()), table[:, 4].tolist(),
                            strict=True))  # (id, file id, offset) -> queue id
        for kind, mid, fid, off, detail in overlaps(table[:, 0], table[:, 1], table[:, 2],
                                                    table[:, 3]):
            self.add(kind, queue=names.get(queue_of.get((mid, fid, off), -1)), message_id=mid,
                     file_id=fid, offset=off, detail=detail)

    def _damaged_payload(self, qid: int, mid: int, name: str | None,
                         rec: records.MessageRecord, problem: str) -> None:
        """A finding, or a note if the message was already moved aside for it or the
        payload journal holds its bytes."""
        kind = k.REASON_KINDS.get(problem, k.BAD_RECORD)
        if self.journal.get((rec.file_id, rec.offset)) == rec.length:
            self.notes.append(Finding(k.JOURNALED, queue=name, message_id=mid,
                                      file_id=rec.file_id, offset=rec.offset, detail=(
                f"{kind}: {problem}; the payload journal holds its bytes, which the next "
                "read-write open writes back")))
            return
        counts = self.damage_by_segment.setdefault(rec.file_id, [0, 0])
        if records.set_aside(rec.state, rec.reason):
            counts[0] += 1
            self.notes.append(Finding(k.DAMAGED_SET_ASIDE, queue=name, message_id=mid,
                                      file_id=rec.file_id, offset=rec.offset, detail=(
                f"{kind}: {problem}; in the dead letters with reason {rec.reason!r}")))
            return
        counts[1] += 1
        self.damaged.append((qid, mid, problem))
        self.add(kind, queue=name, message_id=mid, file_id=rec.file_id, offset=rec.offset,
                 detail=problem)

    def _expect(self, key: bytes, value: bytes | None, queue: str, mid: int, index: str) -> None:
        """Queue the check that ``key`` exists (with ``value``, if given)."""
        self._pending.append((key, value, queue, mid, index))
        if len(self._pending) >= BATCH:
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        got = self.meta.multi_get([p[0] for p in pending])
        for (key, value, queue, mid, index), raw in zip(pending, got, strict=True):
            if raw is None:
                self.missing_keys.append((key, value if value is not None else b""))
                self.add(k.INDEX_MISSING, queue=queue, message_id=mid,
                         detail=f"its key in the {index} index is missing ({key.hex()})")
            elif value is not None and raw != value:
                other = keys.U64.unpack(raw)[0] if len(raw) == 8 else raw.hex()
                self.add(k.INDEX_MISSING, queue=queue, message_id=mid,
                         detail=f"its {index} key names message {other}")

    # -- indexes ---------------------------------------------------------------

    def _index(self, qid: int, name: str, rec_q: records.QueueRecord, kind: bytes) -> None:
        """Every key of one index belongs to a message that implies exactly that key."""
        lo = keys.prefix(kind, qid)
        batch: list[tuple[bytes, bytes, int]] = []
        for key, value in self.meta.scan(lo, keys.prefix_end(lo)):
            why = keys.index_key_problem(kind, key, value)
            if why is not None:
                self._stray(name, None, kind, key, why)
                continue
            mid = keys.U64.unpack(value)[0] if kind == keys.DEDUP else keys.trailing_id(key)
            batch.append((key, value, mid))
            if len(batch) >= BATCH:
                self._check_owners(qid, name, rec_q, kind, batch)
                batch = []
        self._check_owners(qid, name, rec_q, kind, batch)

    def _check_owners(self, qid: int, name: str, rec_q: records.QueueRecord, kind: bytes,
                      batch: list[tuple[bytes, bytes, int]]) -> None:
        if not batch:
            return
        owners = self.meta.multi_get([keys.message_key(qid, mid) for _, _, mid in batch])
        for (key, _, mid), raw in zip(batch, owners, strict=True):
            if raw is None:
                self._stray(name, mid, kind, key, "no message owns it")
                continue
            rec = decode_message(raw, rec_q)
            if isinstance(rec, str):
                continue  # the message is reported as bad_record; its key cannot be judged
            if kind == keys.DEDUP:
                if rec.digest != key[5:]:
                    self._stray(name, mid, kind, key, "its message has another digest")
                elif rec.state == records.DEAD and not self.dead_keep_dedup:
                    self._stray(name, mid, kind, key, "its message is a dead letter (dead "
                                                      "letters release their dedup key)")
                continue
            if kind == keys.EXPIRY:
                if not rec.expires_us:
                    self._stray(name, mid, kind, key, (
                        f"its message ({records.STATE_NAMES[rec.state]}) has no TTL"))
                elif keys.expiry_key(qid, rec.expires_us, mid) != key:
                    self._stray(name, mid, kind, key, "its message has another expiry time")
                continue
            pkey = keys.priority_key(rec_q.order, rec_q.priority_type, rec.priority)
            if keys.index_key(rec.state, qid, mid, pkey, rec.when_us) != key:
                self._stray(name, mid, kind, key, (
                    f"its message is {records.STATE_NAMES[rec.state]} and implies another key"))

    def _stray(self, name: str, mid: int | None, kind: bytes, key: bytes, why: str) -> None:
        self.stray_keys.append(key)
        self.add(k.STRAY_INDEX_KEY, queue=name, message_id=mid,
                 detail=f"{_INDEX_NAMES[kind]} index key {key.hex()}: {why}")

    def _orphan_queue_keys(self) -> None:
        """Per-queue keys (and counters) of queue ids with no Q record, one finding per kind."""
        for kind in (*keys.PER_QUEUE_KINDS, keys.COUNTS, keys.TOTALS):
            if kind == keys.MESSAGE:
                continue  # each such message is a message_without_queue finding
            lo, hi = kind, keys.prefix_end(kind)
            while (key := self.meta.first_key(lo, hi)) is not None:
                if len(key) < 5:  # not a per-queue key: step over it
                    lo = key + b"\x00"
                    continue
                qid = keys.U32.unpack_from(key, 1)[0]
                if qid not in self.queues:
                    self.add(k.ORPHAN_QUEUE_KEYS, detail=(
                        f"keys with prefix {kind.decode()!r} for queue id {qid}, "
                        "which has no Q record"))
                lo = keys.prefix_end(keys.prefix(kind, qid))

    # -- counters --------------------------------------------------------------

    def _counters(self) -> None:
        for qid, (name, _) in sorted(self.queues.items(), key=lambda kv: kv[1][0]):
            self._totals(qid, name)
            counted = self.counts.get(qid, [0, 0, 0, 0, 0])
            raw = self.meta.get(keys.counts_key(qid))
            if raw is None:
                self.add(k.COUNTER_MISMATCH, queue=name, detail="no C record")
                continue
            try:
                stored = list(records.decode_counts(raw))
            except (StorageError, ValueError, TypeError) as exc:
                self.add(k.COUNTER_MISMATCH, queue=name, detail=f"C record: {exc}")
                continue
            if stored != counted:
                diffs = [f"{f}: stored {s}, recount {c}" for f, s, c in
                         zip(COUNTER_FIELDS, stored, counted, strict=False) if s != c]
                self.add(k.COUNTER_MISMATCH, queue=name,
                         detail="; ".join(diffs) or f"stored {stored}, recount {counted}")


    def _totals(self, qid: int, name: str) -> None:
        """The ``E`` totals record (expired count), if any, decodes to a count."""
        raw = self.meta.get(keys.totals_key(qid))
        if raw is None:
            return  # nothing expired yet
        try:
            expired = records.decode_totals(raw)
        except (StorageError, ValueError, TypeError, IndexError) as exc:
            self.add(k.COUNTER_MISMATCH, queue=name, detail=f"E record: {exc}")
            return
        if expired < 0:
            self.add(k.COUNTER_MISMATCH, queue=name, detail=f"E record: expired {expired} < 0")


COUNTER_FIELDS = ("ready", "delayed", "in_flight", "dead", "bytes")
