"""Simulation benchmark of shared KV pools (issue 6): the real Lua scripts on a private Redis.

Simulated workers (one process, stepped round-robin in a shuffled order) each run a toy engine:
requests arrive so that the queue never empties (saturation), a request takes its prompt's blocks
when admitted, grows by one block every ``block_size`` decoded tokens and frees everything when it
finishes; when a step cannot grow a request, the latest-admitted one is preempted (recompute).
Every step is one ``POOL_STEP`` call: chunked asks ahead of need (``plan_blocks``), releases
above the watermark, the release target when the share shrank, and preemption orders.

Scenarios:

* ``equal``: 4 members of weight 1, all saturated: pool utilisation and Jain's fairness index of
  the members' mean held blocks over each 1 s window (divided by the weight, for the weighted
  run).
* ``weighted``: 4 members of weights 1, 2, 3, 4, saturated: each member's share of the held
  blocks against its share of the weights.
* ``preempt``: 3 members saturated with batch work and one that now and then gets a critical
  request: steps from the critical request's first ask to its admission.

Run: ``.venv/bin/python benchmarks/bench_kv_pool.py`` (appends a section to
``benchmarks/HISTORY.md``; ``--no-write`` only prints; ``--record`` also writes the headline
figures into ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures, run_command
from tokenfleet.worker.devtools.local_redis import RedisServer
from tokenfleet.worker.pool.admin import create_pool
from tokenfleet.worker.pool.chunking import plan_blocks
from tokenfleet.worker.pool.config import PoolConfig
from tokenfleet.worker.pool.grant import PoolGrant
from tokenfleet.worker.pool.member import KVPoolMember
from tokenfleet.worker.pool.orders import PreemptAsk

# its rows in benchmarks/RESULTS.md
HEADLINE_KEYS = ("kv-pool-held", "kv-pool-jain", "kv-pool-weighted")

HISTORY = Path(__file__).with_name("HISTORY.md")
BLOCK_SIZE = 16
TOTAL_BLOCKS = 4096
CHUNK = 32
MAX_SEQS = 64


@dataclass
class Req:
    priority: Priority
    prompt_tokens: int
    output_tokens: int
    done_tokens: int = 0
    blocks: int = 0
    first_ask_step: int | None = None

    def blocks_needed(self) -> int:
        return math.ceil((self.prompt_tokens + self.done_tokens + 1) / BLOCK_SIZE)


@dataclass
class SimWorker:
    """A toy engine whose KV budget is the pool's grant."""

    member: KVPoolMember
    rng: random.Random
    saturated: bool = True
    running: list[Req] = field(default_factory=list)
    waiting: deque[Req] = field(default_factory=deque)
    grant: PoolGrant | None = None
    steps: int = 0
    tokens: int = 0
    preempted: int = 0
    critical_waits: list[int] = field(default_factory=list)

    @property
    def used(self) -> int:
        return sum(r.blocks for r in self.running)

    def new_request(self, priority: Priority = Priority.BATCH) -> Req:
        return Req(priority, self.rng.randint(64, 1024), self.rng.randint(16, 512))

    def preempt_latest(self, min_priority: int = -1) -> int:
        """Preempt the latest-admitted running request less urgent than ``min_priority``."""
        for i in range(len(self.running) - 1, -1, -1):
            req = self.running[i]
            if int(req.priority) > min_priority:
                del self.running[i]
                freed, req.blocks, req.done_tokens = req.blocks, 0, 0
                self.waiting.appendleft(req)
                self.preempted += 1
                return freed
        return 0

    def step(self) -> None:  # noqa: C901, PLR0912 (the simulated member's one step, in order)
        self.steps += 1
        held = self.member.held
        release = 0
        g = self.grant
        if g is not None:
            limit = g.release_to
            if g.preempt is not None:  # spare first, then less urgent running work
                limit = min(limit, max(0, held - g.preempt.num_blocks))
                while self.used > limit and self.preempt_latest(int(g.preempt.priority)):
                    pass
            while self.used > limit and self.preempt_latest():
                pass
            limit = max(limit, self.used)
            release = held - limit
            held = limit
        # decode one token per running request; grow within the budget or preempt
        finished = []
        for req in list(self.running):
            if req not in self.running:
                continue
            req.done_tokens += 1
            self.tokens += 1
            while req.blocks_needed() > req.blocks:
                if self.used < held:
                    req.blocks += 1
                elif self.preempt_latest() == 0:
                    break
            if req.done_tokens >= req.output_tokens:
                finished.append(req)
        for req in finished:
            if req in self.running:
                self.running.remove(req)
        # admit in priority order while the budget allows
        if self.saturated:
            while len(self.waiting) < 8:
                self.waiting.append(self.new_request())
        ordered = sorted(self.waiting, key=lambda r: int(r.priority))
        self.waiting = deque(ordered)
        ask = None
        while self.waiting and len(self.running) < MAX_SEQS:
            head = self.waiting[0]
            need = head.blocks_needed()
            if held - self.used >= need:
                self.waiting.popleft()
                head.blocks = need
                self.running.append(head)
                if head.first_ask_step is not None:
                    self.critical_waits.append(self.steps - head.first_ask_step)
                continue
            if head.priority is Priority.CRITICAL:
                if head.first_ask_step is None:
                    head.first_ask_step = self.steps
                ask = PreemptAsk(head.priority, need - (held - self.used))
            break
        need = self.waiting[0].blocks_needed() if self.waiting else 0
        plan = plan_blocks(held=held, used=self.used, need=need, chunk=CHUNK)
        by_priority = [0, 0, 0]
        for req in self.running:
            by_priority[int(req.priority)] += req.blocks
        self.grant = self.member.step(
            active=bool(self.running or self.waiting),
            want_blocks=plan.want,
            release_blocks=release + plan.release,
            blocks_by_priority=by_priority,
            ask=ask,
        )


def jain(values: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2); 1 when all are equal."""
    square_sum = sum(v * v for v in values)
    return (sum(values) ** 2) / (len(values) * square_sum) if square_sum else 1.0


def run_scenario(
    url: str, name: str, weights: list[float], seconds: float, warmup: float, seed: int
) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    keys = Keys("bench")
    config = PoolConfig(total_blocks=TOTAL_BLOCKS, block_size=BLOCK_SIZE, chunk_blocks=CHUNK)
    create_pool(client, keys, name, config)
    rng = random.Random(seed)
    workers = []
    for i, weight in enumerate(weights):
        m = KVPoolMember(client=client, keys=keys, pool=name, member=f"w{i}", weight=weight)
        m.join()
        workers.append(SimWorker(m, random.Random(rng.random())))
    if name == "preempt":
        workers[-1].saturated = False
    # per 1 s window: per-member sums of held and used, and the number of samples
    windows: dict[int, list[list[float]]] = {}
    start = time.monotonic()
    rounds = 0
    while (now := time.monotonic()) - start < warmup + seconds:
        order = list(workers)
        rng.shuffle(order)
        for w in order:
            idle = not w.waiting and not w.running
            if name == "preempt" and w is workers[-1] and idle and rng.random() < 0.02:
                w.waiting.append(w.new_request(Priority.CRITICAL))
            w.step()
        rounds += 1
        if now - start < warmup:
            continue
        second = int(now - start - warmup)
        win = windows.setdefault(second, [[0.0] * len(workers) for _ in range(3)])
        for i, w in enumerate(workers):
            win[0][i] += w.member.held
            win[1][i] += w.used
        win[2][0] += 1
    elapsed = time.monotonic() - start - warmup
    client.close()
    full = [win for second, win in windows.items() if second < int(seconds)]
    held = [[h / win[2][0] for h in win[0]] for win in full]
    used = [[u / win[2][0] for u in win[1]] for win in full]
    busy = [i for i, w in enumerate(workers) if w.saturated]
    return {
        "name": name,
        "weights": weights,
        "windows": len(full),
        "steps_per_s": rounds * len(workers) / (elapsed + warmup),
        "util_held": statistics.mean(sum(h) for h in held) / TOTAL_BLOCKS,
        "util_used": statistics.mean(sum(u) for u in used) / TOTAL_BLOCKS,
        # fairness relative to weight: x_i = held_i / w_i over the saturated members
        "jain_min": min(jain([h[i] / weights[i] for i in busy]) for h in held),
        "jain_mean": statistics.mean(jain([h[i] / weights[i] for i in busy]) for h in held),
        "jain_used_mean": statistics.mean(jain([u[i] / weights[i] for i in busy]) for u in used),
        "mean_held": [statistics.mean(h[i] for h in held) for i in range(len(workers))],
        "tokens_per_s": [w.tokens / (elapsed + warmup) for w in workers],
        "preempted": sum(w.preempted for w in workers),
        "critical_waits": workers[-1].critical_waits,
    }


def report(results: list[dict[str, Any]], command: str) -> str:
    lines = [
        "## Shared KV pools (issue 6)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {platform.system()}, Python {platform.python_version()}; "
        f"pool of {TOTAL_BLOCKS} blocks of {BLOCK_SIZE} tokens, cap 900 permille, chunk {CHUNK}; "
        "simulated saturated workers stepping round-robin, one `POOL_STEP` call per step, "
        "against a private redis-server (Redis `TIME` clock). held = blocks granted by the pool; "
        "used = blocks the toy engines' running requests occupy (the rest is ask-ahead spare). "
        "Local preemptions are the toy engines' own recompute preemptions (growth beyond the "
        "grant, release targets, orders).",
        "",
        "| scenario | 1 s windows | steps/s | held / total | used / total | "
        "Jain of held/weight per window (min / mean) | Jain of used/weight (mean) "
        "| local preemptions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} (weights {', '.join(f'{w:g}' for w in r['weights'])}) "
            f"| {r['windows']} | {r['steps_per_s']:.0f} | {r['util_held']:.1%} "
            f"| {r['util_used']:.1%} | {r['jain_min']:.4f} / {r['jain_mean']:.4f} "
            f"| {r['jain_used_mean']:.4f} | {r['preempted']} |"
        )
    lines += ["", "| scenario | member | weight | weight share | held share | deviation |"]
    lines.append("|---|---|---|---|---|---|")
    for r in results:
        if r["name"] == "preempt":
            continue
        total_w, total_h = sum(r["weights"]), sum(r["mean_held"])
        for i, (w, h) in enumerate(zip(r["weights"], r["mean_held"], strict=True)):
            target, share = w / total_w, h / total_h
            lines.append(
                f"| {r['name']} | w{i} | {w:g} | {target:.1%} | {share:.1%} "
                f"| {share / target - 1:+.2%} |"
            )
    for r in results:
        if r["name"] == "preempt" and r["critical_waits"]:
            waits = sorted(r["critical_waits"])
            lines += [
                "",
                f"Cross-worker preemption ({len(waits)} critical requests on a member with no "
                "blocks while 3 members run batch work): steps of the requesting member from the "
                f"first ask to admission: median {statistics.median(waits):g}, "
                f"max {waits[-1]}.",
            ]
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds left out at the start")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only")
    add_record_flag(parser)
    args = parser.parse_args()
    command = run_command(sys.argv)  # the HISTORY section's, as the headline row's
    scenarios = [
        ("equal", [1.0, 1.0, 1.0, 1.0]),
        ("weighted", [1.0, 2.0, 3.0, 4.0]),
        ("preempt", [1.0, 1.0, 1.0, 1.0]),
    ]
    results = []
    with RedisServer() as server:
        for name, weights in scenarios:
            seconds = args.seconds if name != "preempt" else max(3.0, args.seconds / 3)
            results.append(run_scenario(server.url, name, weights, seconds, args.warmup, args.seed))
    text = report(results, command)
    print(text)
    if not args.no_write:  # append: other benchmarks write their own sections
        with HISTORY.open("a") as f:
            if f.tell() == 0:
                f.write("# Benchmark history\n")
            f.write("\n" + text)
    if args.record:
        record_figures(
            headline_figures(results), benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS
        )
    return 0


def headline_figures(results: list[dict[str, Any]]) -> dict[str, str]:
    """The rows of benchmarks/RESULTS.md this run measures: the equal scenario's utilisation and
    its lowest window's fairness, and the weighted scenario's largest deviation from the weights."""
    by_name = {r["name"]: r for r in results}
    equal, weighted = by_name["equal"], by_name["weighted"]
    total_w, total_h = sum(weighted["weights"]), sum(weighted["mean_held"])
    deviation = max(
        abs((h / total_h) / (w / total_w) - 1)
        for w, h in zip(weighted["weights"], weighted["mean_held"], strict=True)
    )
    return {
        "kv-pool-held": f"{equal['util_held']:.1%} ({equal['util_used']:.1%} used)".replace(
            "%", " %"
        ),
        "kv-pool-jain": f"{equal['jain_min']:.4f}",
        "kv-pool-weighted": f"{deviation:.2%}".replace("%", " %"),
    }


if __name__ == "__main__":
    raise SystemExit(main())
