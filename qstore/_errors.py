"""The exception tree of qstore.

Every error qstore raises on purpose derives from :class:`QStoreError`::

    QStoreError
    ├── StoreLocked            another process holds the store read-write
    ├── StoreClosed            the store was closed
    ├── ReadOnlyStore          a write on a store opened with readonly=True
    ├── QueueNotFound          no queue of that name
    ├── QueueExists            create_queue of an existing name (exist_ok=False)
    ├── InvalidArgument        bad input; also a ValueError
    │   └── PayloadTooLarge    payload over max_payload_bytes
    ├── MessageNotFound        no such message (never pushed, acked, purged)
    ├── LeaseExpired           receipt expired or superseded by a later delivery
    ├── Corruption             damaged bytes on disk: (path, offset, reason)
    └── StorageError           an unexpected failure of RocksDB or the OS

Errors from rocksdict (plain ``Exception`` with a message) are wrapped in
:class:`StorageError` or :class:`StoreLocked`; they never reach users raw.
"""

from __future__ import annotations

from typing import Any


def _rebuild(cls: type[QStoreError], args: tuple[Any, ...],
             state: dict[str, Any]) -> QStoreError:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class QStoreError(Exception):
    """Root of every error qstore raises.

    Every one pickles and copies as it is (its message and its fields), so it
    can cross ``multiprocessing`` and ``concurrent.futures``: Exception's own
    reduce calls ``cls(*args)``, which for a class that builds its message
    from its fields either fails (``MessageNotFound``) or wraps the message
    in itself again (``QueueNotFound``).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, self.__dict__))


class StoreLocked(QStoreError):
    """Another process (or another open in this one) holds the store read-write.

    ``served``: the store directory holds a server's socket (``qstore serve``),
    or the file a running server writes into it, so the writer is most likely
    that server, which other processes reach with ``qstore.connect``: at
    ``address`` when it is known (a server listening on TCP), else through
    the store's path.
    """

    def __init__(self, path: str, served: bool = False, address: str | None = None) -> None:
        if served:
            where = address if address is not None else path
            super().__init__(f"store {path!r} is locked by another writer, most likely the "
                             f"qstore server on {where}: use qstore.connect({where!r}) "
                             "to go through it, or open it with readonly=True")
        else:
            super().__init__(f"store {path!r} is locked by another writer; open it with "
                             "readonly=True")
        self.path = path
        self.served = served
        self.address = address


class StoreClosed(QStoreError):
    """The store has been closed."""


class ReadOnlyStore(QStoreError):
    """A write was attempted on a store opened with ``readonly=True``."""


class QueueNotFound(QStoreError):
    def __init__(self, name: str) -> None:
        super().__init__(f"queue {name!r} does not exist")
        self.name = name


class QueueExists(QStoreError):
    def __init__(self, name: str) -> None:
        super().__init__(f"queue {name!r} already exists")
        self.name = name


class InvalidArgument(QStoreError, ValueError):
    """Bad input: wrong type, out of range, unknown option. Nothing was changed."""


class PayloadTooLarge(InvalidArgument):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"payload of {size} bytes is over max_payload_bytes={limit}")
        self.size = size
        self.limit = limit


class MessageNotFound(QStoreError):
    def __init__(self, queue: str, message_id: int) -> None:
        super().__init__(f"message {message_id} not found in queue {queue!r}")
        self.queue = queue
        self.message_id = message_id


class LeaseExpired(QStoreError):
    """The receipt's lease expired or a later delivery superseded it; nothing changed."""


class Corruption(QStoreError):
    """Damaged bytes on disk. Never repaired silently, never returned as data."""

    def __init__(self, path: str, offset: int, reason: str) -> None:
        super().__init__(f"corruption in {path} at offset {offset}: {reason}")
        self.path = path
        self.offset = offset
        self.reason = reason


class StorageError(QStoreError):
    """An unexpected failure of RocksDB or the operating system (a full disk, an I/O error).

    ``errno`` is the OS error number when an ``OSError`` caused it (``errno.ENOSPC``
    for a full disk), or when RocksDB's message names one, else None. Nothing
    the failed operation meant to change was changed (docs/faults.md). Once
    the cause is gone (space freed), the next write works in the same process:
    after a failed metadata write it reopens the database first.
    """

    errno: int | None = None


# Exit codes of the `qstore` commands and the spark/ scripts (README, "Command line").
EXIT_OK = 0
EXIT_FOUND = 1  # the command found something: audit findings, an empty queue, rejected rows
EXIT_USAGE = 2
EXIT_LOCKED = 3
EXIT_NOT_FOUND = 4
EXIT_ERROR = 5


def exit_code(exc: QStoreError) -> int:
    """The documented exit code of a command that failed with ``exc``."""
    if isinstance(exc, StoreLocked):
        return EXIT_LOCKED
    if isinstance(exc, (QueueNotFound, MessageNotFound)):
        return EXIT_NOT_FOUND
    if isinstance(exc, InvalidArgument):
        return EXIT_USAGE
    return EXIT_ERROR
