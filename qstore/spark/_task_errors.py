"""The qstore error behind a failed Spark job, found in the failure's text.

A Python task that raises fails the job, and the driver gets a Spark error
(``PythonException``, or ``Py4JJavaError`` through the RDD API) whose text is
the task's Python traceback; the exception itself stays in the executor. Its
last line names the class as ``module.Class: message``, so a
:class:`~qstore.Corruption` an executor met (damaged metadata in the part of a
snapshot only executors read) is recognised by that line and raised again in
the driver, where the command turns it into the exit code ``qstore check``
gives (5) with its one-line message, instead of "the job failed" with the
traceback.

Why the text, and not a checksum pass over the metadata in the driver before
Spark starts: rocksdict has no ``VerifyChecksum``, so the driver would have to
read every key of the snapshot itself (the work the executors are there to
share), and damage a task meets for any other reason (a table file unreadable
on one executor's mount) would still fail the job. The line this reads is
Python's own traceback format, which Spark passes on unchanged.
"""

from __future__ import annotations

import errno
import re

from .._errors import Corruption, InvalidArgument, StorageError

# "qstore._errors.Corruption: corruption in PATH at offset N: REASON" (Corruption's message)
_CORRUPTION_LINE = re.compile(
    rf"^{re.escape(f'{Corruption.__module__}.{Corruption.__qualname__}')}: "
    r"corruption in (?P<path>.+?) at offset (?P<offset>\d+): (?P<reason>.*?)\s*$",
    re.MULTILINE)


def task_corruption(exc: BaseException) -> Corruption | None:
    """The :class:`~qstore.Corruption` a task raised to fail the job of ``exc``, or None."""
    found = _CORRUPTION_LINE.findall(str(exc))
    if not found:
        return None
    path, offset, reason = found[-1]  # Spark reports the last attempt's failure last
    return Corruption(path, int(offset), reason)


# A task's last traceback line for an OS error: "OSError: [Errno 28] No space left
# on device: '/store/staging/...'" (any OSError subclass, or qstore's StorageError).
_OS_ERROR_LINE = re.compile(
    r"^(?:[A-Za-z_][\w.]*Error): \[Errno (?P<errno>\d+)\] (?P<text>.*?)\s*$", re.MULTILINE)
# The errors that mean the storage failed (exit 5), not the job or its input.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})


def task_storage_error(exc: BaseException) -> StorageError | None:
    """A :class:`~qstore.StorageError` for a task that failed the job of ``exc`` on
    a full disk or an I/O error (``[Errno N]`` in its last traceback line), or
    None. A store's disk that filled while the executors wrote their staging
    files failed a backfill with exit 3, "the Spark run failed", and about 200
    lines naming neither the file nor the filesystem (a Spark fault audit)."""
    found = [m for m in _OS_ERROR_LINE.finditer(str(exc))
             if int(m.group("errno")) in STORAGE_ERRNOS]
    if not found:
        return None
    last = found[-1]  # Spark reports the last attempt's failure last
    err = StorageError(f"a Spark task failed: [Errno {last.group('errno')}] "
                       f"{last.group('text')}")
    err.errno = int(last.group("errno"))
    return err


# Spark's CSV reader, told to check each file's header (enforceSchema=false), fails
# the task on a file whose header names the columns in another order.
_CSV_HEADER = re.compile(
    r"CSV header does not conform to the schema\.\s*Header: (?P<header>[^\n]*?)\s*\n"
    r"\s*Schema: (?P<schema>[^\n]*?)\s*\n.*?CSV file: (?P<file>\S+)", re.DOTALL)


def task_input_error(exc: BaseException) -> InvalidArgument | None:
    """An :class:`~qstore.InvalidArgument` for a task that failed the job of ``exc``
    on a source file the job cannot read as asked, or None: a CSV file of the
    source whose header lists the columns in another order than the file the
    columns were taken from (they were read by position, payload and priority
    swapped, before the job asked Spark to check headers; a backfill audit)."""
    found = _CSV_HEADER.search(str(exc))
    if found is None:
        return None
    path = found.group("file").removeprefix("file://")
    return InvalidArgument(
        f"the CSV file {path} has the header {found.group('header')!r}, where the source's "
        f"columns are {found.group('schema')!r}: the files of one CSV source must name the "
        "same columns in the same order")
