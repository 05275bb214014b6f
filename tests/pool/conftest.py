"""Pool test fixtures: a tiny real model (built once per session, no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with its byte-level BPE tokenizer, seed 0 (as tests/engine/conftest.py)."""
    from tokenfleet.worker.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), flavour="llama", seed=0)
