"""The runner's fast decoder loop (fast_forward.py, issue 31): where it applies, and that its
logits are the model's own forward's, bit for bit, on prefill, decode and mixed steps."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tokenfleet.worker.engine.batch import ScheduledSeq, StepBatch
from tokenfleet.worker.engine.fast_forward import FastForward
from tokenfleet.worker.engine.model_runner import ModelRunner


def runner(path: Path, fast: bool, quantization: str = "int4") -> ModelRunner:
    return ModelRunner(
        path, num_kv_blocks=16, block_size=16, quantization=quantization, fast_forward=fast
    )


def steps() -> list[StepBatch]:
    """Two prompts (one in two chunks), then decodes of both, then a decode beside a prefill."""
    a, b, c = [5, 17, 99, 3, 42, 7, 250, 11], [9, 8, 7, 6, 5, 4, 3, 2, 1, 30, 31], [4, 44, 144]
    seq = ScheduledSeq
    return [
        StepBatch([seq("a", a, 0, [0], True), seq("b", b[:6], 0, [1, 2], False)]),
        StepBatch([seq("b", b[6:], 6, [1, 2], True)]),
        StepBatch([seq("a", [12], 8, [0], True), seq("b", [13], 11, [1, 2], True)]),
        StepBatch([seq("c", c, 0, [3], True), seq("a", [14], 9, [0], True)]),
    ]


def test_it_computes_the_model_forwards_logits_bit_for_bit(tiny_llama_dir: Path) -> None:
    fast, plain = runner(tiny_llama_dir, True), runner(tiny_llama_dir, False)
    assert fast.fast is not None and plain.fast is None
    for batch in steps():
        want, got = plain.execute(batch), fast.execute(batch)
        assert got.shape == want.shape == (batch.num_logits, fast.vocab_size)
        assert torch.equal(got, want)
    for mine, theirs in zip(fast.cache.layers, plain.cache.layers, strict=True):
        assert torch.equal(mine, theirs)  # the same K/V written


def test_it_applies_only_to_joined_llama_layers(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    """An unquantized model keeps q/k/v apart (nothing joined); Qwen2's attention is its own."""
    assert runner(tiny_llama_dir, True, quantization="none").fast is None
    assert runner(tiny_qwen2_dir, True).fast is None
    assert FastForward.build(runner(tiny_llama_dir, False).model) is not None


def test_a_loop_that_differs_is_dropped_with_one_line(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = FastForward.__call__
    monkeypatch.setattr(
        FastForward, "__call__", lambda self, step, keep: real(self, step, keep) + 1e-3
    )
    with caplog.at_level(logging.WARNING):
        loaded = runner(tiny_llama_dir, True)
    assert loaded.fast is None
    lines = [r.getMessage() for r in caplog.records if "fast decoder loop" in r.getMessage()]
    assert len(lines) == 1 and "running the model's forward" in lines[0], lines
