"""Where an engine step's time goes on a real model: the parts of one step, measured.

Runs the engine on the real-model chat workload (all requests at once, greedy, EOS ignored, so
every request generates exactly its max_tokens) and splits the time of every ``engine.step()``
into: scheduling (``scheduler.schedule``), building the step's index tensors
(``ModelRunner._build_step``), the model's forward split by module kind (attention: the paged
attention function itself; q/k/v/o projections; MLP; norms and embeddings, rotary and the rest of
the forward's Python, as the remainder; LM head), sampling, and the post-processing around
sampling (detokenizing, stop checks, outputs). Each part is timed with ``perf_counter`` around the
real call (module forward hooks, wrapped methods), so the split adds a few microseconds per hook
to what it measures; the total is also measured without any hook, and the table gives both.

    .venv/bin/python benchmarks/profile_engine_step.py --model smollm2 --threads 1
    .venv/bin/python benchmarks/profile_engine_step.py --requests 1  # batch 1
    .venv/bin/python benchmarks/profile_engine_step.py --quantization none  # dequantized, float32
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import chat_workload


class Clock:
    """Accumulates seconds per part; ``wrap`` times a callable, ``hook`` a module's forward."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1

        return timed

    def hook(self, part: str, module: torch.nn.Module) -> None:
        starts: list[float] = []

        def pre(*_: Any) -> None:
            starts.append(time.perf_counter())

        def post(*_: Any) -> None:
            self.seconds[part] += time.perf_counter() - starts.pop()
            self.calls[part] += 1

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def run(engine: Any, workload: Any) -> tuple[float, int, int]:
    """Seconds spent in ``engine.step()``, steps taken and tokens generated, for the workload."""
    from tokenfleet.worker.engine.request import SamplingParams

    for req in workload.requests:
        params = SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True)
        engine.add_request(req.request_id, list(req.prompt_token_ids), params)
    total, steps, tokens = 0.0, 0, 0
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        total += time.perf_counter() - start
        steps += 1
        tokens += sum(len(o.new_token_ids) for o in outputs)
    return total, steps, tokens


def instrument(engine: Any, clock: Clock) -> None:
    """Time every part of a step (see the module docstring)."""
    from transformers import AttentionInterface

    from tokenfleet.worker.engine.paged_attention import (
        ATTN_IMPLEMENTATION,
        paged_attention_forward,
    )

    timed_attention = clock.wrap("attention (paged function)", paged_attention_forward)
    AttentionInterface.register(ATTN_IMPLEMENTATION, timed_attention)
    runner = engine.runner
    fast = runner.fast  # the fast decoder loop (fast_forward.py) calls modules' parts itself
    if fast is not None:
        fast.attention = timed_attention
        runner._forward = clock.wrap("model forward", runner._forward)
    runner._build_step = clock.wrap("step index tensors", runner._build_step)
    engine.scheduler.schedule = clock.wrap("scheduling", engine.scheduler.schedule)
    engine.sampler.sample = clock.wrap("sampling", engine.sampler.sample)
    engine._postprocess = clock.wrap("post-processing (incl. sampling)", engine._postprocess)
    model = runner.model
    if fast is None:
        clock.hook("model forward", model)
    clock.hook("LM head", model.lm_head)
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj"):  # fused or not
            if hasattr(attn, name):
                clock.hook("q/k/v/o projections", getattr(attn, name))
        if fast is None:
            clock.hook("MLP", layer.mlp)
        else:  # its products (the activation and product between them count as the rest)
            clock.hook("MLP", layer.mlp.gate_up_proj)
            clock.hook("MLP", layer.mlp.down_proj)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument(
        "--quantization", default="auto", help="auto | none | int8 | int4 (the engine's setting)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tokenfleet.worker.engine.engine import Engine, EngineConfig
    from tokenfleet.worker.models.resolve import resolve_model

    folder = resolve_model(args.model)
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        kv_memory_bytes=1 << 30,
        quantization=args.quantization,
        seed=0,
    )
    plain = Engine(folder, config)
    wl = chat_workload(args.requests, tokenizer=plain.tokenizer, rate_per_s=1e9, seed=0)
    run(plain, wl)  # warm-up
    bare_s, steps, tokens = run(plain, wl)
    engine = Engine.from_runner(plain.runner, plain.tokenizer, config)
    clock = Clock()
    instrument(engine, clock)
    total_s, _, _ = run(engine, wl)
    secs = clock.seconds
    forward = secs["model forward"]
    parts = [
        ("scheduling", secs["scheduling"]),
        ("step index tensors", secs["step index tensors"]),
        ("attention (paged function)", secs["attention (paged function)"]),
        ("q/k/v/o projections", secs["q/k/v/o projections"]),
        ("MLP", secs["MLP"]),
        ("LM head", secs["LM head"]),
        (
            "rest of the forward (norms, rotary, embeddings, module Python)",
            forward
            - secs["attention (paged function)"]
            - secs["q/k/v/o projections"]
            - secs["MLP"]
            - secs["LM head"],
        ),
        ("sampling", secs["sampling"]),
        (
            "post-processing without sampling (detokenize, stop checks, outputs)",
            secs["post-processing (incl. sampling)"] - secs["sampling"],
        ),
    ]
    accounted = sum(v for _, v in parts)
    report: Any = getattr(plain.runner, "quantization", None)
    quantized = report.describe() if report is not None else "none"
    parts.append(("rest of step() (stats, outputs, Python)", total_s - accounted))
    print(
        f"\nengine step profile: {args.model}, {len(wl.requests)} chat requests at once, "
        f"{wl.num_prompt_tokens} prompt + {wl.num_output_tokens} output tokens, "
        f"{args.threads} thread(s), quantization {quantized}; "
        f"{steps} steps, {tokens} tokens"
    )
    print(
        f"step time without hooks {bare_s:.2f} s ({1000 * bare_s / steps:.1f} ms/step, "
        f"{tokens / bare_s:.0f} tok/s); with hooks {total_s:.2f} s"
    )
    print("| part | seconds | share of step time |")
    print("|---|---:|---:|")
    for name, value in parts:
        print(f"| {name} | {value:.2f} | {100 * value / total_s:.1f} % |")


if __name__ == "__main__":
    main()
