"""Weight-only quantized linear layers on a CPU, with PyTorch's own int4 and int8 kernels.

``quantize_model(model, mode, ...)`` swaps the decoder's ``nn.Linear`` layers for
:class:`Int4Linear` (4-bit weights in groups of ``GROUP_SIZE`` along the input, each group with
its own scale and zero point: ``aten._weight_int4pack_mm_for_cpu``) or :class:`Int8Linear`
(8-bit weights, one scale per output channel: ``aten._weight_int8pack_mm``). Activations are
cast to bfloat16 for the product (both kernels' fast paths take bfloat16 only: with float32
activations they run a scalar path 5-20x slower than float32 ``F.linear``) and the result back
to the model's dtype (a bfloat16 input gets a bfloat16 result: no casts between two quantized
products). The LM head becomes a :class:`QuantizedHead` (int4 for a few rows of logits, with
the candidates that can win recomputed in float32; the float head for many rows and for rows
whose every logit matters); everything else
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


PACK_CHUNK_ROWS = 1024  # rows quantized at a time (a multiple of 32: see _int4_pack)


def _rows(weights: list[torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of the weights ``weights`` stacked (views, or a copy of at most
    ``stop - start`` rows where the range spans two of them), as float32."""
    pieces, offset = [], 0
    for weight in weights:
        lo, hi = max(start - offset, 0), min(stop - offset, weight.shape[0])
        if lo < hi:
            pieces.append(weight.detach()[lo:hi])
        offset += weight.shape[0]
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).float()


def _int4_pack(weights: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 form of the weights ``weights`` stacked along the output (the joined rows of a
    fused layer are those of its parts), made ``PACK_CHUNK_ROWS`` rows at a time: the CPU
    packing lays out rows in blocks of 32 (16 for an odd tail), so packing chunks that are
    multiples of 32 and concatenating them gives the whole packing byte for byte, and no float
    copy of all the rows (nor an int32 one, 4 bytes a weight) is ever made.
    Returns (packed ``[out, in / 2]`` uint8, scales and zeros ``[groups, out, 2]`` bfloat16)."""
    out_features = sum(w.shape[0] for w in weights)
    in_features = weights[0].shape[1]
    packed_chunks, scale_chunks = [], []
    for start in range(0, out_features, PACK_CHUNK_ROWS):
        stop = min(start + PACK_CHUNK_ROWS, out_features)
        groups = _rows(weights, start, stop).view(stop - start, -1, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        q = q.to(torch.int32).view(stop - start, in_features)
        packed_chunks.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # (scale, zero) with w = (q - 8) * scale + zero, [rows, groups, 2]
        scale_chunks.append(torch.stack([scale, low + 8 * scale], -1).to(torch.bfloat16))
    packed = packed_chunks[0] if len(packed_chunks) == 1 else torch.cat(packed_chunks)
    scales_zeros = torch.cat(scale_chunks).transpose(0, 1).contiguous()  # [groups, out, 2]
    return packed, scales_zeros


def _joined_bias(layers: list[nn.Linear]) -> nn.Parameter | None:
    if layers[0].bias is None:
        return None
    return nn.Parameter(torch.cat([layer.bias.detach() for layer in layers]), requires_grad=False)


class _QuantizedLinear(nn.Module):
    """What Int4Linear and Int8Linear share: built from one ``nn.Linear`` or from ``parts``
    (one layer whose output is the parts' outputs side by side, quantized straight from their
    weights: no joined float copy), ``forward`` = ``_product`` plus the bias."""

    def __init__(self, linear: nn.Linear | None = None, *, parts: list[nn.Linear] | None = None):
        super().__init__()
        layers = parts if parts is not None else [linear] if linear is not None else []
        if not layers:
            raise ValueError(f"{type(self).__name__} needs a linear layer or parts")
        self.in_features = layers[0].in_features
        self.out_features = sum(layer.out_features for layer in layers)
        self._quantize([layer.weight for layer in layers])
        self.bias = layers[0].bias if len(layers) == 1 else _joined_bias(layers)
        if len(layers) > 1:
            setattr(self, FUSED_PARTS, tuple(layer.out_features for layer in layers))

    @classmethod
    def joined(cls, layers: list[nn.Linear]) -> _QuantizedLinear:
        return cls(parts=layers)

    @classmethod
    def supports(cls, linear: nn.Linear) -> bool:
        return cls.fits(linear.in_features, linear.out_features)

    @staticmethod
    def fits(in_features: int, out_features: int) -> bool:
        return True

    def _quantize(self, weights: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W'.T (+ bias)`` in ``x``'s dtype (bfloat16 in, bfloat16 out: no cast)."""
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = self._product(flat).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int4Linear(_QuantizedLinear):
    """``nn.Linear`` with 4-bit weights in groups of ``GROUP_SIZE`` (asymmetric: each group's
    min and max span q = 0..15). Invariant: ``in_features % GROUP_SIZE == 0`` and
    ``out_features % INT4_ROWS_MULTIPLE == 0`` (``supports`` says whether a layer fits)."""

    @staticmethod
    def fits(in_features: int, out_features: int) -> bool:
        return in_features % GROUP_SIZE == 0 and out_features % INT4_ROWS_MULTIPLE == 0

    def _quantize(self, weights: list[torch.Tensor]) -> None:
        packed, scales_zeros = _int4_pack(weights)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, GROUP_SIZE, self.scales_zeros
        )


class Int8Linear(_QuantizedLinear):
    """``nn.Linear`` with 8-bit weights, one symmetric scale per output channel."""

    def _quantize(self, weights: list[torch.Tensor]) -> None:
        q = torch.empty(self.out_features, self.in_features, dtype=torch.int8)
        scales = torch.empty(self.out_features, dtype=torch.bfloat16)
        for start in range(0, self.out_features, PACK_CHUNK_ROWS):  # no full-size temporaries
            stop = min(start + PACK_CHUNK_ROWS, self.out_features)
            weight = _rows(weights, start, stop)
            scale = (weight.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
            q[start:stop] = torch.round(weight / scale[:, None]).clamp(-127, 127)
            scales[start:stop] = scale
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scales)

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)


class QuantizedHead(nn.Module):
    """The LM head with int4 (or int8) weights for up to ``max_rows`` rows of logits and its
    float weights (kept, usually tied to the input embeddings: not copied) for more, and for
    every row listed in ``float_rows``. The quantized kernels read an eighth (a quarter) of the
    bytes, which wins while the product is bound by reading weights, and loses to float32's
    matmul once enough rows share each weight read (measurements: benchmarks/RESULTS.md,
    "LM head and projection kernels by rows").

    The quantized logits are off by more than the gap between a greedy choice and the
    runner-up at many positions (SmolLM2: up to ~0.8 as int8, mostly the bfloat16 rounding of
    the activations the kernels need; more as int4). So each row's ``exact_top`` highest
    quantized logits are recomputed in float32 from the float weights: every logit that can win
    is the float head's own. A row where the best recomputed logit is not ``margin`` above the
    ``exact_top``-th quantized one (a flat distribution: a token left out could be the real
    best) has every token whose quantized logit is within ``margin`` of that best recomputed
    too (only those can beat it), or, when there are more than ``WIDE_CANDIDATES`` of them, is
    recomputed whole by the float head.

    ``float_rows`` (set by the model runner for one forward, then cleared): the rows whose
    every logit matters -- sampled with a temperature, asked for logprobs, or masked by a
    grammar (the masked argmax may be any allowed token) -- computed whole by the float head.

    Invariant: every row's argmax is the float head's argmax, provided the quantized logits are
    off by less than ``margin``; the rows in ``float_rows`` are the float head's logits. Only
    the other logits of the other rows (greedy, unconstrained, no logprobs: nobody reads them)
    are the quantized ones.
    """

    def __init__(
        self,
        linear: nn.Linear,
        max_rows: int,
        kind: str = "int4",
        exact_top: int | None = None,
        margin: float | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.float_head = linear
        self.kind = kind
        self.quantized = Int4Linear(linear) if kind == "int4" else Int8Linear(linear)
        self.max_rows = max_rows
        exact_top = HEAD_EXACT_TOP[kind] if exact_top is None else exact_top
        self.exact_top = min(exact_top, linear.out_features)
        self.margin = HEAD_MARGINS[kind] if margin is None else margin
        self.float_rows: list[int] = []  # this forward's rows that need all float logits
        self.num_float_rows = 0  # rows the margin sent to the float head (for measurements)
        self.num_wide_rows = 0  # rows whose near candidates were recomputed (measurements)

    @staticmethod
    def supports(linear: nn.Linear, kind: str) -> bool:
        return kind == "int8" or Int4Linear.supports(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        num_rows, num_float = rows.shape[0], len(self.float_rows)
        if (
            x.dtype != torch.float32
            or num_rows - num_float > self.max_rows
            or num_float >= num_rows
        ):
            return self.float_head(x)
        if not num_float:
            return self._greedy_rows(rows).view(*x.shape[:-1], self.out_features)
        exact = torch.zeros(num_rows, dtype=torch.bool)
        exact[self.float_rows] = True
        logits = torch.empty(num_rows, self.out_features, dtype=x.dtype, device=x.device)
        logits[exact] = self.float_head(rows[exact])
        logits[~exact] = self._greedy_rows(rows[~exact])
        return logits.view(*x.shape[:-1], self.out_features)

    def _greedy_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Logits of ``rows`` whose argmax is the float head's (see the class docstring)."""
        logits = self.quantized(rows)
        approx, top = logits.topk(self.exact_top, dim=-1)
        weights = self.float_head.weight[top]  # [rows, exact_top, in_features]
        exact = torch.bmm(weights, rows.unsqueeze(-1)).squeeze(-1)
        if self.float_head.bias is not None:
            exact = exact + self.float_head.bias[top]
        logits.scatter_(1, top, exact)
        best = exact.amax(-1)
        for i in (best < approx[:, -1] + self.margin).nonzero().flatten().tolist():
            # A token left out could win: only those within ``margin`` of the best exact logit
            # can (quantized logits off by less than it), so they are recomputed too; a flat
            # row with too many of them is recomputed whole.
            near = (logits[i] > best[i] - self.margin).nonzero().flatten()
            if len(near) > WIDE_CANDIDATES:
                self.num_float_rows += 1
                logits[i] = self.float_head(rows[i])
                continue
            exact_near = self.float_head.weight[near] @ rows[i]
            if self.float_head.bias is not None:
                exact_near = exact_near + self.float_head.bias[near]
            logits[i, near] = exact_near
            self.num_wide_rows += 1
        return logits


WIDE_CANDIDATES = 4096  # QuantizedHead: a row with more near candidates runs the float head
HEAD_MAX_ROWS = {"int4": 16, "int8": 12}  # QuantizedHead: more rows than this run float
# The quantized logits' error the head's guarantee assumes (see QuantizedHead), and how many
# candidates it recomputes. Measured on SmolLM2 (1,104 rows of real hidden states, prompts and
# greedy continuations): int8 off by up to 0.79 (0.49 among each row's 64 best tokens), int4
# by up to 5.3 (2.3 among the 64 best: the winner is among those). Rows sent whole to the float
# head at these settings: none of the 1,104 as int8, 0.5 % as int4 at a margin of 3.
HEAD_MARGINS = {"int4": 4.0, "int8": 1.0}
HEAD_EXACT_TOP = {"int4": 64, "int8": 32}


_LAYERS: dict[str, type[_QuantizedLinear]] = {"int4": Int4Linear, "int8": Int8Linear}


@dataclass(slots=True)
class QuantizationReport:
    """What ``quantize_model`` did: the mode asked for and the one applied (``none`` after a
    fallback), layers swapped and left as they were, and why nothing was swapped, if so."""

    requested: str
    applied: str = "none"
    num_quantized: int = 0
    num_skipped: int = 0
    fallback_reason: str | None = None
    head: str = "as loaded"  # the LM head: "int4"/"int8" (QuantizedHead) or as loaded

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


def joined_quantizer(mode: str) -> Callable[[list[nn.Linear]], nn.Module | None] | None:
    """For ``fuse_projections(convert=...)``: one layer joining ``layers``' outputs, quantized
    as ``mode`` (``int4`` or ``int8``) straight from their weights (no joined float copy), or
    None where the joined shape does not fit the kernel (then joined as float); None when
    nothing would be quantized."""
    if mode not in _LAYERS or not kernels_available():
        return None
    layer_cls = _LAYERS[mode]

    def quantize(layers: list[nn.Linear]) -> nn.Module | None:
        out_features = sum(layer.out_features for layer in layers)
        fits = layer_cls.fits(layers[0].in_features, out_features)
        return layer_cls.joined(layers) if fits else None

    return quantize


def quantize_model(
    model: Any, mode: str, device: torch.device, source: str | os.PathLike[str] | None = None
) -> QuantizationReport:
    """Swap ``model``'s linear layers for quantized ones and its LM head for an
    :class:`QuantizedHead`, in place.

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
        if hasattr(linear, FUSED_PARTS):  # joined as float (not by joined_quantizer)
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
    """Swap ``model``'s LM head for a :class:`QuantizedHead` (int4 where its shape fits the
    kernel, else int8, whatever the mode of the other layers: the head's guarantees do not depend
    on its precision); what the head runs as now."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return "as loaded"
    kind = "int4" if QuantizedHead.supports(head, "int4") else "int8"
    for name, child in model.named_children():
        if child is head:
            setattr(model, name, QuantizedHead(head, HEAD_MAX_ROWS[kind], kind))
            return kind
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
