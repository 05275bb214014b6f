"""``make gpu-check``: the engine's equivalence tests and the decode/workload benchmarks on CUDA,
their output written to ``benchmarks/gpu/gpu-check-<UTC time>.md`` (issue 31: no CUDA run had
ever been recorded).

On a machine without CUDA it prints one line saying so and exits 0: nothing is run or written.
Run it whenever a GPU machine is lent::

    make gpu-check                     # or: .venv/bin/python scripts/gpu_check.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def steps(quick: bool) -> list[tuple[str, list[str]]]:
    """(title, command) of each check, in order; ``quick`` trims the benchmarks."""
    reps = ["--reps", "30", "--warmup", "5"] if quick else ["--reps", "100", "--warmup", "10"]
    requests = "16" if quick else "64"
    return [
        (
            "equivalence: tiny models (runner, engine) and SmolLM2 on CUDA against HF",
            [PY, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "not browser",
             "tests/engine/test_model_runner.py", "tests/engine/test_engine_tiny.py",
             "tests/models/test_cuda_equivalence.py"],
        ),
        (
            "decode step, SmolLM2, float32, batch 1/8/32",
            [PY, "benchmarks/bench_decode_step.py", "--model", "smollm2", "--device", "cuda",
             "--batch", "1,8,32", "--quantization", "none", *reps],
        ),
        (
            "mixed workload, SmolLM2 chats",
            [PY, "benchmarks/bench_engine_workload.py", "--model", "smollm2", "--chat",
             "--device", "cuda", "--requests", requests, "--rounds", "1" if quick else "3",
             "--sides", "ours,hf-static,hf-cb"],
        ),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and requests")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu"), help="figures folder")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu-check: skipped: no CUDA device on this machine (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'}); run it where a GPU is lent"
        )
        return 0
    name = torch.cuda.get_device_name(0)
    out = Path(args.out) / f"gpu-check-{time.strftime('%Y%m%dT%H%MZ', time.gmtime())}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"# gpu-check {when}", "", f"Device: {name}; torch {torch.__version__}.", ""]
    failed = 0
    for title, command in steps(args.quick):
        print(f"gpu-check: {title}", flush=True)
        started = time.monotonic()
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        took = time.monotonic() - started
        failed += proc.returncode != 0
        tail = (proc.stdout + proc.stderr)[-6000:]
        print(tail, flush=True)
        lines += [f"## {title}", "", f"`{' '.join(command[1:])}`: exit {proc.returncode}, "
                  f"{took:.0f} s", "", "```", tail.rstrip(), "```", ""]  # fmt: skip
    out.write_text("\n".join(lines))
    print(f"gpu-check: {failed} of {len(steps(args.quick))} steps failed; figures in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
