"""Huge prompts and the other streams: inter-token gaps of running streams while big prompts arrive.

One real worker process (tiny model, 1 torch thread) behind a private redis-server streams
``--streams`` requests (greedy, prompts chosen so that none meets EOS early: every stream runs
``--stream-tokens`` tokens). Once each has 20 tokens, big prompts are submitted through the
producer's ``Client.submit``, depending on the scenario:

* ``baseline``: none;
* ``oversize``: ``--oversize`` text prompts of ``--oversize-bytes`` (1,000,000: the default
  payload limit is 1 MiB) — far over ``max_model_len``, refused on the cheap bound;
* ``near-bound``: as many prompts just under the bound (95 % of ``max_model_len`` × the most
  bytes per token: ~50 KB, ~27,000 tokens for the tiny model), which must be tokenized to be
  refused (on the thread, after the change);
* ``fitting``: ``--fitting`` text prompts of ``--fitting-chars`` characters that fit (they run:
  their prefill chunks, not their tokenizing, set the gaps then, in both modes).

The client times every token event it receives; a stream's inter-token gap is the time between
two consecutive tokens of it. Each scenario runs on two workers, side by side in one run:

* ``inline``: the code path before issue 15 (the same worker with ``PromptPrep`` reduced to
  it: no cheap bound, every prompt tokenized by the engine on the loop, refused after);
* ``off-loop``: the worker as shipped (refused on the bound, long prompts tokenized on a thread).

Run::

    .venv/bin/python benchmarks/bench_huge_prompts.py          # about 1 minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis

from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures

HEADLINE_KEYS = ("huge-prompts",)  # its row in benchmarks/RESULTS.md

SCENARIOS = ("baseline", "oversize", "near-bound", "fitting")
MODES = ("inline", "off-loop")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=4, help="running streams (4)")
    p.add_argument("--stream-tokens", type=int, default=200, help="tokens per stream (200)")
    p.add_argument("--oversize", type=int, default=5, help="oversize prompts (5)")
    p.add_argument("--oversize-bytes", type=int, default=1_000_000, help="their size (1e6)")
    p.add_argument("--fitting", type=int, default=3, help="long prompts that fit (3)")
    p.add_argument("--fitting-chars", type=int, default=6000, help="their size (6000)")
    p.add_argument("--rounds", type=int, default=1, help="repeat every (mode, scenario) (1)")
    p.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)  # the worker process
    add_record_flag(p)
    return p


# -- the worker process ---------------------------------------------------------------------------
def serve(mode: str, argv: list[str]) -> int:
    """A ``tokenfleet worker`` process; ``inline``: with the pre-issue-15 prompt path."""
    import logging

    import torch

    from tokenfleet.worker.cli import build_parser as worker_parser
    from tokenfleet.worker.commands.worker import build_settings
    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.service import WorkerService
    from tokenfleet.worker.service.prompt_prep import PromptPrep

    class InlinePrep(PromptPrep):
        """Before issue 15: no cheap bound, every prompt tokenized by the engine on the loop."""

        def check(self, req: Any) -> None:
            return None

        def off_loop(self, req: Any) -> bool:
            return False

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    settings, ws = build_settings(worker_parser().parse_args(["worker", *argv]))
    torch.set_num_threads(1)
    engine = Engine(ws.model, **ws.engine_overrides())
    service = WorkerService(engine, settings, ws)
    if mode == "inline":
        service.feed.prep = InlinePrep(engine.tokenizer, engine.max_model_len, lambda r: "")
    service.install_signal_handlers()
    return service.run()


# -- the client side ------------------------------------------------------------------------------
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
        self.token_times: dict[str, list[float]] = {}
        self.ends: dict[str, tuple[float, dict[str, Any]]] = {}
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            msg = self.pubsub.get_message(timeout=0.2)
            if not msg or msg["type"] != "pmessage":
                continue
            now = time.monotonic()
            ev = orjson.loads(msg["data"])
            if ev["type"] == "token":
                self.token_times.setdefault(ev["id"], []).append(now)
            else:
                self.ends[ev["id"]] = (now, ev)

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.pubsub.close()
        self.client.close()


@dataclass
class Run:
    mode: str
    scenario: str
    gaps_s: list[float] = field(default_factory=list)  # the streams' inter-token gaps
    big_end_s: list[float] = field(default_factory=list)  # big prompt submitted -> its end
    big_ends: list[str] = field(default_factory=list)  # their terminal status/code

    def gap_ms(self, q: float) -> float:
        gaps = sorted(self.gaps_s)
        return 1e3 * gaps[min(len(gaps) - 1, int(q * len(gaps)))]


def wait_for(predicate: Any, what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.005)


def big_prompts(scenario: str, args: argparse.Namespace) -> list[str]:
    words = "the quick brown fox jumps over the lazy dog and keeps running far away "
    if scenario == "oversize":
        size, count = args.oversize_bytes, args.oversize
    elif scenario == "near-bound":
        size, count = int(0.95 * args.bound_bytes), args.oversize
    elif scenario == "fitting":
        size, count = args.fitting_chars, args.fitting
    else:
        return []
    return [(f"{i} " + words * (size // len(words) + 1))[:size] for i in range(count)]


def run_scenario(
    client: Any,
    url: str,
    prefix: str,
    mode: str,
    scenario: str,
    streams: list[list[int]],
    args: Any,
) -> Run:
    listener = Listener(url, prefix)
    run = Run(mode, scenario)
    try:
        tag = uuid.uuid4().hex[:6]
        ids = []
        for i, prompt in enumerate(streams):
            rid = f"s{i}-{tag}"
            client.submit(
                prompt=prompt, max_tokens=args.stream_tokens, temperature=0, request_id=rid
            ).close()
            ids.append(rid)
        wait_for(lambda: all(len(listener.token_times.get(r, ())) >= 20 for r in ids), "streams")
        submitted: dict[str, float] = {}
        for i, text in enumerate(big_prompts(scenario, args)):
            rid = f"b{i}-{tag}"
            submitted[rid] = time.monotonic()
            client.submit(prompt=text, max_tokens=8, temperature=0, request_id=rid).close()
        wait_for(lambda: all(r in listener.ends for r in [*ids, *submitted]), "every end")
        for rid in ids:
            times = listener.token_times[rid]
            if len(times) != args.stream_tokens:
                raise RuntimeError(f"{rid}: {len(times)} tokens, not {args.stream_tokens}")
            run.gaps_s += [b - a for a, b in itertools.pairwise(times)]
        for rid, t0 in submitted.items():
            end_t, ev = listener.ends[rid]
            run.big_end_s.append(end_t - t0)
            run.big_ends.append(ev.get("code") or ev.get("status", "?"))
    finally:
        listener.close()
    return run


def stream_prompts(model: str, args: argparse.Namespace) -> list[list[int]]:
    """Prompts whose greedy output runs ``--stream-tokens`` tokens without meeting EOS."""
    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.engine.request import SamplingParams

    engine = Engine(model, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=args.stream_tokens)
    found: list[list[int]] = []
    for k in range(1, 200):
        prompt = [(k * 13 + 5 * i) % 600 + 10 for i in range(24)]
        (out,) = engine.generate([prompt], params)
        if len(out.token_ids) == args.stream_tokens:
            found.append(prompt)
            if len(found) == args.streams:
                return found
    raise RuntimeError("not enough prompts that run to max_tokens")


def prompt_bound_bytes(model: str) -> int:
    """The most bytes a prompt may have before the worker refuses it on the cheap bound."""
    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.service.prompt_bound import token_bound_for

    engine = Engine(model, device="cpu")
    bound, why = token_bound_for(engine.tokenizer)
    if bound is None:
        raise RuntimeError(f"no cheap bound for this tokenizer: {why}")
    return engine.max_model_len * bound.max_bytes_per_token


def start_worker(mode: str, model: str, url: str, prefix: str, log_dir: Path) -> Any:
    name = f"huge-{mode}-{uuid.uuid4().hex[:4]}"
    env = {**os.environ, "REDIS_URL": url, "TOKENFLEET_KEY_PREFIX": prefix}
    log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed by the child
    argv = [sys.executable, __file__, "--serve", mode, "--model", model, "--name", name]
    argv += ["--threads", "1", "--max-num-seqs", "16", "--log-level", "WARNING"]
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    from tokenfleet.shared.keys import Keys

    rc = redis.Redis.from_url(url)
    wait_for(lambda: rc.exists(Keys(prefix).worker(name)) or proc.poll() is not None, "worker")
    rc.close()
    if proc.poll() is not None:
        raise RuntimeError((log_dir / f"{name}.log").read_text()[-3000:])
    return proc


def main() -> int:
    args, rest = build_parser().parse_known_args()
    if args.serve:
        return serve(args.serve, rest)
    import torch

    from tokenfleet.producer import Client
    from tokenfleet.shared.settings import Settings
    from tokenfleet.worker.devtools.local_redis import RedisServer
    from tokenfleet.worker.devtools.tiny_model import cached_tiny_model

    torch.set_num_threads(1)
    model = str(cached_tiny_model())
    streams = stream_prompts(model, args)
    args.bound_bytes = prompt_bound_bytes(model)
    print(
        f"model {model}; cpu cores {os.cpu_count()}; {args.streams} streams of "
        f"{args.stream_tokens} tokens; oversize: {args.oversize} x {args.oversize_bytes} bytes; "
        f"near-bound: {args.oversize} x {int(0.95 * args.bound_bytes)} bytes; "
        f"fitting: {args.fitting} x {args.fitting_chars} chars; rounds {args.rounds}",
        flush=True,
    )
    runs: list[Run] = []
    log_dir = Path(tempfile.mkdtemp(prefix="bench-huge-"))
    with RedisServer() as server:
        url = server.url
        for _ in range(args.rounds):
            for mode in MODES:
                prefix = f"huge-{uuid.uuid4().hex[:6]}"
                settings = Settings(redis_url=url, key_prefix=prefix, record_ttl_s=600)
                proc = start_worker(mode, model, url, prefix, log_dir)
                try:
                    with Client.from_url(url, settings=settings) as client:
                        client.submit(prompt=[7] * 40, max_tokens=8, temperature=0).result(
                            timeout=120
                        )  # warm
                        for scenario in SCENARIOS:
                            run = run_scenario(client, url, prefix, mode, scenario, streams, args)
                            runs.append(run)
                            print(f"  {mode:8} {scenario:8} done", flush=True)
                finally:
                    proc.terminate()
                    proc.wait(60)
    print()
    print(
        "| worker | big prompts arriving | gap p50 ms | gap p99 ms | gap max ms | "
        "big prompt: submit -> end, s (median / max) | their end |"
    )
    print("|---|---|---|---|---|---|---|")
    gap_max_ms: dict[tuple[str, str], float] = {}
    for scenario in SCENARIOS:
        for mode in MODES:
            rs = [r for r in runs if r.mode == mode and r.scenario == scenario]
            merged = Run(mode, scenario)
            for r in rs:
                merged.gaps_s += r.gaps_s
                merged.big_end_s += r.big_end_s
                merged.big_ends += r.big_ends
            big = (
                f"{statistics.median(merged.big_end_s):.3f} / {max(merged.big_end_s):.3f}"
                if merged.big_end_s
                else "-"
            )
            ends = ", ".join(sorted(set(merged.big_ends))) or "-"
            gap_max_ms[mode, scenario] = 1e3 * max(merged.gaps_s)
            print(
                f"| {mode} | {scenario} | {merged.gap_ms(0.5):.1f} | {merged.gap_ms(0.99):.1f} | "
                f"{1e3 * max(merged.gaps_s):.1f} | {big} | {ends} |"
            )
    if args.record:  # its row in benchmarks/RESULTS.md: the worker as shipped
        shipped = gap_max_ms["off-loop", "oversize"]
        quiet = gap_max_ms["off-loop", "baseline"]
        figures = {HEADLINE_KEYS[0]: f"{shipped:.0f} ms (no arrivals: {quiet:.0f} ms)"}
        record_figures(figures, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
