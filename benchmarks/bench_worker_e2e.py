"""End to end through Redis: the worker fleet against the in-process engine, on the same workload.

Three comparisons, measured side by side in one run, each side replaying a seeded workload from
``workload.make_workload`` in real time (Poisson arrivals, greedy; EOS is *not* ignored because
the producer's ``submit`` has no ``ignore_eos``, so each side counts the tokens it really got;
greedy decoding makes them equal, which the run checks):

* ``engine``: ``Engine.step()`` in this process, requests added at their arrival (1 torch thread).
* ``fleet-1``: one ``tokenfleet worker`` process (1 torch thread) behind a private redis-server;
  this process submits each request with the producer's ``Client.submit`` at its arrival and
  times the events it receives on the channels (one PSUBSCRIBE listener).
* ``fleet-2``: two worker processes (1 thread each), on a heavier workload that keeps both busy
  (all requests arrive within half a second), compared with ``fleet-1`` on that same workload.

The light workload comes from the engine benchmark's generator (64 requests at 20/s by default,
prompts 16-128 tokens, max_tokens 16-128); the heavy one has max_tokens 32-192.

Throughput = output tokens / (last terminal event - workload start). TTFT = first token seen by
the client (fleet) or by the caller of ``Engine.step()`` (engine: when the step that sampled it
returns) - scheduled arrival. Both sides wait for an arrival the same way (``wait_until``:
sleep, then spin the last millisecond), so that neither side's TTFT includes the load
generator's own wake-up lateness. ``--rounds N`` repeats the light pair
(engine, fleet-1) N times, alternating which side goes first, and reports each round and the
medians: on a shared machine the load drifts between two sides measured one after the other, and
a pair measured close together is the fairer comparison. Run::

    .venv/bin/python benchmarks/bench_worker_e2e.py            # about 1 minute on 2 CPU cores
    .venv/bin/python benchmarks/bench_worker_e2e.py --rounds 5 --no-heavy
    .venv/bin/python benchmarks/bench_worker_e2e.py --rounds 5 --pin   # worker on its own CPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import Workload, make_workload, percentile

from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures

# benchmarks/RESULTS.md rows this script measures (each row names the command that measures it)
HEADLINE_KEYS = (  # its rows in benchmarks/RESULTS.md
    *("e2e-throughput", "e2e-throughput-25", "smollm2-e2e"),
    *("e2e-ttft", "e2e-ttft-25"),
    "e2e-two-workers",
)
THROUGHPUT_KEYS, TTFT_KEYS, TWO_WORKERS_KEY = (
    HEADLINE_KEYS[:3],
    HEADLINE_KEYS[3:5],
    HEADLINE_KEYS[5],
)

SPIN_S = 0.001


@dataclass(frozen=True)
class Placement:
    """Which CPUs the engine side or worker (``compute``) and everything else (``rest``) use;
    ``None``: wherever the OS schedules them. Affinity is per thread and inherited by the
    threads and processes it starts, so setting this thread's before a start places the child."""

    compute: set[int] | None = None
    rest: set[int] | None = None

    @contextlib.contextmanager
    def computing(self) -> Any:
        """This thread (and what it starts meanwhile) on the compute CPUs, then back."""
        if self.compute is None:
            yield
            return
        os.sched_setaffinity(0, self.compute)
        try:
            yield
        finally:
            os.sched_setaffinity(0, self.rest or self.compute)


def wait_until(t: float) -> None:
    """Return at epoch time ``t``: sleep until ``SPIN_S`` before it, then spin. A plain sleep
    wakes 0.15-0.4 ms late on this VM, and that lateness would count as TTFT."""
    ahead = t - time.time() - SPIN_S
    if ahead > 0:
        time.sleep(ahead)
    while time.time() < t:
        pass


@dataclass
class Side:
    name: str
    num_output_tokens: int = 0
    makespan_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    # fleet only, per request: TTFT split at the record's timestamps (seconds)
    phases: dict[str, list[float]] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.num_output_tokens / self.makespan_s if self.makespan_s else 0.0

    @property
    def ttft_p50_ms(self) -> float:
        return percentile(self.ttft_s, 50) * 1000

    @property
    def ttft_p90_ms(self) -> float:
        return percentile(self.ttft_s, 90) * 1000


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        help="bundled name (smollm2), .gguf file or model folder (default: the cached tiny llama)",
    )
    p.add_argument("--requests", type=int, default=64, help="requests, engine-bench workload")
    p.add_argument("--rate", type=float, default=20.0, help="arrivals/s, engine-bench workload")
    p.add_argument("--heavy-requests", type=int, default=96)
    p.add_argument("--heavy-rate", type=float, default=200.0, help="arrivals/s, heavy workload")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds", type=int, default=1, help="light (engine, fleet-1) pairs, alternating order"
    )
    p.add_argument("--no-heavy", action="store_true", help="skip the fleet-1/fleet-2 heavy sides")
    p.add_argument(
        "--pin",
        action="store_true",
        help="(implies --no-heavy) run the engine side and the worker on the last CPU, this "
        "process (client, listener) and redis-server on the others, as a deployment that gives "
        "a worker its own core would",
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="use this Redis (every side gets a unique key prefix) instead of "
        "starting a private redis-server",
    )
    add_record_flag(p)
    return p


def run_engine(model: str, wl: Workload, args: argparse.Namespace, placement: Placement) -> Side:
    with placement.computing():
        return _run_engine(model, wl, args)


def _run_engine(model: str, wl: Workload, args: argparse.Namespace) -> Side:
    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.engine.request import SamplingParams

    engine = Engine(model, device="cpu", max_num_seqs=args.max_num_seqs)
    engine.generate([[7] * 40] * 4, SamplingParams(temperature=0, max_tokens=8))  # warm-up
    engine.block_manager.reset_prefix_cache()
    side = Side("engine")
    pending = deque(wl.requests)
    first_seen: dict[str, float] = {}
    start = time.time()
    arrival = {r.request_id: start + r.arrival_s for r in wl.requests}
    last = start
    while pending or engine.has_unfinished():
        now = time.time()
        while pending and start + pending[0].arrival_s <= now:
            r = pending.popleft()
            params = SamplingParams(temperature=0, max_tokens=r.max_tokens)
            engine.add_request(
                r.request_id, r.prompt_token_ids, params, arrival_time=start + r.arrival_s
            )
        if not engine.has_unfinished():
            wait_until(start + pending[0].arrival_s)
            continue
        outputs = engine.step()
        seen = time.time()  # the caller has this step's tokens now (the fleet: the client)
        for out in outputs:
            if out.new_token_ids and out.first_index == 0:
                first_seen[out.request_id] = seen
            if out.finished:
                if out.request_id not in first_seen:
                    raise RuntimeError(f"{out.request_id} finished without a token")
                side.num_output_tokens += out.num_output_tokens
                side.ttft_s.append(first_seen[out.request_id] - arrival[out.request_id])
                last = seen
    side.makespan_s = last - start
    return side


class Listener:
    """Times every event on ``PREFIX:ch:*`` as this process receives it."""

    def __init__(self, url: str, prefix: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.pubsub = self.client.pubsub()
        self.pubsub.psubscribe(f"{prefix}:ch:*")
        while True:  # wait for the subscription to be confirmed
            msg = self.pubsub.get_message(timeout=1.0)
            if msg and msg["type"] == "psubscribe":
                break
        self.first: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.done: dict[str, float] = {}
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            msg = self.pubsub.get_message(timeout=0.2)
            if not msg or msg["type"] != "pmessage":
                continue
            now = time.time()
            ev = orjson.loads(msg["data"])
            rid = ev["id"]
            if ev["type"] == "token":
                self.first.setdefault(rid, now)
                self.tokens[rid] = self.tokens.get(rid, 0) + 1
            else:
                self.done[rid] = now

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.pubsub.close()
        self.client.close()


def run_fleet(
    name: str,
    model: str,
    url: str,
    num_workers: int,
    wl: Workload,
    args: argparse.Namespace,
    placement: Placement,
) -> Side:
    from tokenfleet.producer import Client
    from tokenfleet.shared.settings import Settings
    from tokenfleet.worker.devtools.local_fleet import LocalFleet, delete_prefix

    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    settings = Settings(redis_url=url, key_prefix=prefix, record_ttl_s=600)
    fleet = LocalFleet(
        model,
        url,
        key_prefix=prefix,
        num_workers=num_workers,
        extra_args=["--max-num-seqs", str(args.max_num_seqs), "--log-level", "WARNING"],
    )
    with placement.computing():
        fleet.start()
    listener = Listener(url, prefix)
    try:
        with Client.from_url(url, settings=settings) as client:
            warm = [
                client.submit(prompt=[7] * 40, max_tokens=8, temperature=0)
                for _ in range(2 * num_workers)
            ]
            for h in warm:
                h.result(timeout=120)
            side = Side(name)
            start = time.time()
            for r in wl.requests:
                wait_until(start + r.arrival_s)
                h = client.submit(
                    prompt=list(r.prompt_token_ids),
                    max_tokens=r.max_tokens,
                    temperature=0,
                    request_id=f"{r.request_id}-{prefix}",
                )
                h.close()
            ids = {f"{r.request_id}-{prefix}": r for r in wl.requests}
            deadline = time.time() + 600
            while not all(rid in listener.done for rid in ids) and time.time() < deadline:
                time.sleep(0.05)
        rc = redis.Redis.from_url(url)
        for rid, r in ids.items():
            side.num_output_tokens += listener.tokens.get(rid, 0)
            if rid in listener.first:
                side.ttft_s.append(listener.first[rid] - (start + r.arrival_s))
                raw: Any = rc.hgetall(settings_key(prefix, rid))
                rec = {k.decode(): v for k, v in raw.items()}
                enq, st, ft = (
                    float(rec[k]) for k in ("enqueued_at", "started_at", "first_token_at")
                )
                for phase, value in (
                    ("submit", enq - (start + r.arrival_s)),
                    ("queue", st - enq),
                    ("first token", ft - st),
                    ("delivery", listener.first[rid] - ft),
                ):
                    side.phases.setdefault(phase, []).append(value)
        rc.close()
        side.makespan_s = max(listener.done.get(rid, time.time()) for rid in ids) - start
        missing = [rid for rid in ids if rid not in listener.done]
        if missing:
            raise RuntimeError(f"{name}: {len(missing)} requests did not finish")
    finally:
        listener.close()
        fleet.stop()
        fleet.cleanup()
        delete_prefix(url, prefix)
    return side


def settings_key(prefix: str, rid: str) -> str:
    from tokenfleet.shared.keys import Keys

    return Keys(prefix).record(rid)


def main() -> int:  # noqa: C901, PLR0912, PLR0915 (the benchmark's scenario, top to bottom)
    args = build_parser().parse_args()
    import torch

    from tokenfleet.worker.devtools.local_redis import RedisServer
    from tokenfleet.worker.devtools.tiny_model import cached_tiny_model

    torch.set_num_threads(1)
    if args.model:
        from tokenfleet.worker.models.resolve import resolve_model

        model = str(resolve_model(args.model))  # a bundled name or GGUF file: its folder
    else:
        model = str(cached_tiny_model())
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    light = make_workload(
        args.requests,
        vocab_size=vocab,
        rate_per_s=args.rate,
        prompt_tokens=(16, 128),
        max_tokens=(16, 128),
        seed=args.seed,
    )
    heavy = make_workload(
        args.heavy_requests,
        vocab_size=vocab,
        rate_per_s=args.heavy_rate,
        prompt_tokens=(16, 128),
        max_tokens=(32, 192),
        seed=args.seed + 1,
    )
    print(
        f"model {model}; cpu cores {os.cpu_count()}; light: {len(light.requests)} requests at "
        f"{args.rate}/s ({light.num_output_tokens} output tokens); heavy: "
        f"{len(heavy.requests)} at {args.heavy_rate}/s ({heavy.num_output_tokens} tokens)",
        flush=True,
    )
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    placement = Placement()
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--pin needs at least 2 CPUs")
        args.no_heavy = True  # the heavy pair measures two workers sharing every CPU
        rest = set(cpus[:-1])
        placement = Placement(compute={cpus[-1]}, rest=rest)
        os.sched_setaffinity(0, rest)  # redis-server and the listener inherit it
        print(f"pinned: engine side and worker on CPU {cpus[-1]}, the rest on {cpus[:-1]}")
    pairs: list[tuple[Side, Side]] = []
    one_heavy = two_heavy = None
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(RedisServer()).url
        for i in range(args.rounds):
            if i % 2 == 0:
                engine = run_engine(model, light, args, placement)
                one = run_fleet("fleet-1", model, url, 1, light, args, placement)
            else:
                one = run_fleet("fleet-1", model, url, 1, light, args, placement)
                engine = run_engine(model, light, args, placement)
            print(
                f"  round {i + 1}: engine {engine.throughput:.0f} tok/s, TTFT p50 "
                f"{engine.ttft_p50_ms:.1f} ms; fleet-1 {one.throughput:.0f} tok/s, "
                f"{one.ttft_p50_ms:.1f} ms",
                flush=True,
            )
            if one.num_output_tokens != engine.num_output_tokens:
                raise RuntimeError(
                    f"greedy outputs differ: fleet {one.num_output_tokens} tokens, "
                    f"engine {engine.num_output_tokens}"
                )
            pairs.append((engine, one))
        if not args.no_heavy:
            one_heavy = run_fleet("fleet-1 heavy", model, url, 1, heavy, args, Placement())
            print(f"  fleet-1 heavy done: {one_heavy.throughput:.0f} tok/s", flush=True)
            two_heavy = run_fleet("fleet-2 heavy", model, url, 2, heavy, args, Placement())
            print(f"  fleet-2 heavy done: {two_heavy.throughput:.0f} tok/s", flush=True)
    print()
    print(
        "| side | workload | output tokens | output tok/s | TTFT p50 ms | TTFT p90 ms | "
        "makespan s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    rows: list[tuple[Side, str]] = [(side, "light") for pair in pairs for side in pair]
    if one_heavy is not None and two_heavy is not None:
        rows += [(one_heavy, "heavy"), (two_heavy, "heavy")]
    for side, wl_name in rows:
        print(
            f"| {side.name} | {wl_name} | {side.num_output_tokens} | {side.throughput:.0f} | "
            f"{side.ttft_p50_ms:.1f} | "
            f"{side.ttft_p90_ms:.1f} | {side.makespan_s:.2f} |"
        )
    print()
    phases: dict[str, list[float]] = {}
    for _, one in pairs:
        for phase, values in one.phases.items():
            phases.setdefault(phase, []).extend(values)
    print(
        "fleet-1 (light) TTFT by phase, p50 ms: "
        + ", ".join(f"{name} {percentile(vals, 50) * 1000:.2f}" for name, vals in phases.items())
    )
    print(
        "(submit: arrival -> record written by the producer; queue: -> worker's START; "
        "first token: -> its token appended; delivery: -> seen by the client)"
    )
    print()
    ratios = [one.throughput / engine.throughput for engine, one in pairs]
    overheads = [one.ttft_p50_ms - engine.ttft_p50_ms for engine, one in pairs]
    rounds = len(pairs) > 1
    print("| ratio | value | goal |")
    print("|---|---:|---|")
    print(f"| fleet-1 / engine throughput (light) | {_summary(ratios, '.3f', rounds)} | >= 0.95 |")
    print(
        f"| fleet-1 - engine TTFT p50 (light) | {_summary(overheads, '+.1f', rounds)} ms "
        f"| <= 2 ms |"
    )
    if rounds:  # every round's requests together: steadier than the median of round p50s
        engine_all = [t for engine, _ in pairs for t in engine.ttft_s]
        fleet_all = [t for _, one in pairs for t in one.ttft_s]
        pooled = (percentile(fleet_all, 50) - percentile(engine_all, 50)) * 1000
        print(
            f"| fleet-1 - engine TTFT p50, all rounds' requests pooled | {pooled:+.1f} ms "
            f"(engine {percentile(engine_all, 50) * 1000:.1f}, fleet-1 "
            f"{percentile(fleet_all, 50) * 1000:.1f}) | <= 2 ms |"
        )
    figures = dict.fromkeys(THROUGHPUT_KEYS, f"{statistics.median(ratios):.3f}")
    figures.update(dict.fromkeys(TTFT_KEYS, f"{statistics.median(overheads):+.1f} ms"))
    if one_heavy is not None and two_heavy is not None:
        print(
            f"| fleet-2 / fleet-1 throughput (heavy) | "
            f"{two_heavy.throughput / one_heavy.throughput:.3f} | report |"
        )
        figures[TWO_WORKERS_KEY] = f"{two_heavy.throughput / one_heavy.throughput:.2f}"
    if args.record:
        record_figures(figures, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS)
    return 0


def _summary(values: list[float], fmt: str, rounds: bool) -> str:
    """One value, or the median with every round's value (in round order)."""
    if not rounds:
        return format(values[0], fmt)
    each = " ".join(format(v, fmt) for v in values)
    return f"median {format(statistics.median(values), fmt)} (rounds: {each})"


if __name__ == "__main__":
    sys.exit(main())
