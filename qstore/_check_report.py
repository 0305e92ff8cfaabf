"""What the integrity check reports: finding kinds, :class:`Finding` and :class:`CheckReport`.

The kind names are the Spark audit's (``qstore/spark/_audit_checks.py``) where
the two look at the same thing, so a finding means the same whichever found
it. docs/check.md explains every kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .payload import _format as fmt

# Kinds shared with the Spark audit (same strings, same meaning).
CRC_MISMATCH = "crc_mismatch"  # message: the record's checksum does not match its bytes
LENGTH_MISMATCH = "length_mismatch"  # message: the frame's length is not the reference's
OUT_OF_BOUNDS = "out_of_bounds"  # message: the record is not inside the segment's data
MISSING_SEGMENT = "missing_segment"  # message or segment: the segment file is not there
BAD_SEGMENT_HEADER = "bad_segment_header"  # message or segment: the file header is damaged
BAD_RECORD = "bad_record"  # message: its record does not decode, or a field is invalid
INDEX_MISSING = "index_missing"  # message: its key in the index of its state (or dedup) is absent
STRAY_INDEX_KEY = "stray_index_key"  # index key: no message owns it, or it disagrees with it
MESSAGE_WITHOUT_QUEUE = "message_without_queue"  # message: its queue id has no Q record
ORPHAN_QUEUE_KEYS = "orphan_queue_keys"  # per-queue keys of a queue id with no Q record
COUNTER_MISMATCH = "counter_mismatch"  # queue: the C record differs from a recount
SEGMENT_RECORD_MISMATCH = "segment_record_mismatch"  # segment: the S record differs
SEGMENT_TRUNCATED = "segment_truncated"  # segment: the file is shorter than its data
ORPHAN_SEGMENT = "orphan_segment"  # segment: a file nothing references or accounts for
UNLISTED_SEGMENT = "unlisted_segment"  # segment: a referenced file missing from the manifest
# Kinds of the check only.
BAD_QUEUE_RECORD = "bad_queue_record"  # queue: its Q record does not decode
ID_ABOVE_HWM = "id_above_hwm"  # message: its id is not below M"id_hwm" (could be reused)
OVERLAP = "overlap"  # message: its bytes overlap an earlier record's in the same segment
BAD_COMPACTION_RECORD = "bad_compaction_record"  # M"compaction" does not decode or disagrees
# A note, not damage: a compaction pass was interrupted; the next open finishes it.
COMPACTION_IN_PROGRESS = "compaction_in_progress"
# A note: damaged payload of a message already moved to the dead letters for it
# (by a pop, or by `qstore check --repair`), or segment damage that only such
# messages touch. The bytes are kept as they are; nothing more is to be done.
DAMAGED_SET_ASIDE = "damaged_set_aside"
# A note: the payload bytes (or the segment's length) of a message are not as
# its record says, but the payload journal (durability="always") holds them; the
# next read-write open writes them back (a store that stopped before its checkpoint).
JOURNALED = "journaled"
# Segment-level damage kinds that become DAMAGED_SET_ASIDE notes when every
# damaged message in the segment was set aside.
SEGMENT_DAMAGE = frozenset({MISSING_SEGMENT, BAD_SEGMENT_HEADER, SEGMENT_TRUNCATED})

NOT_IN_MANIFEST = "segment is not listed in the snapshot manifest"
HEADER_REASONS = frozenset({fmt.BAD_MAGIC, fmt.BAD_VERSION, fmt.BAD_HEADER_CRC,
                            fmt.WRONG_FILE_ID, fmt.SHORT_HEADER})
# Corruption reasons of qstore.payload (docs/payload-format.md) -> finding kind.
REASON_KINDS = {
    fmt.BAD_CRC: CRC_MISMATCH,
    fmt.BAD_LENGTH: LENGTH_MISMATCH,
    fmt.OUT_OF_BOUNDS: OUT_OF_BOUNDS,
    fmt.MISSING_SEGMENT: MISSING_SEGMENT,
    NOT_IN_MANIFEST: MISSING_SEGMENT,
    **{reason: BAD_SEGMENT_HEADER for reason in HEADER_REASONS},
}


@dataclass(frozen=True)
class Finding:
    """One inconsistency: its kind and where it is (the fields that apply are set)."""

    kind: str
    queue: str | None = None
    message_id: int | None = None
    file_id: int | None = None
    offset: int | None = None
    detail: str = ""

    def sort_key(self) -> tuple[Any, ...]:
        return (self.kind, self.queue or "", -1 if self.message_id is None else self.message_id,
                -1 if self.file_id is None else self.file_id, self.offset or 0)

    def where(self) -> str:
        """Where the finding is, in words: ``message 7 in 'emails' segment 2 @ 24``."""
        parts = []
        if self.message_id is not None:
            parts.append(f"message {self.message_id}")
        if self.queue is not None:
            parts.append(f"in {self.queue!r}" if parts else f"queue {self.queue!r}")
        if self.file_id is not None:
            at = f" @ {self.offset}" if self.offset is not None else ""
            parts.append(f"segment {self.file_id}{at}")
        return " ".join(parts) or "store"

    def __str__(self) -> str:
        return f"{self.kind}: {self.where()}: {self.detail}"


@dataclass(frozen=True)
class CheckReport:
    """The result of :func:`qstore.Store.check` (and ``qstore check``).

    ``findings`` are inconsistencies (``ok`` is True when there are none);
    ``notes`` are facts worth knowing that need nothing done (an interrupted
    compaction pass, damage already set aside). The counts say how much was
    checked. ``repairs`` (only from ``check(repair=True)``) says what the
    repair did, one entry per action, each a :class:`Finding` whose ``kind``
    names the action; the findings are then those of a check after it.
    """

    findings: tuple[Finding, ...]
    notes: tuple[Finding, ...]
    queues: int  # queue records read
    messages: int  # message records read
    segments: int  # segment files found
    payload_bytes: int  # payload bytes read and found intact (frames not counted)
    repairs: tuple[Finding, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.findings

    def by_kind(self) -> dict[str, int]:
        """How many findings of each kind, sorted by kind."""
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.kind] = out.get(f.kind, 0) + 1
        return dict(sorted(out.items()))

    def summary(self) -> str:
        """One line: what was checked and the verdict."""
        checked = (f"{self.messages:,} messages in {self.queues:,} queues, "
                   f"{self.segments:,} segments, {self.payload_bytes:,} payload bytes verified")
        if self.notes:  # a repaired store reads "clean" while bodies are gone: say so
            kinds: dict[str, int] = {}
            for n in self.notes:
                kinds[n.kind] = kinds.get(n.kind, 0) + 1
            checked += "; notes: " + ", ".join(f"{c:,} {k}" for k, c in sorted(kinds.items()))
        if self.ok:
            return f"clean: {checked}"
        return f"{len(self.findings):,} findings: {checked}"
