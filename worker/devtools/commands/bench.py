"""``tokenfleet bench``: run a benchmark script from the repository's ``benchmarks/`` folder.

The scripts live in the source tree (they are not installed): this command finds the folder
under the current directory or next to an editable install and runs the chosen script with the
same interpreter, passing the remaining arguments through. ``tokenfleet bench`` alone runs the
end-to-end worker benchmark (``benchmarks/bench_worker_e2e.py``); ``tokenfleet bench all`` (what
``make bench`` runs) runs every script with its defaults and ``--record`` (each writes its
headline figures into ``benchmarks/RESULTS.md``: ``tokenfleet.worker.devtools.bench_table``),
one after the other, and fails if any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tokenfleet.worker.devtools.bench_table import RECORD_FLAG

# Benchmark name -> script in benchmarks/; ``bench all`` runs them in this order. Read-only.
SCRIPTS: Mapping[str, str] = MappingProxyType(
    {
        "e2e": "bench_worker_e2e.py",
        "engine": "bench_engine_workload.py",
        "producer": "bench_producer.py",
        "decode": "bench_decode_step.py",
        "pool": "bench_kv_pool.py",
        "compute-share": "bench_compute_share.py",
        "start": "bench_worker_start.py",
    }
)
ALL = "all"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run a benchmark from the source tree (default: worker end to end)",
        description="Run benchmarks/<script> from the source tree; extra arguments are passed "
        "to it (e.g. tokenfleet bench e2e -- --requests 32).",
    )
    p.add_argument(
        "which",
        nargs="?",
        default="e2e",
        choices=[*sorted(SCRIPTS), ALL],
        help="which benchmark (default e2e; all: every one in turn)",
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="e2e only: use this Redis (unique key prefixes) instead of starting a "
        "private redis-server",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
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
    folder = find_benchmarks()
    if folder is None:
        print(
            "tokenfleet bench: no benchmarks/ folder found; run it from a source checkout",
            file=sys.stderr,
        )
        return 2
    extra = [a for a in args.args if a != "--"]
    if args.redis_url:
        if args.which != "e2e":
            print(
                "tokenfleet bench: --redis-url applies to the e2e benchmark only", file=sys.stderr
            )
            return 2
        extra = ["--redis-url", args.redis_url, *extra]
    if args.which == ALL:
        if extra:
            print("tokenfleet bench all: takes no script arguments", file=sys.stderr)
            return 2
        return run_all(folder)
    return subprocess.call([sys.executable, str(folder / SCRIPTS[args.which]), *extra])


def run_all(folder: Path) -> int:
    """Every benchmark with its defaults and ``--record``, in turn; 0 only if each exited 0. A
    failure does not stop the others (each measures something different), it is listed at the
    end."""
    failed: list[str] = []
    for i, (name, script) in enumerate(SCRIPTS.items(), start=1):
        print(f"\n== tokenfleet bench {name} ({i}/{len(SCRIPTS)}): {script} ==", flush=True)
        started = time.monotonic()
        code = subprocess.call([sys.executable, str(folder / script), RECORD_FLAG])
        print(f"== {name}: exit {code} after {time.monotonic() - started:.0f} s ==", flush=True)
        if code != 0:
            failed.append(f"{name} (exit {code})")
    if failed:
        print("tokenfleet bench all: failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0
