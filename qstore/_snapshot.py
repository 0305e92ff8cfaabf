"""Consistent snapshots of a running store, for Spark jobs and backups.

A snapshot directory holds ``meta/`` (a RocksDB checkpoint), ``payload/``
(hard links of every segment) and ``MANIFEST.json`` (format version, time,
every segment with the length of its data at the moment of the checkpoint).
All three are taken under the writer lock, so they agree. Segments are never
modified in place (the active one only grows; compaction only unlinks), so a
hard link keeps the snapshot's bytes intact whatever the live store does
next; bytes of the active segment past the manifest's length belong to the
live store and are ignored by readers of the snapshot.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from typing import Any

from ._core import Core
from ._errors import InvalidArgument, StorageError
from ._fs import calls, fsync_dir, write_json_durably
from .payload._format import segment_name

log = logging.getLogger("qstore.snapshot")

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1  # never change the meaning of 1


def take_snapshot(core: Core, dest: str) -> str:
    """Write a snapshot of the store to ``dest`` (new, or an empty directory).

    All or nothing: a snapshot that fails (a full disk, an I/O error, a
    destination on another filesystem) raises :class:`StorageError` (the
    ``errno`` kept) and removes what it wrote, so ``dest`` is as it was.
    """
    dest = os.fspath(dest)
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
        os.makedirs(os.path.join(dest, "payload"), exist_ok=True)
    except OSError as exc:
        raise _storage_error(f"cannot create the snapshot directory {dest!r}", exc) from exc
    with core.settling:
        core.check_open()
        if not core.readonly:
            # The S record of the segment pushes defer catches up, so the snapshot's
            # records defer none of its messages (a view's may: readers count them).
            core.settle_segments()
        created = core.clock()
        core.meta.checkpoint(os.path.join(dest, "meta"))
        segments = []
        for fid in core.payload.file_ids():
            name = segment_name(fid)
            try:
                calls.link(core.payload.path_of(fid), os.path.join(dest, "payload", name))
            except OSError as exc:
                raise _storage_error(f"cannot hard-link segment {name} into {dest!r} (a "
                                     "snapshot must be on the store's filesystem)", exc) from exc
            # A view's active segment ends where its records do: the writer cuts
            # the preallocated zeros off (in the linked file too) when it closes.
            segments.append({"file_id": fid, "length": core.data_size(fid)})
        active = core.payload.active_id
    manifest = {
        "format": MANIFEST_FORMAT,
        "kind": "qstore-snapshot",
        "created_at": created,
        "active_id": active,
        "segments": segments,
    }
    try:
        write_json_durably(os.path.join(dest, MANIFEST), manifest)
        fsync_dir(os.path.join(dest, "payload"))
    except OSError as exc:
        raise _storage_error(f"cannot write the snapshot manifest in {dest!r}", exc) from exc


def _storage_error(what: str, exc: OSError) -> StorageError:
    err = StorageError(f"{what}: {exc}")
    err.errno = exc.errno
    return err


def _remove_partial(dest: str, existed: bool) -> None:
    """Remove what a failed snapshot wrote: ``dest`` itself, or its contents if it existed.

    Hard links and the checkpoint's files only: the store's own files are untouched.
    """
    paths = [os.path.join(dest, name) for name in os.listdir(dest)] if existed else [dest]
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):  # reported below
                os.unlink(path)
        if os.path.lexists(path):
            log.error("cannot remove %s of a failed snapshot; remove it by hand", path)


def read_manifest(snapshot: str) -> dict[str, Any]:
    path = os.path.join(snapshot, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        raise InvalidArgument(f"{snapshot!r} is not a qstore snapshot (no {MANIFEST})") from None
    if manifest.get("kind") != "qstore-snapshot" or manifest.get("format") != MANIFEST_FORMAT:
        raise InvalidArgument(f"{path} is not a snapshot manifest of format {MANIFEST_FORMAT}")
    return manifest
