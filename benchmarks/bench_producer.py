"""Producer benchmark: submit latency, and submit_many throughput against raw pipelined XADD.

Starts its own redis-server on a loopback TCP port (persistence off), so both sides of the ratio
run against the same server in the same run::

    .venv/bin/python benchmarks/bench_producer.py [--latency-n 2000] [--bulk-n 20000]

``submit`` latency covers validation, encoding, the enqueue script (dedupe, bound check, XADD,
record) and sending the SUBSCRIBE on the shared pub/sub connection (its confirmation is awaited
by the handle's first read, not by ``submit``). ``submit_many`` is
pipelined (256 requests per script call), 1000 requests per call. The raw baseline is redis-py's
pipelined XADD of the same encoded payload, 1000 per pipeline; the two alternate block by block
so that both see the same load (the ratio is the figure to compare across machines).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import redis

from tokenfleet.producer import Client
from tokenfleet.producer.core.request import prepare
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures
from tokenfleet.worker.devtools.local_redis import RedisServer

HEADLINE_KEYS = ("submit-latency", "submit-many")  # its rows in benchmarks/RESULTS.md

PROMPT = "Summarise the following paragraph in one sentence: " + "lorem ipsum " * 20
BATCH = 1000


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_submit(url: str, n: int) -> list[float]:
    settings = Settings(redis_url=url, key_prefix="bench-lat")
    times = []
    with Client.from_url(settings=settings) as client:
        client.set_queue_config("normal", max_waiting=10_000_000)
        for _ in range(50):  # warm-up: scripts loaded, connections open
            client.submit(PROMPT, max_tokens=64).close()
        for _ in range(n):
            t0 = time.perf_counter()
            handle = client.submit(PROMPT, max_tokens=64)
            times.append(time.perf_counter() - t0)
            handle.close()
    return times


def bench_bulk(url: str, n: int, round_no: int) -> tuple[float, float]:
    """(submit_many req/s, raw XADD entries/s), measured in alternating blocks of BATCH so
    that both sides see the same machine load."""
    settings = Settings(redis_url=url, key_prefix=f"bench-many-{round_no}")
    payload = prepare(settings, now=time.time(), prompt=PROMPT, max_tokens=64).payload
    raw = redis.Redis.from_url(url)
    stream = f"bench-raw-{round_no}"
    t_many = t_raw = 0.0
    with Client.from_url(settings=settings) as client:
        client.set_queue_config("normal", max_waiting=10_000_000)
        client.submit_many([PROMPT] * 100)  # warm-up: script loaded, connection open
        raw.xadd(stream, {"id": "warm", "d": payload, "dl": ""})
        for start in range(0, n, BATCH):
            size = min(BATCH, n - start)
            t0 = time.perf_counter()
            out = client.submit_many([{"prompt": PROMPT, "max_tokens": 64}] * size)
            t1 = time.perf_counter()
            pipe = raw.pipeline(transaction=False)
            for i in range(start, start + size):
                pipe.xadd(stream, {"id": f"r{i}", "d": payload, "dl": ""})
            pipe.execute()
            t2 = time.perf_counter()
            if any(isinstance(x, Exception) for x in out):
                raise RuntimeError("a request was refused during the benchmark")
            t_many += t1 - t0
            t_raw += t2 - t1
    raw.close()
    return n / t_many, n / t_raw


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--latency-n", type=int, default=2000)
    parser.add_argument("--bulk-n", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    add_record_flag(parser)
    args = parser.parse_args()
    with RedisServer(unix_socket=False) as server:
        lat = bench_submit(server.url, args.latency_n)
        many, raw, ratios = [], [], []
        for i in range(args.rounds):
            m, x = bench_bulk(server.url, args.bulk_n, i)
            many.append(m)
            raw.append(x)
            ratios.append(m / x)
    print(f"redis-server {server.binary} on {server.url}")
    print(f"{'metric':44s} {'value':>12s}")
    print(f"{'submit latency p50 (ms)':44s} {1e3 * statistics.median(lat):12.3f}")
    print(f"{'submit latency p99 (ms)':44s} {1e3 * percentile(lat, 0.99):12.3f}")
    print(f"{'submit_many throughput (req/s, median)':44s} {statistics.median(many):12.0f}")
    print(f"{'raw pipelined XADD (entries/s, median)':44s} {statistics.median(raw):12.0f}")
    print(f"{'ratio submit_many / raw XADD (median)':44s} {statistics.median(ratios):12.2f}")
    print(f"{'ratio per round':44s} {' '.join(f'{x:.2f}' for x in ratios):>12s}")
    if args.record:  # its rows in benchmarks/RESULTS.md
        p50, p99 = 1e3 * statistics.median(lat), 1e3 * percentile(lat, 0.99)
        figures = {
            "submit-latency": f"{p50:.2f} / {p99:.2f} ms",
            "submit-many": f"{statistics.median(ratios):.2f}",
        }
        record_figures(figures, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS)


if __name__ == "__main__":
    main()
