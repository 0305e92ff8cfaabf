"""A snapshot opened read-only, and its message prefix split into ranges.

:class:`Snapshot` is what every reader of a snapshot starts from (the data
source's tasks, the audit's tasks, the plain scan): the manifest, the
metadata opened read-only, the queues, and checked access to the payloads.
:func:`plan_ranges` splits the ``m`` (message) prefix into the ranges the
Spark partitions read: a queue id and a range of message ids. Queue ids are
discovered by seeking through the prefix (one seek per queue), so messages
of a queue id with no ``Q`` record are read too.

A snapshot is read without writing a byte to it, so it can sit on a
read-only (shared) mount: RocksDB and rocksdict write into the directory they
open (rocksdict rewrites its config file even on a read-only open, RocksDB
starts an info log), so each :class:`Snapshot` opens a private scratch copy of
``meta/`` instead. The copy links the table and log files (the bulk of the
metadata, opened read-only through the links) and copies the few small files.

The scratch copy lives in the system's temporary directory and goes when the
reader closes (every task and the driver close theirs when their part of the
job ends). A process killed first (a cancelled or lost Spark task, SIGKILL)
cannot remove its own: the scratch directory's name carries the process id,
and the next reader on that machine removes every one whose process is gone.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

from .._errors import Corruption, InvalidArgument, StorageError
from .._seg_accounts import covered_ids
from .._snapshot import read_manifest
from ..meta import MetaDB, keys, private_copy, records
from ..payload import PayloadRef, SegmentCheck, SegmentReader
from ..payload import _format as fmt

NOT_IN_MANIFEST = "segment is not listed in the snapshot manifest"
ROWS_PER_PARTITION = 100_000  # default partition size when no count is asked for
MAX_PARTITIONS = 4096


SCRATCH_PREFIX = "qstore-snapshot-meta-"  # then the owner's pid, "-", a random part
ORDERS = ("max", "min", "fifo")
PRIORITY_TYPES = ("int", "str")


_MESSAGE_KEY_BYTES = 1 + keys.QID_ID.size  # m qid:u32 id:u64


@dataclass(frozen=True)
class QueueInfo:
    name: str
    rec: records.QueueRecord


@dataclass(frozen=True)
class ScanRange:
    """Messages of queue ``qid`` with ``lo_id <= id < hi_id`` (None: open end)."""

    qid: int
    lo_id: int | None
    hi_id: int | None

    def bounds(self) -> tuple[bytes, bytes]:
        p = keys.prefix(keys.MESSAGE, self.qid)
        lo = p if self.lo_id is None else keys.message_key(self.qid, self.lo_id)
        hi = keys.prefix_end(p) if self.hi_id is None else keys.message_key(self.qid, self.hi_id)
        return lo, hi


class Snapshot:
    """A snapshot directory opened read-only: its manifest, metadata and segments.

    Opening is cheap (a read-only RocksDB open is about 2 ms), so every Spark
    task opens its own. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.manifest = read_manifest(self.path)
        self.segment_lengths: dict[int, int] = {
            int(s["file_id"]): int(s["length"]) for s in self.manifest["segments"]
        }
        active = self.manifest.get("active_id")
        self.active_id: int | None = int(active) if active is not None else None
        meta_dir = os.path.join(self.path, "meta")
        self._scratch = private_meta_copy(meta_dir)
        try:  # errors name meta_dir's files, not the scratch copy that links them
            self.meta = MetaDB(self._scratch, readonly=True, store_path=self.path,
                               copy_of=meta_dir)
        except BaseException:
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise
        self.queues: dict[int, QueueInfo] = {}
        self.bad_queue_records: list[tuple[bytes, str]] = []  # (Q key, why it is unusable)
        self._readers: dict[int, SegmentReader | Corruption] = {}
        self._checks: dict[int, SegmentCheck] = {}
        try:
            # S records that defer pushes (a snapshot of a read-only view can hold
            # some): their messages from the covered id up are not in the record.
            self.covered = covered_ids(self.meta)
            # Format 1 dead letters own their k keys; later ones hold none.
            self.dead_keep_dedup = records.dead_letters_own_dedup_keys(
                records.readable_store_format(self.meta.get(keys.FORMAT_KEY), self.path))
            for key, value in self.meta.scan(keys.QUEUE, keys.prefix_end(keys.QUEUE)):
                info = queue_info(key, value)
                if isinstance(info, str):
                    self.bad_queue_records.append((key, info))
                else:
                    self.queues[info.rec.qid] = info
        except BaseException:
            self.close()
            raise

    def segment_path(self, file_id: int) -> str:
        return os.path.join(self.path, "payload", fmt.segment_name(file_id))

    def qids_with_keys(self, kind: bytes, short: list[bytes] | None = None) -> list[int]:
        """Every queue id that has at least one key of per-queue ``kind`` (one seek each);
        keys of ``kind`` too short to hold a queue id go to ``short`` if given."""
        end = keys.prefix_end(kind)
        found: list[int] = []
        key = self.meta.first_key(kind, end)
        while key is not None:
            if len(key) < 5:  # not a per-queue key; step over it
                if short is not None:
                    short.append(key)
                key = self.meta.first_key(key + b"\x00", end)
                continue
            qid = keys.U32.unpack_from(key, 1)[0]
            found.append(qid)
            key = self.meta.first_key(keys.prefix_end(keys.prefix(kind, qid)), end)
        return found

    def id_span(self, qid: int) -> tuple[int, int] | None:
        """The first and last message id of queue ``qid``, or None if it has none."""
        p = keys.prefix(keys.MESSAGE, qid)
        end = keys.prefix_end(p)
        # Keys of another length are bad records (the scan reports them): stepped
        # over here, not read as ids (a 7-byte key last in its queue's range
        # failed the whole audit with struct.error; a check-vs-audit differential).
        first = self.meta.first_key(p, end)
        while first is not None and len(first) != _MESSAGE_KEY_BYTES:
            first = self.meta.first_key(first + b"\x00", end)
        last = self.meta.last_key(p, end)
        while last is not None and len(last) != _MESSAGE_KEY_BYTES:
            last = self.meta.last_key(p, last)
        if first is None or last is None:
            return None
        return keys.trailing_id(first), keys.trailing_id(last)

    def message_count(self, qid: int) -> int | None:
        """Messages of ``qid`` by its stored counters (None if it has none)."""
        raw = self.meta.get(keys.counts_key(qid))
        if raw is None:
            return None
        try:  # only steers the split: a damaged record (an audit finding) counts as absent
            return int(sum(records.decode_counts(raw)[:4]))
        except Exception:
            return None

    def read_payload(self, ref: PayloadRef) -> bytes:
        """The payload of ``ref``, checked (bounds from the manifest, frame, CRC).

        Raises :class:`~qstore.Corruption`; the reason is one of the fixed
        strings of ``qstore.payload._format`` or :data:`NOT_IN_MANIFEST`.
        """
        reader = self._readers.get(ref.file_id)
        if reader is None:
            reader = self._readers[ref.file_id] = self._open_segment(ref.file_id)
        if isinstance(reader, Corruption):
            raise Corruption(reader.path, ref.offset, reader.reason)
        return reader.read(ref, self.segment_lengths[ref.file_id])

    def check_refs(self, file_ids: list[int], offsets: list[int],
                   lengths: list[int]) -> list[str | None]:
        """For each reference, None if it resolves to an intact record, else the reason
        (the checks of :meth:`read_payload`, without copying the payloads)."""
        if not file_ids:
            return []
        distinct = set(file_ids)
        if len(distinct) == 1:  # the usual case: a batch inside one segment
            return self._check(file_ids[0]).check(list(offsets), list(lengths))
        out: list[str | None] = [None] * len(file_ids)
        groups: dict[int, list[int]] = {fid: [] for fid in distinct}
        for i, fid in enumerate(file_ids):
            groups[fid].append(i)
        for fid, at in groups.items():
            problems = self._check(fid).check([offsets[i] for i in at], [lengths[i] for i in at])
            for i, problem in zip(at, problems, strict=True):
                out[i] = problem
        return out

    def _check(self, file_id: int) -> SegmentCheck:
        check = self._checks.get(file_id)
        if check is None:
            length = self.segment_lengths.get(file_id)
            check = self._checks[file_id] = SegmentCheck(
                self.segment_path(file_id), file_id, length or 0,
                NOT_IN_MANIFEST if length is None else None)
        return check

    def _open_segment(self, file_id: int) -> SegmentReader | Corruption:
        path = self.segment_path(file_id)
        if file_id not in self.segment_lengths:
            return Corruption(path, 0, NOT_IN_MANIFEST)
        try:
            return SegmentReader(path, file_id)
        except FileNotFoundError:
            return Corruption(path, 0, fmt.MISSING_SEGMENT)
        except Corruption as exc:  # a damaged header: every record of the file is unreadable
            return exc

    def close(self) -> None:
        for reader in self._readers.values():
            if isinstance(reader, SegmentReader):
                reader.close()
        self._readers.clear()
        for check in self._checks.values():
            check.close()
        self._checks.clear()
        self.meta.close()
        shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def private_meta_copy(meta_dir: str) -> str:
    """A new private directory that RocksDB can open read-only as ``meta_dir``
    (:func:`qstore.meta.private_copy`), named after this process so that the
    next reader can remove it if this one dies (:func:`remove_stale_scratch`).
    Raises InvalidArgument if ``meta_dir`` is not a directory, StorageError
    (with the errno) if it cannot be listed or, the usual case, if the copy
    cannot be made in the temporary directory (``TMPDIR`` full, missing,
    read-only): the snapshot is not at fault then, and the message says so.
    """
    remove_stale_scratch()
    try:
        return private_copy(meta_dir, prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    except OSError as exc:
        if not os.path.isdir(meta_dir):
            raise InvalidArgument(f"{os.path.dirname(meta_dir)} is not a qstore snapshot: "
                                  f"cannot list {meta_dir} ({exc.strerror})") from None
        if exc.filename is not None and os.path.abspath(exc.filename) == \
                os.path.abspath(meta_dir):
            err = StorageError(f"cannot list {meta_dir}: {exc.strerror}")
        else:
            err = StorageError(
                f"cannot make the private copy of {meta_dir} that a snapshot's readers "
                f"open, in the temporary directory {tempfile.gettempdir()} (TMPDIR): "
                f"{exc.strerror} (errno {exc.errno}); give TMPDIR room or another "
                "directory (a few KiB per reader)")
        err.errno = exc.errno
        raise err from None


def remove_stale_scratch(directory: str | None = None) -> list[str]:
    """Remove the scratch copies of readers that died without closing; returns them.

    A scratch directory belongs to the process whose id its name carries;
    one whose process no longer exists on this machine is removed.
    """
    root = directory or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        if not name.startswith(SCRATCH_PREFIX):
            continue
        pid_text = name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def queue_info(key: bytes, value: bytes) -> QueueInfo | str:
    """The queue of a ``Q`` record, or why the record is unusable (naming its key)."""
    where = f"queue key {key.hex()}"
    try:
        name = key[1:].decode("utf-8")
    except UnicodeDecodeError:
        return f"{where}: the queue name is not UTF-8"
    try:
        rec = records.QueueRecord.decode(value)
    except Exception as exc:  # msgpack's errors have no common base
        return f"{where} ({name!r}): undecodable record ({type(exc).__name__}: {exc})"
    problems = []
    if type(rec.qid) is not int or not 0 <= rec.qid < 1 << 32:
        problems.append(f"queue id {rec.qid!r}")
    if rec.order not in ORDERS:
        problems.append(f"order {rec.order!r}")
    if rec.priority_type not in PRIORITY_TYPES:
        problems.append(f"priority type {rec.priority_type!r}")
    if type(rec.max_attempts) is not int or rec.max_attempts < 1:
        problems.append(f"max_attempts {rec.max_attempts!r}")
    if type(rec.dedup) is not bool:
        problems.append(f"dedup {rec.dedup!r}")
    if problems:
        return f"{where} ({name!r}): bad field(s): {', '.join(problems)}"
    return QueueInfo(name, rec)


def plan_ranges(snap: Snapshot, *, partitions: int | None = None,
                rows_per_partition: int = ROWS_PER_PARTITION,
                queues: Iterable[str] | None = None) -> list[ScanRange]:
    """Split the message prefix into about ``partitions`` ranges (by queue, then id).

    Without ``partitions``, one range per ``rows_per_partition`` messages.
    Each queue gets ranges in proportion to its message count (stored
    counters; they only steer the split, so a wrong counter cannot hide a
    message), cut at evenly spaced ids between its first and last message.
    The first and last range of a queue are open-ended, so together they
    cover the queue's whole prefix whatever the ids are.
    """
    wanted = None if queues is None else set(queues)
    spans: list[tuple[int, int, int, int]] = []  # qid, first id, last id, weight
    for qid in snap.qids_with_keys(keys.MESSAGE):
        info = snap.queues.get(qid)
        if wanted is not None and (info is None or info.name not in wanted):
            continue
        span = snap.id_span(qid)
        if span is None:
            continue
        count = snap.message_count(qid)
        weight = count if count is not None and count > 0 else span[1] - span[0] + 1
        spans.append((qid, span[0], span[1], weight))
    if not spans:
        return []
    total = sum(s[3] for s in spans)
    target = partitions or math.ceil(total / max(1, rows_per_partition))
    target = max(1, min(target, MAX_PARTITIONS))
    ranges: list[ScanRange] = []
    for qid, first, last, weight in spans:
        width = last - first + 1
        k = max(1, min(width, round(target * weight / total)))
        cuts = [first + (width * i) // k for i in range(1, k)]
        lows: list[int | None] = [None, *cuts]
        highs: list[int | None] = [*cuts, None]
        ranges.extend(ScanRange(qid, lo, hi) for lo, hi in zip(lows, highs, strict=True))
    return ranges
