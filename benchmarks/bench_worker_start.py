"""Worker start: how long until a ``tokenfleet worker`` serves, and how much memory it holds.

Side by side in one run, each a fresh process (``--rounds`` of each, alternating):

* ``worker, warm cache (default: --quantization auto)``: ``tokenfleet worker --model MODEL``
  with its default settings until its heartbeat is in Redis (model resolved from the conversion
  cache, loaded, its linear layers quantized to the file's own precision, smoke-tested, KV
  cache allocated; SmolLM2's Q4_1 file runs as int4, issue 31);
* ``worker, warm cache, --quantization none``: the same worker running the file's weights
  dequantized to float32 (the default before issue 31);
* ``from_pretrained only``: a bare Python process that imports transformers and loads the same
  folder with ``AutoModelForCausalLM.from_pretrained`` (the floor a worker's load cannot beat);
* ``worker, cold cache`` (once, first): the default worker with an empty conversion cache, so
  its start includes converting the GGUF file.

Peak resident memory is the process's ``VmHWM`` (Linux). Run::

    .venv/bin/python benchmarks/bench_worker_start.py                 # smollm2, 3 rounds
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from tokenfleet.shared.keys import Keys
from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures

PREFIX = "bench-start"
LOAD_ONLY = (
    "import sys, time; t = time.perf_counter(); "
    "from transformers import AutoModelForCausalLM, AutoTokenizer; "
    "AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
    "AutoTokenizer.from_pretrained(sys.argv[1]); "
    "print('loaded', flush=True); sys.stdin.read()"
)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_worker(
    model: str, url: str, cache: Path, name: str, quantization: str | None = None
) -> tuple[float, float]:
    """Seconds from spawn to heartbeat, and peak RSS in MiB, of one worker."""
    env = {**os.environ, "REDIS_URL": url, "TOKENFLEET_MODEL_CACHE": str(cache)}
    env["TOKENFLEET_KEY_PREFIX"] = PREFIX
    args = [sys.executable, "-m", "tokenfleet.worker.cli", "worker", "--model", model]
    args += ["--name", name, "--threads", "1", "--log-level", "WARNING"]
    args += ["--quantization", quantization] if quantization else []  # None: the default
    r = redis.Redis.from_url(url)
    started = time.perf_counter()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while not r.exists(Keys(PREFIX).worker(name)):
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise SystemExit(f"worker exited: {err}")
            time.sleep(0.01)
        elapsed = time.perf_counter() - started
        return elapsed, peak_rss_mib(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:  # a loaded host: its graceful stop is not measured
            proc.kill()
            proc.wait()
        r.close()


def load_only(folder: Path) -> tuple[float, float]:
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", LOAD_ONLY, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdout.readline()
    elapsed = time.perf_counter() - started
    rss = peak_rss_mib(proc.pid)
    proc.stdin.close()
    proc.wait(30)
    return elapsed, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="what the worker loads (smollm2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache start")
    add_record_flag(parser)
    args = parser.parse_args()
    from tokenfleet.worker.devtools.local_redis import RedisServer
    from tokenfleet.worker.models.gguf_cache import cache_root
    from tokenfleet.worker.models.resolve import resolve_model

    server = RedisServer(unix_socket=True, prefer="system").start()
    rows: dict[str, list[tuple[float, float]]] = {}
    try:
        if not args.no_cold:
            with tempfile.TemporaryDirectory() as cold:
                rows[COLD] = [start_worker(args.model, server.url, Path(cold), "cold")]
        warm = cache_root()
        folder = resolve_model(args.model, cache=warm)
        for i in range(args.rounds):
            sides = [WARM, WARM_NONE, "from_pretrained only"]
            for name in sides if i % 2 == 0 else sides[::-1]:
                if name == WARM:
                    result = start_worker(args.model, server.url, warm, f"w{i}")
                elif name == WARM_NONE:
                    result = start_worker(args.model, server.url, warm, f"f{i}", "none")
                else:
                    result = load_only(folder)
                rows.setdefault(name, []).append(result)
                took, peak = rows[name][-1]
                print(f"  round {i + 1} {name}: {took:.2f} s, {peak:.0f} MiB", flush=True)
    finally:
        server.stop()
    print(f"\nworker start, model {args.model} ({folder}), {args.rounds} rounds, 1 thread")
    print("| side | start s (median) | peak RSS MiB (median) |")
    print("|---|---:|---:|")
    for name, runs in rows.items():
        print(
            f"| {name} | {statistics.median(t for t, _ in runs):.2f} | "
            f"{statistics.median(m for _, m in runs):.0f} |"
        )
    if args.record:
        record_figures(
            {HEADLINE_KEYS[0]: headline(rows)}, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS
        )


HEADLINE_KEYS = ("worker-start",)  # its row in benchmarks/RESULTS.md
WARM, COLD = "worker, warm cache (default: --quantization auto)", "worker, cold cache (converts)"
WARM_NONE = "worker, warm cache, --quantization none"


def headline(rows: dict[str, list[tuple[float, float]]]) -> str:
    """The row's figure: the default worker's warm start (median s) and peak RSS (median GiB),
    the cold start; in brackets the same two with ``--quantization none``."""

    def start_and_rss(name: str) -> str:
        runs = rows[name]
        return (
            f"{statistics.median(t for t, _ in runs):.2f} s; "
            f"{statistics.median(m for _, m in runs) / 1024:.2f} GiB"
        )

    text = start_and_rss(WARM) + (f"; cold {rows[COLD][0][0]:.1f} s" if COLD in rows else "")
    return text + f" (none: {start_and_rss(WARM_NONE)})"


if __name__ == "__main__":
    main()
