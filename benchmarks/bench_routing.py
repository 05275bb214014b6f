"""Routing (issue 19): a multi-turn chat trace on 2 workers, routed against round-robin and off.

The trace: ``--conversations`` chats, each with its own long system prompt (``--system-chars``
characters of seeded words), ``--turns`` turns each; conversation ``c`` starts at ``c *
--gap-s`` and sends its next turn (its history, the assistant's answer, a new user message)
``--think-s`` after the previous one has ended (a user reading and typing). Each worker's KV
cache (``--kv-blocks``) holds about half of the conversations' prefixes (defaults: 8 system
prompts of about 550 SmolLM2 tokens, histories of 600-700 tokens by the last turn, 192 blocks of
16 tokens per worker), so where a turn lands decides whether its history is a prefix-cache hit.
Steps compute at most ``--max-batched-tokens`` (128: chunked prefill, so an arrival waits for a
short step, not for a whole long prompt's prefill).

Three sides, each on a fresh fleet of 2 workers (1 torch thread each) behind one private
redis-server, rotating which goes first for ``--rounds`` rounds:

* ``routed``: the producer's ``TOKENFLEET_ROUTING=prefix``: each turn carries its session
  (``metadata.session``) and prefix chain; the enqueue script sends it to the session's worker;
* ``rr``: round-robin, the issue's baseline: the n-th turn submitted (over all conversations) goes
  to worker ``n mod 2``, whatever it holds (through the routing machinery itself: two sessions
  pinned to the two workers, each turn naming session ``n mod 2``; the pin is set again before
  each turn, since a steal re-pins a session to its stealer);
* ``off``: ``routing="off"``: every turn goes to the shared stream (the first free worker takes
  it: the fleet's plain load balancing, without routing).

TTFT = first token event seen by this process - just before ``submit``; throughput = output
tokens / (last terminal event - start; think times included, the same on both sides); submit =
the ``submit()`` call's wall time. Run::

    .venv/bin/python benchmarks/bench_routing.py --model smollm2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import redis

from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import percentile

HEADLINE_KEYS = ("routing-ttft", "routing-throughput")  # its rows in benchmarks/RESULTS.md

WORDS = [
    *("policy", "customer", "refund", "order", "shipping", "warranty", "invoice", "account"),
    *("support", "product", "return", "delivery", "payment", "address", "billing", "contract"),
    *("service", "manual", "guide", "answer", "question", "tone", "polite", "brief", "formal"),
    *("detail", "example", "rule", "exception", "escalate", "record", "note", "privacy", "data"),
]


@dataclass
class Side:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    later_ttft_s: list[float] = field(default_factory=list)  # turns 2.. (history to reuse)
    submit_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    makespan_s: float = 0.0
    routes: dict[str, int] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.num_output_tokens / self.makespan_s if self.makespan_s else 0.0


class Listener:
    """Times every event on ``PREFIX:ch:*`` as this process receives it."""

    def __init__(self, url: str, prefix: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.pubsub = self.client.pubsub()
        self.pubsub.psubscribe(f"{prefix}:ch:*")
        while True:
            msg = self.pubsub.get_message(timeout=1.0)
            if msg and msg["type"] == "psubscribe":
                break
        self.first: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.done: dict[str, float] = {}
        self.lock = threading.Lock()
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
            with self.lock:
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


def system_prompts(n: int, chars: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words: list[str] = [f"You are assistant number {i} of the help desk."]
        while sum(len(w) + 1 for w in words) < chars:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words)[:chars])
    return out


def _session(side: str, conversation: int, n: int, num_workers: int) -> str:
    """The session a turn names: its conversation's, or (round-robin) worker n mod W's."""
    return f"rr-{n % num_workers}" if side == "rr" else f"conv-{conversation}"


def run_side(  # noqa: C901, PLR0915 (one side's scenario, read top to bottom)
    name: str, model: str, url: str, args: argparse.Namespace
) -> Side:
    from tokenfleet.producer import Client
    from tokenfleet.shared.keys import Keys
    from tokenfleet.shared.prefix_chain import model_session_hash
    from tokenfleet.shared.settings import Settings
    from tokenfleet.worker.devtools.local_fleet import LocalFleet, delete_prefix

    prefix = f"bench-rt-{uuid.uuid4().hex[:6]}"
    routing = "off" if name == "off" else "prefix"
    settings = Settings(redis_url=url, key_prefix=prefix, record_ttl_s=600, routing=routing)
    fleet = LocalFleet(
        model,
        url,
        key_prefix=prefix,
        num_workers=2,
        extra_args=[
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--kv-blocks",
            str(args.kv_blocks),
            "--steal-after-s",
            str(args.steal_after_s),
            "--max-batched-tokens",
            str(args.max_batched_tokens),
            "--log-level",
            "WARNING",
        ],
    )
    fleet.start()
    pins = redis.Redis.from_url(url) if name == "rr" else None
    keys = Keys(prefix)

    def pin(n: int) -> None:
        """Round-robin: session rr-n pinned to worker n, set again before each turn (a steal
        re-pins a session to its stealer, which would end the round-robin)."""
        assert pins is not None
        worker = fleet.names[n]
        pins.set(keys.session(model_session_hash("default", f"rr-{n}")), worker, ex=3600)

    listener = Listener(url, prefix)
    submitted = [0]  # turns submitted so far (round-robin)
    side = Side(name)
    try:
        with Client.from_url(url, settings=settings) as client:
            for h in [client.submit("warm up", max_tokens=2, temperature=0) for _ in range(4)]:
                h.result(timeout=300)
            systems = system_prompts(args.conversations, args.system_chars, args.seed)
            history: list[list[dict[str, str]]] = [
                [{"role": "system", "content": s}] for s in systems
            ]
            turn = [0] * args.conversations
            current: dict[int, str] = {}  # conversation -> request id in flight
            submitted_at: dict[str, float] = {}
            later: set[str] = set()  # request ids of turns after a conversation's first

            def send(c: int) -> None:
                msgs = [
                    *history[c],
                    {"role": "user", "content": f"Question {turn[c]}: what is rule {c}.{turn[c]}?"},
                ]
                history[c] = msgs
                if pins is not None:
                    pin(submitted[0] % len(fleet.names))
                t0 = time.time()
                h = client.submit(
                    messages=msgs,
                    max_tokens=args.max_tokens,
                    temperature=0,
                    metadata={"session": _session(name, c, submitted[0], len(fleet.names))},
                )
                submitted[0] += 1
                side.submit_s.append(time.time() - t0)
                submitted_at[h.request_id] = t0
                if turn[c]:
                    later.add(h.request_id)
                current[c] = h.request_id
                h.close()

            start = time.time()
            due = {c: start + c * args.gap_s for c in range(args.conversations)}
            while current or due:
                progressed = False
                now = time.time()
                for c, t in list(due.items()):
                    if t <= now:
                        del due[c]
                        send(c)
                        progressed = True
                for c, rid in list(current.items()):
                    with listener.lock:
                        ended = rid in listener.done
                    if not ended:
                        continue
                    progressed = True
                    rec = client.status(rid)
                    how = (rec.taken or rec.route).split(":")[0]  # stolen_by / overflow / route
                    side.routes[how] = side.routes.get(how, 0) + 1
                    history[c] = [*history[c], {"role": "assistant", "content": rec.text or ""}]
                    del current[c]
                    turn[c] += 1
                    if turn[c] < args.turns:
                        due[c] = time.time() + args.think_s
                if not progressed:
                    time.sleep(0.002)
            with listener.lock:
                side.makespan_s = max(listener.done[r] for r in submitted_at) - start
                for rid, t0 in submitted_at.items():
                    side.num_output_tokens += listener.tokens.get(rid, 0)
                    if rid in listener.first:
                        side.ttft_s.append(listener.first[rid] - t0)
                        if rid in later:
                            side.later_ttft_s.append(listener.first[rid] - t0)
    finally:
        listener.close()
        if pins is not None:
            pins.close()
        fleet.stop()
        fleet.cleanup()
        delete_prefix(url, prefix)
    return side


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="bundled name, .gguf or folder")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-chars", type=int, default=4000, help="about 550 SmolLM2 tokens")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=192, help="per worker (16 tokens each)")
    p.add_argument("--think-s", type=float, default=1.0, help="between a turn's end and the next")
    p.add_argument("--gap-s", type=float, default=0.5, help="between conversations' starts")
    p.add_argument("--steal-after-s", type=float, default=0.5, help="the workers' steal bound")
    p.add_argument("--max-batched-tokens", type=int, default=128, help="tokens per step")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--baselines", default="rr,off", help="sides to compare with: rr, off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis-url", default=None)
    add_record_flag(p)
    args = p.parse_args()

    from tokenfleet.worker.devtools.local_redis import RedisServer
    from tokenfleet.worker.models.resolve import resolve_model

    model = str(resolve_model(args.model))
    server = None if args.redis_url else RedisServer().start()
    url = args.redis_url or server.url  # type: ignore[union-attr]
    sides = ["routed", *args.baselines.split(",")]
    results: dict[str, list[Side]] = {name: [] for name in sides}
    try:
        for i in range(args.rounds):
            shift = i % len(sides)  # each side goes first in turn
            for name in sides[shift:] + sides[:shift]:
                side = run_side(name, model, url, args)
                results[name].append(side)
                p50, p90 = (percentile(side.ttft_s, q) * 1000 for q in (50, 90))
                later = percentile(side.later_ttft_s, 50) * 1000
                sub = percentile(side.submit_s, 50) * 1000
                print(
                    f"round {i + 1} {name:>6}: TTFT p50 {p50:7.1f} ms  p90 {p90:7.1f} ms"
                    f"  (turns 2+: p50 {later:7.1f} ms)"
                    f"  throughput {side.throughput:6.1f} tok/s  submit p50 {sub:.2f} ms"
                    f"  routes {side.routes}",
                    flush=True,
                )
    finally:
        if server is not None:
            server.stop()
    print()
    figures: dict[str, str] = {}
    for base in sides[1:]:
        heads = (f"TTFT p50 routed/{base}", f"throughput routed/{base}")
        print(f"{'round':>6} {heads[0]:>22} {heads[1]:>24}")
        ttft_r, tput_r = [], []
        for i, (a, b) in enumerate(zip(results["routed"], results[base], strict=True)):
            ttft_r.append(percentile(a.ttft_s, 50) / percentile(b.ttft_s, 50))
            tput_r.append(a.throughput / b.throughput)
            print(f"{i + 1:>6} {ttft_r[-1]:>22.3f} {tput_r[-1]:>24.3f}")
        print(
            f"{'median':>6} {statistics.median(ttft_r):>22.3f} {statistics.median(tput_r):>24.3f}"
        )
        print()
        if base == "rr":  # the headline rows (benchmarks/RESULTS.md): routed ÷ round-robin
            figures = {
                "routing-ttft": f"{statistics.median(ttft_r):.3f}",
                "routing-throughput": f"{statistics.median(tput_r):.2f}",
            }
    if "off" in results:
        subs_on = [x for s in results["routed"] for x in s.submit_s]
        subs_off = [x for s in results["off"] for x in s.submit_s]
        on, off = percentile(subs_on, 50) * 1000, percentile(subs_off, 50) * 1000
        print(f"submit p50: routing on {on:.3f} ms, off {off:.3f} ms ({on / off:.3f}x)")
    if args.record and figures:
        record_figures(figures, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
