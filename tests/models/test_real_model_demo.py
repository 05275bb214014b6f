"""``tokenfleet demo`` with no model given runs SmolLM2 and prints real answers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from child_process import run_command, tokenfleet_args
from conftest import MODEL_CACHE

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def test_the_default_demo_streams_real_text(
    smollm2_dir: Path, redis_server: Any, tmp_path: Path
) -> None:
    env = {**os.environ, "REDIS_URL": redis_server.url, "TOKENFLEET_MODEL_CACHE": str(MODEL_CACHE)}
    env.pop("TOKENFLEET_KEY_PREFIX", None)
    args = ["demo", "--workers", "1", "--requests", "3", "--max-tokens", "24", "--timeout", "240"]
    proc = run_command(tokenfleet_args(*args), env, inherit_env=False, cwd=tmp_path, timeout_s=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"model: {smollm2_dir}" in out
    table = out[out.index("request   priority") :]
    assert table.count(" done ") == 3, out
    assert "Q: What is the capital of France?" in out
    answer = out[out.index("Q: What is the capital of France?") :].splitlines()[1]
    assert "Paris" in answer, out  # greedy, so the same answer every run
