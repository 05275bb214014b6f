"""The engine's settings: :class:`EngineConfig`, checked when made (before any model loads)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tokenfleet.worker.engine.scheduler import SchedulerConfig

QUANTIZATION_MODES = ("auto", "none", "int8", "int4")  # see quantization.py
KV_DTYPES = ("auto", "float32", "bfloat16", "float16")  # KV cache storage (model_runner.py)


def check_quantization(mode: str) -> str:
    """``mode`` if it is one of ``QUANTIZATION_MODES``; else ``ValueError`` naming the setting."""
    return _check_choice("quantization", mode, QUANTIZATION_MODES)


def check_kv_dtype(kv_dtype: str) -> str:
    """``kv_dtype`` if it is one of ``KV_DTYPES``; else ``ValueError`` naming the setting."""
    return _check_choice("kv_dtype", kv_dtype, KV_DTYPES)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, not {value!r}")
    return value


@dataclass(slots=True)
class EngineConfig:
    """Engine settings. ``None`` means "derive it": the KV pool holds ``max_num_seqs *
    kv_tokens_per_seq`` tokens, capped by the device's free memory (the model runner decides),
    ``max_model_len`` from the model config capped by the pool."""

    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV pool size in blocks ...
    kv_memory_bytes: int | None = None  # ... or in bytes (give at most one of the two)
    kv_tokens_per_seq: int = 512  # default KV pool: this many tokens per running request
    max_num_seqs: int = 32  # running requests at most
    max_num_batched_tokens: int = 512  # tokens computed per step at most (chunked prefill)
    max_model_len: int | None = None  # prompt + output tokens per request at most
    enable_prefix_caching: bool = True
    max_wait_steps: int | None = None  # anti-starvation: boost after this many waiting steps
    max_wait_s: float | None = 30.0  # anti-starvation: boost after this many waiting seconds
    background_yields: bool = True  # batch-priority work sits out steps that prefill urgent work
    max_yield_steps: int = 8  # ... at most this many steps in a row
    share_prefill: bool = True  # a prompt being prefilled by another request waits to share it
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str = "auto"  # "auto": the model config's dtype (the runner decides)
    kv_dtype: str = "auto"  # KV cache storage; "auto": 16 bits on a CPU, else dtype (the runner)
    quantization: str = "auto"  # auto (a GGUF file's own precision) | none | int8 | int4
    seed: int | None = None  # seeds unseeded sampling (None: nondeterministic)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes < 1:
            raise ValueError(f"kv_memory_bytes must be >= 1, got {self.kv_memory_bytes}")
        if self.num_kv_blocks is not None and self.kv_memory_bytes is not None:
            raise ValueError("give num_kv_blocks or kv_memory_bytes, not both")
        check_quantization(self.quantization)
        check_kv_dtype(self.kv_dtype)
        if self.kv_tokens_per_seq < 1:
            raise ValueError(f"kv_tokens_per_seq must be >= 1, got {self.kv_tokens_per_seq}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        # the scheduler's own checks, raised now rather than at model load (the engine derives
        # the real max_model_len from the model and its KV cache)
        self.scheduler_config(max_model_len=self.max_model_len or 1)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's settings, with ``max_model_len`` as the engine derived it."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            max_wait_steps=self.max_wait_steps,
            max_wait_s=self.max_wait_s,
            background_yields=self.background_yields,
            max_yield_steps=self.max_yield_steps,
            share_prefill=self.share_prefill and self.enable_prefix_caching,
        )

    @property
    def default_kv_tokens(self) -> int:
        """Tokens the KV pool holds when neither blocks nor bytes are given (before the cap)."""
        return self.max_num_seqs * self.kv_tokens_per_seq

    def runner_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ModelRunner`` (besides the model)."""
        return {
            "device": self.device,
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_memory_bytes": self.kv_memory_bytes,
            "default_kv_tokens": self.default_kv_tokens,
            "max_model_len": self.max_model_len,
            "quantization": self.quantization,
        }


def with_overrides(config: EngineConfig, overrides: dict[str, Any]) -> EngineConfig:
    """``config`` with ``overrides`` applied; ``ValueError`` naming any unknown setting."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"unknown engine settings: {', '.join(unknown)}")
    return dataclasses.replace(config, **overrides) if overrides else config
