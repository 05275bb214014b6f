"""The decoder stack of a Llama-style model in one Python loop, without transformers' plumbing.

A decode step of a small model is bound by per-op and per-call overhead, not arithmetic: with
SmolLM2-135M at one sequence, transformers' own forward spends about a fifth of the step in
Python around the ops (the output-capturing decorator, mask creation that returns early, the
decoder layer's deprecated-keyword wrapper and ``GradientCheckpointingLayer.__call__``, keyword
dictionaries passed through three levels, an attention-interface lookup and imports per layer,
the rotary sign product per layer). ``FastForward`` runs the same modules' ops directly:

* the embedding, the rotary cos/sin (the model's own ``rotary_emb``, once per step, with the
  sign of ``rotate_half`` folded into sin once per step instead of once per layer);
* per layer: RMSNorm, the joined q/k/v product (``fusion.py``), the rotary embedding of q and k
  together, ``paged_attention_forward``, ``o_proj`` added into the residual in place, RMSNorm,
  the joined gate/up product, ``act(gate) * up`` in place, ``down_proj`` added in place;
* the final norm and the LM head on the kept rows only (a row-wise norm: the same values).

Each op is the one the fused modules compute (the same kernels, inputs and order), so logits are
bit for bit those of the model's own forward; the runner checks that on its load-time probe and
falls back to the model's forward, with a log line, if they differ.

Which models: ``FastForward.build(model)`` returns None unless the model is a causal LM whose
forward, its base model's forward and every decoder layer's forward are Llama's own bytecode
(``LlamaForCausalLM``, ``LlamaModel``, ``LlamaDecoderLayer``; Mistral's and Qwen2's are
copies where they do the same), every attention was joined by ``fuse_projections`` and every MLP
is a joined gated MLP. Anything else runs through the model's forward as before.

Measured alternative, not taken (benchmarks/RESULTS.md, "The fast decoder loop, and
torch.compile"): ``torch.compile`` (inductor, dynamic shapes) of this loop's per-layer pieces
around the eager paged attention --
* start: 181 s of compiling before the first decode step (loaded 2-core machine);
* speed: slower than this loop at batch 1 (63.3 against 53.6 ms) and 8 (144.2 against 121.9).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from tokenfleet.worker.engine import fusion
from tokenfleet.worker.engine.fusion import ACT_DTYPE, fused_parts
from tokenfleet.worker.engine.paged_attention import STEP_KWARG, PagedStep, paged_attention_forward

log = logging.getLogger(__name__)


class _Layer:
    """One decoder layer's modules and constants, looked up once at load."""

    __slots__ = (
        "act",
        "act_dtype",
        "attn",
        "down",
        "eps_in",
        "eps_post",
        "gate_up",
        "norm_in",
        "norm_post",
        "num_q_heads",
        "o_proj",
        "q_end",
        "qk_end",
        "qkv",
        "scaling",
    )

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.qkv = attn.qkv_proj
        self.o_proj = attn.o_proj
        q_size, k_size, _ = fused_parts(attn.qkv_proj)
        self.q_end, self.qk_end = q_size, q_size + k_size
        self.num_q_heads = q_size // attn.head_dim
        self.scaling = attn.scaling
        self.norm_in, self.norm_post = layer.input_layernorm, layer.post_attention_layernorm
        self.eps_in = self.norm_in.variance_epsilon
        self.eps_post = self.norm_post.variance_epsilon
        self.gate_up, self.down, self.act = mlp.gate_up_proj, mlp.down_proj, mlp.act_fn
        self.act_dtype: torch.dtype | None = getattr(mlp, ACT_DTYPE, None)


def _same_forward(obj: Any, reference: Any) -> bool:
    """Whether ``obj`` runs ``reference``'s forward (its class's, the same bytecode)."""
    return "forward" not in vars(obj) and fusion._same_code(type(obj).forward, reference.forward)


def _given_forward(module: Any, function: Any) -> bool:
    """Whether ``fuse_projections`` gave ``module`` the forward ``function``."""
    return getattr(vars(module).get("forward"), "__func__", None) is function


def _float_rms_norm(norm: Any) -> bool:
    """Whether ``norm`` is a float32 RMSNorm given ``F.rms_norm`` by ``fuse_projections``."""
    weight = getattr(norm, "weight", None)
    return (
        _given_forward(norm, fusion._rms_norm_forward)
        and weight is not None
        and weight.dtype == torch.float32
        and hasattr(norm, "variance_epsilon")
    )


class FastForward:
    """``__call__(step, keep)``: logits ``[len(keep), vocab]`` of the packed tokens ``keep``."""

    def __init__(self, model: Any, layers: list[Any]) -> None:
        base = model.model
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = base.norm
        self.head = model.lm_head
        self.layers = [_Layer(layer) for layer in layers]
        self.head_dim = int(layers[0].self_attn.head_dim)
        sign = layers[0].self_attn.tokenfleet_rotary_sign
        self.sign = sign.clone()
        self.attention = paged_attention_forward  # an attribute: a profiler may wrap it

    @classmethod
    def build(cls, model: Any) -> FastForward | None:
        """The fast forward of ``model``, or None where it does not apply (module docstring)."""
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaForCausalLM,
            LlamaModel,
        )

        base = getattr(model, "model", None)
        if (
            not _same_forward(model, LlamaForCausalLM)
            or base is None
            or not _same_forward(base, LlamaModel)
            or getattr(model, "lm_head", None) is None
            or not _float_rms_norm(getattr(base, "norm", None))
        ):
            return None
        cfg = model.config
        layers = list(base.layers[: cfg.num_hidden_layers])
        if not layers or any(
            not _same_forward(layer, LlamaDecoderLayer)
            or not _given_forward(layer.self_attn, fusion._attention_forward)
            or not _given_forward(layer.mlp, fusion._mlp_forward)
            or not _float_rms_norm(layer.input_layernorm)
            or not _float_rms_norm(layer.post_attention_layernorm)
            for layer in layers
        ):
            return None
        signs = {tuple(layer.self_attn.tokenfleet_rotary_sign.tolist()) for layer in layers}
        if len(signs) != 1 or len({int(layer.self_attn.head_dim) for layer in layers}) != 1:
            return None
        return cls(model, layers)

    def __call__(self, step: PagedStep, keep: torch.Tensor) -> torch.Tensor:
        ids, positions = step.input_ids, step.position_ids
        hidden = self.embed(ids)[0]  # [tokens, hidden]
        cos, sin = self.rotary(hidden[None], positions)  # [1, tokens, head_dim] each
        cos = cos[0].unsqueeze(-2)  # [tokens, 1, head_dim]
        sin = (sin[0].unsqueeze(-2)) * self.sign
        num_tokens, width = hidden.shape
        head_dim, half = self.head_dim, self.head_dim // 2
        kwargs: dict[str, Any] = {STEP_KWARG: step}
        for layer in self.layers:
            x = F.rms_norm(hidden, (width,), layer.norm_in.weight, layer.eps_in)
            qkv = layer.qkv(x)
            qk = qkv[:, : layer.qk_end].view(num_tokens, -1, head_dim)
            qk = qk * cos + torch.roll(qk, half, dims=-1) * sin
            nq = layer.num_q_heads
            attn_out, _ = self.attention(
                layer.attn,
                qk[None, :, :nq].transpose(1, 2),
                qk[None, :, nq:].transpose(1, 2),
                qkv[None, :, layer.qk_end :].view(1, num_tokens, -1, head_dim).transpose(1, 2),
                None,
                scaling=layer.scaling,
                **kwargs,
            )
            hidden += layer.o_proj(attn_out.reshape(num_tokens, -1))
            x = F.rms_norm(hidden, (width,), layer.norm_post.weight, layer.eps_post)
            act_dtype = layer.act_dtype or x.dtype
            gate, up = layer.gate_up(x.to(act_dtype)).chunk(2, dim=-1)
            hidden += layer.down(layer.act(gate) * up).to(hidden.dtype)
        kept = hidden.index_select(0, keep)
        return self.head(F.rms_norm(kept, (width,), self.norm.weight, self.norm.variance_epsilon))
