"""``python -m bench``: parse the options, run the workloads, print and save the results."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from rich.console import Console

from . import _features, _interleaved, _results, _scaling, _spark, _targets, _workloads
from ._peers import BY_NAME, PEERS, Item, PeerSpec
from ._plan import MODES, WORKLOADS, KiB, Params
from ._report import make_console, render
from ._results import Collected, Failure, Sample

LARGE = 64 * KiB
EXTRA = ("profile",)  # runs only when asked for (--profile or --only profile)
ONCE = ("open", "features")  # run once after the repeated workloads, not per repeat


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark qstore against its peers (persist-queue, litequeue, a bare "
                    "rocksdict queue) and check the contract's performance targets. "
                    "See docs/benchmarks.md.",
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", const="quick", dest="mode",
                      help="small sizes, 1 repeat: under a minute")
    mode.add_argument("--full", action="store_const", const="full", dest="mode",
                      help="the contract's 1,000,000-message churn and open runs")
    ap.add_argument("--repeat", type=int, help="runs per figure; the median is reported "
                    "(default 3, --quick 1)")
    ap.add_argument("--dir", help="where the temporary stores go (default: next to the "
                    "JSON file, on the project's disk)")
    ap.add_argument("--json", dest="json_path", metavar="PATH",
                    help="results file (default bench-results/bench-<timestamp>.json)")
    ap.add_argument("--no-json", action="store_true", help="do not write a results file")
    ap.add_argument("--only", action="append", default=[], metavar="WORKLOAD[,...]",
                    help=f"run only these workloads: {', '.join(WORKLOADS + EXTRA)}")
    ap.add_argument("--peers", action="append", default=[], metavar="PEER[,...]",
                    help=f"compare only these peers: {', '.join(BY_NAME)}")
    ap.add_argument("--n", type=int, help="messages per throughput measurement")
    ap.add_argument("--budget", type=float, help="seconds per throughput measurement at most")
    ap.add_argument("--cycles", type=int, help="push/pop/ack cycles in the churn workload")
    ap.add_argument("--backlog", type=int, help="messages in the store the open workload opens")
    ap.add_argument("--profile", action="store_true",
                    help="also profile qstore's single push and pop+ack loops (cProfile)")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--keep", action="store_true", help="keep the temporary stores")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--show", metavar="PATH", help="print the tables of a saved results file")
    return ap


def _params(args: argparse.Namespace, ap: argparse.ArgumentParser) -> Params:
    params = MODES[args.mode or "default"]
    changes: dict[str, Any] = {}
    for name in ("repeat", "n", "budget", "cycles", "backlog"):
        value = getattr(args, name)
        if value is not None:
            if value <= 0:
                ap.error(f"--{name} must be positive")
            changes[name] = value
    if "n" in changes:
        changes["n_large"] = max(1, min(params.n_large, changes["n"]))
    return dataclasses.replace(params, **changes)


def _selected(values: list[str], known: tuple[str, ...], what: str,
              ap: argparse.ArgumentParser) -> list[str]:
    chosen = [v for text in values for v in _csv(text)]
    unknown = [v for v in chosen if v not in known]
    if unknown:
        ap.error(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")
    return chosen


class Bench:
    """One run: the temporary directory, what was collected, the progress lines."""

    def __init__(self, params: Params, peers: list[PeerSpec], run_dir: str,
                 log: Console | None) -> None:
        self.p = params
        self.peers = peers
        self.run_dir = run_dir
        self.log = log
        self.collected = Collected()
        self.errors: list[str] = []
        self._items: dict[tuple[int, int], list[Item]] = {}

    def items(self, n: int, size: int) -> list[Item]:
        if (n, size) not in self._items:
            self._items[(n, size)] = _workloads.make_items(n, size, self.p.seed)
        return self._items[(n, size)]

    @contextlib.contextmanager
    def fresh(self) -> Iterator[str]:
        path = tempfile.mkdtemp(prefix="m-", dir=self.run_dir)
        try:
            yield os.path.join(path, "store")
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def say(self, text: str) -> None:
        if self.log is not None:
            self.log.print(text, markup=False, highlight=False)

    def sample(self, tag: str, workload: str, size: int, spec: PeerSpec, threads: int,
               measure: Callable[[str], Sample]) -> None:
        missing = spec.missing()
        if missing is not None:
            self.collected.failures.append(Failure(workload, size, spec.name, threads, missing))
            return
        with self.fresh() as path:
            try:
                got = measure(path)
            except ImportError as exc:
                status = f"not installed: {exc}"
            except Exception as exc:
                status = f"error: {type(exc).__name__}: {exc}"
                self.say(traceback.format_exc())
            else:
                self.collected.samples.append(got)
                self.say(f"{tag} {workload} {size // KiB} KiB x{threads} {spec.name}: "
                         f"{got.rate:,.0f} msgs/s ({got.ops:,} in {got.seconds:.2f} s)")
                return
        self.say(f"{tag} {workload} {spec.name}: {status}")
        self.collected.failures.append(Failure(workload, size, spec.name, threads, status))

    def metrics(self, tag: str, name: str, measure: Callable[[str], list[_results.Metric]],
                path: str | None = None) -> None:
        try:
            if path is None:
                with self.fresh() as fresh:
                    got = measure(fresh)
            else:
                got = measure(path)
        except Exception as exc:
            self.say(traceback.format_exc())
            self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
            return
        self.collected.metrics.extend(got)
        for m in got:
            self.say(f"{tag} {name}: {m.label} = {m.value:,.3g} {m.unit}")

    # -- the workloads ----------------------------------------------------------

    def run_workload(self, name: str, tag: str) -> None:
        p = self.p
        small, large = self.items(p.n, KiB), self.items(p.n_large, LARGE)
        w = _workloads
        if name in ("push", "push_64k"):
            items = small if name == "push" else large
            for spec in self.peers:
                self.sample(tag, "push", len(items[0][0]), spec, 1, functools.partial(
                    w.measure_push, spec, items=items, budget=p.budget))
        elif name in ("pop_ack", "pop_ack_64k"):
            items = small if name == "pop_ack" else large
            for spec in self.peers:
                self.sample(tag, "pop+ack", len(items[0][0]), spec, 1, functools.partial(
                    w.measure_pop_ack, spec, items=items, budget=p.budget))
        elif name == "batch":
            for spec in self.peers:
                self.sample(tag, "push_many", KiB, spec, 1, functools.partial(
                    w.measure_push_many, spec, items=small, batch=p.batch, budget=p.budget))
                self.sample(tag, "pop_many+ack_many", KiB, spec, 1, functools.partial(
                    w.measure_pop_many_ack_many, spec, items=small, batch=p.batch,
                    budget=p.budget))
        elif name == "mixed":
            for spec in self.peers:
                self.sample(tag, "mixed", KiB, spec, 2 * p.mixed_threads, functools.partial(
                    w.measure_mixed, spec, items=small, producers=p.mixed_threads,
                    budget=p.budget))
        elif name == "group_commit":
            for spec in self.peers:
                if spec.durability != "always":
                    continue
                for threads in (1, p.group_threads):
                    self.sample(tag, "push (threads)", KiB, spec, threads, functools.partial(
                        w.measure_group_push, spec, items=small, threads=threads,
                        budget=p.budget))
        elif name == "interleaved":
            self.metrics(tag, name, lambda path: _interleaved.measure_interleaved(path, p))
        elif name == "spark":
            self.metrics(tag, name, lambda path: _spark.measure_spark(path, p))
        elif name == "churn":
            self.metrics(tag, name, lambda path: _scaling.measure_churn(path, p))
        elif name == "compaction":
            def compaction(path: str) -> list[_results.Metric]:
                os.makedirs(path)
                return _scaling.measure_compaction(path, p)

            self.metrics(tag, name, compaction)
        elif name == "features":
            self.metrics(tag, name, lambda path: _features.measure_features(path, p))
        elif name == "server":
            from ._server import measure_server

            self.metrics(tag, name, lambda path: measure_server(path, p, self.say))
        else:
            raise AssertionError(name)

    def run_open(self) -> None:
        """Build the backlog once, then open it in ``repeat`` fresh child processes."""
        with self.fresh() as path:
            self.metrics("[open]", "open", lambda _: _scaling.build_backlog(path, self.p), path)
            if not os.path.isdir(path):
                return
            for r in range(self.p.repeat):
                self.metrics(f"[{r + 1}/{self.p.repeat}]", "open",
                             lambda _: _scaling.measure_open(path, self.p), path)

    def run_profiles(self) -> None:
        from ._profile import profile_hot_paths

        with self.fresh() as path:
            os.makedirs(path)
            self.collected.profiles.update(profile_hot_paths(path, self.p.n, self.p.seed))
        self.say("[profile] done")


def _environment() -> dict[str, Any]:
    versions = {}
    for spec in PEERS:
        versions[spec.distribution or "rocksdict"] = spec.version()
    from qstore import __version__

    versions["qstore"] = __version__
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "versions": versions, "loadavg_start": os.getloadavg()}


def run(argv: list[str] | None = None) -> int:
    """Run the benchmarks (see ``python -m bench --help``); returns the exit code."""
    ap = _parser()
    args = ap.parse_args(argv)
    out = make_console()
    if args.show:
        render(_results.load(args.show), out)
        return 0
    params = _params(args, ap)
    only = _selected(args.only, WORKLOADS + EXTRA, "workload", ap)
    workloads = [w for w in WORKLOADS if not only or w in only]
    profile = args.profile or "profile" in only
    names = _selected(args.peers, tuple(BY_NAME), "peer", ap)
    peers = [spec for spec in PEERS if not names or spec.name in names]
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = None if args.no_json else (args.json_path or
                                           os.path.join("bench-results", f"bench-{stamp}.json"))
    base = args.dir or (os.path.dirname(os.path.abspath(json_path)) if json_path
                        else os.getcwd())
    os.makedirs(base, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="qstore-bench-", dir=base)
    log = None if args.quiet else Console(stderr=True, highlight=False)
    bench = Bench(params, peers, run_dir, log)
    env = _environment()
    started = time.time()
    try:
        for r in range(params.repeat):
            for name in workloads:
                if name not in ONCE:
                    bench.run_workload(name, f"[{r + 1}/{params.repeat}]")
        if "features" in workloads:
            bench.run_workload("features", "[features]")
        if "open" in workloads:
            bench.run_open()
        if profile:
            bench.run_profiles()
    finally:
        if args.keep:
            bench.say(f"kept the stores in {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    env["loadavg_end"] = os.getloadavg()
    doc = build_document(bench, params, peers, env, argv, started)
    if json_path is not None:
        _results.save(doc, json_path)
    render(doc, out)
    if json_path is not None:
        out.print(f"results written to {json_path}")
    if args.strict and any(t["status"] == "missed" for t in doc["targets"]):
        return 1
    return 0


def build_document(bench: Bench, params: Params, peers: list[PeerSpec], env: dict[str, Any],
                   argv: list[str] | None, started: float) -> dict[str, Any]:
    collected = bench.collected
    rows = _results.aggregate_rows(collected, {s.name: s.compare_to for s in PEERS})
    metrics = _results.aggregate_metrics(collected)
    pdict = dataclasses.asdict(params)
    return {
        "format": _results.FORMAT,
        "started_at": datetime.fromtimestamp(started, UTC).isoformat(),
        "seconds": time.time() - started,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "params": pdict,
        "environment": env,
        "peers": [{"name": s.name, "system": s.system, "durability": s.durability,
                   "compare_to": s.compare_to, "guarantees": s.guarantees,
                   "version": s.version(), "status": s.missing() or "ok"} for s in peers],
        "rows": rows,
        "samples": [_results.sample_dict(s) for s in collected.samples],
        "metrics": metrics,
        "targets": _targets.evaluate(rows, metrics, pdict),
        "errors": bench.errors,
        "profiles": collected.profiles,
    }
