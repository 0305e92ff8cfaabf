"""The `qstore` command line: each command's output and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

import qstore
from qstore import cli
from qstore.cli import main
from tests.conftest import FakeClock


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_push_creates_queue_and_prints_the_id(runner: CliRunner, store_path: str) -> None:
    r = runner.invoke(main, ["push", store_path, "jobs", "hello", "-p", "7", "--create"])
    assert r.exit_code == 0, r.output
    mid = int(r.output.strip())
    with qstore.open(store_path, compactor=False) as store:
        assert store.queue("jobs").get(mid).payload == b"hello"
        assert store.queue("jobs").get(mid).priority == 7


@pytest.mark.parametrize("options", [{"order": "fifo"}, {"priority_type": "str"},
                                     {"max_attempts": 3}, {"dedup": True}])
def test_push_create_uses_an_existing_queue_whatever_its_options(
        runner: CliRunner, store_path: str, options: dict[str, object]) -> None:
    # --create ("if missing") created with the default options and exit_ok=True, so
    # a queue made otherwise was refused, exit 2 (a configuration audit).
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue("q", **options)  # type: ignore[arg-type]
    r = runner.invoke(main, ["push", store_path, "q", "hello", "--create"])
    assert r.exit_code == 0, r.output
    with qstore.open(store_path, compactor=False) as store:
        q = store.queue("q")
        assert q.get(int(r.output)).payload == b"hello"
        assert (q.order, q.priority_type, q.max_attempts, q.dedup) == (
            options.get("order", "max"), options.get("priority_type", "int"),
            options.get("max_attempts", 5), options.get("dedup", False))


def test_pop_takes_in_priority_order_and_exits_1_when_empty(runner: CliRunner,
                                                             store_path: str) -> None:
    for prio, body in ((1, "low"), (9, "high")):
        assert runner.invoke(main, ["push", store_path, "jobs", body, "-p", str(prio),
                                    "--create"]).exit_code == 0
    r = runner.invoke(main, ["pop", store_path, "jobs"])
    assert r.exit_code == 0 and "high" in r.output and "low" not in r.output
    r = runner.invoke(main, ["pop", store_path, "jobs", "-n", "5"])
    assert r.exit_code == 0 and "low" in r.output
    r = runner.invoke(main, ["pop", store_path, "jobs"])
    assert r.exit_code == 1


def test_pop_no_ack_leaves_message_in_flight(runner: CliRunner, store_path: str) -> None:
    runner.invoke(main, ["push", store_path, "jobs", "x", "--create"])
    r = runner.invoke(main, ["pop", store_path, "jobs", "--no-ack"])
    assert r.exit_code == 0 and "receipt=" in r.output
    with qstore.open(store_path, compactor=False) as store:
        assert store.queue("jobs").stats().in_flight == 1


def test_ack_nack_extend_and_redrive_take_receipts_and_say_what_failed(
        runner: CliRunner, store_path: str) -> None:
    # The command line had no ack: a --no-ack receipt was for code only. (The
    # commands run on the real clock: leases of an hour, no time passes.)
    with qstore.open(store_path, compactor=False) as store:
        q = store.create_queue("q", max_attempts=1)
        q.push_many([b"a", b"b", b"c"])
        first, second, third = q.pop_many(3, lease=3600.0)
    r = runner.invoke(main, ["ack", store_path, "q", "1-ffff-1"])
    assert r.exit_code == 4 and "not found" in r.output  # no such message
    r = runner.invoke(main, ["ack", store_path, "q", first.receipt, "1-ffff-1"])
    assert r.exit_code == 4  # all or none: the first is still leased
    r = runner.invoke(main, ["ack", store_path, "q", "garbage"])
    assert r.exit_code == 2 and "malformed receipt" in r.output
    r = runner.invoke(main, ["extend", store_path, "q", first.receipt, "--lease", "7200"])
    assert r.exit_code == 0 and r.output.startswith(f"{first.id}\tlease_deadline=")
    assert float(r.output.split("=")[1]) > first.lease_deadline + 3000
    assert runner.invoke(main, ["ack", store_path, "q", first.receipt]).output == "1\n"
    r = runner.invoke(main, ["nack", store_path, "q", second.receipt, third.receipt])
    assert r.exit_code == 0 and r.output == "2\n"  # their last attempt: dead letters
    r = runner.invoke(main, ["nack", store_path, "q", second.receipt])  # not leased now
    assert r.exit_code == 5 and "expired or was superseded" in r.output
    assert runner.invoke(main, ["redrive", store_path, "q", "-n", "1"]).output == "1\n"
    with qstore.open(store_path, compactor=False) as store:
        q = store.queue("q")
        assert (q.stats().ready, q.stats().dead) == (1, 1)
        got = q.pop(lease=3600.0)
        assert got is not None and (got.payload, got.attempts) == (b"b", 1)  # oldest first
    r = runner.invoke(main, ["nack", store_path, "q", got.receipt, "--delay", "3600"])
    assert r.exit_code == 0
    with qstore.open(store_path, compactor=False) as store:
        assert store.queue("q").stats().dead == 2  # attempts kept: still its last one


def test_pop_raw_writes_one_body_and_refuses_several(runner: CliRunner,
                                                      store_path: str) -> None:
    for body in ("one", "two"):
        runner.invoke(main, ["push", store_path, "jobs", body, "--create"])
    # Bodies back to back would lose their boundaries (and be acked): nothing popped.
    r = runner.invoke(main, ["pop", store_path, "jobs", "--raw", "-n", "2"])
    assert r.exit_code == 2 and "-n 1" in r.output
    r = runner.invoke(main, ["pop", store_path, "jobs", "--raw"])
    assert r.exit_code == 0 and r.stdout_bytes == b"one"
    with qstore.open(store_path, compactor=False) as store:
        assert store.queue("jobs").stats().ready == 1


@pytest.mark.parametrize("text", ["1_000", "\u0663", "0x10", "1.0"])
def test_int_priority_is_ascii_digits_only(runner: CliRunner, store_path: str,
                                           text: str) -> None:
    # int() also takes "1_000" and other scripts' digits ("\u0663" is 3); the
    # backfill's numeric strings refuse both, and so does the command line now.
    runner.invoke(main, ["push", store_path, "jobs", "x", "--create"])
    r = runner.invoke(main, ["push", store_path, "jobs", "y", "-p", text])
    assert r.exit_code == 2 and "int priorities" in r.output
    r = runner.invoke(main, ["push", store_path, "jobs", "z", "-p", " -12 "])
    assert r.exit_code == 0, r.output
    with qstore.open(store_path, compactor=False) as store:
        assert [m.priority for m in store.queue("jobs").pop_many(5)] == [0, -12]


def test_push_to_missing_queue_exits_4(runner: CliRunner, store_path: str) -> None:
    runner.invoke(main, ["push", store_path, "jobs", "x", "--create"])
    r = runner.invoke(main, ["push", store_path, "nope", "x"])
    assert r.exit_code == 4
    assert "nope" in r.output


def test_bad_priority_for_int_queue_is_usage_error(runner: CliRunner, store_path: str) -> None:
    runner.invoke(main, ["push", store_path, "jobs", "x", "--create"])
    r = runner.invoke(main, ["push", store_path, "jobs", "x", "-p", "high"])
    assert r.exit_code == 2


def test_peek_shows_binary_payload_escaped(runner: CliRunner, store_path: str) -> None:
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue("bin").push(b"\x00\x1b[31mred\xff", priority=1)
    r = runner.invoke(main, ["peek", store_path, "bin"])
    assert r.exit_code == 0
    assert "\x1b" not in r.output  # a terminal escape is never printed raw
    assert "\\x00" in r.output


def test_stats_json_matches_store(runner: CliRunner, store_path: str) -> None:
    with qstore.open(store_path, compactor=False) as store:
        q = store.create_queue("a")
        q.push_many([b"1", b"22", b"333"])
        q.pop()
        store.create_queue("t", ttl=30, on_expire="dead", aging=5, aging_cap=2, rate=(3, 1))
    r = runner.invoke(main, ["stats", store_path, "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    plain = {"expired": 0, "ttl": None, "on_expire": "drop", "aging": None, "aging_cap": None,
             "rate": None}
    assert data["queues"] == [
        {"queue": "a", "ready": 2, "delayed": 0, "in_flight": 1, "dead": 0, "bytes": 6, **plain},
        {"queue": "t", "ready": 0, "delayed": 0, "in_flight": 0, "dead": 0, "bytes": 0,
         "expired": 0, "ttl": 30.0, "on_expire": "dead", "aging": 5.0, "aging_cap": 2,
         "rate": [3, 1.0]}]

    assert sum(s["live_bytes"] for s in data["segments"]) == data["live_bytes"] == 3 * 8 + 6


def test_stats_table_shows_every_set_option(runner: CliRunner, store_path: str) -> None:
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue("deadq", on_expire="dead")  # per-push TTLs make dead letters
        store.create_queue("full", ttl=30, on_expire="dead", aging=5, aging_cap=2,
                           rate=(3, 1))
        store.create_queue("plain")
    r = runner.invoke(main, ["stats", store_path], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    rows = {line.split()[1]: line for line in r.output.splitlines()
            if len(line.split()) > 2 and line.split()[1] in ("deadq", "full", "plain")}
    assert "on_expire=dead" in rows["deadq"]
    assert "ttl=30s dead aging=5s cap=2 rate=3/1s" in rows["full"]
    assert rows["plain"].split()[-2] == "-"


def test_stats_table_and_queues_list(runner: CliRunner, store_path: str) -> None:
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue("alpha")
        store.create_queue("beta")
    r = runner.invoke(main, ["queues", store_path])
    assert r.output.split() == ["alpha", "beta"]
    r = runner.invoke(main, ["stats", store_path])
    assert r.exit_code == 0 and "alpha" in r.output and "payload segments" in r.output


def test_compact_reports_what_it_freed(runner: CliRunner, store_path: str) -> None:
    with qstore.open(store_path, compactor=False, segment_max_bytes=4096) as store:
        q = store.create_queue("q")
        q.push_many([bytes(500)] * 40)
        q.ack_many(q.pop_many(40))
    r = runner.invoke(main, ["compact", store_path])
    assert r.exit_code == 0, r.output
    assert "freed" in r.output
    with qstore.open(store_path, compactor=False) as store:
        assert store.stats().garbage_ratio == 0.0


def _into_a_closed_pipe(*args: str) -> int:
    """Run ``qstore ARGS`` with its stdout a pipe nobody reads (closed first, as
    ``qstore ... | head -0`` would); its exit code."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "qstore.cli", *args], stdout=write,
                              stderr=subprocess.DEVNULL, check=False)
    finally:
        os.close(write)
    return done.returncode


@pytest.mark.parametrize("args", [[], ["-n", "3"], ["--raw"], ["--no-ack", "-n", "2"]])
def test_pop_into_a_pipe_nobody_reads_gives_the_messages_back(store_path: str,
                                                              args: list[str]) -> None:
    # They were acked before they were written: `qstore pop S q | consumer` whose
    # consumer had died took them for good. Now written first, then acked, and
    # given back when the write fails; exit 141 (a broken pipe), not 1 ("empty").
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue("q").push_many([b"a", b"b", b"c"])
    assert _into_a_closed_pipe("pop", store_path, "q", *args) == 141
    with qstore.open(store_path, compactor=False) as store:
        st = store.queue("q").stats()
        assert (st.ready, st.in_flight) == (3, 0)


def test_pop_into_a_full_device_or_a_closed_stdout_loses_nothing(store_path: str) -> None:
    # A write that failed otherwise than by a broken pipe exited 1 ("empty")
    # with a traceback; with stdout closed the messages stayed leased until
    # their lease ran out (an AttributeError on None; a crash-point audit).
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue("q").push_many([b"a", b"b"])
    with open("/dev/full", "wb") as full:
        done = subprocess.run([sys.executable, "-m", "qstore.cli", "pop", store_path, "q",
                               "-n", "2"], stdout=full, stderr=subprocess.PIPE, text=True)
    assert done.returncode == 5 and "2 given back" in done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "qstore.cli", "pop", store_path, "q"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: os.close(1))
    assert done.returncode == 2 and "stdout is closed" in done.stderr
    with qstore.open(store_path, compactor=False) as store:
        st = store.queue("q").stats()
        assert (st.ready, st.in_flight) == (2, 0)


@pytest.mark.parametrize("command", ["check", "stats", "queues"])
def test_a_reader_that_went_away_is_exit_141_not_a_finding(store_path: str,
                                                          command: str) -> None:
    # rich and click both made a broken pipe exit 1: `qstore check S | head -1`
    # under pipefail said the store had findings.
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue("q").push(b"x")
    assert _into_a_closed_pipe(command, store_path) == 141


@pytest.mark.parametrize("args", [["--help"], ["pop", "--help"], ["--version"]])
def test_help_into_a_closed_pipe_is_exit_141_too(args: list[str]) -> None:
    # printed while the arguments are parsed, before any command runs (a review)
    assert _into_a_closed_pipe(*args) == 141


def test_ctrl_c_exits_130_not_1(runner: CliRunner, store_path: str,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    # click turned KeyboardInterrupt into "Aborted!" and exit 1, which says
    # "found something": `qstore check S || alert` alerted on a Ctrl-C (a
    # signals audit). 130, as a shell reports a tool SIGINT ended.
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue("q").push(b"x")

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    # On the command line's lazy module (it copies the module's names when first
    # used: patched on the module, the copy would outlive the test).
    monkeypatch.setattr(cli._check, "check_path", interrupted)
    r = runner.invoke(main, ["check", store_path])
    assert r.exit_code == 130 and "interrupted" in r.output and "Aborted" not in r.output


def test_pop_interrupted_while_writing_gives_the_messages_back(
        runner: CliRunner, store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a store they stayed leased until their lease ran out (a signals audit);
    # through a server the closed connection gave them back. Now both: a nack.
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue("q").push_many([b"a", b"b", b"c"])

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("qstore.cli._print_popped", interrupted)
    r = runner.invoke(main, ["pop", store_path, "q", "-n", "3"])
    assert r.exit_code == 130, r.output
    with qstore.open(store_path, compactor=False) as store:
        st = store.queue("q").stats()
        assert (st.ready, st.in_flight) == (3, 0)
        assert [m.attempts for m in store.queue("q").peek(3)] == [1, 1, 1]


def test_writer_locked_store_exits_3(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "s")
    with qstore.open(path, compactor=False) as store:
        store.create_queue("q")
        r = subprocess.run([sys.executable, "-m", "qstore.cli", "push", path, "q", "x"],
                           capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
        assert r.returncode == 3
        said = " ".join(r.stderr.split())
        assert "locked" in said and path in r.stderr.replace("\n", "")
        # What a command line user can do, not Python's readonly=True.
        assert "readonly=True" not in said and "qstore serve" in said
        # Which writers those may be: an embedding process, or a server too old to
        # name itself in STORE/qstore.server (one on a custom socket was called
        # an embedding process; a cross-version audit).
        assert "qstore.open" in said and "older qstore server" in said
        # Inspection is read-only and works while the writer holds the store.
        r = subprocess.run([sys.executable, "-m", "qstore.cli", "queues", path],
                           capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.split() == ["q"]


def test_snapshot_of_a_store_another_process_writes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # It exited 3 ("locked"): a read-only view takes the same snapshot beside
    # the writer (docs/spark.md), and now the command does that.
    path, dest = str(tmp_path / "s"), str(tmp_path / "snap")
    with qstore.open(path, compactor=False) as store:
        q = store.create_queue("q")
        ids = q.push_many([b"a", b"b", b"c"])
        q.ack(q.pop())
        r = subprocess.run([sys.executable, "-m", "qstore.cli", "snapshot", path, dest],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        q.push(b"after")  # the writer goes on; the snapshot does not see it
    with qstore.open(dest, readonly=True) as snap:
        assert [m.payload for m in snap.queue("q").peek(10)] == [b"b", b"c"]
        assert snap.queue("q").get(ids[1]).payload == b"b"
        assert snap.check().ok


def test_snapshot_beside_a_writer_past_a_socket_a_killed_server_left(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Any qstore.sock made the fallback give up ("locked"), also one nothing
    # answers on (a review).
    import socket

    path, dest = str(tmp_path / "s"), str(tmp_path / "snap")
    with qstore.open(path, compactor=False) as store:
        store.create_queue("q").push(b"x")
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(os.path.join(path, "qstore.sock"))
        stale.close()  # the file stays; nothing answers on it
        r = subprocess.run([sys.executable, "-m", "qstore.cli", "snapshot", path, dest],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    with qstore.open(dest, readonly=True) as snap:
        assert [m.payload for m in snap.queue("q").peek(1)] == [b"x"]


@pytest.mark.parametrize("command", ["push", "pop", "peek", "stats", "queues", "compact",
                                     "snapshot", "audit", "backfill", "demo"])
def test_every_command_has_help(runner: CliRunner, command: str) -> None:
    r = runner.invoke(main, [command, "--help"])
    assert r.exit_code == 0
    assert "Usage:" in r.output


def test_demo_without_spark_passes_every_check(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from qstore._demo import run_demo

    assert run_demo(str(tmp_path / "demo"), fresh=True, messages=600, spark=False) == 0


# -- a path that holds no store (issue 11 case 15) ----------------------------------------

NEEDS_A_STORE = [
    ["pop", "{p}", "jobs"],
    ["pop", "{p}", "jobs", "--no-ack"],
    ["push", "{p}", "jobs", "x"],
    ["compact", "{p}"],
    ["snapshot", "{p}", "{p}-snap"],
    ["peek", "{p}", "jobs"],
    ["stats", "{p}"],
    ["queues", "{p}"],
]


@pytest.mark.parametrize("args", NEEDS_A_STORE, ids=lambda a: " ".join(a[:1] + a[3:]))
@pytest.mark.parametrize("kind", ["missing", "empty-dir"])
def test_a_command_on_a_path_without_a_store_exits_2_and_creates_nothing(
        runner: CliRunner, tmp_path: pytest.TempPathFactory, args: list[str], kind: str) -> None:
    path = os.path.join(str(tmp_path), "mistyped")
    if kind == "empty-dir":
        os.mkdir(path)
    r = runner.invoke(main, [a.format(p=path) for a in args])
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())  # rich wraps long lines
    assert "no store at" in said or "is not a qstore store" in said
    assert "nothing was created" in said and "Traceback" not in said
    assert sorted(os.listdir(str(tmp_path))) == (["mistyped"] if kind == "empty-dir" else [])
    if kind == "empty-dir":
        assert os.listdir(path) == []


def test_push_with_create_still_creates_the_store(runner: CliRunner, store_path: str) -> None:
    r = runner.invoke(main, ["push", store_path, "jobs", "x", "--create"])
    assert r.exit_code == 0, r.output
    assert os.path.isdir(os.path.join(store_path, "meta"))


@pytest.mark.parametrize("command", [["stats"], ["queues"], ["pop", "q"], ["compact"]])
def test_a_store_whose_meta_is_a_file_says_what_is_wrong(
        runner: CliRunner, store_path: str, command: list[str]) -> None:
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue("q").push(b"x")
    meta = os.path.join(store_path, "meta")
    os.rename(meta, meta + ".moved")
    with open(meta, "w") as f:
        f.write("not a database")
    r = runner.invoke(main, [command[0], store_path, *command[1:]])
    assert r.exit_code == 5, r.output
    said = " ".join(r.output.split())  # rich wraps long lines
    assert "meta' is not a directory" in said and "not a qstore directory" not in said
    assert "Traceback" not in said


MARKUP_NAME = "x[/y]"  # a closing tag that matches nothing: MarkupError as console markup


def test_queue_names_payloads_and_errors_print_as_written(runner: CliRunner,
                                                          store_path: str) -> None:
    """Names and payloads are data, never console markup: ``x[/y]`` made every
    table and error that quoted it raise rich's MarkupError (a traceback, exit 1),
    and ``[bold]`` in a payload was obeyed instead of shown."""
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue(MARKUP_NAME).push(b"say [bold]hi[/bold]", priority=1)
        store.create_queue("[bold]loud")
    r = runner.invoke(main, ["stats", store_path], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert MARKUP_NAME in r.output and "[bold]loud" in r.output
    r = runner.invoke(main, ["peek", store_path, MARKUP_NAME], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "say [bold]hi[/bold]" in r.output
    r = runner.invoke(main, ["pop", store_path, "no[/such]"])
    assert r.exit_code == 4
    assert r.output.strip() == "error: queue 'no[/such]' does not exist"


def test_check_findings_name_a_markup_like_queue_as_written(runner: CliRunner,
                                                            store_path: str) -> None:
    with qstore.open(store_path, compactor=False) as store:
        q = store.create_queue(MARKUP_NAME)
        q.push(b"payload to damage")
    # The only message's payload ends the only segment (a clean close cuts it there).
    [seg] = [os.path.join(store_path, "payload", n)
             for n in os.listdir(os.path.join(store_path, "payload")) if n.endswith(".seg")]
    with open(seg, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    r = runner.invoke(main, ["check", store_path], env={"COLUMNS": "200"})
    assert r.exit_code == 1, r.output
    assert f"message 1 in '{MARKUP_NAME}'" in r.output


def test_peek_shows_a_push_time_past_year_9999_as_seconds(runner: CliRunner,
                                                          store_path: str) -> None:
    # An injected clock may read up to 1e13 s; datetime stops at year 9999, and the
    # peek ended in a ValueError traceback, exit 1 (the "nothing to show" code).
    with qstore.open(store_path, compactor=False, clock=FakeClock(3e11)) as store:
        store.create_queue("far").push(b"from the future", priority=1)
    r = runner.invoke(main, ["peek", store_path, "far"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "300000000000.000000" in r.output and "from the future" in r.output


def test_stats_of_many_queues_prints_plain_aligned_columns(runner: CliRunner, store_path: str,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    # rich lays out about 3,000 rows a second: 8,000 queues took 3 s (a scale
    # audit). Past RICH_ROWS_MAX rows the table is plain columns, names as written.
    from qstore import _tables

    monkeypatch.setattr(_tables, "RICH_ROWS_MAX", 2)
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue("alpha").push_many([b"1", b"22"])
        store.create_queue(MARKUP_NAME, ttl=30)
        store.create_queue("zeta")
    r = runner.invoke(main, ["stats", store_path], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    at = lines.index("queues (3)")
    assert lines[at + 1].split() == ["queue", "ready", "delayed", "in", "flight", "dead",
                                     "bytes", "expired", "options"]
    assert lines[at + 2].split() == ["alpha", "2", "0", "0", "0", "3", "0", "-"]
    assert lines[at + 3].split() == [MARKUP_NAME, "0", "0", "0", "0", "0", "0", "ttl=30s"]
    assert lines[at + 4].split()[0] == "zeta"
    # Aligned: the numbers end where their headers do (options, last, is not padded).
    assert len({len(lines[i].rsplit(None, 1)[0]) for i in range(at + 1, at + 5)}) == 1


def test_plain_columns_escape_control_characters_and_count_wide_ones_as_two(
        runner: CliRunner, store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A newline in a queue name split its row, the rest reading as a row of its
    # own; alignment counted characters, not terminal cells (a review).
    from rich.cells import cell_len

    from qstore import _tables

    monkeypatch.setattr(_tables, "RICH_ROWS_MAX", 1)
    with qstore.open(store_path, compactor=False) as store:
        store.create_queue("a\nfake 9 9 9")
        store.create_queue("队列队列").push(b"x")
    r = runner.invoke(main, ["stats", store_path], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    at = lines.index("queues (2)")
    rows = lines[at + 1:at + 4]
    assert rows[1].startswith("a\\nfake 9 9 9 ") and rows[2].startswith("队列队列 ")
    assert "fake" not in "".join(lines[at + 4:])  # no row of its own
    assert len({cell_len(row.rsplit(None, 1)[0]) for row in rows}) == 1


def test_stats_through_a_read_only_view_names_the_active_segment(runner: CliRunner,
                                                                 store_path: str) -> None:
    # A view appends nowhere, and said no segment was active, where the writer (and
    # a server) name one (an operations audit): it names the one M synced names.
    with qstore.open(store_path, compactor=False, segment_max_bytes=4096) as store:
        store.create_queue("q").push_many([bytes(1500)] * 5)  # three segments
        writer = [(s.file_id, s.active) for s in store.stats().segments]
    r = runner.invoke(main, ["stats", store_path, "--json"])
    assert r.exit_code == 0, r.output
    viewed = [(s["file_id"], s["active"]) for s in json.loads(r.output)["segments"]]
    assert viewed == writer and [a for _, a in viewed].count(True) == 1


def test_a_backfill_report_gives_a_small_rate_in_two_digits() -> None:
    # A 4-row job printed "(0 msg/s)" (a docs audit).
    from qstore.cli import _rate

    assert [_rate(r) for r in (0.128, 3.0, 9.96, 10.4, 123456.7)] == [
        "0.13", "3", "10", "10", "123,457"]
