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
console's own cost, visible even where the request rate is bound by the worker); then the
medians and the ratios open ÷ closed.

Run::

    .venv/bin/python benchmarks/bench_console.py --rounds 5       # about 6 minutes
    .venv/bin/python benchmarks/bench_console.py --consoles 10 --refresh-s 0.5
"""

from __future__ import annotations

import argparse
import asyncio
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
import redis
from prometheus_client.parser import text_string_to_metric_families

from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures
from tokenfleet.worker.devtools.local_redis import RedisServer, free_port
from tokenfleet.worker.devtools.tiny_model import make_tiny_model


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(args, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)


def wait(check, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_cpu_s(url: str) -> float:
    """CPU seconds the redis-server has used so far (INFO cpu)."""
    r = redis.Redis.from_url(url)
    try:
        info: Any = r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    finally:
        r.close()


def step_totals(port: int) -> tuple[float, float]:
    """(sum, count) of the worker's engine step histogram."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as got:
        text = got.read().decode()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "tokenfleet:engine_step_seconds":
            for s in family.samples:
                if s.name.endswith("_sum"):
                    total += s.value
                elif s.name.endswith("_count"):
                    count += s.value
    return total, count


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


async def consoles(base: str, n: int, until: float) -> int:
    """Hold ``n`` console feeds open until ``until``; the events they received."""
    received = 0

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


async def phase(args: argparse.Namespace, base: str, open_consoles: int) -> tuple[float, int]:
    until = time.monotonic() + args.seconds
    tasks = [load(base, args.concurrency, args.max_tokens, until)]
    if open_consoles:
        tasks.append(consoles(base, open_consoles, until))
    started = time.monotonic()
    results = await asyncio.gather(*tasks)
    elapsed = time.monotonic() - started
    return results[0] / elapsed, results[1] if open_consoles else 0


def main() -> int:
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
            asyncio.run(phase(argparse.Namespace(**{**vars(args), "seconds": 5.0}), base, 0))
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
            for r in range(args.rounds):
                order = ("closed", "open") if r % 2 == 0 else ("open", "closed")
                for name in order:
                    before = step_totals(metrics_port)
                    cpu = (cpu_s(gateway.pid), redis_cpu_s(server.url), time.monotonic())
                    rate, events = asyncio.run(
                        phase(args, base, args.consoles if name == "open" else 0)
                    )
                    wall = time.monotonic() - cpu[2]
                    gw_cpu = 100 * (cpu_s(gateway.pid) - cpu[0]) / wall
                    redis_cpu = 100 * (redis_cpu_s(server.url) - cpu[1]) / wall
                    after = step_totals(metrics_port)
                    steps = after[1] - before[1]
                    step_ms = 1000 * (after[0] - before[0]) / steps if steps else float("nan")
                    rows[name].append((rate, step_ms, gw_cpu, redis_cpu))
                    print(
                        f"{r:>5} {name:>7} {rate:>8.1f} {step_ms:>8.2f} {gw_cpu:>8.1f} "
                        f"{redis_cpu:>10.1f} {events:>7}"
                    )
            closed_rate = statistics.median(x[0] for x in rows["closed"])
            open_rate = statistics.median(x[0] for x in rows["open"])
            closed_step = statistics.median(x[1] for x in rows["closed"])
            open_step = statistics.median(x[1] for x in rows["open"])
            print(
                f"median req/s: closed {closed_rate:.1f}, open {open_rate:.1f} "
                f"(open/closed {open_rate / closed_rate:.3f})"
            )
            print(
                f"median step ms: closed {closed_step:.2f}, open {open_step:.2f} "
                f"(open/closed {open_step / closed_step:.3f})"
            )
            cpu: dict[str, tuple[float, float]] = {}
            for i, what in ((2, "gateway CPU %"), (3, "redis CPU %")):
                closed = statistics.median(x[i] for x in rows["closed"])
                opened = statistics.median(x[i] for x in rows["open"])
                cpu[what] = (closed, opened)
                print(f"median {what}: closed {closed:.1f}, open {opened:.1f}")
            if args.record:  # its rows in benchmarks/RESULTS.md
                figures = {
                    "console-gateway-rate": f"{open_rate / closed_rate:.3f}",
                    "console-step-time": f"{open_step / closed_step:.3f}",
                    "console-gateway-cpu": "{:.1f} % open, {:.1f} % closed".format(
                        cpu["gateway CPU %"][1], cpu["gateway CPU %"][0]
                    ),
                }
                record_figures(figures, benchmarks=Path(__file__).parent)
        finally:
            for proc in (gateway, worker):
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return 0


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as got:
            return bool(got.status == 200)
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
