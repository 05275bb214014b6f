"""Cluster mode against standalone, side by side in one run, and fleets spread over primaries.

Starts a private standalone redis-server on a loopback TCP port and a private 3-primary Redis
Cluster (3 replicas; ``LocalCluster``), persistence off, then measures::

    .venv/bin/python benchmarks/bench_cluster.py [--bulk-n 20000] [--e2e-n 32] [--producers 1,2,4]

1. ``submit_many`` throughput of one producer (1000 requests per call), standalone and cluster
   alternating block by block so that both see the same machine load;
2. end to end with one worker (the tiny model, CPU): ``--e2e-n`` requests of 32 tokens submitted
   at once, from the first submit to the last result, standalone then cluster, ``--rounds``
   times alternating (one worker process at a time);
3. producer throughput as producers (processes) grow, all in one fleet: each submitting to a
   model of its own whose lane (slot) falls on another primary, against the same number of
   producers all submitting to one model (one lane, one primary).

The figures are this machine's: on few cores the producers and all the Redis nodes share the
CPUs, so (3) shows what spreading buys only as far as the cores allow.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenfleet.producer import Client
from tokenfleet.shared.cluster_connection import fleet_slot
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.redis_connect import redis_client
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures
from tokenfleet.worker.devtools.local_redis import RedisServer
from tokenfleet.worker.devtools.testing.local_cluster import LocalCluster

HEADLINE_KEYS = ("cluster",)  # its row in benchmarks/RESULTS.md
PROMPT = "Summarise the following paragraph in one sentence: " + "lorem ipsum " * 20
BATCH = 1000


def settings_for(url: str, mode: str, prefix: str) -> Settings:
    return Settings(redis_url=url, redis_mode=mode, key_prefix=prefix)


def bulk_side_by_side(plain_url: str, cluster_url: str, n: int) -> tuple[float, float, float]:
    """Medians over blocks of BATCH, the two sides alternating (each goes first in turn):
    standalone req/s, cluster req/s, and the ratio of each block pair (robust to a machine
    whose load changes during the run)."""
    clients = [
        Client.from_url(settings=settings_for(plain_url, "standalone", "bench-bulk")),
        Client.from_url(settings=settings_for(cluster_url, "cluster", "bench-bulk")),
    ]
    rates: list[list[float]] = [[], []]
    try:
        for c in clients:
            c.set_queue_config("normal", max_waiting=10_000_000)
            c.submit_many([PROMPT] * 100)  # warm-up: scripts loaded, connections open
        for block, start in enumerate(range(0, n, BATCH)):
            size = min(BATCH, n - start)
            for i in (0, 1) if block % 2 == 0 else (1, 0):  # each side goes first in turn
                c = clients[i]
                t0 = time.perf_counter()
                out = c.submit_many([{"prompt": PROMPT, "max_tokens": 64}] * size)
                rates[i].append(size / (time.perf_counter() - t0))
                if any(isinstance(x, Exception) for x in out):
                    raise RuntimeError("a request was refused during the benchmark")
    finally:
        for c in clients:
            c.close()
    ratios = [c / p for p, c in zip(rates[0], rates[1], strict=True)]
    return statistics.median(rates[0]), statistics.median(rates[1]), statistics.median(ratios)


def end_to_end(url: str, mode: str, model: Path, n: int, round_no: int) -> float:
    """Requests per second through one worker: n requests of 32 tokens, submit to last result."""
    prefix = f"bench-e2e-{mode}-{round_no}"
    settings = settings_for(url, mode, prefix)
    env = {**os.environ, "REDIS_URL": url, "TOKENFLEET_REDIS_MODE": mode}
    env["TOKENFLEET_KEY_PREFIX"] = prefix
    name = f"e2e-{mode}-{round_no}"
    args = [sys.executable, "-m", "tokenfleet.worker.cli", "worker", "--model", str(model),
            "--name", name, "--threads", "1", "--max-num-seqs", "16",
            "--log-level", "WARNING"]  # fmt: skip
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        lane = replace(settings, lane="default")  # the worker's heartbeat is in its lane
        with redis_client(lane) as r:
            deadline = time.monotonic() + 180
            while not r.exists(Keys.for_settings(lane).worker(name)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker did not start: {proc.stderr.read()!r}")  # type: ignore[union-attr]
                time.sleep(0.05)
        with Client.from_url(settings=settings) as client:
            client.submit("warm-up", max_tokens=4, ignore_eos=True).result(timeout=120)
            t0 = time.perf_counter()
            handles = [
                client.submit(f"{PROMPT} {i}", max_tokens=32, ignore_eos=True) for i in range(n)
            ]
            for h in handles:
                if len(h.result(timeout=300).token_ids) != 32:
                    raise RuntimeError("a request ended short")
            return n / (time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait(30)


def _producer(url: str, prefix: str, model: str, n: int, start_at: float, out: Any) -> None:
    with Client.from_url(settings=settings_for(url, "cluster", prefix)) as client:
        client.set_queue_config("normal", model=model, max_waiting=10_000_000)
        client.submit_many([{"prompt": PROMPT, "model": model}] * 50)
        while time.time() < start_at:
            time.sleep(0.001)
        t0 = time.time()
        request = {"prompt": PROMPT, "max_tokens": 64, "model": model}
        for start in range(0, n, BATCH):
            client.submit_many([request] * min(BATCH, n - start))
        out.put((t0, time.time()))


def models_on_distinct_primaries(
    cluster: LocalCluster, prefix: str, count: int, tag: str
) -> list[str]:
    """``count`` model names of fleet ``prefix`` whose lanes fall on the primaries in turn."""
    owners = cluster.primaries()
    chosen: list[str] = []
    i = 0
    while len(chosen) < count:
        model = f"{tag}-{i}"
        i += 1
        owner = cluster.owner_port(fleet_slot(Keys(prefix, cluster=True, lane=model).root))
        if owner == owners[len(chosen) % len(owners)]:
            chosen.append(model)
    return chosen


def producers(url: str, prefix: str, models: list[str], n_each: int) -> float:
    """Aggregate req/s of one producer process per model (all in fleet ``prefix``), all
    starting together."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 3.0  # every process imported and warmed up by then
    procs = [
        ctx.Process(target=_producer, args=(url, prefix, m, n_each, start_at, out)) for m in models
    ]
    for p in procs:
        p.start()
    spans = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    return n_each * len(models) / (max(e for _, e in spans) - min(s for s, _ in spans))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bulk-n", type=int, default=20_000)
    parser.add_argument("--e2e-n", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--producers", default="1,2,4")
    parser.add_argument("--per-producer-n", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    add_record_flag(parser)
    args = parser.parse_args()
    from tokenfleet.worker.devtools.tiny_model import make_tiny_model

    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="bench-cluster-model-")), seed=0)
    server = RedisServer(unix_socket=False, prefer="system").start()
    with LocalCluster(num_primaries=3) as cluster:
        curl = cluster.seed_url
        with redis_client(settings_for(server.url, "standalone", "x")) as r:
            version = r.info("server")["redis_version"]
        print(f"redis-server {version}: standalone, and a cluster of 3 primaries + 3 replicas")
        print(f"cpus: {os.cpu_count()}")
        plain_rate, cluster_rate, ratio = bulk_side_by_side(server.url, curl, args.bulk_n)
        print(f"\n1. submit_many, 1 producer, {args.bulk_n} requests in alternating blocks of "
              f"{BATCH} (medians over blocks):")  # fmt: skip
        print(f"   standalone {plain_rate:9,.0f} req/s   cluster {cluster_rate:9,.0f} req/s"
              f"   cluster/standalone (per block pair) {ratio:.2f}")  # fmt: skip
        e2e: dict[str, list[float]] = {"standalone": [], "cluster": []}
        for rnd in range(args.rounds):
            e2e["standalone"].append(end_to_end(server.url, "standalone", model, args.e2e_n, rnd))
            e2e["cluster"].append(end_to_end(curl, "cluster", model, args.e2e_n, rnd))
        med = {k: statistics.median(v) for k, v in e2e.items()}
        print(f"\n2. end to end, 1 worker (tiny model, CPU), {args.e2e_n} requests x 32 tokens, "
              f"median of {args.rounds}:")  # fmt: skip
        print(f"   standalone {med['standalone']:.2f} req/s ({med['standalone'] * 32:.0f} tok/s)"
              f"   cluster {med['cluster']:.2f} req/s ({med['cluster'] * 32:.0f} tok/s)"
              f"   cluster/standalone {med['cluster'] / med['standalone']:.2f}")  # fmt: skip
        print(f"\n3. producers (processes) x {args.per_producer_n} requests each, on the cluster, "
              f"median of {args.repeats} (one fleet and spread alternating):")  # fmt: skip
        print("   producers   one model (1 lane) req/s   a model each (spread) req/s   primaries")
        for count in (int(x) for x in args.producers.split(",")):
            ones, manys = [], []
            owners: set[int] = set()
            for rep in range(args.repeats):
                fleet = f"bench-f{count}-{rep}"  # a fresh fleet per run: no queue carried over
                ones.append(producers(curl, fleet, ["one"] * count, args.per_producer_n))
                spread = models_on_distinct_primaries(cluster, fleet, count, "spread")
                lanes = [Keys(fleet, cluster=True, lane=m).root for m in spread]
                owners = {cluster.owner_port(fleet_slot(root)) for root in lanes}
                manys.append(producers(curl, fleet, spread, args.per_producer_n))
            one, many = statistics.median(ones), statistics.median(manys)
            print(f"   {count:9d}   {one:24,.0f}   {many:27,.0f}   {len(owners)}")
    server.stop()
    if args.record:  # the headline row (RESULTS.md): cluster ÷ standalone, bulk; end to end
        e2e_ratio = med["cluster"] / med["standalone"]
        figures = {HEADLINE_KEYS[0]: f"{ratio:.2f}; {e2e_ratio:.2f}"}
        record_figures(figures, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS)


if __name__ == "__main__":
    main()
