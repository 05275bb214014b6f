"""Paged KV cache and the attention function that transformers calls for every layer.

The function is registered through transformers' public ``AttentionInterface`` under
``ATTN_IMPLEMENTATION``; no mask function is registered, so transformers' mask builders return
early and never materialise a [1, 1, T, T] mask. Everything a step needs (slot of each new token,
block tables, masks) travels in one ``PagedStep`` object passed to the model's ``forward`` as the
keyword argument ``STEP_KWARG``; transformers hands it to each attention call unchanged.

Cache layout, per layer: one tensor ``[2, num_kv_heads, num_blocks, block_size, head_dim]``
(K then V). Viewed as rows of ``block_size * head_dim`` values, the K rows (then the V rows) of
every head and block of the scheduled block tables are fetched with one ``index_select`` along
dim 0 — one contiguous copy per row, into a reused scratch buffer — and land directly in the
``[kv_heads * seqs, context, head_dim]`` layout the attention matmuls read, with no transpose.

Grouped-query attention never repeats K/V: decodes fold the ``num_heads // num_kv_heads`` query
heads that share a KV head into query rows; prefill chunks use SDPA's ``enable_gqa``.

The cache may store K/V in a narrower dtype than the model computes in (``kv_dtype``: 16 bits
under float32 compute holds twice the tokens per byte). New K/V are rounded once when written;
gathered rows are widened back into the compute dtype in a second scratch buffer, so the
attention arithmetic is the compute dtype's (16-bit matmuls are slower on most CPUs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "tokenfleet_paged"  # name registered with transformers' AttentionInterface
STEP_KWARG = "tokenfleet_step"  # forward() keyword carrying the PagedStep to every layer
# SDPA's enable_gqa (torch >= 2.5); older versions get K/V repeated per query head instead.
SDPA_ENABLE_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)

# Keyword arguments models pass to attention functions that carry nothing we must honour.
IGNORED_KWARGS = frozenset(
    {
        "position_ids",
        "use_cache",
        "cache_position",
        "output_attentions",
        "past_key_values",
    }
)


class PagedKVCache:
    """Per-layer K/V storage addressed by physical block id.

    Invariants:
        * ``layers[i].shape == (2, num_kv_heads, num_blocks, block_size, head_dim)``.
        * Position ``p`` of a sequence with block table ``bt`` lives at
          ``layers[i][:, :, bt[p // block_size], p % block_size]``.
        * The cache never decides which blocks are in use; the block manager does.
        * ``layers`` hold ``dtype`` (the storage dtype); ``gather`` returns ``compute_dtype``.
        * ``scratch`` (and ``widened``) hold no state between attention calls; they only save
          reallocating the gathered K/V of every layer of every step.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        # float16 storage of wider values saturates instead of overflowing to inf (then NaN)
        narrowed = dtype == torch.float16 and self.compute_dtype != torch.float16
        self.clamp = torch.finfo(torch.float16).max if narrowed else None
        # Zeros, not empty: masked-out slots are multiplied by 0 and must not hold NaN.
        self.layers = [
            torch.zeros(
                2, num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device
            )
            for _ in range(num_layers)
        ]
        self.scratch = torch.empty(0, dtype=dtype, device=device)
        self.widened = torch.empty(0, dtype=self.compute_dtype, device=device)

    def gather_rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Row indices into a layer viewed as ``[-1, block_size * head_dim]`` for ``block_ids``.

        ``index_select(0, ...)`` with them yields ``[2, num_kv_heads, len(block_ids),
        block_size * head_dim]``: K and V of each head, blocks in table order.
        """
        offsets = torch.arange(2 * self.num_kv_heads, device=block_ids.device) * self.num_blocks
        return (offsets[:, None] + block_ids[None, :]).reshape(-1)

    def write_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Row indices into a layer viewed as ``[-1, head_dim]`` for K then V of ``slots``."""
        per_head = self.num_blocks * self.block_size
        offsets = torch.arange(2 * self.num_kv_heads, device=slots.device) * per_head
        return (offsets[:, None] + slots[None, :]).reshape(-1)

    def gather(self, layer: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows), block_size * head_dim]`` copied from ``layer`` into the scratch buffer,
        in ``compute_dtype`` (widened through a second buffer when the storage is narrower)."""
        width = self.block_size * self.head_dim
        needed = rows.numel() * width
        if self.scratch.numel() < needed:
            self.scratch = torch.empty(needed, dtype=layer.dtype, device=layer.device)
        out = self.scratch[:needed].view(rows.numel(), width)
        torch.index_select(layer.view(-1, width), 0, rows, out=out)
        if self.compute_dtype == layer.dtype:
            return out
        if self.widened.numel() < needed:
            self.widened = torch.empty(needed, dtype=self.compute_dtype, device=layer.device)
        return self.widened[:needed].view(rows.numel(), width).copy_(out)

    def write(self, layer: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` (``[len(rows), head_dim]``, compute dtype) at ``write_rows`` ``rows``
        of ``layer``, rounded to the storage dtype."""
        if self.clamp is not None:
            values = values.clamp(-self.clamp, self.clamp)
        layer.view(-1, self.head_dim).index_copy_(0, rows, values.to(layer.dtype))


@dataclass(slots=True, eq=False)
class DecodeGroup:
    """Sequences with exactly one new token, of similar context lengths, attended as one batch.

    Packed tokens ``token_start .. token_start + num_seqs - 1``, one per sequence.
    """

    token_start: int
    num_seqs: int
    num_blocks: int  # blocks per (padded) block table; context length padded to this × block_size
    rows: torch.Tensor  # PagedKVCache.gather_rows of the padded block tables, flattened
    positions: torch.Tensor  # [num_seqs] position of each new token (= its context length - 1)
    # window → additive float mask [kv_heads * num_seqs, 1, context] (0 or -inf), built once
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class PrefillChunk:
    """One sequence with several new tokens: packed tokens ``token_start .. token_end - 1``."""

    token_start: int
    token_end: int
    start_pos: int  # position of the first new token
    num_blocks: int
    rows: torch.Tensor  # PagedKVCache.gather_rows of its block table
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window → [m, ctx] bool


@dataclass(slots=True, eq=False)
class PagedStep:
    """Everything the attention function needs for one forward pass, built once per step."""

    cache: PagedKVCache
    write_rows: torch.Tensor  # PagedKVCache.write_rows of each new token's slot (K rows, V rows)
    num_tokens: int
    decodes: list[DecodeGroup]  # packed first, in this order
    prefills: list[PrefillChunk]
    input_ids: torch.Tensor  # [1, num_tokens] the packed tokens, single-token chunks first
    position_ids: torch.Tensor  # [1, num_tokens] position of each packed token
    # Only during the load-time smoke forward: (layer_idx, names of non-None extra kwargs) per call.
    probe: list[tuple[int, frozenset[str]]] | None = None
    # Asked at each layer before its K/V write; True cuts the step short (StepInterrupted).
    interrupt: Callable[[], bool] | None = None


class StepInterrupted(Exception):
    """A step was cut short between layers by its ``interrupt`` check. The layers before wrote
    K/V only at the step's own new positions, which are not computed yet by the scheduler's
    count: running the same chunks again overwrites them, so nothing needs undoing."""


def _window_mask(
    query_pos: torch.Tensor, context_len: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """Bool ``[..., context_len]``: key ``j`` is visible to a query at ``p`` iff ``j <= p`` and,
    with a sliding window ``w``, ``j > p - w`` (transformers' convention)."""
    key_pos = torch.arange(context_len, device=device)
    q = query_pos[..., None]
    mask = key_pos <= q
    if window is not None:
        mask &= key_pos > q - window
    return mask


def _decode_attention(
    decode: DecodeGroup,
    cache: PagedKVCache,
    layer: torch.Tensor,
    query: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of the decode group: ``[kv_heads, n, group, head_dim]``.

    One gather of every sequence's blocks, then two batched matmuls over (kv head, sequence)
    with the group's query heads as rows; cheaper than SDPA's GQA path for one query per sequence.
    """
    _, num_kv_heads, _, block_size, head_dim = layer.shape
    n, ctx = decode.num_seqs, decode.num_blocks * block_size
    group = query.shape[1] // num_kv_heads
    a = decode.token_start
    q = query[0, :, a : a + n].view(num_kv_heads, group, n, head_dim).transpose(1, 2)
    q = q.reshape(num_kv_heads * n, group, head_dim)
    mask = decode.masks.get(window)
    if mask is None:
        visible = _window_mask(decode.positions, ctx, window, query.device)
        mask = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
        mask = mask.masked_fill_(~visible, float("-inf")).repeat(num_kv_heads, 1)[:, None, :]
        decode.masks[window] = mask
    # K first, then V into the same scratch: half the working set stays warm in cache.
    half = decode.rows.numel() // 2
    k = cache.gather(layer, decode.rows[:half]).view(num_kv_heads * n, ctx, head_dim)
    if softcap is None:
        scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scale)
    else:
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale / softcap).tanh_()
        scores = scores.mul_(softcap).add_(mask)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(k.dtype)
    v = cache.gather(layer, decode.rows[half:]).view(num_kv_heads * n, ctx, head_dim)
    return torch.bmm(probs, v).view(num_kv_heads, n, group, head_dim)


def _prefill_attention(
    chunk: PrefillChunk,
    cache: PagedKVCache,
    layer: torch.Tensor,
    query: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of one prefill chunk of ``m`` tokens: ``[m, heads, head_dim]``.

    Without softcapping: one 4-D SDPA call with ``enable_gqa`` and a ``[m, context]`` bool mask,
    which torch's fused CPU kernel takes (3-D inputs, or query heads folded into rows with a
    repeated mask, fall back to the unfused math path: 2-4x slower at 128-480 tokens).
    """
    _, num_kv_heads, _, block_size, head_dim = layer.shape
    num_heads = query.shape[1]
    a, b = chunk.token_start, chunk.token_end
    m, ctx = b - a, chunk.num_blocks * block_size
    kv = cache.gather(layer, chunk.rows).view(2, 1, num_kv_heads, ctx, head_dim)
    mask = chunk.masks.get(window)
    if mask is None:
        positions = torch.arange(chunk.start_pos, chunk.start_pos + m, device=query.device)
        mask = _window_mask(positions, ctx, window, query.device)
        chunk.masks[window] = mask
    group = num_heads // num_kv_heads
    if softcap is None:
        q, k, v = query[:, :, a:b], kv[0], kv[1]
        if SDPA_ENABLE_GQA:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
        else:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return o[0].transpose(0, 1)
    q = query[0, :, a:b].reshape(num_kv_heads, group * m, head_dim)  # rows: (group, token)
    k, v = kv[0, 0], kv[1, 0]
    scores = torch.matmul(q, k.transpose(1, 2)).mul_(scale / softcap).tanh_()
    scores = scores.mul_(softcap).masked_fill_(~mask.repeat(group, 1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(kv.dtype)
    return torch.matmul(probs, v).reshape(num_heads, m, head_dim).transpose(0, 1)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: write this step's K/V, attend over each sequence's cache.

    ``query`` is ``[1, heads, tokens, head_dim]``, ``key``/``value`` ``[1, kv_heads, tokens,
    head_dim]`` (all scheduled sequences packed on the token axis); returns ``[1, tokens, heads,
    head_dim]`` like transformers' own functions.
    """
    step: PagedStep | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} needs the {STEP_KWARG!r} keyword "
            "argument; run the model through tokenfleet's ModelRunner"
        )
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    if step.interrupt is not None and step.interrupt():
        raise StepInterrupted(f"cut short before layer {layer_idx}")
    if step.probe is not None:
        passed = {
            name
            for name, val in kwargs.items()
            if val is not None and name != STEP_KWARG and not (name == "is_causal" and val is True)
        }
        if attention_mask is not None:
            passed.add("attention_mask")
        if getattr(module, "is_causal", True) is not True:
            passed.add("is_causal=False")
        step.probe.append((layer_idx, frozenset(passed)))
    if dropout:
        raise ValueError("paged attention runs inference only: attention dropout must be 0")

    layer = step.cache.layers[layer_idx]
    _, num_kv_heads, _, _, head_dim = layer.shape
    _, num_heads, num_tokens, _ = query.shape
    if key.shape[1] != num_kv_heads or key.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"layer {layer_idx}: key shape {tuple(key.shape)} does not match the paged cache "
            f"({num_kv_heads} KV heads of {head_dim})"
        )
    scale = scaling if scaling is not None else head_dim**-0.5

    # Write this step's K/V into their slots (rows of head_dim values).
    cache = step.cache
    half = step.write_rows.numel() // 2
    cache.write(layer, step.write_rows[:half], key[0].reshape(-1, head_dim))
    cache.write(layer, step.write_rows[half:], value[0].reshape(-1, head_dim))

    if len(step.decodes) == 1 and not step.prefills:  # one batch of decodes: no output buffer
        o = _decode_attention(step.decodes[0], cache, layer, query, scale, sliding_window, softcap)
        return o.transpose(0, 1).reshape(1, num_tokens, num_heads, head_dim), None
    out = query.new_empty(1, num_tokens, num_heads, head_dim)
    for decode in step.decodes:
        o = _decode_attention(decode, cache, layer, query, scale, sliding_window, softcap)
        a, n = decode.token_start, decode.num_seqs
        out[0, a : a + n] = o.transpose(0, 1).reshape(n, num_heads, head_dim)
    for chunk in step.prefills:
        out[0, chunk.token_start : chunk.token_end] = _prefill_attention(
            chunk, cache, layer, query, scale, sliding_window, softcap
        )
    return out, None
