"""The default KV cache holds a full batch of typical chats (issue 31), capped by free memory.

Configuration only, no timing: SmolLM2-135M's shape (30 layers, 3 KV heads of 64) is built from a
config object, so the figures below are the real model's without loading its weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tokenfleet.worker.engine.config import EngineConfig
from tokenfleet.worker.engine.engine import Engine
from tokenfleet.worker.engine.kv_sizing import (
    KV_FREE_MEMORY_SHARE,
    default_kv_blocks,
    free_memory_bytes,
)
from tokenfleet.worker.engine.model_runner import ModelRunner
from tokenfleet.worker.worker_settings import WorkerSettings

# A typical chat of issue 31's load: ~150 prompt tokens and up to 128 new ones, rounded up to
# whole 16-token blocks with one block of slack.
TYPICAL_CHAT_TOKENS = 150 + 128


def smollm2_config() -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        max_position_embeddings=8192,
    )


def test_default_holds_a_full_batch_of_typical_chats() -> None:
    config = EngineConfig()
    per_chat_blocks = -(-TYPICAL_CHAT_TOKENS // config.block_size) + 1
    per_block = ModelRunner.kv_bytes_per_block(smollm2_config(), config.block_size, "float32")
    blocks = default_kv_blocks(per_block, config.block_size, config.default_kv_tokens, 64 << 30)
    assert config.default_kv_tokens == config.max_num_seqs * 512
    assert blocks >= config.max_num_seqs * per_chat_blocks
    # ... and one longest SmolLM2 sequence fits, so no "capped below context" warning
    assert blocks * config.block_size >= 8192
    # the old default (256 MiB, 5,824 tokens) did not hold 32 typical chats
    assert (256 << 20) // per_block < config.max_num_seqs * per_chat_blocks


def test_default_follows_the_batch_size() -> None:
    config = EngineConfig(max_num_seqs=4, kv_tokens_per_seq=300)
    assert config.default_kv_tokens == 1200
    assert default_kv_blocks(1000, 16, config.default_kv_tokens, None) == 75


def test_default_is_capped_by_free_memory() -> None:
    per_block = 46_080 * 16  # SmolLM2, float32, 16-token blocks
    free = 100 * per_block
    blocks = default_kv_blocks(per_block, 16, 32 * 512, free)
    assert blocks == int(free * KV_FREE_MEMORY_SHARE) // per_block == 50
    assert default_kv_blocks(per_block, 16, 32 * 512, 1) == 1  # never an empty pool


def test_free_memory_is_known_on_this_cpu() -> None:
    free = free_memory_bytes(torch.device("cpu"))
    assert free is not None and free > 0


def test_engine_sizes_its_default_pool_from_its_batch(tiny_llama_dir: Path) -> None:
    engine = Engine(
        tiny_llama_dir, EngineConfig(max_num_seqs=3, kv_tokens_per_seq=40, device="cpu")
    )
    assert engine.runner.num_kv_blocks == -(-120 // 16)
    # a given size wins over the default
    runner = ModelRunner(tiny_llama_dir, num_kv_blocks=5, default_kv_tokens=10_000)
    assert runner.num_kv_blocks == 5


def test_a_capped_default_says_so(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoConfig

    from tokenfleet.worker.engine import kv_sizing

    per_block = ModelRunner.kv_bytes_per_block(
        AutoConfig.from_pretrained(tiny_llama_dir), 16, "float32"
    )
    monkeypatch.setattr(kv_sizing, "free_memory_bytes", lambda device: 40 * per_block)
    with caplog.at_level(logging.WARNING, logger="tokenfleet.worker.engine.kv_sizing"):
        runner = ModelRunner(tiny_llama_dir, default_kv_tokens=16 * 1000, max_model_len=64)
    assert runner.num_kv_blocks == 20
    assert "holds 320 tokens" in caplog.text and "--kv-memory" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenfleet.worker.engine.kv_sizing"):
        ModelRunner(tiny_llama_dir, default_kv_tokens=16 * 20, max_model_len=64)
    assert "--kv-memory" not in caplog.text  # what fits is not warned about


def test_worker_setting_reaches_the_engine() -> None:
    ws = WorkerSettings.from_env(
        {"TOKENFLEET_KV_TOKENS_PER_SEQ": "256"}, model="m", max_num_seqs=8, name=None
    )
    config = EngineConfig(**ws.engine_overrides())
    assert config.default_kv_tokens == 8 * 256
    with pytest.raises(ValueError, match="kv_tokens_per_seq"):
        EngineConfig(kv_tokens_per_seq=0)


def test_a_cache_shorter_than_the_context_is_warned_about() -> None:
    from types import SimpleNamespace

    from tokenfleet.worker.models.startup import context_warning

    config = smollm2_config()
    short = SimpleNamespace(runner=SimpleNamespace(config=config), max_model_len=5824)
    warning = context_warning(short)
    assert warning is not None and "below the model's context of 8192" in warning
    assert context_warning(SimpleNamespace(runner=short.runner, max_model_len=8192)) is None
