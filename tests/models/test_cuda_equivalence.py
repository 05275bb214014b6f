"""The engine on CUDA (float32, TF32 off) gives Hugging Face's float32 greedy output on the CPU,
up to the near-ties of tests/models/test_real_model_equivalence.py. Skipped without CUDA; run by
``make gpu-check`` (scripts/gpu_check.py) on a machine with a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import MAX_NEW_TOKENS
from test_real_model_equivalence import check_same

from tokenfleet.worker.engine.engine import Engine, EngineConfig
from tokenfleet.worker.engine.request import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_model,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]


def test_engine_on_cuda_equals_hf_on_cpu(
    smollm2_dir: Path, hf_smollm2: Any, chat_prompts: list[list[int]], hf_outputs: list[list[int]]
) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here
    engine = Engine(smollm2_dir, EngineConfig(device="cuda", dtype="float32", seed=0))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS)
    ties = []
    outputs = engine.generate(chat_prompts, greedy)
    for prompt, out, theirs in zip(chat_prompts, outputs, hf_outputs, strict=True):
        note = check_same(hf_smollm2, prompt, out.token_ids, theirs)
        ties += [note] if note else []
    assert len(ties) <= 1, ties
