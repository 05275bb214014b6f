"""What an open fleet console costs: the gateway's request rate and the worker's step time with
consoles open and updating, against none open, side by side in one run.

One private redis-server, one ``tokenfleet worker`` (``--threads 1``, the tiny Llama by default:
short steps, so any cost the console adds to Redis or the CPU shows the most) and one
``tokenfleet serve`` process (one uvicorn process, the console on, refreshed every
``--refresh-s``). This process keeps ``--concurrency`` non-streaming ``/v1/completions`` requests
of ``--max-tokens`` tokens in flight for ``--seconds`` per phase; in an ``open`` phase it also
holds ``--consoles`` console feeds (``GET /console/events``, read as a browser's EventSource
reads them: every table's HTML and the sparklines' data each period). Phases alternate
closed / open for ``--rounds`` rounds (the machine is shared: neighbours in time are the fair
comparison). Per phase: requests answered per second, and the worker's mean engine step time
(``tokenfleet:engine_step_seconds``' sum and count, read from its metrics endpoint before and
after), and the CPU the gateway process and the redis-server used (per cent of one core: the
console's own cost, visible even where the request rate is bound by the worker; measured first
on the idle fleet too, with no requests, where it is the console's alone); then, per
figure, the median over the rounds of each round's open ÷ closed (its two phases are neighbours
in time, the fair comparison on a machine whose load drifts), with the rounds' quartiles and
range and how many rounds came out above 1: on a loaded host, whether the median can be told
from 1 at all.

Run::

    .venv/bin/python benchmarks/bench_console.py --rounds 5       # about 6 minutes
    .venv/bin/python benchmarks/bench_console.py --consoles 10 --refresh-s 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx

from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures
from tokenfleet.worker.devtools.local_redis import RedisServer, free_port
from tokenfleet.worker.devtools.tiny_model import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway import start, wait  # (the same child processes, the same readiness polls)
from probes import cpu_s, redis_cpu_s, step_totals

# its rows in benchmarks/RESULTS.md
HEADLINE_KEYS = ("console-gateway-rate", "console-step-time", "console-gateway-cpu")


async def load(base: str, concurrency: int, max_tokens: int, until: float) -> int:
    """Requests answered (200) before ``until``, ``concurrency`` in flight."""
    done = 0

    async def one(http: httpx.AsyncClient, i: int) -> None:
        nonlocal done
        while time.monotonic() < until:
            body = {"model": "default", "prompt": f"count {i}", "max_tokens": max_tokens}
            answer = await http.post("/v1/completions", json=body)
            if answer.status_code == 200:
                done += 1

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as http:
        await asyncio.gather(*(one(http, i) for i in range(concurrency)))
    return done


def consoles(base: str, n: int, seconds: float, events: Any) -> None:
    """Hold ``n`` console feeds open for ``seconds``; put the events they received on
    ``events``. Run in a process of its own, as browsers are: reading the feeds costs the load
    generator nothing."""

    async def feeds() -> int:
        received = 0
        until = time.monotonic() + seconds

        async def feed() -> None:
            nonlocal received
            async with (
                httpx.AsyncClient(base_url=base, timeout=None) as http,
                http.stream("GET", "/console/events") as answer,
            ):
                async for line in answer.aiter_lines():
                    if line.startswith("event:"):
                        received += 1
                    if time.monotonic() >= until:
                        return

        await asyncio.gather(*(feed() for _ in range(n)))
        return received

    events.put(asyncio.run(feeds()))


def phase(args: argparse.Namespace, base: str, open_consoles: int, load_on: bool = True) -> Any:
    """One phase: (requests/s, console events received)."""
    events: Any = multiprocessing.Queue()
    feeds = multiprocessing.Process(
        target=consoles, args=(base, open_consoles, args.seconds, events), daemon=True
    )
    if open_consoles:
        feeds.start()
    started = time.monotonic()
    until = started + args.seconds
    done = asyncio.run(load(base, args.concurrency, args.max_tokens, until)) if load_on else 0
    if not load_on:
        time.sleep(max(0.0, until - time.monotonic()))
    elapsed = time.monotonic() - started
    received = 0
    if open_consoles:
        received = events.get(timeout=60)
        feeds.join(30)
    return done / elapsed, received


def main() -> int:  # noqa: PLR0915 (the benchmark's scenario, read top to bottom)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=20.0, help="per phase")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--consoles", type=int, default=3, help="feeds held open in an open phase")
    p.add_argument("--refresh-s", type=float, default=1.0, help="the console's period")
    add_record_flag(p)
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-console-"))
    model = make_tiny_model(tmp / "tiny", flavour="llama", seed=0)
    gateway_port, metrics_port = free_port(), free_port()
    with RedisServer(prefer="system") as server:
        env = {"REDIS_URL": server.url, "TOKENFLEET_KEY_PREFIX": "benchc"}
        cli = [sys.executable, "-m", "tokenfleet.worker.cli"]
        worker = start(
            [
                *cli,
                "worker",
                "--model",
                str(model),
                "--name",
                "bench-w",
                "--threads",
                "1",
                "--max-num-seqs",
                "16",
                "--metrics-port",
                str(metrics_port),
            ],
            env,
            tmp / "worker.log",
        )
        gateway = start(
            [*cli, "serve", "--port", str(gateway_port), "--log-level", "warning"],
            {**env, "TOKENFLEET_GATEWAY_CONSOLE_REFRESH_S": str(args.refresh_s)},
            tmp / "gateway.log",
        )
        base = f"http://127.0.0.1:{gateway_port}"
        try:
            wait(lambda: _ok(base + "/health"), "the gateway")
            wait(lambda: _ok(f"http://127.0.0.1:{metrics_port}/metrics"), "the worker")
            phase(argparse.Namespace(**{**vars(args), "seconds": 5.0}), base, 0)  # warm up
            rows: dict[str, list[tuple[float, float, float, float]]] = {"closed": [], "open": []}
            print(
                f"tiny Llama, worker --threads 1 --max-num-seqs 16, one gateway process; "
                f"{args.concurrency} requests of {args.max_tokens} tokens in flight, "
                f"{args.seconds:g} s per phase; open: {args.consoles} console feeds, refresh "
                f"{args.refresh_s:g} s; os.cpu_count()={os.cpu_count()}"
            )
            print(
                f"{'round':>5} {'console':>7} {'req/s':>8} {'step ms':>8} {'gw cpu%':>8} "
                f"{'redis cpu%':>10} {'events':>7}"
            )
            idle: dict[str, list[tuple[float, float]]] = {"closed": [], "open": []}  # no requests
            for r in range(2):
                for name in ("closed", "open") if r == 0 else ("open", "closed"):
                    at = (cpu_s(gateway.pid), redis_cpu_s(server.url), time.monotonic())
                    phase(args, base, args.consoles if name == "open" else 0, load_on=False)
                    wall = time.monotonic() - at[2]
                    idle[name].append(
                        (
                            100 * (cpu_s(gateway.pid) - at[0]) / wall,
                            100 * (redis_cpu_s(server.url) - at[1]) / wall,
                        )
                    )
            for name, got in idle.items():
                gw, rd = (statistics.mean(x[i] for x in got) for i in (0, 1))
                print(
                    f"  idle fleet, consoles {name:>6}: gateway CPU {gw:5.1f} %, redis {rd:4.1f} %"
                )
            for r in range(args.rounds):
                order = ("closed", "open") if r % 2 == 0 else ("open", "closed")
                for name in order:
                    before = step_totals(metrics_port)
                    at = (cpu_s(gateway.pid), redis_cpu_s(server.url), time.monotonic())
                    rate, events = phase(args, base, args.consoles if name == "open" else 0)
                    wall = time.monotonic() - at[2]
                    gw_cpu = 100 * (cpu_s(gateway.pid) - at[0]) / wall
                    redis_cpu = 100 * (redis_cpu_s(server.url) - at[1]) / wall
                    after = step_totals(metrics_port)
                    steps = after[1] - before[1]
                    step_ms = 1000 * (after[0] - before[0]) / steps if steps else float("nan")
                    rows[name].append((rate, step_ms, gw_cpu, redis_cpu))
                    print(
                        f"{r:>5} {name:>7} {rate:>8.1f} {step_ms:>8.2f} {gw_cpu:>8.1f} "
                        f"{redis_cpu:>10.1f} {events:>7}"
                    )
            # each round's two phases are neighbours in time: their ratio is the fair figure on a
            # machine whose load drifts (the medians of each side are shown for scale)
            pairs = list(zip(rows["open"], rows["closed"], strict=True))
            whats = ("req/s", "step ms", "gateway CPU %", "redis CPU %")
            per_round = {what: [o[i] / c[i] for o, c in pairs] for i, what in enumerate(whats)}
            ratios = {what: statistics.median(r) for what, r in per_round.items()}
            spread = {what: quartiles(r) for what, r in per_round.items()}
            for i, what in enumerate(whats):
                closed = statistics.median(x[i] for x in rows["closed"])
                opened = statistics.median(x[i] for x in rows["open"])
                q1, q3 = spread[what]
                above = sum(r > 1 for r in per_round[what])
                print(
                    f"{what:>14}: median closed {closed:.2f}, open {opened:.2f}; "
                    f"open/closed, median of the rounds' pairs {ratios[what]:.3f} "
                    f"(quartiles {q1:.3f}-{q3:.3f}, range {min(per_round[what]):.2f}-"
                    f"{max(per_round[what]):.2f}; {above} of {len(pairs)} rounds above 1)"
                )
            if args.record:  # its rows in benchmarks/RESULTS.md
                gw_open = statistics.mean(x[0] for x in idle["open"])
                gw_closed = statistics.mean(x[0] for x in idle["closed"])
                figures = {
                    "console-gateway-rate": _with_spread(ratios["req/s"], spread["req/s"]),
                    "console-step-time": _with_spread(ratios["step ms"], spread["step ms"]),
                    "console-gateway-cpu": f"{gw_open:.1f} % open, {gw_closed:.1f} % closed",
                }
                record_figures(figures, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS)
        finally:
            for proc in (gateway, worker):
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return 0


def quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values`` (the two ends of the middle half; with one
    value, that value twice)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def _with_spread(median: float, spread: tuple[float, float]) -> str:
    return f"{median:.3f} (rounds' quartiles {spread[0]:.2f}–{spread[1]:.2f})"


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as got:
            return bool(got.status == 200)
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
