"""Fused projections (issue 31): which modules are fused, and that they compute what they did.

The model runner fuses every model it loads; tests/engine/test_model_runner.py compares those
runners (Llama, Qwen2, Mistral, Gemma, GPT-2) with transformers' own forward, fused or not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenfleet.worker.engine.fusion import fuse_projections, fused_parts
from tokenfleet.worker.engine.model_runner import ModelRunner


def load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def all_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]


def test_a_llama_is_fused_and_computes_the_same(tiny_llama_dir: Path) -> None:
    model, reference = load(tiny_llama_dir), load(tiny_llama_dir)
    layers = model.model.layers
    n = len(layers)
    assert fuse_projections(model) == {"qkv": n, "gate_up": n, "rms_norm": 2 * n + 1}
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert not hasattr(attn, "q_proj") and not hasattr(mlp, "gate_proj")  # weights not kept
        assert fused_parts(attn.qkv_proj) == (
            model.config.num_attention_heads * attn.head_dim,
            model.config.num_key_value_heads * attn.head_dim,
            model.config.num_key_value_heads * attn.head_dim,
        )
        assert fused_parts(mlp.gate_up_proj) == (model.config.intermediate_size,) * 2
        assert fused_parts(mlp.down_proj) == (model.config.hidden_size,)  # not fused
    tokens = [5, 17, 99, 3, 42, 7, 250, 11]
    want, got = all_logits(reference, tokens), all_logits(model, tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert fuse_projections(model) == {"qkv": 0, "gate_up": 0, "rms_norm": 0}  # all done


def test_a_qwen2_fuses_its_mlp_and_keeps_its_attention(tiny_qwen2_dir: Path) -> None:
    """Qwen2's attention passes a sliding window: not Llama's forward, so it runs unfused."""
    model, reference = load(tiny_qwen2_dir), load(tiny_qwen2_dir)
    n = len(model.model.layers)
    assert fuse_projections(model) == {"qkv": 0, "gate_up": n, "rms_norm": 2 * n + 1}
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, nn.Linear) and hasattr(layer.mlp, "gate_up_proj")
    tokens = [5, 17, 99, 3, 42, 7]
    torch.testing.assert_close(
        all_logits(model, tokens), all_logits(reference, tokens), atol=1e-5, rtol=0
    )


def test_the_runner_joins_only_what_it_quantizes(tiny_llama_dir: Path) -> None:
    n = 4  # the tiny Llama's layers
    quantized = ModelRunner(tiny_llama_dir, num_kv_blocks=4, block_size=16, quantization="int4")
    assert quantized.fused == {"qkv": n, "gate_up": n, "rms_norm": 2 * n + 1}
    plain = ModelRunner(tiny_llama_dir, num_kv_blocks=4, block_size=16)  # no copies to hold
    assert plain.fused == {"qkv": 0, "gate_up": 0, "rms_norm": 2 * n + 1}
    assert isinstance(plain.model.model.layers[0].self_attn.q_proj, nn.Linear)
