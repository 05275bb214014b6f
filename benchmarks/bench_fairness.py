"""Fair shares between tenants (issue 33): FIFO against fair admission on a two-tenant trace.

The trace: a *heavy* tenant submits ``--heavy`` requests at once (one ``submit_many``), and
``--light-delay-s`` later a *light* tenant starts sending ``--light`` requests, one every
``--light-gap-s`` (``submit``), all of ``--max-tokens`` output tokens on one prompt length. Two
sides on the same fleet (``--workers`` worker processes of ``--max-num-seqs`` slots, 1 torch
thread each, one private redis-server), taking turns to go first for ``--rounds`` rounds:

* ``fifo``: nobody names a tenant (every request is the default tenant's: the shared stream,
  first come first served, what the fleet did before tenants);
* ``fair``: the heavy requests name tenant ``heavy-R``, the light ones ``light-R`` (R: the round):
  fair admission by virtual token counters (docs/fairness.md).

Figures per side, from the requests' records (Redis's records, the workers' clocks: one machine):
the light tenant's TTFT p50 / p99 (``first_token_at - enqueued_at``), the heavy tenant's
throughput (its output tokens / its makespan), total throughput (every output token / the
makespan of the whole trace), and fair ÷ fifo per round. Then the pull script's own cost in
Redis (``INFO commandstats``: microseconds per ``EVALSHA`` of ``PULL``, one entry per call) with
no tenant, with 2 and with 16 active tenants. Run::

    .venv/bin/python benchmarks/bench_fairness.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import percentile

from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures

# the rows of benchmarks/RESULTS.md this script measures (--record writes them)
HEADLINE_KEYS = ("fairness-light-ttft", "fairness-throughput", "fairness-pull-cost")
PROMPT = (
    "Summarize the following note for a customer in two sentences, politely and briefly: "
    "the order shipped on Monday, the invoice follows by mail, and returns are free."
)


@dataclass
class Side:
    name: str
    light_ttft_s: list[float] = field(default_factory=list)
    heavy_tokens: int = 0
    heavy_makespan_s: float = 0.0
    total_tokens: int = 0
    makespan_s: float = 0.0

    @property
    def heavy_throughput(self) -> float:
        return self.heavy_tokens / self.heavy_makespan_s if self.heavy_makespan_s else 0.0

    @property
    def total_throughput(self) -> float:
        return self.total_tokens / self.makespan_s if self.makespan_s else 0.0


def start_workers(model: str, url: str, prefix: str, args: argparse.Namespace) -> list[Any]:
    env = {**os.environ, "REDIS_URL": url, "TOKENFLEET_KEY_PREFIX": prefix}
    env.pop("TOKENFLEET_MODEL", None)
    procs = []
    for i in range(args.workers):
        cmd = [sys.executable, "-m", "tokenfleet.worker.cli", "worker", "--model", model]
        cmd += ["--name", f"{prefix}-w{i}", "--threads", "1"]
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    r = redis.Redis.from_url(url)
    deadline = time.monotonic() + 300
    while not all(r.exists(f"{prefix}:worker:{prefix}-w{i}") for i in range(args.workers)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit("bench_fairness: a worker did not start")
        time.sleep(0.1)
    r.close()
    return procs


def records(r: redis.Redis, prefix: str, ids: list[str]) -> list[dict[str, str]]:
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.hgetall(f"{prefix}:req:{rid}")
    out = []
    for raw in pipe.execute():
        out.append({k.decode(): v.decode() for k, v in raw.items()})
    return out


def run_side(name: str, rnd: int, client: Any, r: redis.Redis, prefix: str, args: Any) -> Side:
    side = Side(name)
    heavy_tenant = {"tenant": f"heavy-{rnd}"} if name == "fair" else {}
    light_tenant = {"tenant": f"light-{rnd}"} if name == "fair" else {}
    params = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    heavy = [f"{name}-{rnd}-h{i}" for i in range(args.heavy)]
    light = [f"{name}-{rnd}-l{i}" for i in range(args.light)]
    start = time.time()
    client.submit_many(
        [{"prompt": PROMPT, "request_id": rid, **params, **heavy_tenant} for rid in heavy]
    )
    time.sleep(args.light_delay_s)
    for rid in light:
        client.submit(PROMPT, request_id=rid, **params, **light_tenant)
        time.sleep(args.light_gap_s)
    everyone = heavy + light
    while True:
        recs = records(r, prefix, everyone)
        if all(x.get("status") in ("done", "error", "expired", "dropped") for x in recs):
            break
        time.sleep(0.2)
    bad = [x for x in recs if x.get("status") != "done"]
    if bad:
        raise SystemExit(f"bench_fairness: {len(bad)} requests did not end done")
    hrec, lrec = recs[: len(heavy)], recs[len(heavy) :]
    side.light_ttft_s = [float(x["first_token_at"]) - float(x["enqueued_at"]) for x in lrec]
    side.heavy_tokens = sum(int(x["num_tokens"]) for x in hrec)
    side.heavy_makespan_s = max(float(x["finished_at"]) for x in hrec) - start
    side.total_tokens = sum(int(x["num_tokens"]) for x in recs)
    side.makespan_s = max(float(x["finished_at"]) for x in recs) - start
    return side


def pull_cost(url: str, tenants: int, calls: int) -> float:
    """Microseconds per PULL call in Redis (commandstats), one entry read per call, with
    ``tenants`` active tenants (0: the default tenant alone, straight into the shared stream;
    -1: the same, the call given no tenant keys at all: PULL as it was before tenants)."""
    from tokenfleet.shared.keys import Keys
    from tokenfleet.shared.priority import Priority
    from tokenfleet.shared.scripts import registry
    from tokenfleet.shared.scripts.enqueue import ENQUEUE, EnqueueItem, enqueue_keys_args
    from tokenfleet.worker.intake.streams import PriorityStreams

    r = redis.Redis.from_url(url)
    keys = Keys(f"tfpull{tenants}")
    normal = Priority.NORMAL
    streams = PriorityStreams(
        r, keys, model_name="m", priorities=[normal], worker_name="w", starvation_pulls=8
    )
    streams.ensure_groups()
    names = [f"t{i}" for i in range(tenants)] or ["default"]
    bare = tenants < 0  # (the keys and ARGV of PULL before tenants: streams, caps, levels)
    shared, routed = keys.stream("m", normal), keys.routed("m", normal, "w")
    bare_args: list[str | int] = ["workers", "w", 1, 2, -1, -1, "normal", "normal"]
    per = calls // len(names) + 2
    for t in names:
        for lo in range(0, per, 500):
            items = [
                EnqueueItem(f"{t}-{i}", b"{}", None, tenant=t, prompt_tokens=50)
                for i in range(lo, min(per, lo + 500))
            ]
            k, a = enqueue_keys_args(keys, "m", normal, items, now=time.time(), ttl_s=3600)
            registry.call(r, ENQUEUE, k, a)
    from tokenfleet.shared.scripts.worker import PULL

    streams.pull(1)  # registered, warm
    r.config_resetstat()
    for _ in range(calls):
        if bare:
            assert len(registry.call(r, PULL, [routed, shared], bare_args)) == 4
        else:
            assert len(streams.pull(1)) == 1
    stats = r.info("commandstats")
    r.close()
    evalsha = stats.get("cmdstat_evalsha", {})
    return float(evalsha.get("usec_per_call", 0.0))


def report(results: dict[str, list[Side]], costs: dict[int, float], *, record: bool) -> None:
    """Print the paired ratios per round and their medians (and --record them)."""
    sides = list(results)
    print()
    print(
        f"{'round':>6} {'light p50 fair/fifo':>20} {'light p99':>10} {'heavy tput':>11} "
        f"{'total tput':>11}"
    )
    ratios: dict[str, list[float]] = {"p50": [], "p99": [], "heavy": [], "total": []}
    for i, (a, b) in enumerate(zip(results["fair"], results["fifo"], strict=True)):
        ratios["p50"].append(percentile(a.light_ttft_s, 50) / percentile(b.light_ttft_s, 50))
        ratios["p99"].append(percentile(a.light_ttft_s, 99) / percentile(b.light_ttft_s, 99))
        ratios["heavy"].append(a.heavy_throughput / b.heavy_throughput)
        ratios["total"].append(a.total_throughput / b.total_throughput)
        print(
            f"{i + 1:>6} {ratios['p50'][-1]:>20.3f} {ratios['p99'][-1]:>10.3f} "
            f"{ratios['heavy'][-1]:>11.3f} {ratios['total'][-1]:>11.3f}"
        )
    med = {k: statistics.median(v) for k, v in ratios.items()}
    print(
        f"{'median':>6} {med['p50']:>20.3f} {med['p99']:>10.3f} {med['heavy']:>11.3f} "
        f"{med['total']:>11.3f}"
    )
    for name in sides:
        ttft = [x for s in results[name] for x in s.light_ttft_s]
        print(
            f"{name}: light TTFT p50 {percentile(ttft, 50) * 1000:.1f} ms, p99 "
            f"{percentile(ttft, 99) * 1000:.1f} ms over all rounds"
        )
    print(
        "PULL in Redis, us per call (1 entry): "
        + ", ".join(
            ("no tenant keys" if n < 0 else f"{n} tenants") + f" {c:.1f}" for n, c in costs.items()
        )
    )
    print(orjson.dumps({"ratios": med, "pull_us": {str(k): v for k, v in costs.items()}}).decode())
    if record:
        fair = [x for s in results["fair"] for x in s.light_ttft_s]
        fifo = [x for s in results["fifo"] for x in s.light_ttft_s]
        totals = ratios["total"]
        ttft_key, tput_key, pull_key = HEADLINE_KEYS
        record_figures(
            {
                ttft_key: f"{med['p50']:.3f} / {med['p99']:.3f} ({percentile(fair, 50) * 1000:.0f} "
                f"ms against {percentile(fifo, 50):.1f} s p50)",
                tput_key: f"{med['total']:.3f} (rounds {min(totals):.2f}–{max(totals):.2f})",
                pull_key: " / ".join(f"{costs[n]:.1f}" for n in (-1, 0, 2, 16)),
            },
            benchmarks=Path(__file__).parent,
            keys=HEADLINE_KEYS,
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (built here), a bundled name or folder")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--heavy", type=int, default=160)
    p.add_argument("--light", type=int, default=20)
    p.add_argument("--light-delay-s", type=float, default=0.5)
    p.add_argument("--light-gap-s", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pull-calls", type=int, default=2000)
    add_record_flag(p)
    args = p.parse_args()

    from tokenfleet.producer.client import Client
    from tokenfleet.shared.settings import Settings
    from tokenfleet.worker.devtools.local_redis import RedisServer

    tmp = tempfile.TemporaryDirectory()
    if args.model == "tiny":
        from tokenfleet.worker.devtools.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tmp.name) / "tiny"))
    else:
        from tokenfleet.worker.models.resolve import resolve_model

        model = str(resolve_model(args.model))
    server = RedisServer().start()
    prefix = "tfbench"
    procs = start_workers(model, server.url, prefix, args)
    r = redis.Redis.from_url(server.url)
    settings = Settings(redis_url=server.url, key_prefix=prefix, routing="off")
    client = Client.from_url(settings=settings)
    sides = ["fifo", "fair"]
    results: dict[str, list[Side]] = {s: [] for s in sides}
    print(
        f"bench_fairness: {args.workers} workers x {args.max_num_seqs} slots (1 torch thread "
        f"each), model {args.model}; heavy {args.heavy} at once, light {args.light} every "
        f"{args.light_gap_s} s from {args.light_delay_s} s, {args.max_tokens} tokens each",
        flush=True,
    )
    try:
        for rnd in range(args.rounds):
            order = sides if rnd % 2 == 0 else sides[::-1]
            for name in order:
                side = run_side(name, rnd, client, r, prefix, args)
                results[name].append(side)
                lp50, lp99 = (percentile(side.light_ttft_s, q) * 1000 for q in (50, 99))
                print(
                    f"round {rnd + 1} {name:>4}: light TTFT p50 {lp50:8.1f} ms  p99 {lp99:8.1f} "
                    f"ms  heavy {side.heavy_throughput:7.1f} tok/s  total "
                    f"{side.total_throughput:7.1f} tok/s",
                    flush=True,
                )
        costs = {n: pull_cost(server.url, n, args.pull_calls) for n in (-1, 0, 2, 16)}
    finally:
        client.close()
        r.close()
        for proc in procs:
            proc.kill()
            proc.wait()
        server.stop()
        tmp.cleanup()
    report(results, costs, record=args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
