"""A batch through the Batch API against the same requests through ``submit_many``, and
interactive TTFT while a batch runs, side by side on one fleet in one run.

One private redis-server and one ``tokenfleet worker --threads 1`` started by ``LocalFleet``
(SmolLM2-135M-Instruct by default). Sides, alternating which goes first each round:

* ``submit_many``: the batch's lines as requests at priority ``batch``, all at once, then every
  result awaited; lines/s = lines / wall time.
* ``batch``: ``submit_batch`` (upload + create) then ``wait()``, which drives it with an
  in-process runner (a window of lines in the queue at a time); lines/s the same way.

Then TTFT of interactive requests (priority ``normal``, one at a time, ``--ttft-requests``):
on the idle fleet, and while a batch of the same size runs; p50 of each and the ratio.

The same batch side and TTFT also run, in the same rounds, on a second worker (a key prefix of
its own, idle while the first works) started with ``--no-batch-yield``: what
yielding to interactive work costs the batch, and what it buys the interactive requests.

    .venv/bin/python benchmarks/bench_batches.py                       # SmolLM2, 1,000 lines
    .venv/bin/python benchmarks/bench_batches.py --model tiny --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis
import redis.asyncio

from tokenfleet.producer import AsyncClient
from tokenfleet.producer.gateway.batches.handle import submit_batch
from tokenfleet.shared.redis_connect import async_redis_client
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures
from tokenfleet.worker.devtools.local_fleet import LocalFleet
from tokenfleet.worker.devtools.local_redis import RedisServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import percentile

HEADLINE_KEYS = ("batch-throughput", "batch-ttft")  # its rows in benchmarks/RESULTS.md

TOPICS = ["Redis", "queues", "batching", "caches", "streams", "workers", "GPUs", "tokens"]


def lines(n: int, max_tokens: int) -> list[dict]:
    return [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "default",
                "messages": [{"role": "user", "content": f"One fact about {TOPICS[i % 8]} #{i}."}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i in range(n)
    ]


async def via_submit_many(client: AsyncClient, batch: list[dict]) -> float:
    t0 = time.perf_counter()
    reqs = [{**line["body"], "priority": "batch"} for line in batch]
    handles = await client.submit_many(reqs)
    for h in handles:
        assert not isinstance(h, Exception), h
    await asyncio.gather(*(h.result() for h in handles))  # type: ignore[union-attr]
    return len(batch) / (time.perf_counter() - t0)


async def via_batch(client: AsyncClient, r: redis.asyncio.Redis, batch: list[dict]) -> float:
    t0 = time.perf_counter()
    handle = await submit_batch(client, r, batch)
    final = await handle.wait(poll_s=0.1)
    assert final.status == "completed" and final.completed == len(batch), final
    return len(batch) / (time.perf_counter() - t0)


async def ttft(client: AsyncClient, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        h = await client.submit(f"Quick question {i}: what is Redis?", max_tokens=2, temperature=0)
        async for _ in h.stream():
            out.append((time.perf_counter() - t0) * 1000)
            break
        h.close()
        await h.result()
    return out


async def ttft_during_batch(
    client: AsyncClient, r: redis.asyncio.Redis, batch: list[dict], n: int
) -> tuple[list[float], list[float]]:
    """TTFTs on the idle fleet, then while ``batch`` runs (cancelled afterwards)."""
    idle = await ttft(client, n)
    handle = await submit_batch(client, r, batch)
    runner = asyncio.get_running_loop().create_task(handle.wait(poll_s=0.2))
    while (await handle.status()).completed < 8:  # the batch is running
        await asyncio.sleep(0.05)
    busy = await ttft(client, n)
    await handle.cancel()
    await runner
    return idle, busy


async def measure(args: argparse.Namespace, url: str, prefixes: dict[str, str]) -> dict[str, str]:
    r = async_redis_client(Settings(redis_url=url))  # the pool size tokenfleet processes use
    clients = {
        name: AsyncClient(r, settings=Settings(redis_url=url, key_prefix=prefix))
        for name, prefix in prefixes.items()
    }
    batch = lines(args.lines, args.max_tokens)
    rates: dict[str, list[float]] = {"submit_many": [], "batch": [], "batch, no yield": []}
    sides = list(rates) if "plain" in clients else ["submit_many", "batch"]
    for rnd in range(args.rounds):
        for side in sides if rnd % 2 == 0 else sides[::-1]:
            client = clients["plain" if side == "batch, no yield" else "yield"]
            rate = await (
                via_submit_many(client, batch)
                if side == "submit_many"
                else via_batch(client, r, batch)
            )
            rates[side].append(rate)
        print(
            f"round {rnd + 1}: lines/s " + ", ".join(f"{s} {rates[s][-1]:.1f}" for s in sides),
            flush=True,
        )
    ttfts = {
        name: await ttft_during_batch(client, r, batch, args.ttft_requests)
        for name, client in clients.items()
    }
    for client in clients.values():
        await client.aclose()
    await r.aclose()
    ratios = [b / s for b, s in zip(rates["batch"], rates["submit_many"], strict=True)]
    print()
    print(f"model {args.model}; {args.lines} lines of {args.max_tokens} tokens; worker 1 thread")
    for side in sides:
        print(f"{'lines/s ' + side + ' (median)':<50}{statistics.median(rates[side]):>10.1f}")
    print(
        f"{'batch ÷ submit_many (per round)':<50}{statistics.median(ratios):>10.3f}  "
        + " ".join(f"{x:.3f}" for x in ratios)
    )
    if "plain" in clients:
        cost = [y / n for y, n in zip(rates["batch"], rates["batch, no yield"], strict=True)]
        print(
            f"{'batch ÷ batch with no yield (per round)':<50}{statistics.median(cost):>10.3f}  "
            + " ".join(f"{x:.3f}" for x in cost)
        )
    for name, (idle, busy) in ttfts.items():
        p_idle, p_busy = percentile(idle, 50), percentile(busy, 50)
        label = "interactive TTFT p50 idle / in batch" + ("" if name == "yield" else ", no yield")
        print(f"{label:<50}{p_idle:>10.1f}{p_busy:>10.1f} ms  ratio {p_busy / p_idle:.2f}")
    idle, busy = ttfts["yield"]  # the worker as shipped: the headline rows (RESULTS.md)
    return {
        "batch-throughput": f"{statistics.median(ratios):.3f}",
        "batch-ttft": f"{percentile(busy, 50) / percentile(idle, 50):.2f}×",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ttft-requests", type=int, default=20)
    parser.add_argument(
        "--no-compare", action="store_true", help="skip the worker with --no-batch-yield"
    )
    add_record_flag(parser)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-batches-"))
    model = args.model
    if model == "tiny":
        from tokenfleet.worker.devtools.tiny_model import make_tiny_model

        model = str(make_tiny_model(tmp / "tiny"))
    run = uuid.uuid4().hex[:6]
    prefixes = {"yield": f"benchb{run}"}
    worker_args = {"yield": [], "plain": ["--no-batch-yield"]}
    if not args.no_compare:
        prefixes["plain"] = f"benchp{run}"
    with RedisServer() as server:
        fleets = []
        try:
            for name, prefix in prefixes.items():
                fleet = LocalFleet(
                    model,
                    server.url,
                    key_prefix=prefix,
                    num_workers=1,
                    extra_args=worker_args[name],
                )
                fleets.append(fleet.start(300))
            figures = asyncio.run(measure(args, server.url, prefixes))
        finally:
            for fleet in fleets:
                fleet.stop()
    if args.record:
        record_figures(figures, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS)


if __name__ == "__main__":
    main()
