"""The ``qstore`` command line.

Exit codes: 0 success; 1 the command found something (audit or check
findings, an empty queue on ``pop``/``peek``, a failed demo check); 2 bad usage; 3 the
store is locked by another writer; 4 no such queue or message; 5 any other
qstore error (corruption, storage failure).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from . import _errors as errors
from ._check import check_path
from ._errors import EXIT_FOUND, exit_code
from ._store import Store, open_store

out = Console()
err = Console(stderr=True)


@contextmanager
def _exit_codes() -> Iterator[None]:
    """Turn a qstore error into its message on stderr and its documented exit code."""
    try:
        yield
    except errors.QStoreError as exc:
        err.print(f"[red]error:[/red] {exc}")
        sys.exit(exit_code(exc))


@contextmanager
def _store(path: str, *, readonly: bool = False) -> Iterator[Store]:
    """Open a store for one command, turning qstore errors into exit codes."""
    with _exit_codes(), open_store(path, readonly=readonly, compactor=False) as store:
        yield store


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


def _parse_priority(store: Store, queue: str, text: str | None) -> int | str | None:
    if text is None:
        return None
    if store.queue(queue).priority_type == "str":
        return text
    try:
        return int(text)
    except ValueError:
        raise click.BadParameter(f"queue {queue!r} takes int priorities, not {text!r}") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="qstore")
def main() -> None:
    """qstore: a durable, embedded priority work queue.

    Exit codes: 0 ok, 1 found something (audit/check findings, empty queue),
    2 bad usage, 3 store locked, 4 no such queue/message, 5 other error.
    """


@main.command()
@click.argument("store_path", metavar="STORE")
def queues(store_path: str) -> None:
    """List the queues of STORE (read-only; works while a writer runs)."""
    with _store(store_path, readonly=True) as store:
        for name in store.queues():
            out.print(name, markup=False, highlight=False)


@main.command()
@click.argument("store_path", metavar="STORE")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def stats(store_path: str, as_json: bool) -> None:
    """Counts per queue and state, and payload segments (read-only)."""
    with _store(store_path, readonly=True) as store:
        st = store.stats()
    if as_json:
        click.echo(json.dumps({
            "queues": [{"queue": q.queue, "ready": q.ready, "delayed": q.delayed,
                        "in_flight": q.in_flight, "dead": q.dead, "bytes": q.bytes}
                       for q in st.queues],
            "segments": [{"file_id": s.file_id, "size": s.size, "live_bytes": s.live_bytes,
                          "live_count": s.live_count, "garbage_ratio": s.garbage_ratio,
                          "active": s.active} for s in st.segments],
            "disk_bytes": st.disk_bytes, "live_bytes": st.live_bytes,
            "garbage_ratio": st.garbage_ratio,
        }, indent=1))
        return
    print_stats(st)


def print_stats(st: Any, console: Console = out) -> None:
    table = Table(title="queues")
    for col in ("queue", "ready", "delayed", "in flight", "dead", "bytes"):
        table.add_column(col, justify="left" if col == "queue" else "right")
    for q in st.queues:
        table.add_row(q.queue, *(f"{v:,}" for v in (q.ready, q.delayed, q.in_flight, q.dead,
                                                     q.bytes)))
    console.print(table)
    segs = Table(title="payload segments")
    for col in ("file", "size", "live bytes", "live msgs", "garbage"):
        segs.add_column(col, justify="right")
    for s in st.segments:
        segs.add_row(f"{s.file_id}{' (active)' if s.active else ''}", f"{s.size:,}",
                     f"{s.live_bytes:,}", f"{s.live_count:,}", f"{s.garbage_ratio:.0%}")
    console.print(segs)
    console.print(f"disk {st.disk_bytes:,} bytes, live {st.live_bytes:,}, "
                  f"garbage {st.garbage_ratio:.0%}")


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
              help="Create the queue (order max, int priorities) if missing.")
def push(store_path: str, queue: str, payload: str | None, file_: Any, priority: str | None,
         delay: float, create: bool) -> None:
    """Push one message (PAYLOAD text, or --file) onto QUEUE; prints its id."""
    if (payload is None) == (file_ is None):
        raise click.UsageError("give exactly one of PAYLOAD or --file")
    body = payload.encode("utf-8") if payload is not None else file_.read()
    with _store(store_path) as store:
        if create:
            store.create_queue(queue, exist_ok=True)
        mid = store.queue(queue).push(body, priority=_parse_priority(store, queue, priority),
                                      delay=delay)
    click.echo(mid)


@main.command()
@click.argument("store_path", metavar="STORE")
@click.argument("queue")
@click.option("-n", "count", type=click.IntRange(1), default=1, show_default=True)
@click.option("--lease", type=float, default=30.0, show_default=True, help="Lease seconds.")
@click.option("--ack/--no-ack", default=True, show_default=True,
              help="Ack at once (take the message), or leave it leased and print receipts.")
@click.option("--raw", is_flag=True, help="Write the raw payload bytes to stdout.")
def pop(store_path: str, queue: str, count: int, lease: float, ack: bool, raw: bool) -> None:
    """Pop up to N messages from QUEUE. Exit 1 if none was ready."""
    with _store(store_path) as store:
        q = store.queue(queue)
        msgs = q.pop_many(count, lease=lease)
        if ack and msgs:
            q.ack_many(msgs)
    if not msgs:
        err.print("queue is empty")
        sys.exit(EXIT_FOUND)
    for m in msgs:
        if raw:
            sys.stdout.buffer.write(m.payload)
        else:
            receipt = "" if ack else f"\treceipt={m.receipt}"
            click.echo(f"{m.id}\tprio={m.priority}\tattempts={m.attempts}{receipt}\t"
                       f"{_show_payload(m.payload)}")


@main.command()
@click.argument("store_path", metavar="STORE")
@click.argument("queue")
@click.option("-n", "count", type=click.IntRange(1), default=10, show_default=True)
@click.option("--dead", is_flag=True, help="Show dead letters instead of the ready head.")
def peek(store_path: str, queue: str, count: int, dead: bool) -> None:
    """Show the first N ready messages (or dead letters) without leasing them."""
    with _store(store_path, readonly=True) as store:
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
        when = dt.datetime.fromtimestamp(m.enqueued_at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(str(m.id), str(m.priority), str(m.attempts), when, _show_payload(m.payload))
    out.print(table)


@main.command()
@click.argument("store_path", metavar="STORE")
@click.option("--threshold", type=click.FloatRange(0.0, 1.0), default=None,
              help="Garbage ratio a segment needs to be rewritten (default from the store config).")
@click.option("--max-bytes", type=click.IntRange(1), default=None, help="Cap on live bytes copied.")
def compact(store_path: str, threshold: float | None, max_bytes: int | None) -> None:
    """Run one seal-then-compact pass on STORE, with a progress bar."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    with _store(store_path) as store, Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(),
        TimeRemainingColumn(), console=err, transient=True,
    ) as bar:
        task = bar.add_task("copying live payloads", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        result = store.compact(threshold=threshold, max_bytes=max_bytes, progress=progress)
    click.echo(f"read {len(result.segments_read)} segment(s), deleted "
               f"{len(result.segments_deleted)}, moved {result.messages_moved:,} messages "
               f"({result.bytes_copied:,} bytes), freed {result.bytes_freed:,} bytes "
               f"in {result.seconds:.2f}s")


@main.command()
@click.argument("store_path", metavar="STORE")
@click.argument("dest")
def snapshot(store_path: str, dest: str) -> None:
    """Take a consistent snapshot of STORE into DEST (same filesystem).

    Opens the store read-write, so stop its writer first, or call
    store.snapshot() from the process that owns it.
    """
    with _store(store_path) as store:
        store.snapshot(dest)
    click.echo(dest)


@main.command()
@click.argument("snapshot_path", metavar="SNAPSHOT")
@click.option("--master", default=None, help="Spark master URL (default local[2]).")
@click.option("--out", "out_dir", default=None,
              help="Where to write the report (default SNAPSHOT/audit).")
def audit(snapshot_path: str, master: str | None, out_dir: str | None) -> None:
    """Audit a snapshot with Spark. Exit 0 clean, 1 findings, 2 bad usage."""
    from .spark.audit import run_audit

    with _exit_codes():
        result = run_audit(snapshot_path, master=master, out=out_dir)
    sys.exit(result.exit_code)


@main.command()
@click.argument("store_path", metavar="STORE")
def check(store_path: str) -> None:
    """Check the integrity of STORE or of a snapshot, in this process.

    Reads every message record and payload (references, frames, CRCs), every
    index key, the queue counters and the segment records, and the segment
    files; prints a summary line and a table of findings (docs/check.md).
    Opens the store read-only, so it works while a writer runs.

    Exit codes: 0 clean, 1 findings, 2 not a store or snapshot, 5 the check
    could not run (for example metadata missing next to payload segments).
    """
    with _exit_codes():
        report = check_path(store_path)
    out.print(report.summary(), markup=False, highlight=False)
    for note in report.notes:
        out.print(f"note: {note}", markup=False, highlight=False)
    if report.ok:
        return
    table = Table(title="findings")
    for col in ("kind", "where", "detail"):
        table.add_column(col, overflow="fold")
    for f in report.findings:
        table.add_row(f.kind, f.where(), f.detail)
    out.print(table)
    sys.exit(EXIT_FOUND)


@main.command()
@click.argument("source")
@click.option("--format", "fmt", type=click.Choice(["parquet", "json", "csv"]), default="parquet",
              show_default=True)
@click.option("--queue", required=True, help="Target queue (created if missing).")
@click.option("--payload-col", required=True)
@click.option("--priority-col", default=None)
@click.option("--delay-col", default=None)
@click.option("--dedup-col", default=None)
@click.option("--into", "into", required=True, help="Target store directory.")
@click.option("--master", default=None, help="Spark master URL (default local[2]).")
@click.option("--rejects", default=None, help="Where to write rejected rows (Parquet).")
@click.option("--order", type=click.Choice(["max", "min", "fifo"]), default="max",
              show_default=True, help="For a queue that has to be created.")
@click.option("--priority-type", type=click.Choice(["int", "str"]), default="int",
              show_default=True, help="For a queue that has to be created.")
@click.option("--max-attempts", type=click.IntRange(1), default=5, show_default=True,
              help="For a queue that has to be created.")
@click.option("--dedup", is_flag=True, help="Create the queue with dedup=True.")
def backfill(source: str, fmt: str, queue: str, payload_col: str, priority_col: str | None,
             delay_col: str | None, dedup_col: str | None, into: str, master: str | None,
             rejects: str | None, order: str, priority_type: str, max_attempts: int,
             dedup: bool) -> None:
    """Bulk-load messages from a Parquet/JSON/CSV SOURCE into a store with Spark.

    Exit 0 when every row loaded, 1 when some were rejected (see --rejects).
    """
    from .spark.backfill import run_backfill

    with _exit_codes():
        result = run_backfill(source, into=into, queue=queue, fmt=fmt, payload_col=payload_col,
                              priority_col=priority_col, delay_col=delay_col,
                              dedup_col=dedup_col, master=master, rejects=rejects,
                              create_queue_options={"order": order,
                                                    "priority_type": priority_type,
                                                    "max_attempts": max_attempts,
                                                    "dedup": dedup})
    click.echo(f"loaded {result.loaded:,} of {result.rows:,} rows into {result.queue!r} "
               f"({result.ready:,} ready, {result.delayed:,} delayed, {result.bytes:,} bytes) "
               f"in {result.seconds:.1f}s; rejected {result.rejected:,}"
               + (f" (see {result.rejects_path})" if result.rejects_path else ""))
    if result.rejected:
        sys.exit(EXIT_FOUND)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Benchmark qstore against its peers (see `qstore bench --help-bench`)."""
    from ._bench import run

    args = ["--help" if a == "--help-bench" else a for a in ctx.args]
    sys.exit(run(args))


@main.command()
@click.option("--dir", "directory", default="demo-data", show_default=True,
              help="Where the demo store lives.")
@click.option("--fresh", is_flag=True, help="Delete DIR first.")
@click.option("--messages", type=click.IntRange(100), default=20_000, show_default=True)
@click.option("--no-spark", is_flag=True, help="Skip the Spark snapshot audit at the end.")
def demo(directory: str, fresh: bool, messages: int, no_spark: bool) -> None:
    """End-to-end workload: producers, consumers, dead letters, a restart, compaction, audit."""
    from ._demo import run_demo

    sys.exit(run_demo(directory, fresh=fresh, messages=messages, spark=not no_spark))


if __name__ == "__main__":  # pragma: no cover
    main()
