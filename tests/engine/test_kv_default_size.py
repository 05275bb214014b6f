"""The default KV cache holds a full batch of typical chats (issue 31), capped by free memory.

Configuration only, no timing: SmolLM2-135M's shape (30 layers, 3 KV heads of 64) is built from a
config object, so the figures below are the real model's without loading its weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tokenfleet.shared.errors import SettingsError
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


def test_16_bit_storage_holds_twice_the_tokens_per_byte(tiny_llama_dir: Path) -> None:
    """The pool is sized in the storage dtype: ``--kv-memory`` holds twice the blocks in 16
    bits, the default's token count takes half the memory, and the cache is as big as said."""
    config = smollm2_config()
    f32 = ModelRunner.kv_bytes_per_block(config, 16, "float32")
    assert ModelRunner.kv_bytes_per_block(config, 16, torch.float16) == f32 // 2 == 23_040 * 16
    assert ModelRunner.kv_bytes_per_block(config, 16, "bfloat16") == f32 // 2
    # the default's cap (half the free memory) holds twice the blocks
    free = 100 * f32
    assert default_kv_blocks(f32 // 2, 16, 32 * 512, free) == 2 * default_kv_blocks(
        f32, 16, 32 * 512, free
    )
    sizes = {}
    for kv in ("float32", "float16", "bfloat16"):
        runner = ModelRunner(tiny_llama_dir, kv_memory_bytes=1 << 20, block_size=8, kv_dtype=kv)
        per_block = ModelRunner.kv_bytes_per_block(runner.config, 8, runner.kv_dtype)
        stored = sum(t.numel() * t.element_size() for t in runner.cache.layers)
        assert stored == runner.num_kv_blocks * per_block <= 1 << 20
        assert {t.dtype for t in runner.cache.layers} == {getattr(torch, kv)}
        sizes[kv] = runner.num_kv_blocks
    assert sizes["float16"] == sizes["bfloat16"] == 2 * sizes["float32"]
    # the default pool holds its tokens whatever the storage, in half the memory
    engine = Engine(
        tiny_llama_dir,
        EngineConfig(max_num_seqs=3, kv_tokens_per_seq=40, device="cpu", kv_dtype="float16"),
    )
    assert engine.runner.num_kv_blocks == -(-120 // 16)


def test_auto_kv_dtype_is_16_bits_on_a_cpu_and_the_model_dtype_on_cuda() -> None:
    from tokenfleet.worker.engine.model_runner import CPU_AUTO_KV_DTYPE, _resolve_kv_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # float16: measured closer to float32 than bfloat16 (docs/engine.md)
    assert _resolve_kv_dtype("auto", cpu, torch.float32) == torch.float16 == CPU_AUTO_KV_DTYPE
    assert _resolve_kv_dtype("auto", cpu, torch.bfloat16) == torch.bfloat16  # never wider
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert _resolve_kv_dtype("auto", cuda, dtype) == dtype
    assert _resolve_kv_dtype("float32", cpu, torch.float32) == torch.float32  # explicit wins
    assert _resolve_kv_dtype("bfloat16", cuda, torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_dtype must be auto"):
        _resolve_kv_dtype("int8", cpu, torch.float32)
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, float32"):
        EngineConfig(kv_dtype="fp8")


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

    per_block = ModelRunner.kv_bytes_per_block(  # in the CPU's default storage, float16
        AutoConfig.from_pretrained(tiny_llama_dir), 16, "float16"
    )
    monkeypatch.setattr(kv_sizing, "free_memory_bytes", lambda device: 40 * per_block)
    with caplog.at_level(logging.WARNING, logger="tokenfleet.worker.engine.kv_sizing"):
        runner = ModelRunner(tiny_llama_dir, default_kv_tokens=16 * 1000, max_model_len=64)
    assert runner.kv_dtype == torch.float16
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
    assert config.kv_dtype == "auto"
    ws = WorkerSettings.from_env({"TOKENFLEET_KV_DTYPE": "bfloat16"}, model="m", name=None)
    assert EngineConfig(**ws.engine_overrides()).kv_dtype == "bfloat16"
    flag = WorkerSettings.from_env(
        {"TOKENFLEET_KV_DTYPE": "bfloat16"}, model="m", kv_dtype="float32", name=None
    )
    assert EngineConfig(**flag.engine_overrides()).kv_dtype == "float32"  # the flag wins
    with pytest.raises(SettingsError, match="kv_dtype must be one of"):
        WorkerSettings.from_env({"TOKENFLEET_KV_DTYPE": "int8"}, model="m", name=None)
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
