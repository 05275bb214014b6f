"""Mixed-workload benchmark: the Engine against Hugging Face static and continuous batching.

The same seeded workload (``workload.make_workload``: Poisson arrivals, prompts 16-256 tokens,
max_tokens 8-256, greedy, EOS ignored so every request generates exactly its max_tokens) is
replayed in real time against three sides, one after the other in one process:

* ``ours``: ``Engine.step()`` in a loop, requests added as they arrive (continuous batching,
  chunked prefill, paged KV cache, prefix caching on).
* ``ours-int4``: the same engine with its linear layers executed as int4 weights
  (``quantization="int4"``, issue 31; on a float model they are quantized at load).
* ``hf-static``: ``model.generate`` on static batches of 32 formed in arrival order; a batch
  starts when its last member has arrived and the previous batch is done, left-padded, and runs
  until its longest member ends (``min_new_tokens = max_new_tokens``: EOS ignored).
* ``hf-cb``: transformers' own continuous batching (``model.init_continuous_batching()``,
  ``ContinuousBatchingManager.add_request`` at each arrival), with the same KV capacity, token
  budget and sequence limit as ours.

Throughput = requested output tokens / (last finish - workload start). TTFT = first token - arrival;
TPOT = (last token - first token) / (tokens - 1), per request. Sides alternate over ``--rounds``
rounds; the table gives median throughputs, the per-round ratios and their median, and latency
percentiles over all rounds. Run::

    .venv/bin/python benchmarks/bench_engine_workload.py               # 64 requests, 2 threads
    .venv/bin/python benchmarks/bench_engine_workload.py --rate 200    # saturating arrivals
    .venv/bin/python benchmarks/bench_engine_workload.py --model smollm2 --chat --requests 32 \
        --threads 1                                                    # the real-model workload
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import Workload, chat_workload, make_workload, percentile

from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures

# benchmarks/RESULTS.md rows this script measures: ours ÷ a side, by the command of each row
HEADLINE_KEYS = (  # its rows in benchmarks/RESULTS.md: ours ÷ HF static, then ÷ HF CB
    *("engine-static-20", "engine-static-200", "smollm2-engine-static"),
    *("engine-cb-20", "engine-cb-200", "smollm2-engine-cb"),
)
SIDE_KEYS = {"hf-static": HEADLINE_KEYS[:3], "hf-cb": HEADLINE_KEYS[3:]}  # the side's rows


@dataclasses.dataclass(slots=True)
class SideResult:
    name: str
    num_output_tokens: int = 0
    makespan_s: float = 0.0
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    tpot_s: list[float] = dataclasses.field(default_factory=list)
    extra: str = ""

    @property
    def throughput(self) -> float:
        return self.num_output_tokens / self.makespan_s if self.makespan_s else 0.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        help="bundled name (smollm2), .gguf file or model folder (default: a fresh tiny llama)",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="prompts are chat turns through the model's template, 10-200 tokens, 16-128 new "
        "(the real-model workload); default: random token prompts 16-256, 8-256 new",
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--plot", help="write each side's TTFT distribution (CDF) to this PNG")
    parser.add_argument("--rate", type=float, default=20.0, help="mean arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="torch device of every side (cuda)")
    # Continuous batching's own limits (ours and hf-cb alike); the static baseline is always
    # --static-batch. 64 / 1024 measured faster on CPU than 32 / 512 (fewer, fuller steps).
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--static-batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all sides, alternating")
    parser.add_argument(
        "--sides",
        default="ours,ours-int4,hf-static,hf-cb",
        help="comma-separated: ours, ours-int4, hf-static, hf-cb",
    )
    add_record_flag(parser)
    return parser


def run_ours(
    model_dir: Path,
    wl: Workload,
    args: argparse.Namespace,
    num_kv_blocks: int,
    quantization: str = "none",
) -> SideResult:
    from tokenfleet.worker.engine.engine import Engine, EngineConfig
    from tokenfleet.worker.engine.request import SamplingParams

    engine = Engine(
        model_dir,
        EngineConfig(
            block_size=args.block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_batched_tokens,
            device=args.device,
            dtype="float32",
            max_wait_s=None,
            quantization=quantization,
        ),
    )
    engine.generate([[7] * 40] * 4, SamplingParams(temperature=0, max_tokens=8))  # warm-up
    engine.block_manager.reset_prefix_cache()
    res = SideResult("ours" if quantization == "none" else f"ours-{quantization}")
    pending = deque(wl.requests)
    start = time.time()
    last_finish = start
    preemptions = steps = 0
    while pending or engine.has_unfinished():
        now = time.time()
        while pending and start + pending[0].arrival_s <= now:
            r = pending.popleft()
            params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
            engine.add_request(
                r.request_id, r.prompt_token_ids, params, arrival_time=start + r.arrival_s
            )
        if not engine.has_unfinished():
            time.sleep(max(0.0, start + pending[0].arrival_s - time.time()))
            continue
        for out in engine.step():
            if out.finished:
                t = out.timings
                assert t is not None and t.ttft_s is not None and t.finish_time is not None
                assert out.num_output_tokens == next(
                    r.max_tokens for r in wl.requests if r.request_id == out.request_id
                )
                res.num_output_tokens += out.num_output_tokens
                res.ttft_s.append(t.ttft_s)
                if t.tpot_s is not None:
                    res.tpot_s.append(t.tpot_s)
                last_finish = max(last_finish, t.finish_time)
        steps += 1
        preemptions += engine.last_step_stats.num_preemptions
    res.makespan_s = last_finish - start
    res.extra = f"{steps} steps, {preemptions} preemptions"
    return res


def load_hf(model_dir: Path, device: str = "cpu") -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to(device).eval()


def run_hf_static(model_dir: Path, wl: Workload, args: argparse.Namespace) -> SideResult:
    from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList

    model = load_hf(model_dir, args.device)
    pad = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    step_times: list[float] = []

    class RecordStep(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            step_times.append(time.perf_counter())
            return scores

    def generate(prompts: list[tuple[int, ...]], max_new_tokens: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts]).to(args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        mask = mask.to(args.device)
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([RecordStep()]),
            )

    generate([(7,) * 40] * 4, 8)  # warm-up
    res = SideResult("hf-static")
    start = time.perf_counter()
    end = start
    size = args.static_batch
    for b in range(0, len(wl.requests), size):
        batch = wl.requests[b : b + size]
        ready = start + batch[-1].arrival_s
        if time.perf_counter() < ready:
            time.sleep(ready - time.perf_counter())
        step_times.clear()
        generate([r.prompt_token_ids for r in batch], max(r.max_tokens for r in batch))
        end = time.perf_counter()
        for r in batch:
            first, last = step_times[0], step_times[r.max_tokens - 1]
            res.ttft_s.append(first - (start + r.arrival_s))
            if r.max_tokens > 1:
                res.tpot_s.append((last - first) / (r.max_tokens - 1))
            res.num_output_tokens += r.max_tokens
    res.makespan_s = end - start
    res.extra = f"batches of {size}"
    return res


def run_hf_cb(
    model_dir: Path, wl: Workload, args: argparse.Namespace, num_kv_blocks: int
) -> SideResult:
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf(model_dir, args.device)
    pad = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.max_tokens for r in wl.requests),
        eos_token_id=None,  # disabled: every request generates its max_new_tokens
        pad_token_id=pad,
    )
    cb = ContinuousBatchingConfig(
        page_size=args.block_size,
        num_blocks=num_kv_blocks,
        max_batch_tokens=args.max_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
    )
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    # The manager computes in its own thread, where torch.set_num_threads from the main thread
    # does not apply (OpenMP settings are per thread): set it there too, so that every side
    # computes with the same number of threads.
    loop = manager._run_generation_loop

    def loop_with_threads(*loop_args: Any, **loop_kwargs: Any) -> None:  # 5.x passes kwargs
        torch.set_num_threads(args.threads)
        loop(*loop_args, **loop_kwargs)

    manager._run_generation_loop = loop_with_threads
    manager.start()
    try:

        def drain(expected: int, feed: Callable[[], float | None]) -> list[Any]:
            done: list[Any] = []
            while len(done) < expected:
                if not manager.is_running():  # its thread died: its traceback is above
                    raise RuntimeError("hf-cb: the continuous batching manager stopped")
                timeout = feed()
                result = manager.get_result(
                    timeout=0.05 if timeout is None else max(timeout, 0.001)
                )
                if result is not None and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"hf-cb request failed: {result.error}")
                    done.append(result)
            return done

        for i in range(4):  # warm-up
            manager.add_request([7] * 40, request_id=f"warm-{i}", max_new_tokens=8)
        drain(4, lambda: None)

        res = SideResult("hf-cb")
        pending = deque(wl.requests)
        start = time.perf_counter()
        arrival = {r.request_id: start + r.arrival_s for r in wl.requests}

        def feed() -> float | None:
            now = time.perf_counter()
            while pending and start + pending[0].arrival_s <= now:
                r = pending.popleft()
                manager.add_request(
                    list(r.prompt_token_ids),
                    request_id=r.request_id,
                    max_new_tokens=r.max_tokens,
                    record_timestamps=True,
                )
            return start + pending[0].arrival_s - now if pending else None

        last = start
        for result in drain(len(wl.requests), feed):
            ts = result.timestamps
            res.num_output_tokens += len(result.generated_tokens)
            res.ttft_s.append(ts[0] - arrival[result.request_id])
            if len(ts) > 1:
                res.tpot_s.append((ts[-1] - ts[0]) / (len(ts) - 1))
            last = max(last, ts[-1])
        res.makespan_s = last - start
        res.extra = f"page_size {args.block_size}, {num_kv_blocks} pages"
        return res
    finally:
        manager.stop(block=True, timeout=10)


def in_thread(side: Callable[[], SideResult], num_threads: int) -> SideResult:
    """Run one side in a fresh thread with ``num_threads`` torch threads set there.

    transformers' continuous batching computes in its own thread; every side does the same so
    that all see the same threading (torch's thread settings are per thread, and on a busy
    machine 2-way intra-op parallelism in the main thread measured several times slower).
    """
    box: list[SideResult | BaseException] = []

    def target() -> None:
        torch.set_num_threads(num_threads)
        try:
            box.append(side())
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    from tokenfleet.worker.devtools.tiny_model import make_tiny_model
    from tokenfleet.worker.models.resolve import resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir = resolve_model(args.model)
        else:
            model_dir = make_tiny_model(Path(tmp) / "tiny-llama")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if args.chat:
            wl = chat_workload(
                args.requests, tokenizer=tokenizer, rate_per_s=args.rate, seed=args.seed
            )
        else:
            wl = make_workload(
                args.requests, vocab_size=len(tokenizer), rate_per_s=args.rate, seed=args.seed
            )
        # KV capacity: every admitted request can reach its longest length (no preemption needed)
        longest = max(len(r.prompt_token_ids) + r.max_tokens for r in wl.requests)
        num_kv_blocks = args.max_num_seqs * -(-longest // args.block_size)
        print(
            f"workload: {len(wl.requests)} requests over {wl.duration_s:.2f} s "
            f"(Poisson {args.rate}/s, seed {args.seed}), {wl.num_prompt_tokens} prompt tokens, "
            f"{wl.num_output_tokens} output tokens; {args.threads} threads; "
            f"{num_kv_blocks} KV blocks of {args.block_size}",
            flush=True,
        )
        sides: dict[str, Callable[[], SideResult]] = {
            "ours": lambda: run_ours(model_dir, wl, args, num_kv_blocks),
            "ours-int4": lambda: run_ours(model_dir, wl, args, num_kv_blocks, "int4"),
            "hf-static": lambda: run_hf_static(model_dir, wl, args),
            "hf-cb": lambda: run_hf_cb(model_dir, wl, args, num_kv_blocks),
        }
        names = args.sides.split(",")
        for side in names:
            if side not in sides:
                raise SystemExit(f"unknown side {side!r}; choose from {', '.join(sides)}")
        rounds: list[dict[str, SideResult]] = []
        for i in range(args.rounds):  # sides alternate round by round: load hits all alike
            results: dict[str, SideResult] = {}
            for side in names:
                results[side] = r = in_thread(sides[side], args.threads)
                print(
                    f"  round {i + 1} {side}: {r.throughput:.0f} tok/s in {r.makespan_s:.1f} s "
                    f"({r.extra})",
                    flush=True,
                )
            rounds.append(results)

    print()
    print(
        "| side | output tok/s (median) | ours ÷ side (median) | ours ÷ side per round | "
        "TTFT p50 s | TTFT p99 s | TPOT p50 ms |"
    )
    print("|---|---:|---:|---|---:|---:|---:|")
    figures: dict[str, str] = {}
    for side in names:
        runs = [rnd[side] for rnd in rounds]
        ratios = [rnd["ours"].throughput / rnd[side].throughput for rnd in rounds if "ours" in rnd]
        ttft = [t for r in runs for t in r.ttft_s]
        tpot = [t for r in runs for t in r.tpot_s]
        print(
            f"| {side} | {statistics.median(r.throughput for r in runs):.0f} | "
            f"{statistics.median(ratios):.2f} | {' '.join(f'{x:.2f}' for x in ratios)} | "
            f"{percentile(ttft, 50):.2f} | {percentile(ttft, 99):.2f} | "
            f"{1000 * percentile(tpot, 50):.1f} |"
        )
        if ratios:
            figures.update(
                dict.fromkeys(SIDE_KEYS.get(side, ()), f"{statistics.median(ratios):.2f}")
            )
    if args.record and figures:
        record_figures(figures, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS)
    if args.plot:
        title = f"TTFT, {args.model or 'tiny llama'}, {len(wl.requests)} requests at {args.rate}/s"
        plot_ttft(rounds, names, Path(args.plot), title)


def plot_ttft(
    rounds: list[dict[str, SideResult]], names: list[str], path: Path, title: str
) -> None:
    """Each side's TTFT over all rounds as a cumulative distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for side in names:
        ttft = sorted(t for rnd in rounds for t in rnd[side].ttft_s)
        ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=side)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
