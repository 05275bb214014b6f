"""Shared engine fixtures: tiny models built once per test session (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (4 layers, GQA 8/2 heads) with its byte-level BPE tokenizer, seed 0."""
    from tokenfleet.worker.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), flavour="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (2 layers, GQA 4/2 heads, q/k/v biases), seed 0."""
    from tokenfleet.worker.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), flavour="qwen2", seed=0)
