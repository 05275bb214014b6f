"""What a worker says about its model when it starts: one log line a person can check."""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any


def resident_bytes() -> int:
    """This process's peak resident set size, in bytes (ru_maxrss is KiB on Linux, B on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def model_summary(spec: str, folder: Path, engine: Any) -> str:
    """A one-line description of a loaded engine: model, dtype, parameters, memory, KV budget."""
    runner = engine.runner
    params = getattr(runner, "num_parameters", None)  # as loaded, before quantization
    if params is None:
        params = sum(p.numel() for p in runner.model.parameters())
    per_block = runner.kv_bytes_per_block(runner.config, runner.block_size, runner.kv_dtype)
    kv_tokens = runner.num_kv_blocks * runner.block_size
    kv_bytes = runner.num_kv_blocks * per_block
    import torch

    return (
        f"model {spec} ({folder}): {type(runner.model).__name__}, {params / 1e6:.1f}M parameters, "
        f"dtype {str(runner.dtype).removeprefix('torch.')}, quantization "
        f"{runner.quantization.describe()}, device {runner.device}, "
        f"{torch.get_num_threads()} CPU threads; KV cache {runner.num_kv_blocks} blocks of "
        f"{runner.block_size} tokens = {kv_tokens} tokens ({_gib(kv_bytes)}, "
        f"{str(runner.kv_dtype).removeprefix('torch.')}); "
        f"max sequence {engine.max_model_len} tokens; peak resident memory "
        f"{_gib(resident_bytes())}"
    )


def context_warning(engine: Any) -> str | None:
    """A warning when the KV budget caps sequences below the model's own context length."""
    cfg = engine.runner.config
    get = getattr(cfg, "get_text_config", None)
    context = getattr(get() if callable(get) else cfg, "max_position_embeddings", None)
    if context is None or engine.max_model_len >= context:
        return None
    return (
        f"sequences are capped at {engine.max_model_len} tokens, below the model's context of "
        f"{context}: the KV cache holds only that much. Give more with --kv-memory or "
        "--kv-blocks, or set --max-model-len to silence this"
    )
