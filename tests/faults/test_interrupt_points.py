"""Ctrl-C at single points found by an interrupt audit: rotation, batches, the group
commit, the sync client (test_interrupts.py sweeps the points after a write).

Each test raises KeyboardInterrupt from a profile hook where CPython delivers a
signal (right after a C call returns, or as a function is called) and checks
that the store, or the client, carries on: the interrupted call took effect
or not, and nothing else is lost, leaked or left locked.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pytest

import qstore

from ..server._support import serving


@contextmanager
def interrupted_at(when: Callable[[Any, str, Any], bool]) -> Iterator[list[str]]:
    """Raise KeyboardInterrupt at the first profile event ``when`` accepts; yields a
    list that holds "hit" once it was raised."""
    hit: list[str] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if when(frame, event, arg):
            sys.setprofile(None)
            hit.append("hit")
            raise KeyboardInterrupt("simulated Ctrl-C")

    sys.setprofile(hook)
    try:
        yield hit
    finally:
        sys.setprofile(None)


def _in(frame: Any, function: str, file_end: str) -> bool:
    code = frame.f_code
    return bool(code.co_name == function and code.co_filename.endswith(file_end))


def test_an_interrupt_as_a_rotation_closes_the_old_segment_loses_nothing(
        store_path: str) -> None:
    # The sealed writer kept its closed descriptor: every later push failed with
    # EBADF, or, once another file took that number, wrote its payload there and
    # "succeeded", the store's close then cutting that file.
    with qstore.open(store_path, segment_max_bytes=4096, compactor=False) as store:
        q = store.create_queue("q")
        ids = [q.push(b"%d" % i + b"." * 1000) for i in range(3)]
        with interrupted_at(lambda f, e, a: e == "c_return" and a is os.close
                            and _in(f, "finish", "payload/_writer.py")) as hit, \
                pytest.raises(KeyboardInterrupt):
            q.push(b"big" + b"." * 1500)  # does not fit: rotates
        assert hit
        victim = os.open(os.devnull, os.O_RDONLY)  # takes the number just closed
        try:
            ids += [q.push(b"after %d" % i) for i in range(3)]
        finally:
            os.close(victim)
        assert not store.check().findings
        got = {m.id: m.payload for m in q.peek(10)}
        assert set(ids) <= set(got) and got[ids[-1]] == b"after 2"
    with qstore.open(store_path, compactor=False) as store:
        assert not store.check().findings
        assert {m.id for m in store.queue("q").peek(10)} >= set(ids)


def test_an_interrupt_after_a_batch_committed_keeps_its_segments(store_path: str) -> None:
    # The cleanup of a failed batch ran before memory knew of the segments the
    # committed batch rotated into, and deleted them: its messages read as
    # missing segments and went to the dead letters as damaged.
    with qstore.open(store_path, segment_max_bytes=4096, compactor=False) as store:
        q = store.create_queue("q")
        bodies = [(b"B%d" % i + b"." * 1500, i) for i in range(6)]  # spans 3 segments
        with interrupted_at(lambda f, e, a: e == "c_return"
                            and _in(f, "write", "meta/_db.py")) as hit, \
                pytest.raises(KeyboardInterrupt):
            q.push_many(bodies)
        assert hit
        assert not store.check().findings
        assert sorted(m.payload for m in q.pop_many(10)) == sorted(b for b, _ in bodies)
        assert q.dead_letters(10) == []


@pytest.mark.parametrize("point", ["acquire", "_is_owned"])
def test_an_interrupt_in_the_group_commit_leaves_no_lock_held(store_path: str,
                                                              point: str) -> None:
    # An interrupt right after Syncer.wait took its lock (before its try), or in
    # its finally, kept it: every other thread's write in always mode waited
    # forever.
    with qstore.open(store_path, durability="always", compactor=False) as store:
        q = store.create_queue("q")
        q.push(b"warm-up")
        with interrupted_at(lambda f, e, a: e == "c_return"
                            and getattr(a, "__name__", "") == point
                            and _in(f, "wait", "_durability.py")) as hit, \
                pytest.raises(KeyboardInterrupt):
            q.push(b"interrupted")
        assert hit
        done: list[int] = []
        t = threading.Thread(target=lambda: done.append(q.push(b"another thread")),
                             daemon=True)
        t.start()
        t.join(30)
        assert done and not store.core.syncer._cv_lock._is_owned()


@pytest.mark.parametrize("mode", ["interval", "always"])
@pytest.mark.parametrize("section", ["writing", "settling"])
def test_an_interrupt_as_the_writer_lock_is_taken_leaves_it_free(
        store_path: str, mode: str, section: str) -> None:
    # SIGINT while the main thread waits for the writer lock is raised as
    # acquire() returns, in the section's __enter__: the lock stayed taken and
    # every other thread of the process waited on it for good (an interrupt
    # audit: after the first interrupt, with three threads pushing).
    with qstore.open(store_path, durability=mode, compactor=False) as store:
        q = store.create_queue("q")
        q.push(b"warm-up")
        core = store.core
        with interrupted_at(lambda f, e, a: e == "c_return"
                            and getattr(a, "__name__", "") == "acquire"
                            and _in(f, "__enter__", "_core.py")) as hit, \
                pytest.raises(KeyboardInterrupt):
            if section == "writing":
                q.push(b"interrupted")
            else:
                with core.settling:
                    pass
        assert hit and core.lock._recursion_count() == 0  # type: ignore[attr-defined]
        done: list[int] = []
        t = threading.Thread(target=lambda: done.append(q.push(b"another thread")),
                             daemon=True)
        t.start()
        t.join(30)
        assert done and [m.payload for m in q.pop_many(5)] == [b"warm-up", b"another thread"]


def test_an_interrupt_as_a_payload_sync_takes_its_flag_leaves_it_to_the_next_sync(
        store_path: str) -> None:
    # The flag that says appended bytes await an fdatasync was cleared before the
    # try that puts it back: a Ctrl-C as the descriptor's dup returned (a
    # snapshot's sync, in the main thread) left it cleared with nothing synced,
    # and the next sync, an always-mode group commit's, synced nothing and
    # returned durable an unjournaled batch (an interrupt audit).
    with qstore.open(store_path, compactor=False, sync_interval=3600) as store:
        store.create_queue("q").push_many([b"a", b"b"])  # appended, not synced
        payload = store.core.payload
        assert payload.unsynced
        with interrupted_at(lambda f, e, a: e == "c_return"
                            and getattr(a, "__name__", "") == "dup"
                            and _in(f, "sync", "_segments.py")) as hit, \
                pytest.raises(KeyboardInterrupt):
            store.snapshot(store_path + "-snap")
        assert hit
        assert payload.unsynced  # still owed
        store.core.syncer.sync_now()
        fid, synced = payload.synced_position()
        assert not payload.unsynced and synced == store.core.data_size(fid)


def test_a_syncer_whose_thread_start_was_cut_short_stops_cleanly(
        store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # An interrupt inside Thread.start, before the thread ran: the failed open's
    # cleanup stopped the syncer, whose join raised RuntimeError ("cannot join
    # thread before it is started") in place of the KeyboardInterrupt (a review).
    from qstore._durability import Syncer

    with qstore.open(store_path, compactor=False) as store:
        syncer = Syncer("interval", 3600.0, store.core.payload, store.core.meta)

        def cut(self: threading.Thread) -> None:
            raise KeyboardInterrupt("simulated Ctrl-C")

        monkeypatch.setattr(threading.Thread, "start", cut)
        with pytest.raises(KeyboardInterrupt):
            syncer.start()
        monkeypatch.undo()
        syncer.stop()
        assert syncer._thread is None


def test_an_open_cut_short_as_its_threads_start_leaves_the_store_free(
        store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The sweeper and the compactor started after the open's cleanup try: a Ctrl-C
    # there left them running and the store locked for the life of the process
    # (a review). The next open in this process works now, and nothing runs on.
    from qstore import _compact

    with qstore.open(store_path) as store:
        store.create_queue("q").push(b"kept")

    def cut(self: Any) -> None:
        raise KeyboardInterrupt("simulated Ctrl-C")

    monkeypatch.setattr(_compact.Compactor, "start", cut)
    with pytest.raises(KeyboardInterrupt):
        qstore.open(store_path)
    monkeypatch.undo()
    assert not [t for t in threading.enumerate() if t.name.startswith("qstore-")]
    with qstore.open(store_path) as store:
        assert [m.payload for m in store.queue("q").peek(5)] == [b"kept"]


def test_a_view_open_cut_short_at_its_end_keeps_no_file_open(
        store_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The steps after the view's files were open (its syncer, the clock watch)
    # ran outside any cleanup: a Ctrl-C there kept its segments and its metadata
    # open for the life of the process (a review of the open's cleanup).
    from qstore import _core

    with qstore.open(store_path) as store:
        store.create_queue("q").push(b"kept")
    before = [link for link in _open_files() if link.startswith(store_path)]

    def cut(*args: Any) -> None:
        raise KeyboardInterrupt("simulated Ctrl-C")

    monkeypatch.setattr(_core, "watch", cut)
    with pytest.raises(KeyboardInterrupt):
        qstore.open(store_path, readonly=True)
    monkeypatch.undo()
    assert [link for link in _open_files() if link.startswith(store_path)] == before
    with qstore.open(store_path, readonly=True) as view:
        assert [m.payload for m in view.queue("q").peek(5)] == [b"kept"]


def test_an_interrupt_as_the_writer_claim_returns_leaves_no_claim(store_path: str) -> None:
    # The process's claim on the store (beside RocksDB's LOCK) was noted before
    # anything could release it: a Ctrl-C as _claim_writer returned kept it, and
    # every later open in this process said StoreLocked (a review).
    with qstore.open(store_path) as store:
        store.create_queue("q").push(b"kept")
    with interrupted_at(lambda f, e, a: e == "return"
                        and _in(f, "_claim_writer", "_core.py")) as hit, \
            pytest.raises(KeyboardInterrupt):
        qstore.open(store_path)
    assert hit
    with qstore.open(store_path) as store:
        assert [m.payload for m in store.queue("q").peek(5)] == [b"kept"]


def _open_files() -> list[str]:
    links = []
    for name in os.listdir("/proc/self/fd"):
        with suppress(OSError):  # closed since the listing
            links.append(os.readlink(f"/proc/self/fd/{name}"))
    return links


def test_an_interrupt_as_a_new_segment_file_is_opened_leaves_no_file_or_descriptor(
        store_path: str) -> None:
    # Raised as the open returned, before the try that cleans up: every cut
    # rotation left a header-less .seg.new until the next open (an interrupt
    # audit: 48 to 127 of them a run).
    with qstore.open(store_path, compactor=False, segment_max_bytes=64 * 1024) as store:
        q = store.create_queue("q")
        q.push(b"first")
        with interrupted_at(lambda f, e, a: e == "c_return"
                            and getattr(a, "__name__", "") == "open"
                            and _in(f, "create_segment_file", "_writer.py")) as hit, \
                pytest.raises(KeyboardInterrupt):
            for _ in range(100):  # until a push rotates
                q.push(b"x" * 1000)
        assert hit
        payload = os.path.join(store_path, "payload")
        assert [n for n in os.listdir(payload) if n.endswith(".new")] == []
        # Nor a descriptor on it, never handed back (the descriptor leaked).
        assert [link for link in _open_files() if ".seg.new" in link] == []
        q.push(b"after")
        assert store.check().ok


def test_a_client_interrupted_while_decoding_a_pop_gives_its_leases_back(
        tmp_path: Any) -> None:
    # The answer was read, so the link stayed open: the server kept the leases to
    # their deadline, with nobody holding the messages.
    with serving(str(tmp_path / "s")) as address, qstore.connect(address) as a, \
            qstore.connect(address) as b:
        q = a.create_queue("q")
        q.push_many([b"a", b"b", b"c"])
        with interrupted_at(lambda f, e, a_: e == "call"
                            and f.f_code.co_name == "decode_message") as hit, \
                pytest.raises(KeyboardInterrupt):
            q.pop_many(3, lease=3600.0)
        assert hit
        # Given back when the server saw the link close: a parked pop gets one.
        got = b.queue("q").pop(wait=30.0)
        assert got is not None and got.attempts == 2  # the first delivery counts
        assert q.stats().ready == 2  # and the same client still works


@pytest.mark.parametrize("point", ["stop", "_release_writer"])
def test_a_close_cut_short_is_finished_by_the_next_close(store_path: str, point: str) -> None:
    # close() marked the store closed first: a second close() returned at once,
    # leaving the compactor, sweeper and sync threads running, the database open
    # and the store locked in this process.
    store = qstore.open(store_path)
    store.create_queue("q").push(b"kept")
    with interrupted_at(lambda f, e, a: e == "call" and f.f_code.co_name == point
                        and (point != "stop" or f.f_code.co_filename.endswith("_compact.py"))
                        ) as hit, pytest.raises(KeyboardInterrupt):
        store.close()
    assert hit
    store.close()
    assert [t.name for t in threading.enumerate() if t.name.startswith("qstore")] == []
    with qstore.open(store_path) as again:  # not StoreLocked
        assert [m.payload for m in again.queue("q").peek()] == [b"kept"]
        assert not again.check().findings


@pytest.mark.parametrize("step", ["copied", "repointed"])
def test_a_compaction_pass_cut_short_is_rolled_back_or_carried_over(
        store_path: str, step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only an Exception rolled a pass back (or carried its sources over): after a
    # Ctrl-C the running store kept the pass's record, and one cut in its copy
    # left the output an orphan to the check until the next open.
    from qstore import _compact

    with qstore.open(store_path, segment_max_bytes=4096, compactor=False) as store:
        q = store.create_queue("q")
        kept = [q.push(b"keep %d " % i + b"." * 500) for i in range(12)]
        q.ack_many(q.pop_many(6))  # garbage in the sealed segments
        before = set(store.core.payload.file_ids())

        def cut(name: str) -> None:
            if name == step:
                raise KeyboardInterrupt("simulated Ctrl-C")

        monkeypatch.setattr(_compact, "step_hook", cut)
        with pytest.raises(KeyboardInterrupt):
            store.compact(threshold=0.0)
        monkeypatch.setattr(_compact, "step_hook", None)
        report = store.check()
        assert not report.findings and not report.notes, report.summary()
        if step == "copied":  # rolled back: no output left behind
            assert set(store.core.payload.file_ids()) <= before | {store.core.payload.active_id}
        assert {m.id for m in q.peek(20)} == set(kept[6:])
        store.compact(threshold=0.0)  # the next pass finishes the work
        assert not store.check().findings
        assert {m.id for m in q.peek(20)} == set(kept[6:])


def test_a_close_cut_short_after_releasing_the_store_touches_its_files_no_more(
        store_path: str) -> None:
    # Cut as the files were being closed, the close still released the database and
    # the writer claim: the store could be opened again, and the next close() of
    # the old object then cut the active segment under the new writer's pushes,
    # which all went to the dead letters (a review of this change).
    old = qstore.open(store_path, compactor=False)
    old.create_queue("q").push(b"kept")
    with interrupted_at(lambda f, e, a: e == "call" and f.f_code.co_name == "_close_writer"
                        ) as hit, pytest.raises(KeyboardInterrupt):
        old.close()
    assert hit
    with qstore.open(store_path, compactor=False) as new:  # released: not StoreLocked
        q = new.queue("q")
        for i in range(5):
            q.push(b"new %d" % i + b"." * 100)
        old.close()  # closes its descriptors, and nothing else
        assert not new.check().findings
        assert len(q.peek(10)) == 6
    with qstore.open(store_path) as again:
        assert not again.check().findings and len(again.queue("q").peek(10)) == 6


def test_a_close_called_again_inside_a_close_returns(store_path: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A signal handler calling close() while the same thread was in close()
    # waited forever on close's own lock (a review of this change).
    from qstore import _compact

    store = qstore.open(store_path)
    real_stop = _compact.Compactor.stop
    inner: list[str] = []

    def stop(self: Any) -> None:
        store.close()  # as a SIGTERM handler would, in the middle of the close
        inner.append("returned")
        real_stop(self)

    monkeypatch.setattr(_compact.Compactor, "stop", stop)
    store.close()
    assert inner == ["returned"]
    qstore.open(store_path).close()  # and the first close finished


def test_a_child_forked_while_the_writer_holds_the_views_gate_does_not_keep_it(
        store_path: str) -> None:
    # The child shared the gate's open file, and with it the lock, for its whole
    # life: every view waited at the gate and no deletion could run (a review).
    from qstore.payload import _views

    payload = os.path.join(store_path, "payload")
    with qstore.open(store_path, compactor=False):
        pass
    r, w = os.pipe()
    with _views.no_view_opening(payload) as free:
        assert free
        pid = os.fork()
        if pid == 0:  # the child: waits until the parent has checked
            os.close(w)
            os.read(r, 1)
            os._exit(0)
    os.close(r)
    try:
        done = threading.Event()

        def open_view() -> None:
            with _views.viewing(payload) as locked:
                assert locked
                done.set()

        t = threading.Thread(target=open_view, daemon=True)
        t.start()
        assert done.wait(30)  # not held back by the child
        with _views.no_view_opening(payload, wait=5.0) as free:
            assert free
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
