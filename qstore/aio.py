"""``qstore.aio.connect``: the asyncio client of a qstore server.

The same methods, arguments, results and exceptions as :class:`qstore.Client`
(and so as the embedded store), as coroutines; ``queue()`` is awaited too.
Many tasks may share one client: their requests are pipelined on one
connection and answers are matched by request id. A dropped connection fails
every request in flight with :class:`~qstore.ConnectionLost`; the next call
reconnects. Nothing is retried on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from collections.abc import Iterable, Sequence
from typing import Any

from . import _client_base as base
from . import _wire as wire
from ._address import Address, parse_address
from ._check_report import CheckReport
from ._compact import CompactionResult
from ._message import Message, QueueStats, StoreStats
from ._net_errors import ConnectionLost

__all__ = ["AsyncClient", "AsyncQueue", "connect"]


class _Link(base.LinkSettings):
    def __init__(self, address: Address, token: str | None, timeout: float, keep_leases: bool,
                 ssl_context: ssl.SSLContext | None, server_hostname: str | None) -> None:
        super().__init__(address, token, timeout, keep_leases, ssl_context, server_hostname)
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._opening = asyncio.Lock()

    async def _open(self) -> None:
        a = self.address
        try:
            if a.kind == "unix":
                coro = asyncio.open_unix_connection(a.path, ssl=self._ssl,
                                                    server_hostname=self._hostname
                                                    if self._ssl else None)
            else:
                coro = asyncio.open_connection(a.host, a.port, ssl=self._ssl,
                                               server_hostname=(self._hostname or a.host)
                                               if self._ssl else None)
            reader, writer = await asyncio.wait_for(coro, self.timeout)
            writer.write(base.hello(self._token, self._keep))
            welcome = await asyncio.wait_for(_read(reader), self.timeout)
        except (OSError, EOFError, asyncio.IncompleteReadError, TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect to {a}: {exc}") from None
        try:
            self.welcome = base.check_welcome(welcome)
        except BaseException:
            writer.close()
            raise
        self._writer = writer
        self._reader_task = asyncio.create_task(self._read_loop(reader, writer))

    async def _read_loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        why: BaseException = ConnectionLost(f"connection to {self.address} lost")
        try:
            while True:
                value = await _read(reader)
                rid = value[0] if isinstance(value, list) and value else None
                if rid == wire.SERVER_ERROR_ID:
                    why = wire.decode_error(value[2])
                    break
                fut = self._waiting.pop(rid, None) if isinstance(rid, int) else None
                if fut is not None and not fut.done():
                    fut.set_result(value)
        except (OSError, EOFError, asyncio.IncompleteReadError) as exc:
            why = ConnectionLost(f"connection to {self.address} lost: {exc}; requests in "
                                 "flight may or may not have run")
        except Exception as exc:  # a malformed frame from the server
            why = exc
        finally:
            if self._writer is writer:
                self._writer = None
            writer.close()
            waiting, self._waiting = self._waiting, {}
            for fut in waiting.values():
                if not fut.done():
                    fut.set_exception(why)

    async def call(self, op: str, args: dict[str, Any], wait: float = 0.0) -> Any:
        async with self._opening:
            if self._writer is None:
                await self._open()
        writer = self._writer
        assert writer is not None
        rid = next(self._ids)
        frame = base.request(rid, op, args, self.welcome.get("max_frame"))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        try:
            writer.write(frame)
            await writer.drain()
            value = await asyncio.wait_for(fut, self.timeout + wait)
        except (OSError, TimeoutError) as exc:
            self._waiting.pop(rid, None)
            await self.close()
            raise ConnectionLost(f"connection to {self.address} lost during {op}: {exc!r}; "
                                 "it may or may not have run") from None
        return base.result(value, rid)

    async def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        task, self._reader_task = self._reader_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _read(reader: asyncio.StreamReader) -> Any:
    (n,) = wire.LENGTH.unpack(await reader.readexactly(4))
    return wire.unpack(await reader.readexactly(n))


class AsyncQueue(base.QueueInfo):
    """A queue of a server; the methods of :class:`qstore.Queue`, awaitable."""

    def __init__(self, link: _Link, info: dict[str, Any]) -> None:
        super().__init__(info)
        self._link = link

    def __repr__(self) -> str:
        return f"<qstore.aio.AsyncQueue {self.name!r} on {self._link.address}>"

    async def _call(self, op: str, /, **args: Any) -> Any:
        return await self._link.call(op, *base.queue_args(self.name, args))

    async def push(self, payload: bytes, priority: int | str | None = None, delay: float = 0.0,
                   dedup_key: str | bytes | None = None, ttl: float | None = None) -> int:
        return int(await self._call("push", **base.push_args(payload, priority, delay, dedup_key,
                                                             ttl)))

    async def push_many(self, items: Iterable[bytes | Sequence[Any]], *, delay: float = 0.0,
                        ttl: float | None = None) -> list[int]:
        return list(await self._call("push_many", **base.push_many_args(items, delay, ttl)))

    async def pop(self, lease: float = 30.0, wait: float = 0.0) -> Message | None:
        return base.maybe_message(await self._call("pop", lease=lease, wait=wait))

    async def pop_many(self, n: int, lease: float = 30.0, wait: float = 0.0) -> list[Message]:
        return base.messages(await self._call("pop_many", n=n, lease=lease, wait=wait))

    async def ack(self, item: Message | str) -> None:
        await self._call("ack", receipt=base.receipt_of(item))

    async def ack_many(self, items: Iterable[Message | str]) -> int:
        return int(await self._call("ack_many", receipts=base.receipts_of(items)))

    async def nack(self, item: Message | str, delay: float = 0.0) -> None:
        await self._call("nack", receipt=base.receipt_of(item), delay=delay)

    async def extend(self, item: Message | str, lease: float = 30.0) -> Message:
        return wire.decode_message(await self._call("extend", receipt=base.receipt_of(item),
                                                    lease=lease))

    async def peek(self, n: int = 1) -> list[Message]:
        return base.messages(await self._call("peek", n=n))

    async def get(self, message_id: int) -> Message:
        return wire.decode_message(await self._call("get", message_id=message_id))

    async def dead_letters(self, n: int = 10) -> list[Message]:
        return base.messages(await self._call("dead_letters", n=n))

    async def redrive(self, n: int = 100) -> int:
        return int(await self._call("redrive", n=n))

    async def purge(self) -> int:
        return int(await self._call("purge"))

    async def stats(self) -> QueueStats:
        return wire.decode_stats(await self._call("stats"))


class AsyncClient:
    """The asyncio client; an async context manager."""

    def __init__(self, link: _Link) -> None:
        self._link = link
        self.path = str(link.address)

    async def create_queue(self, name: str, *, order: str = "max", priority_type: str = "int",
                     max_attempts: int = 5, dedup: bool = False, exist_ok: bool = False,
                     ttl: float | None = None, on_expire: str = "drop",
                     aging: float | None = None, aging_cap: int | None = None,
                     rate: tuple[int, float] | None = None) -> AsyncQueue:
        info = await self._link.call("create_queue", {
            "name": name, "order": order, "priority_type": priority_type,
            "max_attempts": max_attempts, "dedup": dedup, "exist_ok": exist_ok, "ttl": ttl,
            "on_expire": on_expire, "aging": aging, "aging_cap": aging_cap, "rate": rate})
        return AsyncQueue(self._link, info)

    async def configure_queue(self, name: str, **options: Any) -> AsyncQueue:
        """Change options of queue ``name`` (those of :meth:`qstore.Store.configure_queue`)."""
        info = await self._link.call("configure_queue", {**options, "name": name})
        return AsyncQueue(self._link, info)

    async def queue(self, name: str) -> AsyncQueue:
        return AsyncQueue(self._link, await self._link.call("queue", {"queue": name}))

    async def queues(self) -> list[str]:
        return list(await self._link.call("queues", {}))

    async def delete_queue(self, name: str) -> None:
        await self._link.call("delete_queue", {"name": name})

    async def stats(self) -> StoreStats:
        return wire.decode_store_stats(await self._link.call("store_stats", {}))

    async def compact(self, *, threshold: float | None = None,
                      max_bytes: int | None = None) -> CompactionResult:
        args: dict[str, Any] = {}
        if threshold is not None:
            args["threshold"] = threshold
        if max_bytes is not None:
            args["max_bytes"] = max_bytes
        return wire.decode_compaction(await self._link.call("compact", args, wait=3600.0))

    async def check(self, *, repair: bool = False) -> CheckReport:
        return wire.decode_check(await self._link.call("check", {"repair": repair},
                                                       wait=3600.0))

    async def snapshot(self, dest: str) -> str:
        return str(await self._link.call("snapshot", {"dest": os.path.abspath(dest)},
                                         wait=3600.0))

    async def ping(self) -> None:
        await self._link.call("ping", {})

    async def close(self) -> None:
        await self._link.close()

    async def __aenter__(self) -> AsyncClient:
        await self.ping()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def connect(address: str | os.PathLike[str], *, token: str | None = None,
            timeout: float = base.DEFAULT_TIMEOUT, keep_leases: bool = False,
            tls: bool | ssl.SSLContext = False, cafile: str | None = None,
            server_hostname: str | None = None) -> AsyncClient:
    """An asyncio client of the server at ``address``; connects on first use.

    Use as ``async with qstore.aio.connect(...) as client:`` (which connects
    at once) or call its methods and ``await client.close()``.
    """
    ctx = tls if isinstance(tls, ssl.SSLContext) else (
        base.client_tls(cafile) if tls or cafile else None)
    return AsyncClient(_Link(parse_address(address), token, timeout, keep_leases, ctx,
                             server_hostname))
