"""Decode-step benchmark: tokenfleet's paged ModelRunner against Hugging Face's padded batch decode.

One decode step = every sequence of the batch gets one new token attended over its context.
Prompts hold ``context - block_size / 2`` tokens; successive steps decode the next
``block_size`` positions in turn and then start over, so contexts average ``context`` tokens and
every sequence opens a new KV block once per cycle, as in a real decode.

* tokenfleet: ``ModelRunner.execute`` of a fresh ``StepBatch`` of single-token chunks (index
  tensors built from the batch each step, as in the engine), one runner per side, with block
  tables either as the engine's ``BlockManager`` hands them out (prompt allocated, then one slot
  per step) or shuffled across the pool (worst case: no two blocks of a table adjacent).
* Hugging Face: ``model(input_ids[B, 1], attention_mask, position_ids,
  past_key_values=DynamicCache)`` on the left-padded batch, default attention (sdpa) and eager;
  the cache is cropped back after each cycle (untimed).

* tokenfleet, quantized (``--quantization``, default int4; ``none`` leaves the side out): the
  same runner with its linear layers executed as int4/int8 weights (issue 31); its logits differ
  from the others by that rounding (the difference is printed, not required to be zero).
  ``--compare-forward`` adds it once more run through the model's own forward instead of the
  runner's fast decoder loop (``fast_forward.py``): the same logits, the loop's saving.

* tokenfleet, KV stored as another dtype (``--kv-dtypes``, e.g. ``float32,bfloat16,float16``):
  the BlockManager side with its cache in 16 bits (attention still computes in float32); its
  logits differ by that rounding (printed). The run also prints the KV tokens each dtype holds
  in the default pool's memory and in the cap of the default sizing (half the free memory).

Every other side computes the same logits (checked first). Repetitions are interleaved and
their order alternates (A B C D, D C B A, ...) so machine noise hits all sides alike; medians
after warm-up.

    .venv/bin/python benchmarks/bench_decode_step.py          # 32 seqs x ~128 tokens, 2 threads
    .venv/bin/python benchmarks/bench_decode_step.py --threads 1 --clock cpu   # on a busy machine
    .venv/bin/python benchmarks/bench_decode_step.py --model smollm2 --batch 1,8,32 --threads 1 \
        --reps 60 --plot benchmarks/plots/decode_smollm2.png      # the real model, with a plot
    .venv/bin/python benchmarks/bench_decode_step.py --model smollm2 --batch 8,32 --context 512 \
        --threads 1 --clock cpu --quantization none --kv-dtypes float32,bfloat16,float16
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures


@dataclass(slots=True)
class Side:
    name: str
    step: Callable[[], torch.Tensor]  # one decode step; returns next-token logits [batch, vocab]
    reset: Callable[[], None] = lambda: None  # untimed: undo what step changed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="decode step: tokenfleet vs HF DynamicCache")
    parser.add_argument(
        "--model",
        help="bundled name (smollm2), .gguf file or model folder (default: a fresh tiny llama)",
    )
    parser.add_argument(
        "--batch",
        default="32",
        help="sequences decoding together; several: comma-separated, e.g. 1,8,32",
    )
    parser.add_argument("--plot", help="write decode tokens/s against batch size to this PNG")
    parser.add_argument("--context", type=int, default=128, help="tokens already cached per seq")
    parser.add_argument("--jitter", type=int, default=0, help="context lengths vary by ± this")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=300, help="timed repetitions per side")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device of every side (cuda)")
    parser.add_argument(
        "--quantization",
        default="int4",
        choices=("none", "int8", "int4", "auto"),
        help="the quantized tokenfleet side's mode (none: no such side)",
    )
    parser.add_argument(
        "--kv-dtypes",
        default="",
        help="extra tokenfleet sides with the KV cache stored as each of these comma-separated "
        "dtypes (bfloat16, float16; the plain sides store float32), and a table of the KV "
        "tokens each holds",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: perf_counter; cpu: this thread's CPU time (needs --threads 1; steadier when "
        "other processes share the cores, since waiting for a core is not counted)",
    )
    parser.add_argument(
        "--compare-forward",
        action="store_true",
        help="add the quantized side once more, run through the model's own forward instead of "
        "the runner's fast decoder loop (fast_forward.py)",
    )
    parser.add_argument(
        "--head-baseline",
        default="none",
        choices=("none", "int8"),
        help="also run the quantized side with this LM head instead of its own (int8: the "
        "int8 QuantizedHead the int4 head replaced), as one more side of the same run",
    )
    add_record_flag(parser)
    return parser


def tokenfleet_side(
    model_dir: Path,
    prompts: list[list[int]],
    lengths: list[int],
    args: argparse.Namespace,
    *,
    shuffled: bool,
    quantization: str = "none",
    fast_forward: bool = True,
    head: str = "none",
    kv_dtype: str | None = None,
) -> Side:
    from tokenfleet.worker.engine.batch import ScheduledSeq, StepBatch
    from tokenfleet.worker.engine.block_manager import BlockManager
    from tokenfleet.worker.engine.model_runner import ModelRunner

    bs, batch = args.block_size, len(prompts)
    per_seq = -(-(max(lengths) + bs) // bs)
    pool = 2 * batch * per_seq
    runner = ModelRunner(model_dir, device=args.device, dtype="float32", block_size=bs,
                         num_kv_blocks=pool, quantization=quantization,
                         fast_forward=fast_forward,
                         kv_dtype=kv_dtype or "float32")  # fmt: skip
    if head != "none":  # the same quantized model with another LM head (--head-baseline)
        from tokenfleet.worker.engine.quantization import HEAD_MAX_ROWS, QuantizedHead

        float_head = runner.model.lm_head.float_head
        runner.model.lm_head = QuantizedHead(float_head, HEAD_MAX_ROWS[head], head)
        runner._quantized_head = runner.model.lm_head
        if runner.fast is not None:
            runner.fast.head = runner.model.lm_head
    if shuffled:  # worst case: no two consecutive blocks of a table adjacent in memory
        blocks = list(range(pool))
        random.Random(args.seed).shuffle(blocks)
        tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    else:  # as the engine's BlockManager hands them out: the prompt, then one slot per step
        manager = BlockManager(pool, bs, enable_prefix_caching=False)
        for i, n in enumerate(lengths):
            manager.allocate(str(i), n)
        for _ in range(bs):
            for i in range(batch):
                manager.append(str(i))
        tables = [manager.block_table(str(i)) for i in range(batch)]
    for i, (toks, n) in enumerate(zip(prompts, lengths, strict=True)):
        runner.execute(StepBatch([ScheduledSeq(str(i), toks[:n], 0, tables[i], False)]))
    # Phase p decodes the token at position n + p of every sequence: block_size steps per cycle,
    # so each sequence starts a new block once per cycle, as in a real decode.
    phases = [
        [
            ScheduledSeq(str(i), [toks[n + p]], n + p, tables[i], True)
            for i, (toks, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        for p in range(bs)
    ]
    phase = [0]

    def step() -> torch.Tensor:
        seqs = phases[phase[0]]
        phase[0] = (phase[0] + 1) % bs
        return runner.execute(StepBatch(list(seqs)))  # a fresh batch per step, as in the engine

    if quantization != "none":
        name = f"tokenfleet, {runner.quantization.applied}"
        name += f", {head} head" if head != "none" else ""
        return Side(name if fast_forward else name + MODEL_FORWARD, step)
    if kv_dtype is not None:
        return Side(f"{KV_SIDE}{kv_dtype}", step)
    return Side(SHUFFLED if shuffled else OURS, step)


def hf_side(
    model_dir: Path,
    impl: str,
    prompts: list[list[int]],
    lengths: list[int],
    block_size: int,
    device: str = "cpu",
) -> Side:
    from transformers import AutoModelForCausalLM, DynamicCache

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=impl)
    model = model.to(device).eval()
    batch, width = len(prompts), max(lengths)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width + block_size, dtype=torch.long)
    for i, (toks, n) in enumerate(zip(prompts, lengths, strict=True)):
        ids[i, width - n :] = torch.tensor(toks[:n])
        mask[i, width - n :] = 1
    positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0).to(device)
    ids, mask = ids.to(device), mask.to(device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=mask[:, :width], position_ids=positions,
          past_key_values=cache, use_cache=True)  # fmt: skip
    step_ids = [
        torch.tensor([[toks[n + p]] for toks, n in zip(prompts, lengths, strict=True)]).to(device)
        for p in range(block_size)
    ]
    step_pos = [torch.tensor([[n + p] for n in lengths]).to(device) for p in range(block_size)]
    phase = [0]

    def step() -> torch.Tensor:
        p = phase[0]
        out = model(input_ids=step_ids[p], attention_mask=mask[:, : width + p + 1],
                    position_ids=step_pos[p], past_key_values=cache, use_cache=True)  # fmt: skip
        return out.logits[:, -1]

    def reset() -> None:  # untimed: next phase; back to the prompt after a full cycle
        phase[0] = (phase[0] + 1) % block_size
        if phase[0] == 0:
            cache.crop(-block_size)

    return Side(f"HF {impl} + DynamicCache", step, reset)


FLOOR = "floor: no attention at all"
HF_SDPA = "HF sdpa + DynamicCache"
OURS = "tokenfleet, BlockManager tables"
# benchmarks/RESULTS.md rows this script measures: ours ÷ HF sdpa per batch size (the first two),
# the quantized side ÷ HF sdpa (the third); each row is written by its own command
HEADLINE_KEYS = ("decode-step", "smollm2-decode", "smollm2-decode-int4")
SHUFFLED = "tokenfleet, shuffled tables"
MODEL_FORWARD = ", model forward"  # suffix of the quantized side without the fast decoder loop
KV_SIDE = "tokenfleet, KV "  # + the storage dtype (--kv-dtypes)


def floor_side(
    model_dir: Path, prompts: list[list[int]], lengths: list[int], device: str = "cpu"
) -> Side:
    """The model's forward for one token per sequence with attention replaced by a no-op (the
    query passes through): projections, MLP, norms and LM head only, the floor that no attention
    implementation can go below. Its logits are meaningless and are not checked."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    def no_attention(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return query.transpose(1, 2), None

    AttentionInterface.register("bench_no_attention", no_attention)
    model: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="bench_no_attention"
    )
    model = model.to(device).eval()
    ids = torch.tensor([[toks[n]] for toks, n in zip(prompts, lengths, strict=True)]).to(device)
    positions = torch.tensor([[n] for n in lengths]).to(device)

    def step() -> torch.Tensor:
        return model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, -1]

    return Side(FLOOR, step)


def measure(
    model_dir: Path, batch: int, args: argparse.Namespace, clock: Callable[[], float]
) -> dict[str, list[float]]:
    """Seconds per decode step of every side at ``batch`` sequences, interleaved repetitions."""
    rng = random.Random(args.seed)
    # Prompts of context - block_size / 2 tokens; each step decodes one of the next
    # block_size tokens in turn, so contexts average ``context`` tokens.
    base = args.context - args.block_size // 2
    lengths = [base + rng.randint(-args.jitter, args.jitter) for _ in range(batch)]
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(n + args.block_size)] for n in lengths]
    sides = [
        tokenfleet_side(model_dir, prompts, lengths, args, shuffled=shuffled)
        for shuffled in (False, True)
    ]
    sides += [
        tokenfleet_side(model_dir, prompts, lengths, args, shuffled=False, kv_dtype=kv)
        for kv in kv_dtypes(args)
        if kv != "float32"  # the plain sides
    ]
    if args.quantization != "none":
        quantization = args.quantization
        sides += [
            tokenfleet_side(
                model_dir,
                prompts,
                lengths,
                args,
                shuffled=False,
                quantization=quantization,
                fast_forward=fast,
            )
            for fast in ((True, False) if args.compare_forward else (True,))
        ]
    if args.quantization != "none" and args.head_baseline != "none":
        sides.append(
            tokenfleet_side(
                model_dir,
                prompts,
                lengths,
                args,
                shuffled=False,
                quantization=args.quantization,
                head=args.head_baseline,
            )
        )
    sides += [
        hf_side(model_dir, impl, prompts, lengths, args.block_size, args.device)
        for impl in ("sdpa", "eager")
    ]
    sides.append(floor_side(model_dir, prompts, lengths, args.device))

    # Same next-token logits on every side, or the comparison means nothing.
    reference = sides[0].step()
    for side in sides[1:]:
        if side.name == FLOOR:
            continue
        diff = float((side.step() - reference).abs().max())
        side.reset()
        print(f"batch {batch}: max |logit diff| vs {side.name}: {diff:.1e}", flush=True)
    times: dict[str, list[float]] = {side.name: [] for side in sides}
    for rep in range(args.warmup + args.reps):
        for side in sides if rep % 2 == 0 else sides[::-1]:
            start = clock()
            side.step()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()  # the step's kernels are queued, not done, on return
            elapsed = clock() - start
            side.reset()
            if rep >= args.warmup:
                times[side.name].append(elapsed)
    return times


def report(batch: int, times: dict[str, list[float]], args: argparse.Namespace) -> None:
    base = statistics.median(times[HF_SDPA])
    print(
        f"\ndecode step: {batch} seqs x {args.context}±{args.jitter} tokens of context, "
        f"block size {args.block_size}, {args.threads} threads, {args.reps} interleaved reps, "
        f"{args.clock} clock"
    )
    print(f"| {'side':34s} | median ms | p10 ms | p90 ms | ÷ HF sdpa |")
    print(f"|{'-' * 36}|-----------|--------|--------|-----------|")
    for name, samples in times.items():
        deciles = statistics.quantiles(samples, n=10)
        med = statistics.median(samples)
        print(f"| {name:34s} | {med * 1e3:9.2f} | {deciles[0] * 1e3:6.2f} | "
              f"{deciles[-1] * 1e3:6.2f} | {med / base:9.2f} |")  # fmt: skip


def kv_dtypes(args: argparse.Namespace) -> list[str]:
    return [d for d in str(args.kv_dtypes).split(",") if d]


def kv_capacity(model_dir: Path, args: argparse.Namespace) -> None:
    """KV tokens each ``--kv-dtypes`` dtype holds: the default pool (the engine's
    ``default_kv_tokens``) and its memory, and the default's cap (half the memory free now)."""
    from transformers import AutoConfig

    from tokenfleet.worker.engine.config import EngineConfig
    from tokenfleet.worker.engine.kv_sizing import KV_FREE_MEMORY_SHARE, free_memory_bytes
    from tokenfleet.worker.engine.model_runner import ModelRunner

    config, tokens = AutoConfig.from_pretrained(model_dir), EngineConfig().default_kv_tokens
    free = free_memory_bytes(torch.device(args.device)) or 0
    cap = int(free * KV_FREE_MEMORY_SHARE)
    f32 = ModelRunner.kv_bytes_per_block(config, args.block_size, "float32") // args.block_size
    before = tokens * f32  # the default pool's memory in float32
    print(
        f"\nKV cache: the default pool ({tokens} tokens) took {before / 2**20:.0f} MiB in "
        f"float32; the default is capped at half of the {free / 2**30:.1f} GiB free now"
    )
    print(f"| KV dtype | bytes per token | tokens in {before / 2**20:.0f} MiB | default pool's "
          "memory | tokens the cap holds |")  # fmt: skip
    print("|---|---|---|---|---|")
    for kv in ["float32"] + [d for d in kv_dtypes(args) if d != "float32"]:
        per_token = ModelRunner.kv_bytes_per_block(config, args.block_size, kv) // args.block_size
        print(f"| {kv} | {per_token} | {before // per_token} | "
              f"{tokens * per_token / 2**20:.0f} MiB | {cap // per_token} |")  # fmt: skip


def plot(results: dict[int, dict[str, list[float]]], path: Path, title: str) -> None:
    """Decode tokens/s (batch / median step time) against batch size, one line per side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted(results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in results[batches[0]]:
        rates = [b / statistics.median(results[b][name]) for b in batches]
        ax.plot(batches, rates, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("sequences decoding together (batch)")
    ax.set_ylabel("decode tokens / s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: use it with --threads 1")
    batches = [int(b) for b in str(args.batch).split(",")]
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from tokenfleet.worker.devtools.tiny_model import make_tiny_model

    results: dict[int, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            from tokenfleet.worker.models.resolve import resolve_model

            model_dir = resolve_model(args.model)
        else:
            model_dir = make_tiny_model(Path(tmp) / "tiny-llama")
        for batch in batches:
            results[batch] = measure(model_dir, batch, args, clock)
            report(batch, results[batch], args)
        if kv_dtypes(args):
            kv_capacity(model_dir, args)
    if args.plot:
        title = f"decode step, {args.model or 'tiny llama'}, {args.threads} thread(s)"
        plot(results, Path(args.plot), title)
    if args.record:  # the rows whose command this run is, if any
        plain, quantized = HEADLINE_KEYS[:2], HEADLINE_KEYS[2]
        figures = dict.fromkeys(
            plain, " / ".join(f"{vs_hf(results[b], OURS):.2f}" for b in batches)
        )
        quant = quantized_side(results[batches[0]])
        if quant is not None:  # and in brackets ours and the quantized step at the first batch
            ms = [statistics.median(results[batches[0]][side]) * 1e3 for side in (OURS, quant)]
            figures[quantized] = (
                " / ".join(f"{vs_hf(results[b], quant):.2f}" for b in batches)
                + f" ({ms[0]:.0f} → {ms[1]:.0f} ms)"
            )
        record_figures(figures, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS)


def vs_hf(times: dict[str, list[float]], side: str) -> float:
    """A headline ratio: ``side``'s step ÷ HF sdpa's, medians."""
    return statistics.median(times[side]) / statistics.median(times[HF_SDPA])


def quantized_side(times: dict[str, list[float]]) -> str | None:
    """The quantized tokenfleet side's name (``tokenfleet, <mode applied>``), if it ran."""
    plain = (OURS, SHUFFLED)
    return next(
        (
            n
            for n in times
            if n.startswith("tokenfleet, ")
            and n not in plain
            and not n.endswith(MODEL_FORWARD)
            and not n.startswith(KV_SIDE)
        ),
        None,
    )


if __name__ == "__main__":
    main()
