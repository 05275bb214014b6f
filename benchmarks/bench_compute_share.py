"""Compute share benchmark (issue 6, item 5): co-located members split one device by weight.

Real processes on a real shared device: every member is its own process running a real engine
(the tiny Llama, one torch thread) behind ``PoolLink``, all pinned to the same CPU core, so the
OS time-slices the core between them the way a GPU time-slices between processes. Each member is
flooded (its engine always holds ``--seqs`` requests) and counts the tokens it computes during the
measured window. Runs, side by side in one invocation:

1. ``alone``: one member on the core, for reference.
2. ``no share``: two members (weights 1 and 3) in a pool without a token budget: the core splits
   evenly whatever the weights. Their total rate is what the device achieves with both on it,
   and calibrates the pool's ``--token-budget`` (that rate per round, times ``--budget-factor``),
   as an operator would set it.
3. ``share``: the same two in a pool with that token budget: each paces to its share.

Reported: each member's tokens/s, the heavy ÷ light ratio (the weights say 3), and the pair's
total ÷ the unshared pair's (what pacing costs in throughput).

Run: ``.venv/bin/python benchmarks/bench_compute_share.py`` (appends a section to
``benchmarks/HISTORY.md``; ``--no-write`` only prints; ``--record`` also writes the headline
figure into ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures, run_command

HISTORY = Path(__file__).with_name("HISTORY.md")
HEADLINE_KEYS = ("compute-share",)  # its row in benchmarks/RESULTS.md
BLOCK_SIZE = 16


def member_main(
    url: str,
    model_dir: str,
    name: str,
    weight: float,
    args: dict[str, Any],
    start_at: float,
    results: Any,
) -> None:
    """One member: pin to the shared core, flood the engine, step until the window ends."""
    import redis
    import torch

    from tokenfleet.shared.keys import Keys
    from tokenfleet.shared.priority import Priority
    from tokenfleet.worker.engine.engine import Engine, EngineConfig
    from tokenfleet.worker.engine.request import SamplingParams
    from tokenfleet.worker.pool.link import PoolLink
    from tokenfleet.worker.pool.member import KVPoolMember

    os.sched_setaffinity(0, {args["core"]})
    torch.set_num_threads(1)
    seqs = args["seqs"]
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_kv_blocks=seqs * 8,
        max_num_seqs=seqs,
        max_num_batched_tokens=args["max_batched_tokens"],
        device="cpu",
        max_wait_s=None,
        seed=0,
    )
    engine = Engine(model_dir, config)
    params = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
    client = redis.Redis.from_url(url)
    link = None
    if args["pool"]:
        member = KVPoolMember(
            client=client, keys=Keys("bench"), pool="dev", member=name, weight=weight
        )
        link = PoolLink(engine.pool_port(), member)
        link.join(block_size=BLOCK_SIZE)
    prompt = "the shared device computes tokens for every member of the pool " * 2
    added = 0

    def top_up() -> None:
        nonlocal added
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < seqs:
            engine.add_request(
                f"{name}-{added}", f"{added} {prompt}", params, priority=Priority.BATCH
            )
            added += 1

    top_up()
    warm_until, end_at = start_at + args["warmup"], start_at + args["warmup"] + args["seconds"]
    while time.time() < start_at:  # the warm-up compiles nothing, but loads pages and caches
        time.sleep(0.005)
    tokens = 0
    while True:
        now = time.time()
        if now >= end_at:
            break
        if link is not None:
            link.before_step()
        engine.step()
        if time.time() >= warm_until and time.time() < end_at:
            tokens += engine.last_step_stats.num_tokens
        if link is not None:
            link.step_now()
        top_up()
    waited = link.compute.waited_s if link is not None and link.compute is not None else 0.0
    if link is not None:
        link.leave()
    client.close()
    results.put((name, tokens / args["seconds"], waited))


def run(
    url: str, model_dir: str, members: list[tuple[str, float]], args: dict[str, Any]
) -> dict[str, tuple[float, float]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    start_at = time.time() + args["startup"]
    procs = [
        ctx.Process(target=member_main, args=(url, model_dir, n, w, args, start_at, results))
        for n, w in members
    ]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        name, rate, waited = results.get(
            timeout=args["startup"] + args["warmup"] + args["seconds"] + 120
        )
        out[name] = (rate, waited)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a member exited with {p.exitcode}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds left out at the start")
    parser.add_argument("--startup", type=float, default=8.0, help="seconds to load the models")
    parser.add_argument("--seqs", type=int, default=16, help="requests each engine holds")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=128)
    parser.add_argument("--round-ms", type=int, default=100)
    parser.add_argument(
        "--budget-factor",
        type=float,
        default=1.0,
        help="token budget = the unshared pair's tokens per round times this",
    )
    parser.add_argument("--core", type=int, default=0, help="the CPU core every member shares")
    parser.add_argument("--no-write", action="store_true", help="print only")
    add_record_flag(parser)
    a = parser.parse_args()
    args = {
        k: getattr(a, k)
        for k in (
            "seconds",
            "warmup",
            "startup",
            "seqs",
            "max_tokens",
            "max_batched_tokens",
            "core",
        )
    }

    import redis

    from tokenfleet.shared.keys import Keys
    from tokenfleet.worker.devtools.local_redis import RedisServer
    from tokenfleet.worker.devtools.tiny_model import make_tiny_model
    from tokenfleet.worker.pool.admin import create_pool
    from tokenfleet.worker.pool.config import PoolConfig

    pair = [("light", 1.0), ("heavy", 3.0)]
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server:
        model_dir = str(make_tiny_model(Path(tmp) / "tiny-llama"))
        client = redis.Redis.from_url(server.url)
        print("alone ...", flush=True)
        alone = run(server.url, model_dir, [("alone", 1.0)], {**args, "pool": False})
        rate = alone["alone"][0]
        blocks = 4 * a.seqs * 8  # plenty: only compute is shared

        print("no share ...", flush=True)
        create_pool(
            client,
            Keys("bench"),
            "dev",
            PoolConfig(total_blocks=blocks, block_size=BLOCK_SIZE, cap_permille=1000),
        )
        unshared = run(server.url, model_dir, pair, {**args, "pool": True})
        client.flushdb()
        pair_rate = unshared["light"][0] + unshared["heavy"][0]
        if pair_rate <= 0 or rate <= 0:
            # A window shorter than one engine step measures nothing: say so, not ZeroDivisionError.
            raise SystemExit(
                f"bench_compute_share: no tokens in a {a.seconds} s window (alone {rate:.0f}, "
                f"pair {pair_rate:.0f} tokens/s); run longer windows (--seconds)"
            )
        budget = max(1, round(pair_rate * a.round_ms / 1000 * a.budget_factor))
        print(f"pair: {pair_rate:.0f} tokens/s -> {budget} tokens per {a.round_ms} ms", flush=True)

        print("share ...", flush=True)
        create_pool(
            client,
            Keys("bench"),
            "dev",
            PoolConfig(
                total_blocks=blocks,
                block_size=BLOCK_SIZE,
                cap_permille=1000,
                token_budget=budget,
                round_ms=a.round_ms,
            ),
        )
        shared = run(server.url, model_dir, pair, {**args, "pool": True})
        client.close()

    command = run_command(sys.argv)  # the HISTORY section's, as the headline row's
    lines = [
        f"## Compute share: two members on one CPU core ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{command}` ({platform.machine()}, {os.cpu_count()} cores; every member "
        f"pinned to core {a.core}, one torch thread; {a.seqs} requests per engine, "
        f"{a.max_tokens} tokens each; measured {a.seconds:g} s after {a.warmup:g} s warm-up).",
        f"Lone member: {rate:.0f} tokens/s; the unshared pair: {pair_rate:.0f} tokens/s, so the "
        f"pool's budget is {budget} tokens per {a.round_ms} ms round"
        + (f" (x {a.budget_factor:g})." if a.budget_factor != 1.0 else "."),
        "",
        "| run | light (w=1) tokens/s | heavy (w=3) tokens/s | heavy ÷ light (weights: 3) "
        "| pair ÷ unshared pair |",
        "|---|---|---|---|---|",
    ]
    for label, res in (("no share", unshared), ("share", shared)):
        light, heavy = res["light"][0], res["heavy"][0]
        lines.append(
            f"| {label} | {light:.0f} | {heavy:.0f} | {heavy / max(light, 1e-9):.2f} "
            f"| {(light + heavy) / pair_rate:.2f} |"
        )
    lines += [
        "",
        f"Time spent pacing (share run): light {shared['light'][1]:.1f} s, heavy "
        f"{shared['heavy'][1]:.1f} s of {a.seconds + a.warmup:g} s.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not a.no_write:
        with HISTORY.open("a") as f:
            f.write("\n" + text)
    if a.record:
        light, heavy = shared["light"][0], shared["heavy"][0]
        figure = f"{heavy / max(light, 1e-9):.2f} ({(light + heavy) / pair_rate:.2f})"
        record_figures(
            {HEADLINE_KEYS[0]: figure}, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
