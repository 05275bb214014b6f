"""Fewer, larger ops in Llama-style decoders: q/k/v in one product, gate/up in one, one-call norms.

``fuse_projections(model)`` changes, in place:

* each Llama-style attention: ``q_proj``, ``k_proj`` and ``v_proj`` joined into one
  ``qkv_proj``, and the rotary embedding applied to q and k together (5 ops instead of 16);
* each gated MLP: ``gate_proj`` and ``up_proj`` joined into one ``gate_up_proj``;
* each float32 Llama RMSNorm: one ``F.rms_norm`` call instead of six ops.

A decode step then calls 4 products per layer instead of 7 and about a third fewer small ops
(each costs a few microseconds of dispatch on a CPU, which dominates a one-sequence step).
Quantization (``quantization.py``) packs the joined weights as they are: int4 groups and int8
channels are per output row, so a joined layer's rows are quantized exactly as the separate
layers' were. When both MLP products are quantized, the gate/up product stays bfloat16 through
the activation into ``down_proj`` (which rounds its input to bfloat16 anyway), instead of a
round trip through float32.

Which modules change: those whose ``forward`` is Llama's own (the same bytecode as
``LlamaAttention.forward``, ``LlamaMLP.forward`` or ``LlamaRMSNorm.forward``; Mistral's,
Qwen2/3's and Gemma's MLPs are copies of Llama's), with plain ``nn.Linear`` projections. Any
other module (an attention that passes a sliding window, Qwen3's q/k norms, Gemma's norms,
Phi3's already joined layers, GPT-2's) keeps its own forward.

Invariant: a changed module computes what it computed before, up to float summation order (the
same dot products and element-wise steps; only the kernels that compute them change), except
the bfloat16 MLP activation of a quantized model.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FUSED_PARTS = "tokenfleet_fused_parts"  # attribute of a fused nn.Linear: the out sizes it joins
ACT_DTYPE = "tokenfleet_act_dtype"  # attribute of a fused MLP: dtype of its gate/up product


def fused_parts(linear: nn.Module) -> tuple[int, ...]:
    """The output sizes of the layers ``linear`` joins (one part for an unfused layer)."""
    parts = getattr(linear, FUSED_PARTS, None)
    return tuple(parts) if parts else (int(getattr(linear, "out_features", 0)),)


def _join(layers: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the outputs of ``layers`` side by side."""
    first = layers[0]
    with_bias = first.bias is not None
    joined = nn.Linear(
        first.in_features,
        sum(layer.out_features for layer in layers),
        bias=with_bias,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        joined.weight.copy_(torch.cat([layer.weight for layer in layers]))
        if with_bias:
            joined.bias.copy_(torch.cat([layer.bias for layer in layers]))
    joined.requires_grad_(False)
    setattr(joined, FUSED_PARTS, tuple(layer.out_features for layer in layers))
    return joined


def _linears(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    """``module``'s layers ``names`` if all are plain ``nn.Linear`` of one input size, with or
    all without biases (joinable); else None."""
    layers = [getattr(module, name, None) for name in names]
    found = [layer for layer in layers if type(layer) is nn.Linear]
    if (
        len(found) != len(names)
        or len({layer.in_features for layer in found}) != 1
        or len({layer.bias is None for layer in found}) != 1
    ):
        return None
    return found


def _same_code(method: Callable[..., Any], reference: Callable[..., Any]) -> bool:
    """Whether two functions (decorators unwrapped) compile to the same bytecode and names."""
    a = getattr(method, "__wrapped__", method)
    b = getattr(reference, "__wrapped__", reference)
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return (
        ca is not None
        and cb is not None
        and ca.co_code == cb.co_code
        and ca.co_names == cb.co_names
        and ca.co_varnames == cb.co_varnames
    )


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """Llama's MLP, ``down(act(gate(x)) * up(x))``, with gate and up in one product. With a
    quantized ``gate_up_proj`` its product stays bfloat16 into ``down_proj`` (``ACT_DTYPE``):
    the activation and the product are computed in it, which is what ``down_proj`` rounds its
    input to anyway."""
    act_dtype = getattr(self, ACT_DTYPE, None) or x.dtype
    gate, up = self.gate_up_proj(x.to(act_dtype)).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up).to(x.dtype)


def _attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """Llama's attention forward with q, k and v from one product, and the rotary embedding
    applied to q and k together: ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) =
    roll(x, d / 2) * (-1 .. -1, 1 .. 1)``, the same products and sum (bit for bit) in 5 ops
    instead of Llama's 16."""
    from transformers.models.llama.modeling_llama import (
        ALL_ATTENTION_FUNCTIONS,
        eager_attention_forward,
    )

    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    if position_embeddings is None:  # Llama's decoder layer always passes them
        raise ValueError("fused attention needs the rotary position_embeddings")
    input_shape = hidden_states.shape[:-1]
    head_dim = self.head_dim
    q_size, k_size, _ = fused_parts(self.qkv_proj)
    qkv = self.qkv_proj(hidden_states)
    qk = qkv[..., : q_size + k_size].view(*input_shape, -1, head_dim)  # [..., heads, head_dim]
    cos, sin = (t.unsqueeze(-2) for t in position_embeddings)
    half = head_dim // 2
    sign = self.tokenfleet_rotary_sign
    qk = qk * cos + torch.roll(qk, half, dims=-1) * (sin * sign)
    num_q_heads = q_size // head_dim
    query_states = qk[..., :num_q_heads, :].transpose(-3, -2)
    key_states = qk[..., num_q_heads:, :].transpose(-3, -2)
    value_states = qkv[..., q_size + k_size :].view(*input_shape, -1, head_dim).transpose(-3, -2)
    if cache is not None:
        key_states, value_states = cache.update(
            key_states, value_states, self.layer_idx, kwargs=kwargs
        )
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )
    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def _rms_norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm as one ``F.rms_norm`` call (float32 weights and input: the same float32
    arithmetic; other dtypes take Llama's own steps)."""
    if hidden_states.dtype != torch.float32:
        return type(self).forward(self, hidden_states)
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)


def fuse_projections(
    model: nn.Module,
    join: bool = True,
    convert: Callable[[list[nn.Linear]], nn.Module | None] | None = None,
) -> dict[str, int]:
    """Fuse every Llama-style attention's q/k/v and gated MLP's gate/up in ``model`` (unless
    ``join`` is False), and give its RMSNorms one ``F.rms_norm`` call, in place (see the module
    docstring); returns how many modules of each kind (``qkv``, ``gate_up``, ``rms_norm``) it
    changed.

    Joining as float copies the projections' weights: the separate ones are freed, but a CPU
    allocator keeps most of that memory (measured: SmolLM2 in float32 held 1.25 GiB instead of
    0.92). The model runner joins only weights it is about to quantize, and passes ``convert``
    (``quantization.joined_quantizer``): it makes each joined layer quantized straight from the
    separate layers' weights, a chunk of rows at a time, so no joined float copy is ever made;
    where it answers None (a shape the kernel does not take) the layers are joined as float."""

    def joined(layers: list[nn.Linear]) -> nn.Module:
        layer = convert(layers) if convert is not None else None
        return layer if layer is not None else _join(layers)

    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

    fused = {"qkv": 0, "gate_up": 0, "rms_norm": 0}
    module: Any
    for module in list(model.modules()):
        if "forward" in vars(module):  # already given one (fused before)
            continue
        forward = type(module).forward
        if join and _same_code(forward, LlamaMLP.forward):
            layers = _linears(module, ("gate_proj", "up_proj"))
            if layers is None or layers[0].out_features != layers[1].out_features:
                continue
            module.gate_up_proj = joined(layers)
            del module.gate_proj, module.up_proj
            module.forward = types.MethodType(_mlp_forward, module)
            fused["gate_up"] += 1
        elif join and _same_code(forward, LlamaAttention.forward):
            layers = _linears(module, ("q_proj", "k_proj", "v_proj"))
            if layers is None or module.head_dim % 2:
                continue
            module.qkv_proj = joined(layers)
            del module.q_proj, module.k_proj, module.v_proj
            half = module.head_dim // 2
            weight = layers[0].weight
            sign = torch.tensor([-1.0] * half + [1.0] * half, dtype=weight.dtype).to(weight.device)
            module.register_buffer("tokenfleet_rotary_sign", sign, persistent=False)
            module.forward = types.MethodType(_attention_forward, module)
            fused["qkv"] += 1
        elif _same_code(forward, LlamaRMSNorm.forward):
            if getattr(module, "weight", None) is None or module.weight.dtype != torch.float32:
                continue
            module.forward = types.MethodType(_rms_norm_forward, module)
            fused["rms_norm"] += 1
    return fused
