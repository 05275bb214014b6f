"""CPU time of one product by rows of input: the int4 and int8 weight-only kernels against
float32 ``nn.Linear``, on SmolLM2's projection and LM head shapes (issue 31: which kernel wins
at how many rows; prefill chunks have many rows, decode steps one per sequence).

Random weights (a kernel's speed does not depend on the values), one thread, this thread's CPU
time (steady when other processes share the cores), median of the repetitions. The same layer
is called again and again, so its weights stay in the caches where they fit (all but the LM
head): small-row figures favour float32 more than a real step, whose 30 layers do not fit.

    .venv/bin/python benchmarks/bench_kernels_by_rows.py
    .venv/bin/python benchmarks/bench_kernels_by_rows.py --shapes head --rows 1,8,12,16,24,32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from tokenfleet.worker.engine.quantization import Int4Linear, Int8Linear

SHAPES = {  # SmolLM2-135M: (out_features, in_features); q/k/v and gate/up fused
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}


def cpu_ms(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, reps: int) -> float:
    product(x)
    times = []
    for _ in range(reps):
        start = time.thread_time()
        product(x)
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down", help=", ".join(SHAPES))
    parser.add_argument("--reps", type=int, default=60, help="at most, fewer for big products")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| shape | rows | int4 ms | int8 ms | float32 ms |\n|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for name in args.shapes.split(","):
            out_f, in_f = SHAPES[name]
            linear = nn.Linear(in_f, out_f, bias=False).requires_grad_(False)
            int4, int8 = Int4Linear(linear), Int8Linear(linear)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_f)
                reps = max(5, min(args.reps, int(6e9 / (rows * out_f * in_f))))
                ms = [cpu_ms(f, x, reps) for f in (int4, int8, linear)]
                print(f"| {name} | {rows} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[2]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
