"""Driver side of the backfill: reserve ids in the store, publish a staged job atomically.

The store must be open read-write in this process (its lock is held for the
whole job). The steps, in order, and what a crash (SIGKILL, power loss) at
each point leaves (docs/backfill.md):

1. :func:`clean_staging`: staging directories of earlier jobs are deleted
   (they belong to jobs that crashed; nothing refers to them).
2. :func:`reserve_ids`: ``M id_hwm`` is advanced past the job's ids and
   synced, so no later push can take one of them even after a crash. Segment
   file ids are reserved in memory (:func:`reserve_file_ids`): nothing can take
   them while the lock is held, and a job that never committed needs none.
3. The Spark passes write ``<store>/staging/<job>/`` (segments, SSTs, rejects);
   the driver then writes ``job.json`` (step ``staged``).
4. :func:`commit_job`: rejects are published (``rejects_published``), segments
   are renamed into ``payload/`` (``moving``, ``moved``): unreferenced files
   until the ingestion (a crash leaves them for the next read-write open to
   delete; a commit that raises deletes them itself once the database says
   the ingestion did not land). Then ONE
   ``ingest_external_file`` call adds every SST of the job plus a small SST
   holding the queue's new counters, the new segments' records and the id
   high-water mark (``ingested``). RocksDB commits an ingestion with one
   MANIFEST edit, so the messages, their indexes and the counters appear
   together or not at all; ingested keys shadow older keys of the same name,
   which is how the counters are replaced.
5. ``_SUCCESS`` is written in the rejects directory, the staging directory is
   removed (``cleaned``), and the job's marker is deleted: ``M backfill/<job>``,
   which the ingestion wrote with the rows (into a store the backfill opened
   itself, by the store's close, in its last batch: ``marker_at_close``). A
   crash before that leaves the marker: :func:`settle_loaded` (at the start of
   the next job, whichever it is) writes the ``_SUCCESS`` the crashed one
   could not and keeps the marker, settled; a run of that same job is refused
   until one is given ``again``, which deletes it.

Steps are also crash points for tests: with ``QSTORE_BACKFILL_CRASH_AT=<step>``
in the environment the process SIGKILLs itself right after that step, and
``step_hook`` (None in normal use) is called with each step's name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .._errors import InvalidArgument, QStoreError, StorageError
from .._fs import fsync_dir, write_json_durably
from ..meta import keys, records
from ..payload import _format as fmt

if TYPE_CHECKING:
    from .._store import Store

log = logging.getLogger("qstore.backfill")

STAGING_DIR = "staging"
DIGEST_CHUNK = 10_000  # dedup keys looked up per multi-get at the commit
JOB_FILE = "job.json"
JOB_FORMAT = 1  # never change the meaning of 1
SUCCESS_FILE = "_SUCCESS"
CRASH_ENV = "QSTORE_BACKFILL_CRASH_AT"
# The job marker M backfill/<job> (docs/meta-schema.md): [version, rows, rejects_dir,
# fingerprint]. Version 3 as the ingestion writes it; version 2 once a later job has
# settled it (written the _SUCCESS, reported it) and keeps it to refuse a rerun.
# Version 1 is what builds before version 2 wrote: read as unsettled, never written.
# Those builds settle and delete every version 1 marker, another job's too, so a
# version 1 marker of this build's left one of its jobs without the marker that
# refuses its rerun (its rows loaded twice; a cross-version audit): they refuse a
# version 3 one instead ("unsupported backfill job record version").
MARKER_OLD_UNSETTLED = 1  # never change the meaning of 1
MARKER_SETTLED = 2  # never change the meaning of 2
MARKER_UNSETTLED = 3  # never change the meaning of 3
MARKER_VERSIONS = (MARKER_OLD_UNSETTLED, MARKER_SETTLED, MARKER_UNSETTLED)
STEPS = ("reserved", "staged", "rejects_published", "moving", "moved", "ingested", "cleaned")
# Test hook: called with the name of each step as it completes. None in normal use.
step_hook: Callable[[str], None] | None = None


def step(name: str) -> None:
    """A named point of the job; the test harness can kill the process here."""
    assert name in STEPS, name
    if step_hook is not None:
        step_hook(name)
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def staging_root(store: Store) -> str:
    return os.path.join(os.path.abspath(store.path), STAGING_DIR)


def job_fingerprint(source: Any, fmt_name: str, queue: str,
                    columns: tuple[str | None, ...]) -> str | None:
    """What names a job for :func:`settle_loaded`: its source paths (resolved), format,
    queue and columns; None for a DataFrame source (nothing names it)."""
    if isinstance(source, (str, os.PathLike)):
        paths = [source]
    elif isinstance(source, (list, tuple)) and all(
            isinstance(p, (str, os.PathLike)) for p in source):
        paths = list(source)
    else:
        return None
    return json.dumps({"sources": sorted(os.path.realpath(os.fspath(p)) for p in paths),
                       "format": fmt_name, "queue": queue, "columns": list(columns)},
                      sort_keys=True)


class AlreadyLoaded(QStoreError):
    """The job was loaded by an earlier run that crashed after its commit."""


def settle_loaded(store: Store, fingerprint: str | None,
                  again: bool = False) -> list[tuple[str, int]]:
    """Finish what jobs that crashed after their ingestion left, and refuse a rerun of one.

    Each marker not settled yet gets its rejects directory's ``_SUCCESS`` and is
    rewritten as settled (record version 2), so it is reported once. A marker
    naming a job (a fingerprint) stays until a run of that job: other jobs may
    run in between, and a rerun of the killed job must still be refused then.
    A marker without one (a DataFrame source) is deleted: no run can be that
    job. Returns (job id, rows loaded) of each marker settled now. Raises
    :class:`AlreadyLoaded` (after settling) if one is the job ``fingerprint``
    names: its rows are in the store, and a rerun after a crash would load them
    twice. That marker is kept: the refusal changes nothing of it, so a run
    killed while refusing, before its message was seen, leaves the next run
    refused too (when the refusal deleted it, that next run loaded the rows a
    second time; a crash-point audit). With ``again`` the marker is deleted and
    the job goes on: the rows are loaded a second time, as asked."""
    core = store.core
    with core.settling:
        core.check_writable()
        found = list(core.meta.scan(keys.BACKFILL_JOB, keys.prefix_end(keys.BACKFILL_JOB)))
        if not found:
            return []
        settled, same = [], None
        puts: list[tuple[bytes, bytes]] = []
        deletes: list[bytes] = []
        for key, raw in found:
            job_id = key[len(keys.BACKFILL_JOB):].decode("ascii", "replace")
            version, rows, dest, mark = _marker(job_id, raw)
            if version != MARKER_SETTLED:
                if isinstance(dest, str) and os.path.isdir(dest):
                    _write_success(dest)
                settled.append((job_id, rows))
            ours = fingerprint is not None and mark == fingerprint  # the job run now
            if ours and again:
                deletes.append(key)
            elif ours:
                same = (job_id, rows, dest)
                if version != MARKER_SETTLED:
                    puts.append((key, records.pack([MARKER_SETTLED, rows, dest, mark])))
            elif mark is None:
                deletes.append(key)
            elif version != MARKER_SETTLED:
                puts.append((key, records.pack([MARKER_SETTLED, rows, dest, mark])))
        if puts or deletes:
            core.write_synced(puts, deletes=deletes)
    if same is not None:
        job_id, rows, dest = same
        raise AlreadyLoaded(
            f"nothing loaded: an earlier run of this backfill (job {job_id}: the same sources, "
            f"queue and columns) loaded its {rows} rows before it was killed"
            + (f" (its rejects: {dest}, now marked {SUCCESS_FILE})" if dest else "")
            + "; to load them a second time, run it again with --again (again=True)")
    return settled


def _marker(job_id: str, raw: bytes) -> list[Any]:
    """The decoded marker of backfill ``job_id``; a version this build does not know
    is refused, saying why and what to do (it said "unsupported backfill job
    record version" and the record, cut at 80 characters)."""
    version = records.record_version(raw)
    if type(version) is int and version > max(MARKER_VERSIONS):
        raise StorageError(
            f"the store holds the marker of backfill {job_id} (record M backfill/{job_id}, "
            f"version {version}), written by a newer qstore: this one cannot tell whether "
            "that job's rows are loaded, so it backfills nothing into this store; run "
            "backfills with the newer qstore")
    try:
        value = records.unpack(raw, "backfill job", MARKER_VERSIONS)
        if len(value) != 4:
            raise ValueError(f"{len(value)} fields")
    except (StorageError, ValueError) as exc:  # records.unpack names a decode failure
        raise StorageError(f"the marker of backfill {job_id} (record M backfill/{job_id}) "
                           f"is damaged: {exc!r:.100}") from None
    return value


def _write_success(dest_dir: str) -> None:
    with open(os.path.join(dest_dir, SUCCESS_FILE), "wb"):
        pass
    fsync_dir(dest_dir)


def clean_staging(store: Store) -> list[str]:
    """Delete what crashed jobs left in ``<store>/staging``; returns the job names removed."""
    root = staging_root(store)
    if not os.path.isdir(root):
        return []
    removed = sorted(os.listdir(root))
    for name in removed:
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    if removed:
        fsync_dir(root)
    return removed


def new_job_dir(store: Store, job_id: str) -> str:
    path = os.path.join(staging_root(store), job_id)
    for sub in ("seg", "sst", "rejects", "plan"):
        os.makedirs(os.path.join(path, sub))
    fsync_dir(staging_root(store))
    return path


def refuse_if_space_low(store: Store) -> None:
    """Refuse a backfill while the store refuses pushes for want of space
    (``Core.check_push_space``): its segments would take the room the space
    reserve keeps for the acks and compaction that free the disk."""
    core = store.core
    with core.writing:
        if core.space_low:
            core.check_push_space("backfills")


def reserve_ids(store: Store, n: int) -> int:
    """Reserve ``n`` consecutive message ids; durable before this returns. Returns the first."""
    return store.core.reserve_ids(n)


def reserve_file_ids(store: Store, n: int) -> list[int]:
    """``n`` segment file ids above every segment of the store (held in memory only)."""
    return store.core.reserve_file_ids(n)


@dataclass
class StagedJob:
    """Everything the commit needs, saved as ``job.json`` in the job's staging directory."""

    job_id: str
    queue: str
    qid: int
    first_id: int
    end_id: int
    partitions: list[dict[str, Any]]  # task summaries (see _bulk.PartitionLoader.finish)
    rejects_dest: str | None  # where the rejects go; relative: inside the store directory
    format: int = JOB_FORMAT

    def save(self, staging: str) -> None:
        write_json_durably(os.path.join(staging, JOB_FILE), asdict(self))

    @classmethod
    def load(cls, staging: str) -> StagedJob:
        with open(os.path.join(staging, JOB_FILE), encoding="utf-8") as f:
            raw = json.load(f)
        if raw.get("format") != JOB_FORMAT:
            raise StorageError(f"{staging}/{JOB_FILE} is not a backfill job of format "
                               f"{JOB_FORMAT}")
        return cls(**raw)

    def segments(self) -> list[dict[str, int]]:
        return [seg for part in self.partitions for seg in part["segments"]]

    def total(self, field: str) -> int:
        return sum(int(part[field]) for part in self.partitions)


def _check_staged(store: Store, job: StagedJob, staging: str) -> None:
    """Refuse to publish anything that could overwrite or be overwritten."""
    q = store.core.queues.get(job.queue)
    if q is None or q.qid != job.qid:
        raise StorageError(f"queue {job.queue!r} was deleted or recreated during backfill "
                           f"job {job.job_id}; nothing was loaded")
    if store.core.ids_reserved_below() < job.end_id:
        raise StorageError(f"backfill job {job.job_id}: ids up to {job.end_id} are not "
                           "reserved in the store; nothing was loaded")
    for seg in job.segments():
        fid = seg["file_id"]
        name = fmt.segment_name(fid)
        if fid in store.core.segments or os.path.exists(store.core.payload.path_of(fid)):
            raise StorageError(f"segment {name} of backfill job {job.job_id} already exists "
                               "in the store; nothing was loaded")
        size = os.path.getsize(os.path.join(staging, "seg", name))
        if size != seg["end"]:
            raise StorageError(f"staged segment {name} is {size} bytes, not {seg['end']}")
    for part in job.partitions:
        for sst in part["ssts"]:
            if not os.path.isfile(os.path.join(staging, "sst", sst)):
                raise StorageError(f"staged file {sst} of backfill job {job.job_id} is missing")


def _check_digests_free(store: Store, job: StagedJob, digests: list[bytes]) -> None:
    """Refuse the commit if a message pushed while the job ran holds a dedup key the
    job loads (lock held): two live messages must never share a key."""
    meta = store.core.meta
    for i in range(0, len(digests), DIGEST_CHUNK):
        chunk = digests[i: i + DIGEST_CHUNK]
        raws = meta.multi_get([keys.dedup_key(job.qid, d) for d in chunk])
        taken = [keys.U64.unpack(r)[0] for r in raws if r is not None]
        if taken:
            raise QStoreError(
                f"backfill job {job.job_id}: {len(taken)} message(s) pushed while it ran "
                f"hold dedup keys it loads (message {taken[0]} for one); nothing was "
                "loaded; run it again")


def rejects_dir(store: Store, job: StagedJob) -> str | None:
    if job.rejects_dest is None:
        return None
    return os.path.join(os.path.abspath(store.path), job.rejects_dest)  # absolute stays so


def publish_rejects(store: Store, staging: str, job: StagedJob) -> list[str]:
    """Move the rejects files to their destination (before the data, see docs)."""
    src = os.path.join(staging, "rejects")
    names = sorted(n for n in os.listdir(src) if n.endswith(".parquet"))
    dest_dir = rejects_dir(store, job)
    if dest_dir is None or not names:
        return []
    os.makedirs(dest_dir, exist_ok=True)
    out: list[str] = []
    partial = None
    try:
        for name in names:
            dest = os.path.join(dest_dir, "part-" + name.removeprefix("rejects-"))
            # Across filesystems a move is a copy: under a hidden name first, which
            # readers of the directory skip, then renamed. A copy cut short (a full
            # disk) left a truncated Parquet file under the final name, beside the
            # complete ones, in a job that said nothing was loaded (a Spark fault
            # audit).
            partial = os.path.join(dest_dir, "." + os.path.basename(dest) + ".partial")
            shutil.move(os.path.join(src, name), partial)  # a rename on one filesystem
            os.rename(partial, dest)
            partial = None
            out.append(dest)
        fsync_dir(dest_dir)
    except BaseException:
        for path in ([partial] if partial else []) + out:  # the job fails: withdraw them
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    return out


def commit_job(store: Store, staging: str, loaded_digests: list[bytes] | None = None,
               fingerprint: str | None = None, marker_at_close: bool = False) -> StagedJob:
    """Publish the staged job in ``staging`` into ``store``: all of it or, on a crash, none.

    ``loaded_digests``: the dedup digests the job loads, when other writers may
    have pushed since they were looked up; if a live message holds one now,
    nothing is published. ``fingerprint``: what names the job
    (:func:`job_fingerprint`), kept in its marker until the commit is done.
    ``marker_at_close``: the marker is deleted by the store's close (the caller
    closes it before it reports the job done), not at the end of this call: a
    crash while the store closes then leaves the marker, and a rerun is
    refused instead of loading the rows again (a power-loss audit).
    """
    job = StagedJob.load(staging)
    marker = keys.backfill_job_key(job.job_id)
    # The writer lock, and memory read back if anything raises after a write
    # (other threads may use the store meanwhile: a server's).
    with store.core.settling:
        store.core.check_writable()
        _check_staged(store, job, staging)
        if loaded_digests:
            _check_digests_free(store, job, loaded_digests)
        published = publish_rejects(store, staging, job)
        step("rejects_published")
        payload_dir = os.path.join(store.path, "payload")
        try:
            for i, seg in enumerate(job.segments()):
                name = fmt.segment_name(seg["file_id"])
                os.rename(os.path.join(staging, "seg", name), os.path.join(payload_dir, name))
                if i == 0:
                    step("moving")
            fsync_dir(payload_dir)
            step("moved")
            _ingest_locked(store, job, staging, (marker, records.pack(
                [MARKER_UNSETTLED, job.total("loaded"), rejects_dir(store, job),
                 fingerprint])))
        except BaseException:
            landed = _landed(store, marker)
            if landed is False:
                # Not loaded: withdraw the rejects, and the moved segments, which
                # nothing refers to: an open store (a server's) would not know them
                # until its next open, keeping their disk space (on a full disk,
                # what the failed load needs) while its check reported them as
                # orphans.
                for path in published:
                    os.unlink(path)
                _withdraw_segments(payload_dir, job)
            # Loaded (committed, and something after it raised): the rows are in, and
            # the marker stays for settle_loaded (the next job settles it, a rerun of
            # this one is refused). Unknown (the database cannot be read): nothing is
            # withdrawn; the rejects stay without _SUCCESS (marked) and the next
            # read-write open deletes the segments if nothing refers to them.
            raise
        step("ingested")
    dest_dir = rejects_dir(store, job)
    if dest_dir is not None and os.path.isdir(dest_dir):
        _write_success(dest_dir)
    shutil.rmtree(staging)
    fsync_dir(os.path.dirname(staging))
    step("cleaned")
    # The marker last: a crash before this leaves it, for settle_loaded.
    with store.core.settling:
        store.core.check_writable()
        if marker_at_close:
            store.core.delete_at_close(marker)
        else:
            store.core.write_synced(deletes=[marker])
    return job


def _landed(store: Store, marker: bytes) -> bool | None:
    """Whether the ingestion that writes ``marker`` committed (None: unknown)."""
    try:
        return store.core.meta.get(marker) is not None
    except Exception:  # the database cannot be read now
        log.exception("could not tell whether the failed backfill's ingestion landed")
        return None


def _withdraw_segments(payload_dir: str, job: StagedJob) -> None:
    """Delete the segments a job that did not commit moved into ``payload/``."""
    try:
        for seg in job.segments():
            with contextlib.suppress(FileNotFoundError):  # not moved yet
                os.unlink(os.path.join(payload_dir, fmt.segment_name(seg["file_id"])))
        fsync_dir(payload_dir)
    except OSError:  # the next read-write open deletes what is left
        log.exception("could not delete the segments of a backfill that did not load")


def _ingest_locked(store: Store, job: StagedJob, staging: str,
                   marker: tuple[bytes, bytes]) -> None:
    core = store.core
    paths = [os.path.join(staging, "sst", sst) for part in job.partitions for sst in part["ssts"]]
    # The files overlap each other's key ranges (every partition writes d, k, m and r
    # keys of the same queue) but never share a key; RocksDB 9.8 accepts overlapping
    # files in one call and gives each its own sequence number. The counters the core
    # adds overwrite the live ones because ingested files get a global seqno newer
    # than everything in the database.
    dues = [p["min_due_us"] for p in job.partitions if p["min_due_us"] is not None]
    core.ingest(
        core.queues[job.queue], paths,
        [job.total("ready"), job.total("delayed"), 0, 0, job.total("bytes")],
        {seg["file_id"]: (seg["live_bytes"], seg["live_count"], seg["end"])
         for seg in job.segments()},
        job.end_id, min(dues) if dues else None, [marker],
    )


def check_rejects_dest(path: str) -> None:
    """An explicit rejects directory must be new or empty (its files are one job's rejects)."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise InvalidArgument(f"rejects directory {path!r} exists and is not empty")
