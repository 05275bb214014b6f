"""``make gpu-check`` skips cleanly where there is no CUDA device (this machine) and lists the
checks it would run where there is one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from child_process import run_command

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check runs")
def test_gpu_check_skips_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "figures"
    proc = run_command([sys.executable, str(SCRIPT), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert "gpu-check: skipped: no CUDA device" in proc.stdout
    assert not out.exists()  # nothing run, nothing written


def test_gpu_check_runs_the_equivalence_tests_and_both_benchmarks() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    commands = [" ".join(command) for _title, command in gpu_check.steps(quick=True)]
    assert "tests/models/test_cuda_equivalence.py" in commands[0]
    assert all(path.is_file() for path in (ROOT / "tests/models/test_cuda_equivalence.py",))
    assert "bench_decode_step.py" in commands[1] and "--device cuda" in commands[1]
    assert "bench_engine_workload.py" in commands[2] and "--device cuda" in commands[2]
    assert "gpu-check:" in (ROOT / "Makefile").read_text()
