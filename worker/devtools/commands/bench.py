"""``tokenfleet bench``: run a benchmark script from the repository's ``benchmarks/`` folder.

The scripts live in the source tree (they are not installed): this command finds the folder
under the current directory or next to an editable install and runs the chosen script with the
same interpreter. :data:`PLAN` names every run that refreshes rows of the headline table at the
top of ``benchmarks/RESULTS.md``: a name, the script, its arguments and the rows (keys) it
refreshes. ``tokenfleet bench NAME`` runs one of them (arguments after ``--`` replace the
planned ones; ``tokenfleet bench`` alone is ``e2e``); ``tokenfleet bench all`` (what ``make
bench`` runs) runs every one in turn with ``--record``, quick ones first, skipping with a reason
those this machine cannot run, and fails if any failed; ``tokenfleet bench list`` shows the
plan. Each run writes its rows through ``tokenfleet.worker.devtools.bench_table``, told which
rows are its own (:data:`~tokenfleet.worker.devtools.bench_table.PLANNED_ENV`), so a row always
names the command that measured its value.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

from tokenfleet.worker.devtools.bench_table import (
    PLANNED_ENV,
    RECORD_FLAG,
    RESULTS_ENV,
    run_command,
)


def _redis_cluster_tools(folder: Path) -> str | None:
    """Why a Redis Cluster cannot be set up here, or None."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        return f"{' and '.join(missing)} not on PATH (a Redis Cluster needs Redis >= 7's binaries)"
    return None


def load_script(script: Path) -> ModuleType:
    """A benchmark script as a module (its ``main`` not run): for its checks and its tests."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    if spec is None or spec.loader is None:
        raise ImportError(f"{script} cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def _llama_server_built(folder: Path) -> str | None:
    """Why llama.cpp's server cannot run here (not built yet), or None. Its script builds it on
    a first run, which takes about an hour on 2 cores: ``make bench`` does not start that."""
    module = load_script(folder / "bench_vs_llamacpp.py")
    if module.installed_llama_server(module.DEFAULT_CACHE_DIR / "venv") is None:
        return (
            f"llama.cpp's server is not built in {module.DEFAULT_CACHE_DIR} (build it once with "
            "python benchmarks/bench_vs_llamacpp.py: about an hour on 2 cores)"
        )
    return None


@dataclass(frozen=True, slots=True)
class Benchmark:
    """One run of ``tokenfleet bench all``: ``python benchmarks/<script> <args> --record``
    refreshes the headline rows ``keys`` (and only those: the test of the plan checks each key
    against RESULTS.md and the script's ``HEADLINE_KEYS``)."""

    name: str
    script: str
    args: tuple[str, ...]
    keys: tuple[str, ...]
    minutes: float  # about how long it runs on the quiet 2-core development VM
    # Why this machine cannot run it (its rows are then left as they are), or None.
    cannot_run: Callable[[Path], str | None] | None = None
    note: str = ""  # why its arguments differ from the script's defaults, where they do

    @property
    def command(self) -> str:
        """The command its rows name (``bench_table.run_command``'s form)."""
        return run_command([self.script, *self.args])

    def why_not(self, folder: Path) -> str | None:
        """Why it cannot run here, or None."""
        if not (folder / self.script).is_file():
            return f"{self.script} is not in {folder}"
        try:
            return None if self.cannot_run is None else self.cannot_run(folder)
        except Exception as exc:  # a check that cannot tell: the run would fail the same way
            return f"its check failed: {exc!r}"


# ``bench all``'s runs, quickest first (``tokenfleet bench list`` adds up their minutes: about 48).
PLAN: tuple[Benchmark, ...] = (
    Benchmark("producer", "bench_producer.py", (), ("submit-latency", "submit-many"), 0.2),
    Benchmark("decode", "bench_decode_step.py", (), ("decode-step",), 0.3),
    Benchmark(
        "e2e", "bench_worker_e2e.py", (), ("e2e-throughput", "e2e-ttft", "e2e-two-workers"), 0.5
    ),
    Benchmark(
        "failover-repair", "bench_failover_repair.py", ("--rounds", "3"), ("failover-repair",), 0.7
    ),
    Benchmark(
        "pool", "bench_kv_pool.py", (), ("kv-pool-held", "kv-pool-jain", "kv-pool-weighted"), 0.7
    ),
    Benchmark("engine", "bench_engine_workload.py", (), ("engine-static-20", "engine-cb-20"), 0.8),
    Benchmark(
        "engine-200",
        "bench_engine_workload.py",
        ("--threads", "2", "--rate", "200"),
        ("engine-static-200", "engine-cb-200"),
        0.8,
    ),
    Benchmark("start", "bench_worker_start.py", (), ("worker-start",), 1.0),
    Benchmark(
        "n-engine",
        "bench_n.py",
        ("--engine", "--engine-repeat", "1", "--rounds", "3"),
        ("n4-engine",),
        1.0,
    ),
    Benchmark("compute-share", "bench_compute_share.py", (), ("compute-share",), 1.3),
    Benchmark("n-fleet", "bench_n.py", ("--rounds", "3"), ("n4-fleet",), 1.5),
    Benchmark("structured", "bench_structured.py", ("--rounds", "2"), ("structured-32",), 1.5),
    Benchmark("huge-prompts", "bench_huge_prompts.py", ("--rounds", "2"), ("huge-prompts",), 1.5),
    Benchmark(
        "e2e-smollm2",
        "bench_worker_e2e.py",
        ("--model", "smollm2", "--requests", "32", "--rate", "2", "--rounds", "3", "--no-heavy"),
        ("smollm2-e2e",),
        1.5,
    ),
    Benchmark(
        "decode-int4",
        "bench_decode_step.py",
        (
            *("--model", "smollm2", "--batch", "1,8", "--threads", "1", "--clock", "cpu"),
            *("--reps", "40", "--warmup", "5"),
        ),
        ("smollm2-decode-int4",),
        1.5,
    ),
    Benchmark(
        "decode-smollm2",
        "bench_decode_step.py",
        ("--model", "smollm2", "--batch", "1,8,32", "--threads", "1", "--reps", "60"),
        ("smollm2-decode",),
        2.0,
    ),
    Benchmark(
        "cluster",
        "bench_cluster.py",
        (
            *("--bulk-n", "30000", "--e2e-n", "32", "--rounds", "3", "--producers", "1,2,3"),
            *("--per-producer-n", "10000", "--repeats", "3"),
        ),
        ("cluster",),
        2.0,
        cannot_run=_redis_cluster_tools,
    ),
    Benchmark(
        "gateway-keepalive",
        "bench_gateway.py",
        (
            *("--rounds", "2", "--keepalive-s", "0.5", "--ttft-requests", "10"),
            *("--rate-requests", "100"),
        ),
        ("gateway-sdk-keepalive",),
        2.0,
    ),
    Benchmark(
        "engine-smollm2",
        "bench_engine_workload.py",
        ("--model", "smollm2", "--chat", "--requests", "32", "--threads", "1", "--rate", "4"),
        ("smollm2-engine-static", "smollm2-engine-cb"),
        2.5,
    ),
    Benchmark(
        "e2e-25",
        "bench_worker_e2e.py",
        ("--rounds", "25", "--no-heavy"),
        ("e2e-throughput-25", "e2e-ttft-25"),
        3.0,
    ),
    Benchmark(
        "gateway",
        "bench_gateway.py",
        ("--rounds", "3"),
        ("gateway-throughput", "gateway-ttft"),
        3.0,
    ),
    Benchmark(
        "batches", "bench_batches.py", ("--rounds", "2"), ("batch-throughput", "batch-ttft"), 3.0
    ),
    Benchmark(
        "fairness",
        "bench_fairness.py",
        ("--rounds", "4"),
        ("fairness-light-ttft", "fairness-throughput", "fairness-pull-cost"),
        3.0,
    ),
    Benchmark(
        "console",
        "bench_console.py",
        ("--rounds", "10", "--seconds", "8"),
        ("console-gateway-rate", "console-step-time", "console-gateway-cpu"),
        3.5,
        note="10 paired rounds of 8 s phases, not the 30 of the loaded host's study (HISTORY.md)",
    ),
    Benchmark(
        "routing",
        "bench_routing.py",
        ("--model", "smollm2", "--rounds", "3"),
        ("routing-ttft", "routing-throughput"),
        4.0,
    ),
    Benchmark(
        "llamacpp",
        "bench_vs_llamacpp.py",
        (),
        ("llamacpp-http-1", "llamacpp-http-8", "llamacpp-http-32"),
        5.0,
        cannot_run=_llama_server_built,
    ),
)
# Headline rows that no run of this plan refreshes on any machine like this one, each with why;
# they are edited by hand from a run of their command elsewhere.
UNPLANNED: Mapping[str, str] = MappingProxyType({})
BY_NAME: Mapping[str, Benchmark] = MappingProxyType({b.name: b for b in PLAN})
ALL, LIST, DEFAULT = "all", "list", "e2e"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run a benchmark from the source tree (default: worker end to end)",
        description="Run benchmarks/<script> from the source tree with its planned arguments; "
        "arguments after -- replace them (e.g. tokenfleet bench e2e -- --requests 32). all: "
        "every one in turn with --record (make bench); list: the plan.",
    )
    p.add_argument(
        "which",
        nargs="?",
        default=DEFAULT,
        choices=[*BY_NAME, ALL, LIST],
        metavar="{NAME,all,list}",
        help=f"which benchmark (default {DEFAULT}; all: every one in turn; list: the plan)",
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="e2e only: use this Redis (unique key prefixes) instead of starting a "
        "private redis-server",
    )
    p.add_argument(
        "--results",
        default=None,
        help=f"all: write the figures into this copy of RESULTS.md (sets {RESULTS_ENV}; "
        "README.md is then left alone)",
    )
    p.add_argument("args", nargs="*", help="arguments for the script, after --")
    p.set_defaults(func=func)


def find_benchmarks() -> Path | None:
    """The ``benchmarks/`` folder: under the working directory, else beside the package."""
    # This file is <checkout>/worker/devtools/commands/bench.py in an editable install.
    checkout = Path(__file__).resolve().parents[3]
    for base in (Path.cwd(), checkout):
        folder = base / "benchmarks"
        if (folder / "workload.py").is_file():
            return folder
    return None


def func(args: argparse.Namespace) -> int:
    if args.which == LIST:
        print_plan(find_benchmarks())
        return 0
    folder = find_benchmarks()
    if folder is None:
        print(
            "tokenfleet bench: no benchmarks/ folder found; run it from a source checkout",
            file=sys.stderr,
        )
        return 2
    extra = [a for a in args.args if a != "--"]
    if args.results and args.which != ALL:
        print("tokenfleet bench: --results applies to all only", file=sys.stderr)
        return 2
    if args.which == ALL:
        if extra or args.redis_url:
            print("tokenfleet bench all: takes no script arguments", file=sys.stderr)
            return 2
        return run_all(folder, results=Path(args.results).resolve() if args.results else None)
    bench = BY_NAME[args.which]
    script_args = extra or list(bench.args)
    if args.redis_url:
        if bench.script != BY_NAME["e2e"].script:
            print(
                "tokenfleet bench: --redis-url applies to the e2e benchmark only", file=sys.stderr
            )
            return 2
        script_args = ["--redis-url", args.redis_url, *script_args]
    return subprocess.call([sys.executable, str(folder / bench.script), *script_args])


def print_plan(folder: Path | None) -> None:
    """Each run of ``bench all`` in order: name, minutes, command and the rows it refreshes."""
    total = sum(b.minutes for b in PLAN)
    print(f"tokenfleet bench all: {len(PLAN)} runs, about {total:.0f} min on the quiet 2-core VM")
    for i, b in enumerate(PLAN, start=1):
        print(f"{i:2d}. {b.name}  (~{b.minutes:g} min)  {b.command}")
        print(f"    rows: {' '.join(b.keys)}")
        if b.note:
            print(f"    note: {b.note}")
        why = b.why_not(folder) if folder is not None else None
        if why:
            print(f"    skipped here: {why}")
    for key, why in UNPLANNED.items():
        print(f"not measured by make bench: {key}: {why}")


def run_all(folder: Path, *, results: Path | None = None) -> int:
    """Every planned benchmark with its arguments and ``--record``, in turn; 0 only if none
    failed. A failure does not stop the others (each measures something different); a run this
    machine cannot do is skipped with its reason; the summary at the end lists all of them."""
    env = dict(os.environ)
    if results is not None:
        env[RESULTS_ENV] = str(results)
    started_all = time.monotonic()
    outcomes: list[tuple[Benchmark, str, float]] = []
    for i, bench in enumerate(PLAN, start=1):
        elapsed = _minutes(time.monotonic() - started_all)
        head = f"== [{i}/{len(PLAN)}] {bench.name} ({elapsed} elapsed)"
        why = bench.why_not(folder)
        if why is not None:
            print(f"\n{head}: skipped: {why}; rows left as they are: {' '.join(bench.keys)}")
            outcomes.append((bench, f"skipped: {why}", 0.0))
            continue
        print(f"\n{head}: {bench.command} {RECORD_FLAG} ==", flush=True)
        started = time.monotonic()
        code = subprocess.call(
            [sys.executable, str(folder / bench.script), *bench.args, RECORD_FLAG],
            env={**env, PLANNED_ENV: " ".join(bench.keys)},
        )
        took = time.monotonic() - started
        outcome = "ok" if code == 0 else f"failed (exit {code})"
        print(f"== {bench.name}: {outcome} after {_minutes(took)} ==", flush=True)
        outcomes.append((bench, outcome, took))
    print(f"\ntokenfleet bench all: {_minutes(time.monotonic() - started_all)} in all")
    for bench, outcome, took in outcomes:
        print(f"  {bench.name:18s} {_minutes(took):>7s}  {outcome}")
    failed = [
        f"{b.name} {o.removeprefix('failed ')}" for b, o, _ in outcomes if o.startswith("failed")
    ]
    if failed:
        print("tokenfleet bench all: failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
