"""Consistent snapshots of a running store, for Spark jobs and backups.

A snapshot directory holds ``meta/`` (a RocksDB checkpoint), ``payload/``
(hard links of every segment, damaged ones included: a faithful copy) and
``MANIFEST.json`` (format version, time, every segment with the length of its
data at the moment of the checkpoint).
All three are taken under the writer lock, so they agree. Segments are never
modified in place (the active one only grows; compaction only unlinks), so a
hard link keeps the snapshot's bytes intact whatever the live store does
next; bytes of the active segment past the manifest's length belong to the
live store and are ignored by readers of the snapshot.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from typing import Any

from ._address import checked_path
from ._core import SNAPSHOT_MANIFEST, SNAPSHOT_UNFINISHED, Core
from ._errors import Corruption, InvalidArgument, StorageError
from ._fs import (
    calls,
    fsync_dir,
    fsync_file,
    make_dirs_durably,
    remove_paths,
    write_json_durably,
)
from .payload._format import segment_name

log = logging.getLogger("qstore.snapshot")

MANIFEST = SNAPSHOT_MANIFEST
MANIFEST_FORMAT = 1  # never change the meaning of 1
# In a snapshot's directory while it is taken; removed once its manifest is
# durable. A directory holding it and no manifest is a snapshot whose process
# was killed: a snapshot to it again replaces it, `qstore check` says so.
UNFINISHED = SNAPSHOT_UNFINISHED


def unfinished(dest: str) -> bool:
    """Whether ``dest`` holds a snapshot whose taking was cut short (a killed process)."""
    return (os.path.exists(os.path.join(dest, UNFINISHED))
            and not os.path.exists(os.path.join(dest, MANIFEST)))


def take_snapshot(core: Core, dest: str | os.PathLike[str]) -> str:
    """Write a snapshot of the store to ``dest`` (new, or an empty directory).

    All or nothing: a snapshot that fails (a full disk, an I/O error, a
    destination on another filesystem) raises :class:`StorageError` (the
    ``errno`` kept) and removes what it wrote, so ``dest`` is as it was.
    """
    if isinstance(dest, str) and not dest:  # os.path.exists("") is False: the cwd
        raise InvalidArgument("snapshot destination is empty")
    dest = checked_path(dest, "snapshot destination")
    inside = os.path.realpath(core.path) + os.sep
    if (os.path.realpath(dest) + os.sep).startswith(inside):
        raise InvalidArgument(f"snapshot destination {dest!r} is inside the store "
                              f"{core.path!r}")
    if os.path.isdir(dest) and unfinished(dest):
        _check_replaceable(dest)
        # Ours, cut short by a kill: nothing reads it (no manifest). Its files are
        # hard links and a checkpoint's copies; the store's own stay untouched.
        log.warning("replacing the unfinished snapshot in %s (its process was killed "
                    "while taking it)", dest)
        _remove_partial(dest, existed=True)
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise InvalidArgument(f"snapshot destination {dest!r} exists and is not empty")
    existed = os.path.isdir(dest)
    try:
        _write(core, dest)
    except BaseException:
        _remove_partial(dest, existed)
        raise
    return dest


def _write(core: Core, dest: str) -> None:
    try:
        # The marker before anything else, durable before the first hard link: a
        # kill at any point leaves a directory that is empty or marked, never one
        # that looks like a store (its segments are the live store's files).
        make_dirs_durably(dest)
        with open(os.path.join(dest, UNFINISHED), "wb"):
            pass
        fsync_dir(dest)
        os.makedirs(os.path.join(dest, "payload"), exist_ok=True)  # made durable below
    except OSError as exc:
        raise _storage_error(f"cannot create the snapshot directory {dest!r}", exc) from exc
    with core.settling:
        core.check_open()
        if not core.readonly:
            # The S record of the segment pushes defer catches up, so the snapshot's
            # records defer none of its messages (a view's may: readers count them).
            core.settle_segments()
            # Every payload byte the checkpoint's records name, durable before them:
            # the linked segments are the store's files, and in interval or none
            # mode their last appends may not have been synced yet. A power loss
            # then left a snapshot, returned and durable, whose records named
            # bytes it did not have: damaged for good (a power-loss audit). The
            # sync also keeps the live store's payload ahead of the metadata the
            # checkpoint's flush makes durable. The payload's own fdatasync (it
            # waits for one in progress), not the syncer's: that writes the
            # durable mark, a metadata write that made the checkpoint flush a
            # table of its own for it.
            try:
                core.payload.sync()
            except OSError as exc:
                raise _storage_error("cannot sync the payload before the snapshot",
                                     exc) from exc
        created = core.clock()
        if core.readonly:  # a view: its memtable holds what the writer had not flushed
            core.meta.export(os.path.join(dest, "meta"))
        else:
            core.meta.checkpoint(os.path.join(dest, "meta"))
            if core.syncer.on_synced is not None:
                # Now, after the checkpoint (a write before it flushed a table of its
                # own): the mark moves and the journal and pending batch keys the
                # sync covered go, as after any sync (they stayed until the next).
                core.syncer.on_synced()
        segments = []
        linked = []
        # Damaged segments too (a header that does not read: no reader, so not in
        # file_ids): immutable files of the store like the others, linked as they
        # are, so the snapshot's check names the same damage as the store's.
        damaged = dict(core.payload.damaged)
        for fid in sorted(set(core.payload.file_ids()) | set(damaged)):
            name = segment_name(fid)
            target = os.path.join(dest, "payload", name)
            try:
                calls.link(core.payload.path_of(fid), target)
                linked.append(target)
            except OSError as exc:
                if not (core.readonly and exc.errno == errno.ENOENT):
                    raise _storage_error(f"cannot hard-link segment {name} into {dest!r} "
                                         f"({_link_hint(exc)})", exc) from exc
                if fid in damaged:
                    # A view's damaged segment the writer retired since (a repair
                    # renamed it: nothing referred to it), and no pinned map of it.
                    # Left out, the view's S record of it made a snapshot that never
                    # checked clean (a review): refused, the next view has neither.
                    raise StorageError(
                        f"segment {name} was retired by a repair after this read-only "
                        "view opened, and the view's metadata still names it: open a "
                        "new view and take the snapshot again") from exc
                # A view's segment the writer deleted since the view opened: still the
                # view's (pinned), so its bytes are written out as a copy.
                try:
                    core.payload.write_pinned(fid, target, core.data_size(fid))
                except OSError as exc2:
                    raise _storage_error(f"cannot write segment {name} into {dest!r}",
                                         exc2) from exc2
            if fid in damaged:
                log.warning("segment %s is damaged (%s): linked into the snapshot as it is",
                            name, damaged[fid])
            # A view's active segment ends where its records do: the writer cuts
            # the preallocated zeros off (in the linked file too) when it closes.
            segments.append({"file_id": fid, "length": core.data_size(fid)})
        if core.readonly and linked:
            # A view's newest segment may be the writer's active one, whose last
            # appends that process has not synced yet (the others were sealed,
            # so synced): made durable here, as a writer's snapshot syncs its
            # payload first (a review).
            try:
                fsync_file(linked[-1])
            except OSError as exc:
                raise _storage_error(f"cannot sync segment {linked[-1]!r}", exc) from exc
        active = core.payload.active_id
    manifest = {
        "format": MANIFEST_FORMAT,
        "kind": "qstore-snapshot",
        "created_at": created,
        "active_id": active,
        "segments": segments,
    }
    try:
        fsync_dir(os.path.join(dest, "payload"))
        write_json_durably(os.path.join(dest, MANIFEST), manifest)
        # The manifest makes it a snapshot; the marker goes after it is durable (a
        # kill in between leaves a finished snapshot and a marker readers ignore).
        calls.unlink(os.path.join(dest, UNFINISHED))
        fsync_dir(dest)
    except OSError as exc:
        raise _storage_error(f"cannot write the snapshot manifest in {dest!r}", exc) from exc


def _storage_error(what: str, exc: OSError) -> StorageError:
    err = StorageError(f"{what}: {exc}")
    err.errno = exc.errno
    return err


def _link_hint(exc: OSError) -> str:
    """Why a segment's hard link failed, as far as its errno tells: the store's
    filesystem named for EPERM too was wrong (a non-root audit)."""
    if exc.errno == errno.EXDEV:
        return "a snapshot must be on the store's filesystem"
    if exc.errno == errno.EPERM:
        return ("the kernel refuses links to files this user does not own "
                "(fs.protected_hardlinks): take the snapshot as the store's owner")
    return "the destination must be writable and on the store's filesystem"


# Every name a snapshot writes in its destination; nothing else there is its own.
# (RocksDB's checkpoint stages in meta.tmp, a view's export writes meta.export.sst:
# a snapshot killed there was refused its retake in place; a review.)
_WRITTEN = frozenset({UNFINISHED, "meta", "meta.tmp", "meta.export.sst", "payload", MANIFEST,
                      MANIFEST + ".tmp"})


def _check_replaceable(dest: str) -> None:
    """Refuse to replace an unfinished snapshot that holds more than a snapshot
    writes, or whose marker another user made.

    Any directory holding the marker was taken for one and emptied, whatever
    else it held: a client of a server could plant the marker in a directory
    it may write (a sticky /tmp) and have the server delete other users'
    files there (a security audit).
    """
    others = sorted(set(os.listdir(dest)) - _WRITTEN)
    owner = os.lstat(os.path.join(dest, UNFINISHED)).st_uid
    if others or owner != os.geteuid():
        why = (f"it also holds {others[:5]!r}" if others
               else f"its marker {UNFINISHED} belongs to user {owner}, not to this process's")
        raise InvalidArgument(
            f"snapshot destination {dest!r} looks like a snapshot cut short, but {why}: "
            "not replaced; remove what you do not want there by hand")


def _remove_partial(dest: str, existed: bool) -> None:
    """Remove what a failed snapshot wrote: its names in ``dest``, and ``dest`` itself
    if this snapshot made it (and nothing else is in it).

    Hard links and the checkpoint's files only: the store's own files are
    untouched, and so is anything else in ``dest``.
    """
    try:
        names = os.listdir(dest)
    except FileNotFoundError:
        return
    # The marker last: a kill meanwhile leaves the directory still marked, never
    # meta/ and payload/ without it, which would look like a store.
    left = remove_paths([os.path.join(dest, n) for n in names
                         if n in _WRITTEN and n != UNFINISHED])
    if not left:
        left = remove_paths([os.path.join(dest, UNFINISHED)])
    if not left and not existed:
        with contextlib.suppress(OSError):  # not empty: what another put there stays
            os.rmdir(dest)
    for path in left:
        log.error("cannot remove %s of a failed snapshot; remove it by hand", path)


def read_manifest(snapshot: str) -> dict[str, Any]:
    """The snapshot's manifest, its fields checked.

    ``InvalidArgument`` if ``snapshot`` is not a snapshot (no manifest, or
    another kind or format of file); ``Corruption`` if the manifest is
    damaged (not JSON, fields missing or of the wrong type); ``StorageError``
    if it cannot be read.
    """
    path = os.path.join(snapshot, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise InvalidArgument(f"{snapshot!r} is not a qstore snapshot (no {MANIFEST})") from None
    except OSError as exc:
        raise _storage_error(f"cannot read the snapshot manifest {path!r}", exc) from exc
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise Corruption(path, 0, f"damaged snapshot manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != "qstore-snapshot":
        raise InvalidArgument(f"{path} is not a snapshot manifest")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise InvalidArgument(f"{path} is a snapshot manifest of format "
                              f"{manifest.get('format')!r}; this version reads "
                              f"{MANIFEST_FORMAT}")
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise Corruption(path, 0, f"damaged snapshot manifest: {problem}")
    return manifest


def _manifest_problem(manifest: dict[str, Any]) -> str | None:
    def count(value: object) -> bool:
        return type(value) is int and value >= 0

    segments = manifest.get("segments")
    if not isinstance(segments, list):
        return "'segments' is not a list"
    for seg in segments:
        if not (isinstance(seg, dict) and count(seg.get("file_id"))
                and count(seg.get("length"))):
            return f"segment entry {seg!r:.80} is not {{'file_id': int, 'length': int}}"
    active = manifest.get("active_id")
    if active is not None and not count(active):
        return f"'active_id' is {active!r:.40}, not an int or null"
    created = manifest.get("created_at", 0.0)
    if type(created) not in (int, float):
        return f"'created_at' is {created!r:.40}, not a number"
    return None
