"""A thin wrapper over rocksdict that turns its plain exceptions into qstore errors.

rocksdict (0.3.29) raises plain ``Exception`` with a message; a second
read-write opener's message names the ``LOCK`` file, and becomes
:class:`StoreLocked`, anything else :class:`StorageError`. The binding's traps
this module works around:

- Raw mode everywhere: every open passes ``Options(raw_mode=True)``, read-only
  ones included, because rocksdict rewrites ``rocksdict-config.json`` in the
  database directory on every open, and one open without it flips the stored
  mode. Raw mode takes ``bytes`` only (not bytearray or memoryview).
- Iteration bounds: ``ReadOptions.set_iterate_lower_bound`` sets the *upper*
  bound (a bug in the binding), so scans set ``set_iterate_upper_bound`` and
  ``seek`` to the lower end.
- ``close()`` keeps the ``LOCK`` while any iterator, snapshot or column-family
  handle is alive: each read method drops its iterator when it ends (a
  :meth:`MetaDB.scan` generator when it is exhausted or closed), and callers
  close the database only after finishing their scans.

After a failed write (a full disk, an I/O error) RocksDB refuses every later
write with "Writer has previous error", even once space is back, and the
binding has no ``Resume()``. :class:`MetaDB` remembers the failure in
:attr:`MetaDB.failed`, refuses writes while it is set, and :meth:`MetaDB.reopen`
closes and reopens the database (the caller holds the writer lock and reloads
whatever it keeps in memory, see ``Core.resume``). Until a reopen succeeds the
old handle keeps serving reads.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import fcntl
import logging
import os
import shutil
import struct
import tempfile
import threading
import weakref
from collections.abc import Generator, Iterable, Iterator
from typing import Any, cast

from rocksdict import (
    AccessType,
    Checkpoint,
    IngestExternalFileOptions,
    Options,
    Rdict,
    RdictIter,
    ReadOptions,
    SstFileWriter,
    WriteBatch,
    WriteOptions,
)

from .._address import SOCKET_NAME, served_address
from .._errors import Corruption, StorageError, StoreLocked

Batch = WriteBatch

log = logging.getLogger("qstore")

# OS errors RocksDB names in its messages (it keeps no errno): the StorageError
# gets the number back, so callers can tell a full disk from an I/O error.
_KNOWN_ERRNOS = (_errno.ENOSPC, _errno.EDQUOT, _errno.EIO, _errno.EROFS, _errno.EACCES,
                 _errno.EPERM, _errno.ENOENT, _errno.EMFILE, _errno.ENFILE, _errno.EFBIG)


def storage_error(doing: str, exc: BaseException) -> StorageError:
    """The :class:`StorageError` a rocksdict error becomes, with the errno its message names."""
    text = str(exc)
    err = StorageError(f"{doing}: {text}")
    for code in _KNOWN_ERRNOS:
        if os.strerror(code) in text:
            err.errno = code
            break
    return err


INFO_LOG_MAX_BYTES = 1024 * 1024  # RocksDB's info LOG rolls past this
WRITE_BUFFER_BYTES = 64 * 1024 * 1024
# The memtable size while the disk is nearly full (MetaDB.keep_log_small): the
# write-ahead log, which a reopen after a failed write replays into a table
# file and so needs about its size free, stays about this small.
SMALL_WRITE_BUFFER_BYTES = 256 * 1024
# The options that differ while the log is kept small, set at open and changed
# on the open database (SetOptions):
# - RocksDB sizes a memtable's arena blocks from the write buffer it was opened
#   with (1 MiB for 64 MiB) and flushes a memtable whose allocation passes the
#   write buffer: shrunk alone, it was flushed after every write (20,000 table
#   files and a 5 MB MANIFEST for 20,000 single-key writes through rocksdict).
# - Small memtables make many level-0 table files, and on a nearly full disk
#   RocksDB cancels the compactions that would merge them ("not enough room"):
#   at 20 of them it slowed writes, at 36 stopped them, and a flush (close()
#   flushes) waited for that to clear, for good, as did a write (holding the
#   GIL: the whole process). Kept small, the store may keep thousands.
_LOG_OPTIONS = {
    False: {"write_buffer_size": WRITE_BUFFER_BYTES, "arena_block_size": 1024 * 1024,
            "level0_slowdown_writes_trigger": 20, "level0_stop_writes_trigger": 36},
    True: {"write_buffer_size": SMALL_WRITE_BUFFER_BYTES, "arena_block_size": 32 * 1024,
           "level0_slowdown_writes_trigger": 4000, "level0_stop_writes_trigger": 8000},
}


def _options(create: bool, small_log: bool = False) -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(create)
    opts.set_max_background_jobs(2)
    # Deleted index keys at a queue's head leave tombstones; bigger L0 files and
    # regular compaction keep seeks short (pops also seek from per-level heads
    # past the tombstones, see qstore/_heads.py).
    log_options = _LOG_OPTIONS[small_log]
    opts.set_write_buffer_size(log_options["write_buffer_size"])
    opts.set_arena_block_size(log_options["arena_block_size"])
    opts.set_level_zero_slowdown_writes_trigger(log_options["level0_slowdown_writes_trigger"])
    opts.set_level_zero_stop_writes_trigger(log_options["level0_stop_writes_trigger"])
    # Every open moves the info LOG aside (LOG.old.<time>); on a full disk each
    # failed attempt would leave one more. Keep a few, and roll the LOG within an
    # open too: it grew without bound while a store stayed open (about 8 KB a
    # snapshot, 3 KB every 10 idle minutes: 170 MB a year for an idle server;
    # a resource audit).
    opts.set_keep_log_file_num(4)
    opts.set_max_log_file_size(INFO_LOG_MAX_BYTES)
    return opts


# What a read-write open (or a reopen) of the database writes besides the
# replay of its write-ahead log, measured with rocksdict 0.3.29 on a tmpfs: an
# OPTIONS file (about 8 KiB), a MANIFEST, an info LOG (16-26 KiB), and the
# table file's own blocks. Twice that, rounded up.
OPEN_MARGIN = 128 * 1024


def space_to_open(path: str) -> int:
    """About the free bytes a read-write open of the database at ``path`` needs.

    Recovery replays the write-ahead logs into a table file (about their size
    or less), plus :data:`OPEN_MARGIN`. A failed preallocation of the next
    log is ignored by RocksDB, so that needs nothing.
    """
    try:
        names = os.listdir(path)
    except OSError:
        return OPEN_MARGIN
    wal = 0
    for name in names:
        if name.endswith(".log"):
            with contextlib.suppress(OSError):
                wal += os.path.getsize(os.path.join(path, name))
    return wal + OPEN_MARGIN


LINKED_SUFFIXES = (".sst", ".log", ".blob")  # large, only read: linked, never copied


class _Live:
    """A RocksDB iterator (``it``) a MetaDB counts as in use while this lives."""

    __slots__ = ("it", "__weakref__")

    def __init__(self, it: RdictIter) -> None:
        self.it = it


# Read-only opens of a directory whose writer flushed meanwhile, before one gives up.
VIEW_OPEN_TRIES = 20


def _db_files(path: str) -> set[str]:
    """The database files in ``path`` whose set a flush or compaction changes."""
    return {n for n in os.listdir(path) if n.endswith((".log", ".sst")) or n == "CURRENT"
            or n.startswith("MANIFEST-")}


def private_copy(meta_dir: str, prefix: str = "qstore-meta-") -> str:
    """A new private directory that RocksDB can open read-only as ``meta_dir``.

    RocksDB and rocksdict write into the directory they open, read-only opens
    included (rocksdict rewrites its config file, RocksDB starts an info log),
    which fails on a read-only filesystem. Table and log files are symbolic
    links (read through, never written); the other files (CURRENT, MANIFEST,
    OPTIONS, rocksdict's config: a few KiB) are copied, so whatever the open
    writes lands in the copy. The caller removes it. Raises OSError if
    ``meta_dir`` cannot be listed.
    """
    names = os.listdir(meta_dir)
    scratch = tempfile.mkdtemp(prefix=prefix)
    try:
        for name in names:
            src = os.path.join(os.path.abspath(meta_dir), name)
            if name == "LOCK" or name.startswith("LOG") or not os.path.isfile(src):
                continue  # a read-only open takes no lock and keeps its own log
            if name.endswith(LINKED_SUFFIXES):
                os.symlink(src, os.path.join(scratch, name))
            else:
                shutil.copyfile(src, os.path.join(scratch, name))
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return scratch


def locked_by_another_process(path: str) -> bool:
    """Whether another process holds the database at ``path`` open read-write.

    RocksDB takes a POSIX record lock (``fcntl F_SETLK``) on ``LOCK``; this
    asks for it with ``F_GETLK``, which never takes it (trying to take it
    could make a writer's open fail meanwhile). A process does not see its
    own record locks this way. True when it cannot tell (an unknown
    platform layout of ``struct flock``): callers use it to be lenient.
    """
    try:
        fd = os.open(os.path.join(path, "LOCK"), os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        got = fcntl.fcntl(fd, fcntl.F_GETLK, _FLOCK.pack(fcntl.F_WRLCK, 0, 0, 0, 0))
        return bool(_FLOCK.unpack(got)[0] != fcntl.F_UNLCK)
    except (OSError, struct.error):
        return True
    finally:
        os.close(fd)


# struct flock on Linux, 64-bit: l_type, l_whence (short), l_start, l_len (off_t), l_pid.
_FLOCK = struct.Struct("hhqqi4x")


def _read_only_fs(exc: Exception) -> bool:
    text = str(exc)
    return "Read-only file system" in text or "os error 30" in text  # EROFS


def _denied(exc: Exception) -> bool:
    text = str(exc)
    return "Permission denied" in text or "os error 13" in text  # EACCES


def _corruption(exc: Exception) -> bool:
    """RocksDB's status "Corruption: ..." (a damaged table, manifest or log)."""
    return "Corruption:" in str(exc)


def _locked(exc: Exception) -> bool:
    text = str(exc)
    # A LOCK file this user may not open is not another writer: StorageError, naming
    # it (it was StoreLocked, "locked by another writer"; a non-root audit).
    return ("lock" in text.lower() and ("LOCK" in text or "Resource temporarily" in text)
            and not _denied(exc))


class MetaDB:
    """The metadata database of one store.

    ``copy_of``: ``path`` is a private copy of that directory (:func:`private_copy`,
    what a snapshot's readers open). Errors then name ``copy_of`` and its files,
    never the copy: the copy is gone by the time anyone reads the message, and
    its table files are links to ``copy_of``'s, so damage found through them is
    damage of ``copy_of``.
    """

    def __init__(self, path: str, *, readonly: bool, store_path: str,
                 copy_of: str | None = None) -> None:
        self.path = path
        self.shown = copy_of if copy_of is not None else path  # the directory errors name
        self.readonly = readonly
        self._store_path = store_path
        # Why writes are refused (a failed write put RocksDB in its error state),
        # or None. Cleared by a successful reopen().
        self.failed: StorageError | None = None
        # Batches and ingestions started through this handle, counted before each
        # starts: a caller whose in-memory changes an exception cut short after a
        # write sees the count move (Core.settle).
        self.writes = 0
        self._scratch: str | None = None  # a read-only open's private copy (see _open)
        self._opens = 1  # this handle's open count (see write_mark)
        self.small_log = False  # see keep_log_small
        # RocksDB iterators alive on this handle (see _iter and reopen), and the
        # lock that makes counting them and closing the handle one step.
        self._iterators: weakref.WeakSet[_Live] = weakref.WeakSet()
        self._iterators_lock = threading.Lock()
        self._db = self._open(create=not readonly)
        self._wopts = WriteOptions()
        self._wopts_sync = WriteOptions()
        self._wopts_sync.sync = True

    def _open(self, *, create: bool) -> Rdict:
        readonly = self.readonly
        access = AccessType.read_only() if readonly else AccessType.read_write()
        try:
            if not readonly:
                return Rdict(self.path, _options(create, self.small_log), access_type=access)
            db = self._open_view()
            if db is not None:
                return db
        except Exception as exc:
            if not readonly and _locked(exc):
                address = served_address(self._store_path)
                sock = os.path.join(self._store_path, SOCKET_NAME)
                served = address is not None or os.path.exists(sock)
                if address is not None and address.startswith("unix://") \
                        and os.path.abspath(address[len("unix://"):]) == os.path.abspath(sock):
                    address = None  # its own socket: the store's path reaches it
                raise StoreLocked(self._store_path, served, address) from None
            if readonly and (_read_only_fs(exc) or _denied(exc)):
                # On a read-only filesystem nothing can change under the view, so
                # a private copy linking the same table files is the same database.
                # A directory this user may read but not write (another user's
                # store, a root-made snapshot) is opened the same way: the open
                # failed writing rocksdict's config file into it, so no view of
                # such a store worked (a non-root audit). A writer may change it
                # meanwhile: a copy that met a flush fails as a raced open does.
                return self._open_copy(self.path)
            raise _open_error(self.path, exc, self.shown) from None
        raise StorageError(f"cannot open metadata at {self.shown} read-only: its writer "
                           f"flushed during each of {VIEW_OPEN_TRIES} tries; try again")

    def _open_view(self) -> Rdict | None:
        """A read-only open of a directory a writer may be changing, once it opened
        with no file of it made or removed meanwhile.

        RocksDB reads the MANIFEST, then the log files it finds. A flush between
        the two (every 256 KiB of writes on a nearly full disk, see
        keep_log_small) removes a log whose writes are in a table the MANIFEST
        read does not list: the view got the writes of the logs after it and
        not those of the one removed, its counters ahead of its indexes (a race
        audit: about 1 view in 100 under load). File numbers are never reused,
        so the same files before and after the open mean no flush ran in between.
        None if every try met one.
        """
        for _ in range(VIEW_OPEN_TRIES):
            before = _db_files(self.path)
            db = Rdict(self.path, _options(False), access_type=AccessType.read_only())
            if _db_files(self.path) == before:
                return db
            db.close()
        return None

    def _failure(self, doing: str, exc: Exception) -> StorageError:
        err = storage_error(doing, exc)
        if not self.readonly:
            self.failed = err
        return err

    def reopen(self) -> None:
        """Close and reopen the database after a failed write (writer lock held).

        RocksDB replays its WAL on open: batches whose write failed are not in
        it (or only as a torn tail, which recovery drops), and recovery writes
        the replayed memtable to a table file, so it needs some free space.
        Raises :class:`StorageError` (``failed`` stays set) if the reopen fails;
        the old handle, if it could not be closed, keeps serving reads.
        """
        old = self._db
        with self._iterators_lock:  # no iterator is made until the old handle is closed
            if len(self._iterators):
                # An iterator keeps the database, and its LOCK, alive past close(): the
                # open would fail as StoreLocked, "locked by another writer", for as
                # long as the compactor's scan of every message ran, and leave no
                # handle for reads either (a race audit). Keep it; the next write
                # tries again.
                raise self._must_wait(f"{len(self._iterators)} scan(s) in progress on it")
            try:
                old.close()
            except Exception as exc:  # the error state itself; closing still releases it
                if "Already borrowed" in str(exc):
                    # Another thread is inside a call on it (always mode's checkpoint
                    # flushes outside the writer lock): the handle stays open, and its
                    # LOCK with it, so an open now would fail as StoreLocked (a review).
                    # Keep it; the next write tries again.
                    raise self._must_wait(f"a call in progress on it ({exc})") from None
                log.debug("closing metadata after a failed write: %s", exc)
        del old
        try:
            self._db = self._open(create=False)
        except StoreLocked as exc:  # ours all the same (the store's writer lock is ours)
            error = StorageError(f"cannot reopen the metadata database: its LOCK is still "
                                 f"held in this process ({exc}); after {self.failed}")
            self.failed = error
            self._db = _Unavailable(error)  # type: ignore[assignment]
            raise error from None
        except StorageError as exc:
            self.failed = exc
            self._db = _Unavailable(exc)  # type: ignore[assignment]
            raise
        finally:
            self._opens += 1
        self.failed = None

    def _must_wait(self, why: str) -> StorageError:
        err = StorageError(f"reopening the metadata database must wait for {why}; "
                           f"after {self.failed}")
        err.errno = self.failed.errno if self.failed is not None else None
        return err

    def _open_copy(self, path: str) -> Rdict:
        try:
            self._scratch = private_copy(path)
        except OSError as exc:
            raise StorageError(f"cannot open metadata at {path} read-only: {exc}") from None
        try:
            return Rdict(self._scratch, _options(False), access_type=AccessType.read_only())
        except Exception as exc:
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise _open_error(self._scratch, exc, self.shown) from None

    def _read_error(self, exc: Exception) -> StorageError | Corruption:
        """A failed read's error, naming the files of :attr:`shown`, not of a private copy."""
        text = str(exc)
        if self._scratch is not None:
            text = text.replace(self._scratch, self.path)
        if self.shown != self.path:
            text = text.replace(self.path, self.shown)
        return _read_error(self.shown, Exception(text))

    def get(self, key: bytes) -> bytes | None:
        try:
            value: bytes | None = self._db.get(key)
            return value
        except Exception as exc:
            raise self._read_error(exc) from None

    def write_mark(self) -> tuple[int, int]:
        """A value that changes with every write to the database (and every reopen).

        RocksDB's latest sequence number, which every batch that changes
        something moves on. Two equal marks taken under the writer lock mean
        nothing was written in between: the compactor reads again only the
        records of a pass that something may have changed (qstore/_compact.py).
        """
        try:
            seq: int = self._db.latest_sequence_number()
        except Exception as exc:
            raise self._read_error(exc) from None
        return self._opens, seq

    def multi_get(self, keys: list[bytes]) -> list[bytes | None]:
        try:
            values: list[bytes | None] = self._db[keys]  # type: ignore[index,assignment]
            return values
        except Exception as exc:
            raise self._read_error(exc) from None

    def write(self, batch: WriteBatch, *, sync: bool = False) -> None:
        if self.failed is not None:
            raise self._refused()
        self.writes += 1
        try:
            self._db.write(batch, self._wopts_sync if sync else self._wopts)
        except Exception as exc:
            raise self._failure("metadata write failed", exc) from None

    def _refused(self) -> StorageError:
        failed = self.failed
        assert failed is not None
        err = StorageError(f"metadata writes are stopped until the database is reopened "
                           f"after an earlier failure ({failed})")
        err.errno = failed.errno
        return err

    def sync_wal(self) -> None:
        if self.failed is not None:
            raise self._refused()
        try:
            self._db.flush_wal(True)
        except Exception as exc:
            raise self._failure("metadata sync failed", exc) from None

    def _iter(self, ro: ReadOptions) -> _Live:
        """A new iterator (``.it``), counted while the returned holder lives:
        :meth:`reopen` must not close the handle under one. The caller keeps the
        holder as long as it uses the iterator. Counted by a weak set, not by the
        callers' ``finally``: an interrupt between a call's return and the next
        line's ``try`` left a count that refused every reopen for good (a review)."""
        with self._iterators_lock:
            try:
                live = _Live(self._db.iter(ro))
            except Exception as exc:  # the database is unavailable (closed, a failed reopen)
                raise StorageError(f"metadata read failed: {exc}") from None
            self._iterators.add(live)
        return live

    def scan(self, lo: bytes, hi: bytes,
             limit: int | None = None) -> Generator[tuple[bytes, bytes], None, None]:
        """(key, value) for lo <= key < hi in order, from a point-in-time iterator."""
        ro = ReadOptions()
        ro.set_iterate_upper_bound(hi)  # NOT set_iterate_lower_bound: it sets the upper one
        live = self._iter(ro)
        it = live.it
        try:
            it.seek(lo)
            n = 0
            while it.valid() and (limit is None or n < limit):
                yield it.key(), it.value()
                it.next()
                n += 1
            self._status(it)
        finally:
            del it, live

    def items(self, lo: bytes, hi: bytes) -> Generator[tuple[bytes, bytes], None, None]:
        """(key, value) for lo <= key < hi in order, through rocksdict's own item iterator.

        About a third of the cost of stepping an iterator by hand, for passes
        over millions of keys; a point-in-time view from the first ``next``.
        On a read-write database it steps one iterator by hand (see below).
        The generator holds a RocksDB iterator, and with it the database's
        LOCK, until it is exhausted or dropped: drop it before :meth:`close`.
        """
        if not self.readonly:
            # The writer's own database changes while it scans (the compactor scans
            # beside pushes and acks): the check below, a second iterator made
            # later, could see keys written after the item iterator's view and
            # take them for an early end. One iterator stepped by hand says by its
            # status whether it really ended.
            yield from self.scan(lo, hi)
            return
        ro = ReadOptions()  # kept alive here: the iterator points at its bound
        ro.set_iterate_upper_bound(hi)  # NOT set_iterate_lower_bound: it sets the upper one
        last = None
        try:
            items = cast(Iterator[tuple[bytes, bytes]],  # raw mode: bytes only
                         self._db.items(from_key=lo, read_opt=ro))
            for item in items:
                last = item[0]
                yield item
        except Exception as exc:
            raise self._read_error(exc) from None
        # rocksdict's item iterator ends quietly at a damaged block: step past the
        # last key it gave with an iterator whose status says whether it really ended.
        it = self._db.iter(ro)
        try:
            it.seek(lo if last is None else last)
            if last is not None and it.valid() and it.key() == last:
                it.next()
            if it.valid():
                raise StorageError(f"metadata scan ended early at {it.key().hex()}")
            self._status(it)
        finally:
            del it

    def scan_keys(self, lo: bytes, hi: bytes, limit: int | None = None) -> list[bytes]:
        ro = ReadOptions()
        ro.set_iterate_upper_bound(hi)
        live = self._iter(ro)
        it = live.it
        try:
            it.seek(lo)
            keys: list[bytes] = []
            while it.valid() and (limit is None or len(keys) < limit):
                keys.append(it.key())
                it.next()
            self._status(it)
            return keys
        finally:
            del it, live

    def first_key(self, lo: bytes, hi: bytes) -> bytes | None:
        ro = ReadOptions()
        ro.set_iterate_upper_bound(hi)
        live = self._iter(ro)
        it = live.it
        try:
            it.seek(lo)
            key: bytes | None = it.key() if it.valid() else None
            if key is None:
                self._status(it)
            return key
        finally:
            del it, live

    def last_key(self, lo: bytes, hi: bytes) -> bytes | None:
        """The largest key in [lo, hi), or None."""
        live = self._iter(ReadOptions())
        it = live.it
        try:
            it.seek_for_prev(hi)
            while it.valid():
                key: bytes = it.key()
                if key < lo:
                    return None
                if key < hi:
                    return key
                it.prev()  # seek_for_prev lands on hi itself when it exists
            self._status(it)
            return None
        finally:
            del it, live

    def _status(self, it: Any) -> None:
        """Raise if iterator ``it`` stopped on an error (a damaged block ends an
        iteration like its last key would: only the status tells them apart)."""
        try:
            it.status()
        except Exception as exc:
            raise self._read_error(exc) from None

    def ingest(self, paths: list[str]) -> None:
        """Add SST files (see :class:`SstWriter`) in one atomic ingestion.

        The files are moved (hard-linked) into the database, so they must be on
        its filesystem. They may overlap each other's key ranges; keys they
        share with the database are overwritten (an ingested file gets a
        sequence number newer than everything in it).
        """
        opts = IngestExternalFileOptions()
        opts.set_move_files(True)
        self.writes += 1
        try:
            self._db.ingest_external_file(paths, opts)
        except Exception as exc:
            raise storage_error(f"ingesting {len(paths)} table files failed", exc) from None

    def checkpoint(self, dest: str) -> None:
        try:
            Checkpoint(self._db).create_checkpoint(dest)
        except Exception as exc:
            raise storage_error(f"checkpoint to {dest} failed", exc) from None

    def export(self, dest: str) -> None:
        """A new database at ``dest`` holding every key this one reads now.

        What a read-only view's snapshot takes instead of :meth:`checkpoint`:
        RocksDB's checkpoint of a read-only instance leaves out what only its
        memtable holds (the writer's log, which the view replayed in memory
        when it opened), so a view's checkpoint lost every change the writer
        had not yet flushed to a table file.
        """
        table = dest + ".export.sst"
        writer = SstWriter(table)
        count = 0
        try:
            chunk: list[tuple[bytes, bytes]] = []
            for pair in self.items(b"", _EXPORT_END):
                chunk.append(pair)
                if len(chunk) >= 10_000:
                    writer.put_many(chunk)
                    count += len(chunk)
                    chunk = []
            if chunk:
                writer.put_many(chunk)
                count += len(chunk)
            if count:
                writer.finish()
            copy = MetaDB(dest, readonly=False, store_path=dest)
            try:
                if count:
                    copy.ingest([table])
                copy.flush()
            finally:
                copy.close()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(table)

    def keep_log_small(self, small: bool) -> None:
        """Keep the write-ahead log small (a nearly full disk), or let it grow again.

        RocksDB writes every batch to its log, and drops a log only once the
        memtable it backs is flushed, by default at 64 MiB. After a write fails
        on a full disk, the database must be reopened, and the reopen replays
        the log into a table file: it needs about the log's size free. A store
        that filled its disk with small messages had a log of 15 MB on a 32 MiB
        disk, far more than the 1 MiB space reserve gives back, and no ack,
        pop or compaction could go through until a file was deleted by hand.
        Small, the memtable is flushed (and its log dropped) every
        :data:`SMALL_WRITE_BUFFER_BYTES`; the switch applies to the open
        database at once (``SetOptions``: the next write flushes a memtable
        already past the size) and to every reopen. The caller flushes now, while
        there is room for the table file.
        """
        if small == self.small_log:
            return
        if self.failed is None:  # else the reopen that resumes writes opens with it
            try:
                self._db.set_options({k: str(v) for k, v in _LOG_OPTIONS[small].items()})
            except Exception as exc:  # on a full disk: "Unable to persist options"
                raise storage_error("setting the metadata write buffer failed", exc) from None
        self.small_log = small  # once set (a failure is tried again at the next look)

    def memtable_bytes(self) -> int:
        """The memtables' size: about what a flush writes, and the log it drops."""
        try:
            return int(self._db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0)
        except Exception as exc:
            raise self._read_error(exc) from None

    def flush(self) -> None:
        if self.failed is not None:
            raise self._refused()
        try:
            self._db.flush()
        except Exception as exc:
            raise self._failure("metadata flush failed", exc) from None

    def close(self) -> None:
        """Release the database; its LOCK is released even when closing reports an error."""
        try:
            self._db.close()
        except Exception as exc:
            raise storage_error("closing metadata failed", exc) from None
        finally:
            self._db = _Unavailable(StorageError("the metadata database is closed"))  # type: ignore[assignment]
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None


class _Unavailable:
    """Stands for the database while it is closed or a reopen failed: every call raises."""

    def __init__(self, why: StorageError) -> None:
        self._why = why

    def __getattr__(self, name: str) -> object:
        raise Exception(f"metadata database unavailable: {self._why}")

    def close(self) -> None:
        pass


def _read_error(path: str, exc: Exception) -> StorageError | Corruption:
    if _corruption(exc):
        return Corruption(path, 0, f"metadata is damaged: {exc}")
    return storage_error("metadata read failed", exc)


def _open_error(path: str, exc: Exception, shown: str | None = None
                ) -> StorageError | Corruption:
    """The error of a failed open of ``path``: ``Corruption`` when RocksDB found damage.

    ``shown``: the directory ``path`` is a private copy of. Damage is named in
    it (the copy links its table files); any other failure names the copy too,
    since what failed may be a write into the copy (its info log, in ``TMPDIR``).
    """
    shown = path if shown is None else shown
    text = str(exc)
    if _corruption(exc):
        return Corruption(shown, 0, f"metadata is damaged: {text.replace(path, shown)}")
    if "No such file" in text and os.path.exists(os.path.join(path, "CURRENT")):
        # The database exists but a file it names is gone (its MANIFEST, a
        # table): damage, as the contract says for missing metadata. A view
        # racing the writer's deletion of a file retries on the same text.
        return Corruption(shown, 0, f"metadata is damaged: a file of the database is "
                                    f"missing: {text.replace(path, shown)}")
    if shown != path:
        return storage_error(f"cannot open metadata at {shown} through its private copy "
                             f"{path}", exc)
    return storage_error(f"cannot open metadata at {path}", exc)


class SstWriter:
    """A sorted table file for :meth:`MetaDB.ingest`, written in raw mode as the database.

    Keys must be added in strictly ascending order; an empty file cannot be
    finished. :meth:`finish` syncs the file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._writer = SstFileWriter(Options(raw_mode=True))
        try:
            self._writer.open(path)
        except Exception as exc:
            raise StorageError(f"cannot create table file {path}: {exc}") from None

    def put(self, key: bytes, value: bytes) -> None:
        self.put_many([(key, value)])

    def put_many(self, pairs: Iterable[tuple[bytes, bytes]]) -> None:
        """Add sorted ``(key, value)`` pairs (one call for a whole batch)."""
        writer = self._writer
        try:
            for key, value in pairs:
                writer[key] = value
        except Exception as exc:  # a key out of order, a failed write
            raise StorageError(f"writing table file {self.path} failed: {exc}") from None

    def put_keys(self, keys: Iterable[bytes], value: bytes = b"") -> None:
        """Add sorted keys, all with ``value``."""
        writer = self._writer
        try:
            for key in keys:
                writer[key] = value
        except Exception as exc:
            raise StorageError(f"writing table file {self.path} failed: {exc}") from None

    def finish(self) -> None:
        try:
            self._writer.finish()
        except Exception as exc:
            raise StorageError(f"cannot finish table file {self.path}: {exc}") from None


def write_sst(path: str, entries: Iterable[tuple[bytes, bytes]]) -> None:
    """A table file holding ``entries`` (in any order; at least one)."""
    writer = SstWriter(path)
    writer.put_many(sorted(entries))
    writer.finish()


# Above every key of the schema (docs/meta-schema.md: keys begin with an ASCII tag).
_EXPORT_END = b"\xff" * 8


def new_batch() -> WriteBatch:
    return WriteBatch(raw_mode=True)

