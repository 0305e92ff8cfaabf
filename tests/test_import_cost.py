"""What ``import qstore`` loads: numpy, asyncio and the embedded store only when
something uses them.

A web worker that pushes, a consumer that talks to a server, or a
``qstore push`` from a shell imports qstore in a fresh process each time;
numpy (about 50 ms, 20 MB and OpenBLAS's threads), asyncio (about 25 ms)
and the embedded store (RocksDB and the core) are loaded only by the paths
that need them (qstore/_lazy.py, the package's ``__getattr__``). Each case
runs in a fresh interpreter, since this one has imported them all long ago.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.server._support import running


def _run(code: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120, check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_single_operations_load_neither_numpy_nor_asyncio(tmp_path) -> None:  # type: ignore[no-untyped-def]
    got = _run(f"""
        import json, sys
        import qstore
        seen = {{"import": sorted(m for m in ("numpy", "asyncio", "rocksdict", "qstore._core")
                                  if m in sys.modules)}}
        with qstore.open({str(tmp_path / "s")!r}) as store:
            q = store.create_queue("q")
            q.push(b"one", priority=3)
            m = q.pop()
            q.ack(m)
            ids = q.push_many([b"a", b"b"])
            got = q.pop_many(2)
            q.ack_many(got)
            seen["ops"] = sorted(m for m in ("numpy", "asyncio") if m in sys.modules)
            seen["bodies"] = [m.payload.decode() for m in got]
        print(json.dumps(seen))
    """)
    assert got == {"import": [], "ops": [], "bodies": ["a", "b"]}


def test_numpy_and_aio_load_when_first_used(tmp_path) -> None:  # type: ignore[no-untyped-def]
    got = _run(f"""
        import json, sys
        import qstore
        seen = {{}}
        with qstore.open({str(tmp_path / "s")!r}, segment_max_bytes=64 * 1024,
                         compactor=False) as store:
            q = store.create_queue("q")
            ids = q.push_many([bytes([i % 256]) * 1000 for i in range(300)])
            q.ack_many(q.pop_many(200))
            seen["before"] = "numpy" in sys.modules
            result = store.compact(threshold=0.0)
            seen["moved"] = result.messages_moved
            seen["after"] = "numpy" in sys.modules
            left = q.pop_many(100)
            index = dict(zip(ids, range(300)))
            seen["left"] = [m.payload == bytes([index[m.id] % 256]) * 1000 for m in left]
        seen["aio"] = qstore.aio.connect.__module__
        seen["asyncio"] = "asyncio" in sys.modules
        print(json.dumps(seen))
    """)
    assert got["before"] is False and got["after"] is True
    assert got["moved"] == 100 and got["left"] == [True] * 100
    assert got["aio"] == "qstore.aio" and got["asyncio"] is True


def test_a_client_loads_neither_numpy_nor_asyncio(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with running(str(tmp_path / "store")) as server:
        got = _run(f"""
            import json, sys
            import qstore
            with qstore.connect({server.address!r}) as client:
                q = client.create_queue("q")
                q.push(b"over the wire")
                m = q.pop()
                q.ack(m)
            heavy = ("numpy", "asyncio", "rocksdict", "qstore._core")
            print(json.dumps({{"body": m.payload.decode(),
                              "loaded": [x for x in heavy if x in sys.modules]}}))
        """)
    assert got == {"body": "over the wire", "loaded": []}


def test_the_command_line_loads_the_server_and_the_store_only_for_commands_that_use_them(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    # `qstore push` and `qstore pop` from a shell, through a running server: a
    # fresh process each time, which needs the client only. The same commands
    # on a store with no server load the embedded store, and `serve`'s loop
    # choices are listed without the server.
    store = str(tmp_path / "store")
    heavy = ("numpy", "asyncio", "rocksdict", "qstore._core", "qstore._store", "qstore.server",
             "prometheus_client")
    code = """
        import contextlib, io, json, sys
        from qstore.cli import main, serve
        seen = {{"import": [x for x in {heavy!r} if x in sys.modules],
                "loops": list(next(p for p in serve.params if p.name == "loop").type.choices)}}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            for args in {commands!r}:
                try:
                    main(args, standalone_mode=False)
                except SystemExit as exc:
                    seen.setdefault("exits", []).append(exc.code)
        seen["out"] = out.getvalue().split()
        seen["loaded"] = [x for x in {heavy!r} if x in sys.modules]
        print(json.dumps(seen))
    """
    with running(store) as server:
        got = _run(code.format(heavy=heavy, commands=[
            ["push", server.address, "q", "shell", "--create"],
            ["pop", server.address, "q"]]))
    assert got["import"] == [] and got["loaded"] == []
    assert got["loops"] == ["auto", "uvloop", "asyncio"]
    assert got["out"][0] == "1" and got["out"][-1] == "shell" and "exits" not in got
    embedded = _run(code.format(heavy=heavy, commands=[["pop", store, "q"]]))
    assert embedded["import"] == [] and embedded["exits"] == [1]  # the queue is empty
    assert "rocksdict" in embedded["loaded"] and "qstore._store" in embedded["loaded"]
    assert "qstore.server" not in embedded["loaded"]
