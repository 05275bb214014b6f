"""`n` = 4 against four separate requests: prompt tokens prefilled and time, side by side.

A real ``tokenfleet serve`` and a real worker on SmolLM2, twice over: one fleet as shipped
(``share_prefill`` on: a prompt whose blocks a running prefill computes waits and reads them
from the prefix cache) and one started with ``--no-share-prefill`` (each request computes its
own prompt, as before). On each fleet, each round sends one chat request with ``n`` = 4 and,
separately, four requests at once with the same prompt (seeds s .. s+3) — a long system prompt
(about 400 tokens) made unique per round and side so nothing is cached from before. Prompt
tokens prefilled = the worker's ``tokenfleet:prompt_tokens`` minus
``tokenfleet:prefix_cache_hit_tokens`` over the side (its Prometheus metrics); time = the
answer's wall time (all four choices whole, non-streaming). The order of the sides alternates
per round; the medians are printed.

``--engine``: the same four requests added at once to an in-process engine (no Redis, no
HTTP), with a prompt ``--engine-repeat`` times longer, so its prefill spans several steps of
``max_num_batched_tokens`` (512): ``share_prefill`` on against off, prefilled tokens and time.
Through a fleet the four usually reach the engine a step or more apart (intake, prompt
rendering), so a prompt prefilled in one step is shared by the plain prefix cache already; a
longer one is where the wait-and-share rule counts.

    .venv/bin/python benchmarks/bench_n.py --rounds 5
    .venv/bin/python benchmarks/bench_n.py --engine --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures
from tokenfleet.worker.devtools.local_fleet import LocalFleet
from tokenfleet.worker.devtools.local_redis import RedisServer, free_port

HEADLINE_KEYS = ("n4-fleet", "n4-engine")  # its rows in benchmarks/RESULTS.md
N4_KEYS = dict(zip(("fleet", "engine"), HEADLINE_KEYS, strict=True))
SYSTEM = (
    "You are the assistant of a harbour office. Ships arrive and leave every hour; each has a "
    "name, a flag, a length in metres, a cargo and a berth. You answer questions about the "
    "schedule, the tides, the berths, the rules for dangerous cargo, the pilots on duty and "
    "the weather at sea. Be brief and precise, give times in 24-hour format, and never invent "
    "a ship that is not on the list. "
) * 4
QUESTION = "Write a two-line welcome note for the crew of a ship arriving tonight."
_METRIC = re.compile(r"^(tokenfleet:[a-z_]+)_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def metrics(port: int) -> dict[str, float]:
    """The worker's counters (``_total`` series) by name."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {name: float(value) for name, value in _METRIC.findall(text)}


def prefilled(before: dict[str, float], after: dict[str, float]) -> tuple[int, int]:
    """(prompt tokens of finished requests, of which prefilled) between two readings."""
    prompt = after.get("tokenfleet:prompt_tokens", 0) - before.get("tokenfleet:prompt_tokens", 0)
    hits = after.get("tokenfleet:prefix_cache_hit_tokens", 0) - before.get(
        "tokenfleet:prefix_cache_hit_tokens", 0
    )
    return int(prompt), int(prompt - hits)


class Side:
    """One fleet (worker + gateway) under a key prefix of its own."""

    def __init__(self, name: str, url: str, metrics_port: int) -> None:
        self.name, self.url, self.metrics_port = name, url, metrics_port

    async def run(self, client: httpx.AsyncClient, mode: str, tag: str, max_tokens: int) -> Any:
        body: dict[str, Any] = {
            "model": "default",
            "messages": [
                {"role": "system", "content": f"[{tag}] {SYSTEM}"},
                {"role": "user", "content": QUESTION},
            ],
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": 11,
        }
        before = metrics(self.metrics_port)
        start = time.perf_counter()
        if mode == "n4":
            r = await client.post(f"{self.url}/v1/chat/completions", json={**body, "n": 4})
            r.raise_for_status()
            usage = r.json()["usage"]
            prompt_tokens = usage["prompt_tokens"]
        else:
            rs = await asyncio.gather(
                *(
                    client.post(f"{self.url}/v1/chat/completions", json={**body, "seed": 11 + i})
                    for i in range(4)
                )
            )
            for r in rs:
                r.raise_for_status()
            prompt_tokens = rs[0].json()["usage"]["prompt_tokens"]
        elapsed = time.perf_counter() - start
        deadline = time.monotonic() + 30  # the counters move as each request's end publishes
        while (counted := prefilled(before, metrics(self.metrics_port)))[0] < 4 * prompt_tokens:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker counted {counted[0]} of {4 * prompt_tokens}")
            await asyncio.sleep(0.05)
        return elapsed, counted[1], prompt_tokens


def start_side(
    name: str, redis_url: str, tmp: Path, threads: int, extra: list[str]
) -> tuple[Side, LocalFleet, subprocess.Popen[bytes]]:
    prefix = f"benchn{name}{uuid.uuid4().hex[:4]}"
    mport = free_port()
    fleet = LocalFleet(
        "smollm2",
        redis_url,
        key_prefix=prefix,
        num_workers=1,
        threads=threads,
        extra_args=["--metrics-port", str(mport), *extra],
    ).start(300)
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_url, "TOKENFLEET_KEY_PREFIX": prefix}
    with open(tmp / f"gw-{name}.log", "wb") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet.worker.cli", "serve", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).json()["data"]:
                break
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline or gateway.poll() is not None:
            raise RuntimeError((tmp / f"gw-{name}.log").read_text()[-2000:])
        time.sleep(0.2)
    return Side(name, url, mport), fleet, gateway


async def measure(sides: list[Side], rounds: int, max_tokens: int) -> dict[str, str]:
    results: dict[tuple[str, str], list[tuple[float, int]]] = {}
    prompt = 0
    async with httpx.AsyncClient(timeout=600) as client:
        for side in sides:  # warm-up (the model's first forward passes), not counted
            await side.run(client, "n4", f"warm-{side.name}", 4)
        for r in range(rounds):
            order = [(s, m) for s in sides for m in ("n4", "four")]
            if r % 2:
                order.reverse()
            for side, mode in order:
                elapsed, filled, prompt = await side.run(
                    client, mode, f"{r}-{side.name}-{mode}-{uuid.uuid4().hex[:6]}", max_tokens
                )
                results.setdefault((side.name, mode), []).append((elapsed, filled))
                print(f"round {r} {side.name:>8} {mode:>4}: {elapsed:6.2f} s, {filled} prefilled")
    print(f"\nprompt: {prompt} tokens; 4 answers of {max_tokens} tokens; median of {rounds} rounds")
    print(f"{'fleet':>9} {'request':>14} {'prefilled':>10} {'time s':>8}")
    medians = {}
    for (name, mode), rows in results.items():
        label = "n = 4" if mode == "n4" else "4 separate"
        t = statistics.median(e for e, _ in rows)
        f = statistics.median(p for _, p in rows)
        medians[(name, mode)] = (f, t)
        print(f"{name:>9} {label:>14} {f:>10.0f} {t:>8.2f}")
    (fn, tn), (ff, tf) = medians[("shared", "n4")], medians[("shared", "four")]
    return {N4_KEYS["fleet"]: f"{fn:.0f} against {ff:.0f}; {tn:.2f} against {tf:.2f} s"}


def engine_rounds(rounds: int, threads: int, max_tokens: int, repeat: int) -> dict[str, str]:
    """The ``--engine`` measurement (module doc)."""
    import torch

    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.engine.request import SamplingParams
    from tokenfleet.worker.models.resolve import resolve_model

    torch.set_num_threads(threads)
    root = Path(__file__).resolve().parents[1]
    model = resolve_model("smollm2", cache=root / ".cache" / "models")
    engines = {
        share: Engine(model, num_kv_blocks=2048, max_num_batched_tokens=512, share_prefill=share)
        for share in (True, False)
    }
    tok = engines[True].tokenizer
    results: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    num_prompt = 0
    for r in range(-1, rounds):  # round -1: warm-up
        for share in (True, False) if r % 2 else (False, True):
            engine = engines[share]
            messages = [
                {
                    "role": "system",
                    "content": f"[{r}-{share}-{uuid.uuid4().hex}] {SYSTEM * repeat}",
                },
                {"role": "user", "content": QUESTION},
            ]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
            num_prompt = len(ids)
            start = time.perf_counter()
            for i in range(4):
                params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=11 + i)
                engine.add_request(f"r{r}-{share}-{i}", ids, params)
            hits = 0
            while engine.has_unfinished():
                engine.step()
                hits += engine.last_step_stats.num_prefix_cache_hit_tokens
            elapsed = time.perf_counter() - start
            if r >= 0:
                results[share].append((elapsed, 4 * num_prompt - hits))
                print(
                    f"round {r} share_prefill={share!s:>5}: {elapsed:6.2f} s, "
                    f"{4 * num_prompt - hits} prefilled"
                )
    print(
        f"\nin-process engine, torch threads {threads}; prompt {num_prompt} tokens; "
        f"4 requests of {max_tokens} tokens added at once; median of {rounds} rounds"
    )
    medians = {}
    for share, rows in results.items():
        t = statistics.median(e for e, _ in rows)
        f = statistics.median(p for _, p in rows)
        medians[share] = (f, t)
        print(f"share_prefill={share!s:>5}: {f:.0f} prompt tokens prefilled, {t:.2f} s")
    (fo, to), (ff, tf) = medians[True], medians[False]
    return {N4_KEYS["engine"]: f"{fo:.0f} against {ff:.0f}; {to:.2f} against {tf:.2f} s"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each worker")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--engine", action="store_true", help="in-process engine only (doc)")
    ap.add_argument("--engine-repeat", type=int, default=4, help="the prompt, this many times")
    add_record_flag(ap)
    args = ap.parse_args()
    if args.engine:
        figures = engine_rounds(args.rounds, args.threads, args.max_tokens, args.engine_repeat)
        if args.record:
            record_figures(figures, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS)
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-n-"))
    print(f"worker torch threads {args.threads}; SmolLM2-135M-Instruct; one worker per fleet")
    with RedisServer() as server:
        started = []
        try:
            for name, extra in (("shared", []), ("unshared", ["--no-share-prefill"])):
                started.append(start_side(name, server.url, tmp, args.threads, extra))
            figures = asyncio.run(measure([s for s, _, _ in started], args.rounds, args.max_tokens))
            if args.record:
                record_figures(figures, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS)
        finally:
            for _, fleet, gateway in started:
                gateway.terminate()
                gateway.wait(60)
                fleet.stop()


if __name__ == "__main__":
    main()
