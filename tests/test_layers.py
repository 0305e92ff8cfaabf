"""The package's layers point one way (docs/architecture.md), read from the source.

Every ``import`` of every module under qstore/ is parsed: no circle between
qstore's modules, no import hidden inside a function (the usual way to dodge
one), rocksdict only inside qstore/meta, segment frames only inside
qstore/payload, and the core never reaching up to the facade.
"""

from __future__ import annotations

import ast
import pathlib
import re

import qstore

ROOT = pathlib.Path(qstore.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function?, line) for every import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    out: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((alias.name, in_function, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                out.append((mod, in_function, child.lineno))
                # "from . import _states" imports a module too
                out.extend((f"{mod}.{alias.name}", in_function, child.lineno)
                           for alias in child.names)
            visit(child, inner)

    visit(tree, False)
    return out


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}
GRAPH = {
    name: sorted({mod for mod, _, _ in _imports(path) if mod in MODULES and mod != name})
    for name, path in MODULES.items()
}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in GRAPH[node]:
            # A package's __init__ importing its own submodules is not a layer edge.
            if node == nxt.rpartition(".")[0]:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(GRAPH):
        if name not in state and (found := walk(name)):
            return found
    return None


def test_the_modules_form_no_import_circle() -> None:
    assert _cycle() is None


def test_no_qstore_module_imports_inside_a_function() -> None:
    # The exceptions: the modules of qstore.spark that import pyspark (an
    # optional extra, slow to import) are loaded when a Spark job starts, and
    # the package loads qstore.aio (asyncio) and the embedded store (RocksDB,
    # the core) on first use, so that a client process loads neither.
    lazy = ("qstore.aio", "qstore._queue", "qstore._store")
    hidden = [f"{name}:{line} imports {mod}" for name, path in MODULES.items()
              for mod, in_function, line in _imports(path)
              if in_function and (mod == "qstore" or mod.startswith("qstore."))
              and not mod.startswith("qstore.spark")
              and not (name == "qstore" and mod.startswith(lazy))]
    assert hidden == []


def test_every_lazy_module_is_imported_for_the_type_checker_too() -> None:
    # A module loaded on first use (qstore/_lazy.py's lazy("qstore.x")) is
    # imported by name at run time; its import under TYPE_CHECKING keeps it an
    # edge of the graph above, so a lazy load cannot hide a circle.
    lazies = {(name, target) for name, path in MODULES.items()
              for target in re.findall(r'\blazy\("(qstore[\w.]*)"\)',
                                       path.read_text(encoding="utf-8"))}
    assert ("qstore.cli", "qstore.server") in lazies
    assert {(name, target) for name, target in lazies if target not in GRAPH[name]} == set()


def test_only_qstore_meta_imports_rocksdict() -> None:
    users = {name for name, path in MODULES.items()
             for mod, _, _ in _imports(path) if mod.split(".")[0] == "rocksdict"}
    assert users and all(name.startswith("qstore.meta") for name in users), users


def test_only_qstore_payload_touches_segment_frames() -> None:
    framing = {"qstore.payload._format.FRAME", "qstore.payload._format.encode_frame",
               "qstore.payload._format.record_crc", "qstore.payload._reader.frame_problem"}
    outside = {f"{name}: {mod}" for name, path in MODULES.items()
               if not name.startswith("qstore.payload")
               for mod, _, _ in _imports(path) if mod in framing}
    texts = {name: path.read_text(encoding="utf-8") for name, path in MODULES.items()
             if not name.startswith("qstore.payload")}
    by_attribute = {name for name, text in texts.items()
                    if "fmt.FRAME.unpack" in text or "fmt.record_crc" in text
                    or "fmt.encode_frame" in text}
    assert outside == set() and by_attribute == set()


def test_the_core_never_reaches_up_to_the_facade() -> None:
    up = {"qstore._store", "qstore._queue", "qstore._compact", "qstore._snapshot", "qstore.cli"}
    for low in ("qstore._core", "qstore._states", "qstore._txn", "qstore._heads",
                "qstore._durability", "qstore.meta._db", "qstore.payload._segments"):
        assert not set(GRAPH[low]) & up, low
    for low in ("qstore._states", "qstore._txn"):
        assert "qstore._core" not in GRAPH[low]


def test_records_are_encoded_in_one_module() -> None:
    # msgpack also frames the backfill's own job files (plans and task results,
    # never a record of the store): those two modules are the only others.
    users = {name for name, path in MODULES.items()
             for mod, _, _ in _imports(path) if mod == "msgpack"}
    # qstore._wire frames the client/server protocol (docs/protocol.md): messages in
    # flight between processes, never a record of the store.
    assert users == {"qstore.meta._records", "qstore.spark._bulk_source",
                     "qstore.spark.backfill", "qstore._wire"}
