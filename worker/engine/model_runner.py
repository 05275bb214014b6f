"""Run an unmodified Hugging Face causal LM over a paged KV cache, one packed forward per step.

Every scheduled sequence's new tokens are concatenated into one ``input_ids`` row
(``[1, total_tokens]``) with per-token ``position_ids``; attention goes through
``paged_attention.paged_attention_forward``, registered with transformers' public
``AttentionInterface``. Single-token chunks (decodes) are packed first so that attention handles
them as one batch; logits come back in the order of the batch's sequences.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from tokenfleet.worker.engine.batch import ScheduledSeq, StepBatch
from tokenfleet.worker.engine.fast_forward import FastForward
from tokenfleet.worker.engine.fusion import fuse_projections
from tokenfleet.worker.engine.kv_sizing import DEFAULT_KV_TOKENS, kv_pool_blocks
from tokenfleet.worker.engine.paged_attention import (
    ATTN_IMPLEMENTATION,
    IGNORED_KWARGS,
    STEP_KWARG,
    DecodeGroup,
    PagedKVCache,
    PagedStep,
    PrefillChunk,
    paged_attention_forward,
)
from tokenfleet.worker.engine.quantization import (
    QuantizedHead,
    joined_quantizer,
    quantize_model,
    resolve_mode,
)

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV storage under kv_dtype "auto" on a CPU, chosen by measurement (docs/engine.md): on SmolLM2
# greedy output equal to float32 storage, logprobs 4.5x closer than bfloat16's; attention no
# slower within the noise of an ad-hoc timing (benchmarks/RESULTS.md, KV cache storage).
CPU_AUTO_KV_DTYPE = torch.float16


def _start_pos(seq: ScheduledSeq) -> int:
    return seq.start_pos


def _similar_width_groups(widths: list[int]) -> list[tuple[int, int]]:
    """Split ascending ``widths`` into ``[first, last)`` runs whose widest member is at most
    twice the narrowest: each run is padded to its widest, so padding stays under half."""
    groups: list[tuple[int, int]] = []
    first = 0
    for i, width in enumerate(widths):
        if width > 2 * widths[first]:
            groups.append((first, i))
            first = i
    if widths:
        groups.append((first, len(widths)))
    return groups


class UnsupportedModel(ValueError):
    """The model cannot run on the paged attention path (the message says which model and why)."""


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _kv_shape(config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) as the config declares them."""
    cfg = _text_config(config)
    num_heads = int(cfg.num_attention_heads)
    num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return int(cfg.num_hidden_layers), num_kv_heads, int(head_dim)


def _config_dtype(config: Any) -> torch.dtype | None:
    """The dtype the model's config declares (``dtype``, or ``torch_dtype`` before 4.56)."""
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = _DTYPES.get(declared)
    return declared if isinstance(declared, torch.dtype) else None


def _resolve_dtype(dtype: str, device: torch.device, config: Any = None) -> torch.dtype:
    """``dtype`` as a torch dtype; ``"auto"`` follows the model's own dtype where the device
    computes it well: on CUDA bfloat16 becomes float16 where the card lacks bfloat16; on a CPU a
    16-bit model runs in float32 (CPU matmuls in 16 bits are slower than in 32 on most CPUs, and
    PyTorch's CPU float16 kernels are partial). A config that declares nothing gets float32 on a
    CPU, bfloat16 (else float16) on CUDA."""
    if dtype == "auto":
        declared = _config_dtype(config) if config is not None else None
        if device.type == "cuda":
            if declared is None or declared == torch.bfloat16:
                return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            return declared
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, not {dtype!r}")
    return _DTYPES[dtype]


def _resolve_kv_dtype(kv_dtype: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype: ``"auto"`` is ``CPU_AUTO_KV_DTYPE`` on a CPU under a
    wider compute dtype (memory, not arithmetic, is what 16 bits save there), else ``dtype``."""
    if kv_dtype == "auto":
        wider = dtype.itemsize > CPU_AUTO_KV_DTYPE.itemsize
        return CPU_AUTO_KV_DTYPE if device.type == "cpu" and wider else dtype
    if kv_dtype not in _DTYPES:
        raise ValueError(f"kv_dtype must be auto or one of {sorted(_DTYPES)}, not {kv_dtype!r}")
    return _DTYPES[kv_dtype]


class ModelRunner:
    """Owns the model and its paged KV cache; ``execute`` runs one scheduled step.

    The KV pool is ``num_kv_blocks`` blocks, else ``kv_memory_bytes`` worth, else (the default)
    ``default_kv_tokens`` tokens capped by the device's free memory (``kv_sizing``), stored as
    ``kv_dtype`` (``_resolve_kv_dtype``; attention computes in the model's dtype). Linear
    layers run as loaded, or weight-only quantized (``quantization``: see ``quantization.py``).

    Invariants:
        * ``num_kv_blocks * block_size >= max_model_len`` (one longest sequence always fits).
        * Every decoder layer of ``model`` calls the paged attention function once per forward
          (checked by a smoke forward at load time; other models raise ``UnsupportedModel``).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        device: str | None = None,
        dtype: str = "auto",
        kv_dtype: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        default_kv_tokens: int = DEFAULT_KV_TOKENS,
        max_model_len: int | None = None,
        quantization: str = "auto",
        trust_remote_code: bool = False,
        fast_forward: bool = True,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {block_size}")
        if num_kv_blocks is not None and kv_memory_bytes is not None:
            raise ValueError("give num_kv_blocks or kv_memory_bytes, not both")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.block_size = block_size

        self.config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        self.dtype = _resolve_dtype(dtype, self.device, _text_config(self.config))
        self.kv_dtype = _resolve_kv_dtype(kv_dtype, self.device, self.dtype)
        model_type = getattr(self.config, "model_type", type(self.config).__name__)
        _register_attention()
        try:
            hf_model: Any = AutoModelForCausalLM.from_pretrained(
                model,
                dtype=self.dtype,
                attn_implementation=ATTN_IMPLEMENTATION,
                trust_remote_code=trust_remote_code,
            )
        except (ValueError, TypeError, NotImplementedError, KeyError) as exc:
            why = (
                "its modeling code picks attention classes from its own table instead of "
                "transformers' AttentionInterface"
                if isinstance(exc, KeyError)
                else str(exc)
            )
            raise UnsupportedModel(
                f"model type {model_type!r} cannot be loaded with the custom attention function "
                f"{ATTN_IMPLEMENTATION!r}: {why}"
            ) from exc
        self.model: Any = hf_model.to(self.device).eval()
        self.config = self.model.config
        # counted as loaded: quantized layers keep their weights as buffers, not parameters
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        # Projections are joined only where they will be quantized (see fuse_projections): not
        # on CUDA, nor where this torch lacks the kernels (quantize_model then says why).
        mode = resolve_mode(quantization, model) if self.device.type == "cpu" else "none"
        convert = joined_quantizer(mode)
        self.fused = fuse_projections(self.model, join=convert is not None, convert=convert)
        self.quantization = quantize_model(self.model, quantization, self.device, source=model)
        head = self.model.get_output_embeddings()
        self._quantized_head = head if isinstance(head, QuantizedHead) else None

        num_layers, num_kv_heads, head_dim = _kv_shape(self.config)
        per_block = self.kv_bytes_per_block(self.config, block_size, self.kv_dtype)
        if num_kv_blocks is None:
            num_kv_blocks = kv_pool_blocks(
                per_block, block_size, kv_memory_bytes, default_kv_tokens, self.device
            )
        max_positions = getattr(_text_config(self.config), "max_position_embeddings", None)
        if max_model_len is None:
            max_model_len = min(
                max_positions or num_kv_blocks * block_size, num_kv_blocks * block_size
            )
        elif max_positions is not None and max_model_len > max_positions:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{max_positions}"
            )
        if num_kv_blocks * block_size < max(max_model_len, 1):
            raise ValueError(
                f"{num_kv_blocks} KV blocks of {block_size} tokens cannot hold one sequence of "
                f"max_model_len {max_model_len}"
            )
        self.num_kv_blocks = int(num_kv_blocks)
        self.max_model_len = int(max_model_len)
        self.cache = PagedKVCache(
            num_layers=num_layers,
            num_blocks=self.num_kv_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=self.kv_dtype,
            device=self.device,
            compute_dtype=self.dtype,
        )
        self.eos_token_ids = self._eos_token_ids()
        # The decoder loop without transformers' plumbing (fast_forward.py), where it applies.
        self.fast: FastForward | None = FastForward.build(self.model) if fast_forward else None
        self.vocab_size = self._smoke_test(model_type, num_layers)

    @staticmethod
    def kv_bytes_per_block(config: Any, block_size: int, dtype: torch.dtype | str) -> int:
        """Bytes of K and V, all layers, for one block of ``block_size`` tokens stored as
        ``dtype`` (the KV storage dtype, not necessarily the model's)."""
        if isinstance(dtype, str):
            dtype = _DTYPES[dtype]
        num_layers, num_kv_heads, head_dim = _kv_shape(config)
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * block_size * element

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for source in (getattr(gen, "eos_token_id", None), _text_config(self.config).eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source)
        return frozenset(ids)

    def _smoke_test(self, model_type: str, num_layers: int) -> int:
        """Run a 3-token forward; check each layer called the paged function; return vocab size."""
        tokens = [1, 2, 3]
        num_blocks = -(-len(tokens) // self.block_size)
        probe_seq = ScheduledSeq("smoke-test", tokens, 0, list(range(num_blocks)), True)
        step = self._build_step([probe_seq])
        step.probe = []
        reason: str | None = None
        try:
            logits = self._forward(step, [len(tokens) - 1])
        except Exception as exc:  # the model's own code failed on our path: report it as such
            raise UnsupportedModel(
                f"model type {model_type!r} failed a forward pass through paged attention: {exc!r}"
            ) from exc
        called = sorted(layer for layer, _ in step.probe)
        unknown = {name for _, kwargs in step.probe for name in kwargs} - IGNORED_KWARGS
        if not called:
            reason = "its attention layers never call the registered attention function"
        elif called != list(range(num_layers)):
            reason = (
                f"attention was called for layers {called}, expected each of "
                f"0..{num_layers - 1} once"
            )
        elif unknown:
            reason = (
                f"its attention passes arguments paged attention cannot honour: {sorted(unknown)}"
            )
        if reason is not None:
            raise UnsupportedModel(f"model type {model_type!r} is not supported: {reason}")
        if self.fast is not None:  # it must compute the model's own logits, bit for bit
            fast = self._forward(self._build_step([probe_seq]), [len(tokens) - 1])
            if not torch.equal(fast, logits):
                log.warning(
                    "model type %r: the fast decoder loop's logits differ from the model's "
                    "forward (max %.2e); running the model's forward",
                    model_type,
                    float((fast - logits).abs().max()),
                )
                self.fast = None
        # Clean the blocks the probe wrote (nobody owns them yet, but keep the pool pristine).
        for layer in self.cache.layers:
            layer[:, :, :num_blocks].zero_()
        return int(logits.shape[-1])

    def _build_step(self, seqs: list[ScheduledSeq]) -> PagedStep:
        """Index tensors for ``seqs``, already packed: single-token chunks first, by start_pos."""
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_positions: list[int] = []
        chunks: list[tuple[int, int, int, list[int]]] = []
        lowest, highest = 0, 0
        for seq in seqs:
            start, m = seq.start_pos, len(seq.token_ids)
            end = start + m
            if m == 0:
                raise ValueError(f"request {seq.request_id}: empty token chunk")
            if start < 0 or end > self.max_model_len:
                raise ValueError(
                    f"request {seq.request_id}: positions {start}..{end - 1} outside "
                    f"0..{self.max_model_len - 1} (max_model_len)"
                )
            used = seq.block_table[: -(-end // bs)]
            if len(used) * bs < end:
                raise ValueError(
                    f"request {seq.request_id}: block table of {len(seq.block_table)} blocks "
                    f"cannot hold {end} tokens"
                )
            lowest, highest = min(lowest, *used), max(highest, *used)
            if m == 1:
                decode_tables.append(used)
                decode_positions.append(start)
                ids.append(seq.token_ids[0])
                positions.append(start)
                slots.append(used[start // bs] * bs + start % bs)
                continue
            chunks.append((len(ids), m, start, used))
            ids.extend(seq.token_ids)
            positions.extend(range(start, end))
            slots.extend(used[p // bs] * bs + p % bs for p in range(start, end))
        if lowest < 0 or highest >= self.num_kv_blocks:
            raise ValueError(
                f"block table refers to block {lowest if lowest < 0 else highest}, outside "
                f"0..{self.num_kv_blocks - 1}"
            )
        decodes = []
        for first, last in _similar_width_groups([len(t) for t in decode_tables]):
            tables = decode_tables[first:last]
            width = len(tables[-1])
            padded = [t + [t[0]] * (width - len(t)) for t in tables]  # padding is masked out
            decodes.append(
                DecodeGroup(
                    token_start=first,
                    num_seqs=last - first,
                    num_blocks=width,
                    rows=self.cache.gather_rows(torch.tensor(padded, device=dev).view(-1)),
                    positions=torch.tensor(decode_positions[first:last], device=dev),
                )
            )
        prefills = [
            PrefillChunk(
                token_start=first,
                token_end=first + m,
                start_pos=start,
                num_blocks=len(table),
                rows=self.cache.gather_rows(torch.tensor(table, device=dev)),
            )
            for first, m, start, table in chunks
        ]
        return PagedStep(
            cache=self.cache,
            write_rows=self.cache.write_rows(torch.tensor(slots, device=dev)),
            num_tokens=len(ids),
            decodes=decodes,
            prefills=prefills,
            input_ids=torch.tensor([ids], device=dev),
            position_ids=torch.tensor([positions], device=dev),
        )

    def _forward(
        self, step: PagedStep, keep: list[int], full_rows: list[int] | None = None
    ) -> torch.Tensor:
        """One packed forward; logits of the packed token indices ``keep``, as float32; the rows
        ``full_rows`` (indices into ``keep``) all the float head's (``StepBatch``)."""
        keep_ids = torch.tensor(keep, dtype=torch.long, device=self.device)
        head = self._quantized_head
        if head is not None:
            head.float_rows = full_rows or []
        try:
            with torch.inference_mode():
                if self.fast is not None and step.probe is None:
                    return self.fast(step, keep_ids).float()
                out = self.model(
                    input_ids=step.input_ids,
                    position_ids=step.position_ids,
                    use_cache=False,
                    logits_to_keep=keep_ids,
                    **{STEP_KWARG: step},
                )
        finally:
            if head is not None:
                head.float_rows = []
        return out.logits[0].float()

    def execute(
        self, batch: StepBatch, interrupt: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        """Compute one step; float32 logits ``[batch.num_logits, vocab_size]`` in batch order.

        ``interrupt``: asked before each layer's attention; when it answers True the step stops
        there with ``StepInterrupted`` (nothing to undo: see that class).
        Raises ``ValueError`` for a chunk that is empty, passes ``max_model_len``, or whose block
        table is too short or names a block outside the pool.
        """
        if not batch.seqs:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        # Single-token chunks first, by context length, so attention batches them.
        packed = sorted((s for s in batch.seqs if len(s.token_ids) == 1), key=_start_pos)
        packed += [s for s in batch.seqs if len(s.token_ids) != 1]
        step = self._build_step(packed)
        step.interrupt = interrupt
        last_index: dict[int, int] = {}
        offset = 0
        for seq in packed:
            offset += len(seq.token_ids)
            last_index[id(seq)] = offset - 1
        keep = [last_index[id(s)] for s in batch.seqs if s.needs_logits]
        return self._forward(step, keep, batch.full_logit_rows)
