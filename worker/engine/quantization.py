"""Weight-only quantized linear layers on a CPU, with PyTorch's own int4 and int8 kernels.

``quantize_model(model, mode, ...)`` swaps the decoder's ``nn.Linear`` layers for
:class:`Int4Linear` (4-bit weights in groups of ``GROUP_SIZE`` along the input, each group with
its own scale and zero point: ``aten._weight_int4pack_mm_for_cpu``) or :class:`Int8Linear`
(8-bit weights, one scale per output channel: ``aten._weight_int8pack_mm``). Activations are
cast to bfloat16 for the product (both kernels' fast paths take bfloat16 only: with float32
activations they run a scalar path 5-20x slower than float32 ``F.linear``) and the result back
to the model's dtype (a bfloat16 input gets a bfloat16 result: no casts between two quantized
products). The LM head becomes an :class:`Int8Head` (int8 for a few rows of logits, with the
candidates that can win recomputed in float32; the float head for many rows); everything else
(norms, attention, the embeddings) stays as the model was loaded.

Modes: ``none``; ``int4``; ``int8``; ``auto`` keeps a GGUF file's own precision (its linear
weights' type: Q4_x and other 2-4 bit types -> int4, Q5_x/Q6_K/Q8_x -> int8, float -> none),
read from the converted folder's ``tokenfleet-source.json``.

A Q4_1 group of 32 (``w = q * d + m``, q in 0..15) is the same grid as an int4 group here
(``w = (q - 8) * scale + zero``, with scale = d, zero = m + 8 d): requantizing the dequantized
weights by their group's min and max gives back the file's q exactly; only d and m are rounded
from float16 to bfloat16 (the kernel's scale type). Q4_0 and k-quants are requantized to that
grid, which approximates them.

Invariant: after ``quantize_model`` every swapped layer computes ``x @ W'.T (+ bias)`` where
``W'`` is the dequantized int4/int8 weight; layers it cannot run quantized (shape, device, kernel
missing) stay as they were, and when none can, one warning says why.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenfleet.worker.engine.config import check_quantization
from tokenfleet.worker.engine.fusion import ACT_DTYPE, FUSED_PARTS, fused_parts

log = logging.getLogger(__name__)

GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1/Q8_0 blocks are 32 wide: one file block, one int4 group
INT4_ROWS_MULTIPLE = 16  # the CPU int4 packing needs out_features % 16 == 0
SOURCE_FILE = "tokenfleet-source.json"  # written by the GGUF conversion cache next to the weights
_INT4_TYPES = ("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "IQ2", "IQ3", "IQ4", "TQ")
_INT8_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K")


def mode_for_gguf_type(type_name: str) -> str:
    """The mode that keeps a GGUF tensor type's precision (``F32`` -> ``none``)."""
    name = type_name.upper()
    if name.startswith(_INT4_TYPES):
        return "int4"
    if name.startswith(_INT8_TYPES):
        return "int8"
    return "none"


def file_precision(folder: str | os.PathLike[str]) -> str | None:
    """The mode that keeps the precision of the GGUF file ``folder`` was converted from, or None
    (not a converted GGUF, or the file's types unknown). The linear weights' most common type
    decides (a Q4_1 file keeps its embedding in Q8_0 and its norms in F32)."""
    source = Path(folder) / SOURCE_FILE
    try:
        info = json.loads(source.read_text())
    except (OSError, ValueError):
        return None
    types = info.get("linear_types")
    if not isinstance(types, dict) and isinstance(info.get("gguf"), str):
        types = gguf_linear_types(Path(info["gguf"]))  # converted before the types were recorded
    if not types:
        return None
    return mode_for_gguf_type(max(types, key=lambda t: types[t]))


def gguf_linear_types(path: Path) -> dict[str, int] | None:
    """How many of a GGUF file's 2-D projection weights (attention and MLP) have each type;
    None when the file is gone or unreadable."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
    except Exception:  # a missing, moved or foreign file: the precision is just unknown
        return None
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        if len(tensor.shape) == 2 and (".attn_" in tensor.name or ".ffn_" in tensor.name):
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


def kernels_available() -> bool:
    """Whether this torch has the CPU weight-only kernels."""
    ops = torch.ops.aten
    return all(
        hasattr(ops, name)
        for name in (
            "_weight_int8pack_mm",
            "_weight_int4pack_mm_for_cpu",
            "_convert_weight_to_int4pack_for_cpu",
        )
    )


class Int4Linear(nn.Module):
    """``nn.Linear`` with 4-bit weights in groups of ``GROUP_SIZE`` (asymmetric: each group's
    min and max span q = 0..15). Invariant: ``in_features % GROUP_SIZE == 0`` and
    ``out_features % INT4_ROWS_MULTIPLE == 0`` (``supports`` says whether a layer fits)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        groups = weight.view(self.out_features, -1, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        q = q.to(torch.int32).view(self.out_features, self.in_features)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # [groups, out, 2]: (scale, zero) with w = (q - 8) * scale + zero
        scales_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
        self.register_buffer("scales_zeros", scales_zeros.to(torch.bfloat16))
        self.bias = linear.bias

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        return (
            linear.in_features % GROUP_SIZE == 0 and linear.out_features % INT4_ROWS_MULTIPLE == 0
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W'.T (+ bias)`` in ``x``'s dtype (bfloat16 in, bfloat16 out: no cast)."""
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, GROUP_SIZE, self.scales_zeros
        ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """``nn.Linear`` with 8-bit weights, one symmetric scale per output channel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.bias = linear.bias

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W'.T (+ bias)`` in ``x``'s dtype (bfloat16 in, bfloat16 out: no cast)."""
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int8Head(nn.Module):
    """The LM head with int8 weights (per channel) for up to ``max_rows`` rows of logits and its
    float weights (kept, usually tied to the input embeddings) for more: the int8 kernel reads a
    quarter of the bytes, which wins while the product is bound by reading weights, and loses
    to float32's matmul once enough rows share each weight read (measured on SmolLM2's
    49152 x 576 head, one thread: 5.9 ms against 10.1 at 1 row, 13 against 33 at 8, 27 against
    24 at 16).

    The int8 logits are off by up to ~0.8 on SmolLM2 (mostly the bfloat16 rounding of the
    activations the kernel needs), more than the gap between a greedy choice and the runner-up
    at many positions. So each row's ``exact_top`` highest int8 logits are recomputed in float32
    from the float weights: every logit that can win is the float head's own. A row where the
    best recomputed logit is not ``margin`` above the ``exact_top``-th int8 one (a flat
    distribution: a token left out could be the real best) is recomputed whole by the float
    head. Invariant: the argmax of every row is the float head's argmax, provided the int8
    logits are off by less than ``margin``; the other logits (sampling's tail, logprobs'
    normaliser) are the int8 ones.
    """

    def __init__(
        self, linear: nn.Linear, max_rows: int, exact_top: int = 32, margin: float = 1.0
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.float_head = linear
        self.int8_head = Int8Linear(linear)
        self.max_rows = max_rows
        self.exact_top = min(exact_top, linear.out_features)
        self.margin = margin
        self.num_float_rows = 0  # rows the margin sent to the float head (for measurements)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > self.max_rows or x.dtype != torch.float32:
            return self.float_head(x)
        logits = self.int8_head(rows)
        approx, top = logits.topk(self.exact_top, dim=-1)
        weights = self.float_head.weight[top]  # [rows, exact_top, in_features]
        exact = torch.bmm(weights, rows.unsqueeze(-1)).squeeze(-1)
        if self.float_head.bias is not None:
            exact = exact + self.float_head.bias[top]
        logits.scatter_(1, top, exact)
        unsure = exact.amax(-1) < approx[:, -1] + self.margin
        if bool(unsure.any()):
            self.num_float_rows += int(unsure.sum())
            logits[unsure] = self.float_head(rows[unsure])
        return logits.view(*x.shape[:-1], self.out_features)


HEAD_INT8_MAX_ROWS = 12  # Int8Head: more rows of logits than this run the float head


_LAYERS: dict[str, type[Int4Linear] | type[Int8Linear]] = {"int4": Int4Linear, "int8": Int8Linear}


@dataclass(slots=True)
class QuantizationReport:
    """What ``quantize_model`` did: the mode asked for and the one applied (``none`` after a
    fallback), layers swapped and left as they were, and why nothing was swapped, if so."""

    requested: str
    applied: str = "none"
    num_quantized: int = 0
    num_skipped: int = 0
    fallback_reason: str | None = None
    head: str = "as loaded"  # the LM head: "int8" (Int8Head) or as loaded

    def describe(self) -> str:
        """A few words for the worker's start line: the mode that ran and, where ``auto`` chose
        it or a fallback forced it, why."""
        if self.fallback_reason is not None:
            return f"none ({self.requested} fell back: {self.fallback_reason})"
        if self.applied == "none":
            return "none (auto: not a quantized GGUF file)" if self.requested == "auto" else "none"
        why = "auto: the GGUF file's precision, " if self.requested == "auto" else ""
        skipped = f", {self.num_skipped} left float" if self.num_skipped else ""
        return f"{self.applied} ({why}{self.num_quantized} linear layers{skipped})"


def resolve_mode(mode: str, source: str | os.PathLike[str] | None = None) -> str:
    """``mode`` with ``auto`` replaced by the precision of the GGUF file ``source`` was
    converted from (``none`` when unknown)."""
    if mode == "auto":
        return (file_precision(source) if source is not None else None) or "none"
    return check_quantization(mode)


def joined_quantizer(mode: str) -> Callable[[nn.Linear], nn.Module] | None:
    """For ``fuse_projections(convert=...)``: each joined layer quantized as ``mode`` (``int4``
    or ``int8``) when it fits the kernel, else left float; None when nothing would be."""
    if mode not in _LAYERS or not kernels_available():
        return None
    layer_cls = _LAYERS[mode]

    def quantize(linear: nn.Linear) -> nn.Module:
        if not layer_cls.supports(linear):
            return linear
        layer = layer_cls(linear)
        setattr(layer, FUSED_PARTS, fused_parts(linear))
        return layer

    return quantize


def quantize_model(
    model: Any, mode: str, device: torch.device, source: str | os.PathLike[str] | None = None
) -> QuantizationReport:
    """Swap ``model``'s linear layers for quantized ones and its LM head for an
    :class:`Int8Head`, in place.

    ``mode`` ``auto`` takes the precision of the GGUF file ``source`` was converted from (float
    when unknown). Falls back to the model as loaded, with one warning naming the model and the
    reason, when the device is not a CPU, the kernels are missing, or no layer fits them.
    """
    report = QuantizationReport(requested=check_quantization(mode))
    mode = resolve_mode(mode, source)
    if mode == "none":
        return report
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    layer_cls = _LAYERS[mode]
    targets = _linear_layers(model)
    fitting = [(parent, name, lin) for parent, name, lin in targets if layer_cls.supports(lin)]
    reason = None
    if device.type != "cpu":
        reason = f"{mode} weights run on a CPU only, this model is on {device.type}"
    elif not kernels_available():
        reason = f"this torch {torch.__version__} lacks the CPU weight-only {mode} kernels"
    elif not fitting:
        reason = (
            f"none of its {len(targets)} linear layers fits the {mode} kernel (int4 needs "
            f"in_features % {GROUP_SIZE} == 0 and out_features % {INT4_ROWS_MULTIPLE} == 0)"
        )
    if reason is not None:
        log.warning(
            "quantization %s: model type %r cannot be executed as %s: %s; running its weights "
            "as loaded",
            report.requested,
            model_type,
            mode,
            reason,
        )
        report.fallback_reason = reason
        return report
    for parent, name, linear in fitting:
        layer = layer_cls(linear)
        if hasattr(linear, FUSED_PARTS):
            setattr(layer, FUSED_PARTS, fused_parts(linear))
        setattr(parent, name, layer)
    for parent, _, _ in fitting:  # a fused MLP both of whose products are quantized
        if isinstance(getattr(parent, "gate_up_proj", None), layer_cls) and isinstance(
            getattr(parent, "down_proj", None), layer_cls
        ):
            setattr(parent, ACT_DTYPE, torch.bfloat16)  # gate/up's product stays bfloat16
    done = [m for m in model.modules() if isinstance(m, layer_cls)]  # joined ones, and these
    report.applied = mode
    report.num_quantized = sum(len(fused_parts(layer)) for layer in done)
    report.num_skipped = sum(len(fused_parts(linear)) for _, _, linear in targets) - sum(
        len(fused_parts(linear)) for _, _, linear in fitting
    )
    report.head = _quantize_head(model)
    return report


def _quantize_head(model: Any) -> str:
    """Swap ``model``'s LM head for an :class:`Int8Head`; what the head runs as now."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return "as loaded"
    for name, child in model.named_children():
        if child is head:
            setattr(model, name, Int8Head(head, HEAD_INT8_MAX_ROWS))
            return "int8"
    return "as loaded"


def _linear_layers(model: Any) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every ``nn.Linear`` of ``model`` with its parent and attribute name, except the output
    embeddings (the LM head, often tied to the input embeddings)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and child is not head:
                found.append((parent, name, child))
    return found
