"""Store format migrations, 1 -> 3 and 2 -> 3 (docs/meta-schema.md, "Store formats").

Format 2 -> 3 writes the format key alone (:func:`mark_current_format`). 1 -> 3
moves the dedup keys:

Format 1 hashed a push's payload as it was (``blake2b(body)``) and an explicit
dedup key as ``blake2b(b"k" + key)``: a payload ``b"kfoo"`` and the key
``"foo"`` had the same digest, so one push returned the other's id. And a dead
letter kept its dedup key, so no push with that key could enqueue until the
letter was purged or redriven. Format 2 hashes payloads with a personalised
BLAKE2b (:func:`keys.payload_digest`; explicit keys are hashed as before) and
a dead letter holds no ``k`` key (one that dies under format 3 keeps its
digest in its record, for a redrive; one migrated here loses it).

A read-write open of a format 1 store migrates it here before anything else
runs; a read-only open reads format 1 as it is (the integrity check knows
both). The migration is a pass over the messages of dedup queues only:

- a dead letter with a digest: its ``k`` key is deleted and its record loses
  the digest;
- a live message whose digest is the format 1 hash of its payload: the record
  and its ``k`` key move to :func:`keys.payload_digest`. The payload is read
  to tell a payload hash from an explicit key (nothing else says which one it
  was). A message whose payload cannot be read (damage) keeps its digest: it
  still dedups pushes of its explicit key or format 1 hash, never a new push
  of its payload;
- any other digest is an explicit key's, unchanged.

Batches of :data:`CHUNK` messages are written synced; the format key is
written last. A crash in between leaves format 1 and the pass runs again:
a migrated record no longer holds the format 1 hash of its payload, so it is
left alone the second time (the pass is idempotent).
"""

from __future__ import annotations

import logging

from ._errors import Corruption
from .meta import MetaDB, keys, new_batch, records
from .payload import PayloadRef, SegmentSet

log = logging.getLogger("qstore")

CHUNK = 1000  # messages per synced batch


def mark_current_format(meta: MetaDB) -> None:
    """Write the current store format (synced): the last step of every migration.

    Format 2 to 3 is this step alone. Format 3 only gave an existing field a
    meaning: a dead letter's record may keep its digest while it owns no ``k``
    key (a redrive takes the key back). A format 2 build reads such a record as
    owning the key, and its ack of a redriven letter deleted the key of a live
    copy (a cross-version audit), so the number had to change for it to refuse
    the store; the data is already right for format 3.
    """
    batch = new_batch()
    batch.put(keys.FORMAT_KEY, records.pack([records.RECORD_VERSION, records.STORE_FORMAT]))
    meta.write(batch, sync=True)


def migrate_dedup(meta: MetaDB, payload: SegmentSet, dedup_qids: list[int]) -> int:
    """Move the dedup keys of a format 1 store to the current format; the format key last.

    Returns how many message records were rewritten.
    """
    changed = 0
    for qid in dedup_qids:
        lo = keys.prefix(keys.MESSAGE, qid)
        pending: list[tuple[bytes, bytes]] = []
        for key, value in meta.scan(lo, keys.prefix_end(lo)):
            if records.MessageRecord.decode(value).digest is not None:
                pending.append((key, value))
            if len(pending) >= CHUNK:
                changed += _rewrite(meta, payload, qid, pending)
                pending = []
        changed += _rewrite(meta, payload, qid, pending)
    mark_current_format(meta)
    if changed:
        log.info("store format 1 -> %d: %d dedup record(s) rewritten", records.STORE_FORMAT,
                 changed)
    return changed


def _rewrite(meta: MetaDB, payload: SegmentSet, qid: int,
             items: list[tuple[bytes, bytes]]) -> int:
    batch = new_batch()
    changed = 0
    for key, value in items:
        rec = records.MessageRecord.decode(value)
        old = rec.digest
        assert old is not None
        mid = keys.trailing_id(key)
        old_key = keys.dedup_key(qid, old)
        owned = meta.get(old_key) == keys.U64.pack(mid)
        if rec.state == records.DEAD:
            rec.digest = None
        else:
            try:
                body = payload.read(PayloadRef(rec.file_id, rec.offset, rec.length))
            except Corruption:
                continue  # cannot tell: keep it (see the module docstring)
            if keys.legacy_payload_digest(body) != old:
                continue  # an explicit key's digest, or migrated already
            rec.digest = keys.payload_digest(body)
            batch.put(keys.dedup_key(qid, rec.digest), keys.U64.pack(mid))
        if owned:
            batch.delete(old_key)
        batch.put(key, rec.encode())
        changed += 1
    if changed:
        meta.write(batch, sync=True)
    return changed
