"""Where the server's store calls run: a store thread, or the event loop itself.

With ``durability="always"`` a call waits for a sync (hundreds of
microseconds) when it leaves the writer lock, so the calls run on one store
thread, off the event loop, in the order the loop submitted them (the
requests of one connection take effect in the order they arrived). The
thread takes every call queued since its last round and hands all the
results back to the loop with one ``call_soon_threadsafe``: under load a
thread hop is paid per round, not per request.

With ``interval`` or ``none`` no store call waits for the disk: a call only
waits for the writer lock, which other threads (the compactor, the sweeper)
hold for one batch at a time. Those calls run inline on the event loop
(:class:`InlineStore`), which saves the two thread hops per request that
were most of a request's round trip. Compaction and snapshots run in their
own thread either way (the server's ``_ops``).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

_Work = tuple[Callable[[], Any], "asyncio.Future[Any]"]
_STOP: Any = None
ROUND_MAX = 512  # calls per round: bounds the latency a round adds to the first call in it


class StoreThread:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="qstore-server-store",
                                        daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._work.put((fn, fut))
        return fut

    def stop(self) -> None:
        """Finish every call submitted so far, then end the thread."""
        self._work.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        work = self._work
        while True:
            item = work.get()
            batch = []
            stop = item is None
            if item is not None:
                batch.append(item)
            while not stop and len(batch) < ROUND_MAX:
                try:
                    item = work.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                else:
                    batch.append(item)
            done: list[tuple[asyncio.Future[Any], bool, Any]] = []
            for fn, fut in batch:
                try:
                    done.append((fut, True, fn()))
                except BaseException as exc:  # handed to the request's own future
                    done.append((fut, False, exc))
            if done:
                self._loop.call_soon_threadsafe(_settle, done)
            if stop:
                return


def _settle(done: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    for fut, ok, value in done:
        if fut.cancelled():
            continue
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)


class InlineStore:
    """The :class:`StoreThread` interface, running each call at once on the loop.

    Except while a call that holds the writer lock for long runs in another
    thread (``store.check()``: seconds to minutes): a call made inline then
    would wait for the lock on the event loop, so that not even a ping or a
    handshake of another client is answered (a security audit saw 2.2 s
    stalls during a 2.7 s check). While :meth:`holding` is in effect, and
    until the calls made meanwhile have all finished (so that none overtakes
    an earlier one), calls go to a side thread instead (:meth:`diverting`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._holds = 0
        self._pending = 0
        self._side: StoreThread | None = None

    def diverting(self) -> bool:
        """Whether calls go to the side thread now (the server asks before it runs
        one inline itself)."""
        return self._holds > 0 or self._pending > 0

    def holding(self) -> _Holding:
        """A context: a call holding the writer lock for long runs meanwhile."""
        return _Holding(self)

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        if self.diverting():
            if self._side is None:
                self._side = StoreThread(self._loop)
            self._pending += 1
            fut = self._side.submit(fn)
            fut.add_done_callback(self._side_done)
            return fut
        fut = self._loop.create_future()
        try:
            fut.set_result(fn())
        except Exception as exc:  # handed to the request's own future
            fut.set_exception(exc)
        return fut

    def _side_done(self, _fut: asyncio.Future[Any]) -> None:
        self._pending -= 1

    def stop(self) -> None:
        """Finish the side thread's calls, if it has any; the others have finished."""
        if self._side is not None:
            self._side.stop()


class _Holding:
    def __init__(self, store: InlineStore) -> None:
        self._store = store

    def __enter__(self) -> None:
        self._store._holds += 1

    def __exit__(self, *exc: object) -> None:
        self._store._holds -= 1
