"""The ``qstore`` command line.

Exit codes: 0 success; 1 the command found something (audit or check
findings, an empty queue on ``pop``/``peek``, a failed demo check); 2 bad usage,
also a STORE path that holds no store (nothing is created: only ``push --create``,
``serve`` and ``backfill`` create stores); 3 the
store is locked by another writer, or a Spark run (``audit``, ``backfill``) failed:
an unreachable master, a failed job; 4 no such queue or message; 5 any other
qstore error (corruption, storage failure); 130 interrupted (Ctrl-C); 141 the
reader of the output went away (a broken pipe: ``qstore check STORE | head -1``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import _errors as errors
from ._address import LOOPS
from ._cli_target import is_address, open_target, read_token, server_answers, server_of
from ._errors import EXIT_FOUND, exit_code
from ._fs import remove_paths
from ._lazy import lazy
from ._numbers import plain_number
from ._tables import add_plain_row, print_stats

# serve --log-level: logging's numbers, without importing logging to start the CLI
LOG_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}

if TYPE_CHECKING:
    from . import _check, _demo, _snapshot, server
    from . import _core as embedded_core
    from . import _store as embedded
else:  # loaded by the commands that use them (qstore/_lazy.py)
    _check = lazy("qstore._check")
    embedded_core = lazy("qstore._core")
    _demo = lazy("qstore._demo")
    _snapshot = lazy("qstore._snapshot")
    embedded = lazy("qstore._store")
    server = lazy("qstore.server")

EXIT_SPARK_FAILED = 3  # a Spark run failed (contract section 5); nothing was changed
EXIT_BROKEN_PIPE = 141  # the output's reader went away: 128 + SIGPIPE, as a shell reports it
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports it


def _reader_gone() -> NoReturn:
    """The reader of stdout went away: nothing more reaches it, stdout must not fail
    again at exit, and the exit code says so (:data:`EXIT_BROKEN_PIPE`). Both rich
    and click made that exit 1, which says "found something" (check findings)."""
    with suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(EXIT_BROKEN_PIPE)


class _Out(Console):
    def on_broken_pipe(self) -> None:
        _reader_gone()


out = _Out()
err = Console(stderr=True)


def _error(message: str) -> None:
    """``error: MESSAGE`` on stderr. The message is plain text, never markup: it
    quotes queue names, paths and arguments (``x[/y]`` raised MarkupError)."""
    err.print(Text.assemble(("error:", "red"), " ", message))


@contextmanager
def _exit_codes() -> Iterator[None]:
    """Turn a qstore error into its message on stderr and its documented exit code."""
    try:
        yield
    except errors.StoreLocked as exc:
        # Its message names Python's readonly=True, which no command takes. A command
        # gets here when the writer is not a server answering on the store's socket
        # (through one, the command would have gone through it), or it is a serve.
        if exc.served and server_answers(exc.path):
            _error(f"store {exc.path!r} is served already: a qstore server answers on "
                   "its socket; every other command goes through it")
            sys.exit(exit_code(exc))
        if exc.served and exc.address is not None:  # a server on TCP only
            _error(f"store {exc.path!r} is served already, by the qstore server on "
                   f"{exc.address}: give commands that address (with --token-file if it "
                   "needs a token) instead of the store's path")
            sys.exit(exit_code(exc))
        # A server of a qstore from before STORE/qstore.server, on an address other
        # than the store's socket, is told from an embedding process by nothing.
        _error(f"store {exc.path!r} is locked by another writer (a "
               "process that opened it with qstore.open, or an older qstore server "
               "listening elsewhere than the store's socket): read-only commands (stats, "
               "peek, queues, check, snapshot) still work; to change it while that process runs, "
               "let a server own the store (qstore serve) and have both go through it")
        sys.exit(exit_code(exc))
    except errors.QStoreError as exc:
        _error(str(exc))
        sys.exit(exit_code(exc))


@contextmanager
def _store(path: str, *, readonly: bool = False) -> Iterator[embedded.Store]:
    """Open a store for one command, turning qstore errors into exit codes."""
    with _exit_codes(), embedded.open_store(path, readonly=readonly, compactor=False) as store:
        yield store


@contextmanager
def _target(target: str, token_file: str | None, *, readonly: bool = False,
            keep_leases: bool = False, create: bool = False) -> Iterator[Any]:
    """The running server's client, or the store opened here (see _cli_target.py).

    Unless ``create``, a path holding no store exits 2 and creates nothing.
    """
    tls, cafile = _tls_options()
    with _exit_codes(), open_target(target, token_file, readonly=readonly,
                                    keep_leases=keep_leases, create=create, tls=tls,
                                    cafile=cafile) as store:
        yield store


def _tls_options() -> tuple[bool, str | None]:
    """The command's ``--tls`` and ``--cafile`` (kept in the click context by
    :func:`server_options`, so the commands' signatures need not carry them)."""
    meta = click.get_current_context().meta
    return bool(meta.get("qstore.tls")), meta.get("qstore.cafile")


def _remember(key: str) -> Any:
    def callback(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        ctx.meta[key] = value
        return value
    return callback


def server_options(f: Any) -> Any:
    """``--token-file``, ``--tls`` and ``--cafile``: how a command reaches a server."""
    f = click.option("--cafile", type=click.Path(exists=True, dir_okay=False), default=None,
                     expose_value=False, callback=_remember("qstore.cafile"),
                     help="CA certificate(s) to trust for a TLS server (implies --tls).")(f)
    f = click.option("--tls", is_flag=True, default=False, expose_value=False,
                     callback=_remember("qstore.tls"),
                     help="Reach a tcp:// server address over TLS (a server started "
                          "with --tls-cert).")(f)
    return click.option("--token-file", type=click.Path(exists=True, dir_okay=False),
                        default=None,
                        help="File holding the server's token (when it has one).")(f)


def _show_payload(payload: bytes, limit: int = 80) -> str:
    """A payload made safe for a terminal: printable text as is, else escaped bytes."""
    try:
        text = payload.decode("utf-8")
        if text.isprintable():
            return text if len(text) <= limit else text[:limit] + f"... ({len(payload)} bytes)"
    except UnicodeDecodeError:
        pass
    shown = repr(payload[:limit])
    return shown + (f"... ({len(payload)} bytes)" if len(payload) > limit else "")


def _parse_priority(store: Any, queue: str, text: str | None) -> int | str | None:
    if text is None:
        return None
    if store.queue(queue).priority_type == "str":
        return text
    try:
        return int(plain_number(text))  # not "1_000" or other scripts' digits
    except ValueError:
        raise click.BadParameter(f"queue {queue!r} takes int priorities, not {text!r}") from None


class _Command(click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """``--help`` prints while the arguments are parsed, before any command runs."""
        try:
            return super().parse_args(ctx, args)
        except BrokenPipeError:
            _reader_gone()


class _Commands(click.Group):
    command_class = _Command

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; a reader of its output that went away (``qstore check S |
        head -1``) ends it with :data:`EXIT_BROKEN_PIPE`, as SIGPIPE ends a shell tool."""
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # a write that did not go through rich (``out``)
            _reader_gone()
        except KeyboardInterrupt:
            # click made it "Aborted!" and exit 1, which says "found something":
            # `qstore check S || alert` alerted on a Ctrl-C (a signals audit).
            with suppress(OSError, ValueError):
                click.echo("interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except BrokenPipeError:  # qstore --help, qstore --version
            _reader_gone()


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="qstore")
def main() -> None:
    """qstore: a durable, embedded priority work queue.

    Exit codes: 0 ok, 1 found something (audit/check findings, empty queue,
    rejected backfill rows), 2 bad usage (also: STORE is not a store; only
    push --create, serve and backfill create one), 3 store locked by another
    writer, or a failed Spark run (audit, backfill), 4 no such queue/message,
    5 other error (a store that cannot be read, corruption, storage failure),
    130 interrupted (Ctrl-C), 141 the output's reader went away (a broken pipe).
    """


@main.command()
@click.argument("store_path", metavar="STORE")
@server_options
def queues(store_path: str, token_file: str | None) -> None:
    """List the queues of STORE (read-only; works while a writer runs).

    STORE is a store directory (through its server when one runs) or a
    server address, unix:///PATH or tcp://HOST:PORT.
    """
    with _target(store_path, token_file, readonly=True) as store:
        for name in store.queues():
            out.print(name, markup=False, highlight=False)


@main.command()
@click.argument("store_path", metavar="STORE")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@server_options
def stats(store_path: str, as_json: bool, token_file: str | None) -> None:
    """Counts per queue and state, and payload segments (read-only).

    STORE is a store directory (through its server when one runs) or a
    server address, unix:///PATH or tcp://HOST:PORT.
    """
    with _target(store_path, token_file, readonly=True) as store:
        st = store.stats()
    if as_json:
        click.echo(json.dumps({
            "queues": [{"queue": q.queue, "ready": q.ready, "delayed": q.delayed,
                        "in_flight": q.in_flight, "dead": q.dead, "bytes": q.bytes,
                        "expired": q.expired, "ttl": q.ttl, "on_expire": q.on_expire,
                        "aging": q.aging, "aging_cap": q.aging_cap,
                        "rate": None if q.rate is None else list(q.rate)}
                       for q in st.queues],
            "segments": [{"file_id": s.file_id, "size": s.size, "live_bytes": s.live_bytes,
                          "live_count": s.live_count, "garbage_ratio": s.garbage_ratio,
                          "active": s.active} for s in st.segments],
            "disk_bytes": st.disk_bytes, "live_bytes": st.live_bytes,
            "garbage_ratio": st.garbage_ratio,
        }, indent=1))
        return
    print_stats(st, out)


@main.command()
@click.argument("store_path", metavar="STORE")
@click.argument("queue")
@click.argument("payload", required=False)
@click.option("--file", "file_", type=click.File("rb"),
              help="Read the payload from a file ('-' for stdin).")
@click.option("-p", "--priority", help="Priority (int, or text on a str queue).")
@click.option("--delay", type=float, default=0.0, show_default=True,
              help="Seconds before it is ready.")
@click.option("--create", is_flag=True,
              help="Create the store and the queue (order max, int priorities) if missing.")
@click.option("--ttl", type=click.FloatRange(0.0, min_open=True), default=None,
              help="Seconds until it expires (default: the queue's ttl).")
@server_options
def push(store_path: str, queue: str, payload: str | None, file_: Any, priority: str | None,
         delay: float, create: bool, ttl: float | None, token_file: str | None) -> None:
    """Push one message (PAYLOAD text, or --file) onto QUEUE; prints its id.

    STORE is a store directory (through its server when one runs) or a
    server address, unix:///PATH or tcp://HOST:PORT.
    """
    if (payload is None) == (file_ is None):
        raise click.UsageError("give exactly one of PAYLOAD or --file")
    body = payload.encode("utf-8") if payload is not None else file_.read()
    with _target(store_path, token_file, create=create) as store:
        if create:  # if missing: an existing queue is used as it is, whatever its options
            with suppress(errors.QueueExists):
                store.create_queue(queue)
        mid = store.queue(queue).push(body, priority=_parse_priority(store, queue, priority),
                                      delay=delay, ttl=ttl)
    click.echo(mid)


@main.command()
@click.argument("store_path", metavar="STORE")
@click.argument("queue")
@click.option("-n", "count", type=click.IntRange(1), default=1, show_default=True)
@click.option("--lease", type=float, default=30.0, show_default=True, help="Lease seconds.")
@click.option("--ack/--no-ack", default=True, show_default=True,
              help="Ack at once (take the message), or leave it leased and print receipts.")
@click.option("--raw", is_flag=True,
              help="Write the raw payload bytes to stdout (one message: -n 1).")
@server_options
def pop(store_path: str, queue: str, count: int, lease: float, ack: bool, raw: bool,
        token_file: str | None) -> None:
    """Pop up to N messages from QUEUE. Exit 1 if none was ready.

    STORE is a store directory (through its server when one runs) or a
    server address, unix:///PATH or tcp://HOST:PORT. Through a server,
    --no-ack leases stay leased after the command ends (keep_leases).
    """
    if raw and count > 1:
        # Raw bodies back to back would lose where one ends, and acked ones are gone.
        raise click.UsageError("--raw writes one message's bytes: use it with -n 1")
    if sys.stdout is None:  # started with stdout closed (>&-): nowhere to write them
        raise click.UsageError("stdout is closed: nowhere to write the messages")
    with _target(store_path, token_file, keep_leases=not ack) as store:
        q = store.queue(queue)
        msgs = q.pop_many(count, lease=lease)
        if msgs:
            # Written out first, then acked: a reader that went away (``qstore pop
            # S q | consumer`` whose consumer died) took nothing. They go back at
            # once (a nack: the attempt counts); acked first, they were gone for good.
            try:
                _print_popped(msgs, raw=raw, receipts=not ack)
            except (OSError, KeyboardInterrupt) as exc:
                # Ctrl-C while they were written: given back too (on a store, they
                # stayed leased until their lease ran out; a signals audit).
                for m in msgs:
                    with suppress(errors.QStoreError):  # else its lease runs out
                        q.nack(m)
                if isinstance(exc, (BrokenPipeError, KeyboardInterrupt)):
                    raise
                _error(f"cannot write the messages out ({exc.strerror or exc}): "
                       f"{len(msgs)} given back")
                sys.exit(errors.EXIT_ERROR)
            if ack:
                q.ack_many(msgs)
    if not msgs:
        err.print("queue is empty")
        sys.exit(EXIT_FOUND)


def _print_popped(msgs: list[Any], *, raw: bool, receipts: bool) -> None:
    """What ``qstore pop`` prints, flushed (a failed write raises here)."""
    for m in msgs:
        if raw:
            sys.stdout.buffer.write(m.payload)
        else:
            receipt = f"\treceipt={m.receipt}" if receipts else ""
            click.echo(f"{m.id}\tprio={m.priority}\tattempts={m.attempts}{receipt}\t"
                       f"{_show_payload(m.payload)}")
    sys.stdout.flush()


_RECEIPTS_HELP = """

    STORE is a store directory (through its server when one runs) or a
    server address, unix:///PATH or tcp://HOST:PORT. Receipts are as
    `qstore pop --no-ack` prints them. Exit 4 if a message is gone (acked, or
    its queue purged), 5 if its lease ran out (it was delivered again, or is
    ready or dead: a later receipt, if any, is the live one).
    """


@main.command(help="""Ack leased messages by receipt: all of them, or none (one batch).
    Prints how many.""" + _RECEIPTS_HELP)
@click.argument("store_path", metavar="STORE")
@click.argument("queue")
@click.argument("receipts", nargs=-1, required=True)
@server_options
def ack(store_path: str, queue: str, receipts: tuple[str, ...], token_file: str | None) -> None:
    with _target(store_path, token_file) as store:
        click.echo(store.queue(queue).ack_many(list(receipts)))


@main.command(help="""Give leased messages back by receipt, one after the other: ready again
    (after --delay), attempts kept; one that used its last attempt goes to the
    dead letters. An error stops at the receipt it names: those before it
    were given back. Prints how many.""" + _RECEIPTS_HELP)
@click.argument("store_path", metavar="STORE")
@click.argument("queue")
@click.argument("receipts", nargs=-1, required=True)
@click.option("--delay", type=float, default=0.0, show_default=True,
              help="Seconds before they are ready again.")
@server_options
def nack(store_path: str, queue: str, receipts: tuple[str, ...], delay: float,
         token_file: str | None) -> None:
    with _target(store_path, token_file) as store:
        q = store.queue(queue)
        for receipt in receipts:
            q.nack(receipt, delay=delay)
    click.echo(len(receipts))


@main.command(help="""Extend leases by receipt, one after the other, to now + --lease seconds;
    the receipts stay valid. Prints each message's id and new deadline (Unix
    seconds).""" + _RECEIPTS_HELP)
@click.argument("store_path", metavar="STORE")
@click.argument("queue")
@click.argument("receipts", nargs=-1, required=True)
@click.option("--lease", type=float, default=30.0, show_default=True, help="Lease seconds.")
@server_options
def extend(store_path: str, queue: str, receipts: tuple[str, ...], lease: float,
           token_file: str | None) -> None:
    with _target(store_path, token_file) as store:
        q = store.queue(queue)
        for receipt in receipts:
            m = q.extend(receipt, lease=lease)
            click.echo(f"{m.id}\tlease_deadline={m.lease_deadline:.6f}")


@main.command()
@click.argument("store_path", metavar="STORE")
@click.argument("queue")
@click.option("-n", "count", type=click.IntRange(1), default=100, show_default=True)
@server_options
def redrive(store_path: str, queue: str, count: int, token_file: str | None) -> None:
    """Move up to N dead letters of QUEUE back to ready, oldest first, attempts
    reset to 0. Prints how many.

    STORE is a store directory (through its server when one runs) or a
    server address, unix:///PATH or tcp://HOST:PORT.
    """
    with _target(store_path, token_file) as store:
        click.echo(store.queue(queue).redrive(count))


@main.command()
@click.argument("store_path", metavar="STORE")
@click.argument("queue")
@click.option("-n", "count", type=click.IntRange(1), default=10, show_default=True)
@click.option("--dead", is_flag=True, help="Show dead letters instead of the ready head.")
@server_options
def peek(store_path: str, queue: str, count: int, dead: bool, token_file: str | None) -> None:
    """Show the first N ready messages (or dead letters) without leasing them.

    STORE is a store directory (through its server when one runs) or a
    server address, unix:///PATH or tcp://HOST:PORT.
    """
    with _target(store_path, token_file, readonly=True) as store:
        q = store.queue(queue)
        msgs = q.dead_letters(count) if dead else q.peek(count)
    if not msgs:
        err.print("nothing to show")
        sys.exit(EXIT_FOUND)
    table = Table()
    for col in ("id", "priority", "attempts", "enqueued", "payload"):
        table.add_column(col)
    import datetime as dt

    for m in msgs:
        try:
            when = dt.datetime.fromtimestamp(m.enqueued_at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        except (ValueError, OverflowError, OSError):  # past year 9999 (an injected clock)
            when = f"{m.enqueued_at:.6f}"
        add_plain_row(table, str(m.id), str(m.priority), str(m.attempts), when,
                      _show_payload(m.payload))
    out.print(table)


@main.command()
@click.argument("store_path", metavar="STORE")
@click.option("--threshold", type=click.FloatRange(0.0, 1.0), default=None,
              help="Garbage ratio a segment needs to be rewritten (default from the store config).")
@click.option("--max-bytes", type=click.IntRange(1), default=None, help="Cap on live bytes copied.")
@server_options
def compact(store_path: str, threshold: float | None, max_bytes: int | None,
            token_file: str | None) -> None:
    """Run one seal-then-compact pass on STORE, with a progress bar.

    STORE is a store directory (through its server when one runs: the pass
    runs in the server, without a progress bar) or a server address.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    with _target(store_path, token_file) as store, Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(),
        TimeRemainingColumn(), console=err, transient=True,
    ) as bar:
        task = bar.add_task("copying live payloads", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        if isinstance(store, embedded.Store):
            result = store.compact(threshold=threshold, max_bytes=max_bytes, progress=progress)
        else:  # a progress callback cannot cross the wire
            result = store.compact(threshold=threshold, max_bytes=max_bytes)
    click.echo(f"read {len(result.segments_read)} segment(s), deleted "
               f"{len(result.segments_deleted)}, moved {result.messages_moved:,} messages "
               f"({result.bytes_copied:,} bytes), freed {result.bytes_freed:,} bytes "
               f"in {result.seconds:.2f}s")


@main.command()
@click.argument("store_path", metavar="STORE")
@click.argument("dest")
@server_options
def snapshot(store_path: str, dest: str, token_file: str | None) -> None:
    """Take a consistent snapshot of STORE into DEST (same filesystem).

    When a server owns STORE (or STORE is a server address) the server takes
    it, and DEST is a path on the server's machine; otherwise the store is
    opened here, read-write, or, when another process has it open (an
    application that embeds it), through a read-only view (docs/spark.md).
    """
    tls, cafile = _tls_options()
    with _exit_codes():
        try:
            with open_target(store_path, token_file, tls=tls, cafile=cafile) as store:
                store.snapshot(dest)
        except errors.StoreLocked as exc:
            if exc.served and (exc.address is not None or server_answers(store_path)):
                raise  # a server holds it (a socket file a killed one left says nothing)
            # It said "locked", although a view takes the same consistent snapshot
            # beside the writer (a newcomer's audit).
            with embedded.open_store(store_path, readonly=True, compactor=False) as view:
                view.snapshot(dest)
    click.echo(dest)


@main.command()
@click.argument("snapshot_path", metavar="SNAPSHOT")
@click.option("--master", default=None, help="Spark master URL (default local[2]).")
@click.option("--out", "out_dir", default=None,
              help="Where to write the report (default SNAPSHOT/audit).")
@click.option("--quiet", is_flag=True, help="Do not print the summary.")
def audit(snapshot_path: str, master: str | None, out_dir: str | None, quiet: bool) -> None:
    """Audit a snapshot with Spark (docs/spark.md).

    Exit 0 clean, 1 findings, 2 bad usage (including a path that is not a
    snapshot), 3 the audit could not complete (the Spark run failed: an
    unreachable master, a failed job), 5 the snapshot cannot be read (a
    store format this version does not read, damaged metadata), as for
    check; the message says why. Under
    spark-submit (spark/audit.py), the session and master are spark-submit's.
    """
    from .spark.audit import EXIT_INCOMPLETE, run_audit

    try:
        result = run_audit(snapshot_path, master=master, out=out_dir, quiet=quiet)
    except errors.InvalidArgument as exc:
        _error(str(exc))
        sys.exit(errors.EXIT_USAGE)
    except errors.QStoreError as exc:  # the snapshot, read before Spark starts: as check
        _error(str(exc))
        sys.exit(exit_code(exc))
    except Exception as exc:  # reported, not swallowed: the code says the audit failed
        _error(f"the audit could not complete: {exc}")
        sys.exit(EXIT_INCOMPLETE)
    sys.exit(result.exit_code)


@main.command()
@click.argument("store_path", metavar="STORE")
@click.option("--repair", is_flag=True, help=(
    "Move messages with damaged payloads to the dead letters and rebuild counters, "
    "index keys and segment records from the message records; print what was done. "
    "Goes through the server that owns STORE, else opens it read-write. Deletes no "
    "payload."))
@server_options
def check(store_path: str, repair: bool, token_file: str | None) -> None:
    """Check the integrity of STORE or of a snapshot.

    Reads every message record and payload (references, frames, CRCs), every
    index key, the queue counters and the segment records, and the segment
    files; prints a summary line and a table of findings (docs/check.md).
    A store directory or snapshot is checked in this process, opened
    read-only, so it works while a writer runs; a server address
    (unix:///PATH, tcp://HOST:PORT) is checked by that server. With
    --repair, through the server that owns the store (STORE/qstore.sock, or
    STORE given as unix:// or tcp://), else read-write here, and the report
    is that of a check after the repair.

    Exit codes: 0 clean (after --repair: nothing left), 1 findings, 2 not a
    store or snapshot (or --repair on a snapshot), 3 --repair on a store
    another process without a server has open, 5 the check could not run
    (for example metadata missing next to payload segments).
    """
    if repair:
        if os.path.exists(os.path.join(store_path, _snapshot.MANIFEST)):
            _error("a snapshot is never changed: --repair takes a store")
            sys.exit(errors.EXIT_USAGE)
        if not is_address(store_path) and not os.path.isdir(os.path.join(store_path, "meta")):
            with _exit_codes():
                _check.check_path(store_path)  # the error a plain check gives (exit 2 or 5)
        with _target(store_path, token_file) as store, _exit_codes():
            report = store.check(repair=True)
        for entry in report.repairs:
            out.print(f"repaired: {entry}", markup=False, highlight=False, soft_wrap=True)
        if not report.repairs:
            out.print("repaired: nothing to repair", markup=False, highlight=False)
    elif is_address(store_path):  # a server's address: its store, checked by the server
        with _target(store_path, token_file) as store, _exit_codes():
            report = store.check()
    else:
        with _exit_codes():
            report = _check.check_path(store_path)
    out.print(report.summary(), markup=False, highlight=False, soft_wrap=True)
    for note in report.notes:
        out.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    if report.ok:
        return
    table = Table(title="findings")
    for col in ("kind", "where", "detail"):
        table.add_column(col, overflow="fold")
    for f in report.findings:
        add_plain_row(table, f.kind, f.where(), f.detail)
    out.print(table)
    sys.exit(EXIT_FOUND)


@main.command(epilog="Exit codes: 0 every row loaded; 1 loaded, some rows rejected (see the "
               "rejects table); 2 bad usage; 3 the store is locked by another writer, or the "
               "Spark run failed (an unreachable master, a failed job); 5 any other qstore "
               "error (also: a task met a full disk or an I/O error; an earlier, killed "
               "run of the same job had loaded its rows: --again loads them again). "
               "Nothing is loaded unless the code is 0 or 1.")
@click.argument("sources", metavar="SOURCE...", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(["parquet", "json", "csv"]),
              default="parquet", show_default=True, help="Format of every SOURCE.")
@click.option("--queue", required=True, help="Target queue (created if missing).")
@click.option("--payload-col", default="payload", show_default=True,
              help="Binary or string column.")
@click.option("--priority-col", default=None, help="Priority column (default: priority 0 / '').")
@click.option("--delay-col", default=None, help="Delay column, seconds from now.")
@click.option("--dedup-col", default=None, help="Dedup key column (dedup queues).")
@click.option("--ttl-col", default=None,
              help="TTL column, seconds until the message expires (null: the queue's TTL).")
@click.option("--into", "into", required=True,
              help="Target store directory, or the address of the server that owns it.")
@click.option("--master", default=None,
              help="Spark master URL (default local[2], or spark-submit's).")
@click.option("--rejects", default=None, help="New or empty directory for the rejects table.")
@click.option("--order", type=click.Choice(["max", "min", "fifo"]), default=None,
              help="If the queue is created (default max).")
@click.option("--priority-type", type=click.Choice(["int", "str"]), default=None,
              help="If the queue is created (default int).")
@click.option("--max-attempts", type=click.IntRange(1), default=None,
              help="If the queue is created (default 5).")
@click.option("--dedup/--no-dedup", default=None,
              help="If the queue is created (default: --dedup when --dedup-col is given).")
@click.option("--again", is_flag=True,
              help="Load a job that an earlier, killed run had loaded (it is refused "
                   "otherwise, exit 5): its rows a second time.")
@server_options
def backfill(sources: tuple[str, ...], fmt: str, queue: str, payload_col: str,
             priority_col: str | None, delay_col: str | None, dedup_col: str | None,
             ttl_col: str | None, into: str, master: str | None, rejects: str | None,
             order: str | None,
             priority_type: str | None, max_attempts: int | None, dedup: bool | None,
             again: bool, token_file: str | None) -> None:
    """Bulk-load messages from Parquet/JSON/CSV SOURCEs into a store with Spark.

    The queue options (--order, --priority-type, --max-attempts, --dedup) are
    used only when the queue has to be created; for an existing queue, an
    option given here must match it (exit 2 if not). Also run by
    `spark-submit spark/backfill.py`.

    When a server owns the store (STORE/qstore.sock answers), or --into is a
    server address, the server runs the job in its process on its own store
    while its clients go on; SOURCE and --rejects then name paths on the
    server's machine (absolute ones through an address).
    """
    import logging

    given = {"order": order, "priority_type": priority_type, "max_attempts": max_attempts,
             "dedup": dedup}
    options = {k: v for k, v in given.items() if v is not None}  # unset: never sent
    if is_address(into) or server_answers(into):
        # The server runs the job (the Spark driver in its process) on its own store.
        args: dict[str, Any] = {"sources": list(sources), "queue": queue, "fmt": fmt,
                                "payload_col": payload_col, "priority_col": priority_col,
                                "delay_col": delay_col, "dedup_col": dedup_col,
                                "ttl_col": ttl_col, "master": master, "rejects": rejects,
                                "create_queue_options": options or None}
        if again:  # only when given: a server from before it refuses the argument
            args["again"] = True
        _report_backfill(_backfill_through_server(into, args, token_file))
        return
    from pyspark.sql import SparkSession

    from .spark.backfill import run_backfill

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    had_session = SparkSession.getActiveSession() is not None
    try:
        with _exit_codes():
            result = run_backfill(
                sources[0] if len(sources) == 1 else list(sources), into=into, queue=queue,
                fmt=fmt, payload_col=payload_col, priority_col=priority_col,
                delay_col=delay_col, dedup_col=dedup_col, ttl_col=ttl_col, master=master,
                rejects=rejects,
                create_queue_options=options or None, again=again)
    except Exception as exc:  # a failed Spark run: reported, and the store is unchanged
        logging.getLogger("qstore.backfill").exception("backfill failed; nothing was loaded")
        _error(f"backfill failed, nothing was loaded: {exc}")
        sys.exit(EXIT_SPARK_FAILED)
    else:
        # Said before Spark stops (about a second): the job's marker is gone once
        # the store closed, and a crash before the report left the rows in and
        # nothing said (a review). Outside the except above: a report that cannot
        # be written (a broken pipe, 141) is no failed run (a review: it said
        # "nothing was loaded", exit 3, and the rerun loaded the rows twice).
        _report_backfill(dataclasses.asdict(result) | {"rate": result.rate})
    finally:
        active = SparkSession.getActiveSession()
        if active is not None and not had_session:  # ours: spark-submit's or a local one
            active.stop()


def _backfill_through_server(into: str, args: dict[str, Any],
                             token_file: str | None) -> dict[str, Any]:
    """Ask the server that owns ``into`` (or is at that address) to run the backfill.

    Paths name files on the server's machine: through a store directory's
    socket (this machine) relative ones are made absolute here; given a
    ``tcp://`` or ``unix://`` address, they must be absolute already.
    """
    paths = [*args["sources"], *([args["rejects"]] if args["rejects"] else [])]
    if is_address(into):
        relative = [p for p in paths if not os.path.isabs(p)]
        if relative:
            _error(f"through a server address, SOURCE and --rejects "
                   f"must be absolute paths on the server's machine, not {relative[0]!r}")
            sys.exit(errors.EXIT_USAGE)
    else:
        args["sources"] = [os.path.abspath(p) for p in args["sources"]]
        if args["rejects"]:
            args["rejects"] = os.path.abspath(args["rejects"])
    with _exit_codes():
        tls, cafile = _tls_options()
        client = server_of(into, read_token(token_file), tls=tls, cafile=cafile)
        if client is None:  # the server went away since we looked
            raise errors.StoreLocked(into)
        with client:
            try:
                return client._backfill(args)
            except errors.QStoreError as exc:
                if getattr(exc, "spark_failed", False):
                    _error(str(exc))
                    sys.exit(EXIT_SPARK_FAILED)
                raise


def _rate(rate: float) -> str:
    """A rate for people: whole numbers, but two digits under 10 (a 4-row job's
    0.13 msg/s printed as "0 msg/s")."""
    return f"{rate:,.0f}" if rate >= 10 else f"{rate:.2g}"


def _report_backfill(result: dict[str, Any]) -> None:
    r = result
    click.echo(f"loaded {r['loaded']:,} of {r['rows']:,} rows into queue {r['queue']!r} "
               f"of {r['store']} ({r['ready']:,} ready, {r['delayed']:,} delayed, "
               f"{r['bytes']:,} bytes) in {r['seconds']:.1f}s ({_rate(r['rate'])} msg/s); "
               f"rejected {r['rejected']:,} ({r['duplicates']:,} duplicates)")
    if r["rejects_path"]:
        click.echo(f"rejects table: {r['rejects_path']}")
    if r["rejected"]:
        sys.exit(EXIT_FOUND)


@main.command()
@click.option("--dir", "directory", default="demo-data", show_default=True,
              help="Where the demo store lives.")
@click.option("--fresh", is_flag=True, help="Delete DIR first.")
@click.option("--messages", type=click.IntRange(100), default=20_000, show_default=True)
@click.option("--no-spark", is_flag=True, help="Skip the Spark snapshot audit at the end.")
def demo(directory: str, fresh: bool, messages: int, no_spark: bool) -> None:
    """End-to-end workload: producers, consumers, dead letters, a restart, compaction, audit."""

    sys.exit(_demo.run_demo(directory, fresh=fresh, messages=messages, spark=not no_spark))


@main.command()
@click.argument("store_path", metavar="STORE")
@click.option("--listen", default=None,
              help="unix:///PATH or tcp://HOST:PORT (default: unix socket STORE/qstore.sock).")
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True),
              help="File holding the token every client must send (whitespace stripped).")
@click.option("--tls-cert", type=click.Path(dir_okay=False, exists=True),
              help="PEM certificate (chain) for TLS.")
@click.option("--tls-key", type=click.Path(dir_okay=False, exists=True), help="PEM key for TLS.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve Prometheus metrics on 127.0.0.1:PORT.")
@click.option("--max-payload-bytes", type=click.IntRange(1), default=None,
              help="Largest message payload, bytes (default: the store's, 64 MiB).")
@click.option("--max-frame", type=click.IntRange(1, 2**32 - 1), default=None,
              help="Largest frame accepted, bytes (default: the payload limit plus a "
                   "quarter, at least 1 MiB more: 80 MiB for 64 MiB payloads).")
@click.option("--max-connections", type=click.IntRange(1), default=1024, show_default=True)
@click.option("--max-waiting", type=click.IntRange(1), default=10_000, show_default=True,
              help="Pops parked waiting for a message, over all connections.")
@click.option("--durability", type=click.Choice(["none", "interval", "always"]),
              default="interval", show_default=True)
@click.option("--loop", "loop", type=click.Choice(list(LOOPS)), default="auto",
              show_default=True,
              help="The event loop: uvloop where installed (auto), or asyncio's own.")
@click.option("--log-level", type=click.Choice(list(LOG_LEVELS)), default="info",
              show_default=True,
              help="Log lines at this level and above go to stderr, with time and level.")
def serve(store_path: str, listen: str | None, token_file: str | None, tls_cert: str | None,
          tls_key: str | None, metrics_port: int | None, max_payload_bytes: int | None,
          max_frame: int | None, max_connections: int, max_waiting: int,
          durability: str, loop: str, log_level: str) -> None:
    """Serve STORE to clients (qstore.connect) until SIGTERM or SIGINT.

    Prints "listening on ADDRESS" once clients can connect, then the event loop
    it runs on ("event loop: uvloop" or "event loop: asyncio"), then, with
    --metrics-port, "metrics on URL". Logs go to stderr, one line each with its
    time and level ("stopped" last, on a clean shutdown).
    See docs/server.md for operations and security.
    """
    import logging

    # Without a handler, Python printed only warnings and errors, bare: no time
    # or level to tell damage from a nearly full disk in a service's journal,
    # and no INFO line at all (repair actions, the log kept small).
    logging.basicConfig(level=LOG_LEVELS[log_level], stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (tls_cert is None) != (tls_key is None):
        raise click.UsageError("give both --tls-cert and --tls-key, or neither")
    try:
        token = read_token(token_file)
        ctx = server.tls_context(tls_cert, tls_key) if tls_cert and tls_key else None
    except errors.InvalidArgument as exc:
        raise click.UsageError(str(exc)) from None
    try:
        loop_name = "asyncio" if server.loop_factory(loop) is None else "uvloop"
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None

    listened = False

    def ready(address: str) -> None:
        nonlocal listened
        listened = True
        click.echo(f"listening on {address}")
        click.echo(f"event loop: {loop_name}")
        if metrics_port is not None:
            click.echo(f"metrics on http://127.0.0.1:{metrics_port}/metrics")
        sys.stdout.flush()

    # What was at the path before: a serve that creates a store and then cannot
    # listen (a taken port) takes away what it created, as a command that fails
    # on a mistyped path creates nothing.
    existed = os.path.isdir(store_path)
    before = set(os.listdir(store_path)) if existed else set()
    was_store = existed and _held_store(store_path)
    with _exit_codes():
        options: dict[str, Any] = {"durability": durability}
        if max_payload_bytes is not None:
            options["max_payload_bytes"] = max_payload_bytes
        store = embedded.open_store(store_path, **options)
        limits = server.Limits(
            max_frame=max_frame or server.default_max_frame(store.config.max_payload_bytes),
            max_connections=max_connections, max_waiting=max_waiting)
        try:
            server.serve(store, listen, token=token, ssl_context=ctx, limits=limits,
                         metrics_port=metrics_port, ready=ready, loop=loop,
                         ignore_later_signals=True)
            logging.getLogger("qstore").info("qstore server stopped; store %s closed",
                                             store_path)
        except BaseException:
            store.close()
            if not listened and not was_store:
                _remove_created(store_path, existed, before)
            raise
        finally:
            store.close()


def _held_store(path: str) -> bool:
    try:
        embedded_core.require_store(path)
    except errors.QStoreError:
        return False
    return True


def _remove_created(path: str, existed: bool, before: set[str]) -> None:
    """Remove what a failed ``serve`` created at ``path`` (which held no store)."""
    remove_paths([os.path.join(path, n) for n in set(os.listdir(path)) - before]
                 if existed else [path])


if __name__ == "__main__":  # pragma: no cover
    main()
