"""Pick the next token of every sequence in a step, each with its own sampling parameters.

Greedy rows (``temperature == 0``) take the argmax. Other rows divide their logits by the
temperature, keep the ``top_k`` most likely tokens and then the smallest set whose probability
reaches ``top_p``, and draw one token with the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``
(equivalent to drawing from ``p``).

Reproducibility: a row with a seed draws its ``E`` from a generator seeded by
``token_seed(seed, output_index)`` only, so token ``i`` of a seeded request depends on its own
logits, its seed and ``i`` — not on its batch neighbours, nor on whether it was resumed on another
worker from its first ``i`` tokens. Rows without a seed share the sampler's generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenfleet.worker.engine.request import SamplingParams

_MASK64 = (1 << 64) - 1


def token_seed(seed: int, output_index: int) -> int:
    """A 63-bit generator seed for output token ``output_index`` of a request seeded ``seed``.

    splitmix64 of a mix of both, so neighbouring seeds and indices give unrelated streams.
    """
    x = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


class Sampler:
    """Batched sampling with per-row parameters; ``seed`` seeds the shared generator of unseeded
    rows (None: a nondeterministic seed)."""

    def __init__(self, *, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self._shared = torch.Generator(device=self.device)
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)
        self._per_token = torch.Generator(device=self.device)  # reseeded for each seeded row

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
    ) -> list[int]:
        """One token id per row of ``logits`` ([rows, vocab]); ``output_indices[i]`` is the index
        the sampled token will have in row ``i``'s output."""
        if (
            logits.dim() != 2
            or logits.shape[0] != len(params)
            or len(params) != len(output_indices)
        ):
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match {len(params)} params and "
                f"{len(output_indices)} output indices"
            )
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            row_params = [params[i] for i in rows]
            probs = _filtered_probs(logits[rows].float(), row_params)
            noise = torch.empty_like(probs).exponential_(generator=self._shared)
            for j, i in enumerate(rows):
                seed = params[i].seed
                if seed is not None:
                    self._per_token.manual_seed(token_seed(seed, output_indices[i]))
                    noise[j].exponential_(generator=self._per_token)
            tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens.tolist()  # list[int]: a 1-D long tensor


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax of ``logits / temperature`` after the top-k and top-p filters, row by row."""
    vocab_size = logits.shape[1]
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    x = logits / temps.unsqueeze(1)
    use_top_k = any(0 < p.top_k < vocab_size for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if use_top_k or use_top_p:
        sorted_x, sorted_idx = x.sort(dim=-1, descending=True)
        if use_top_k:
            ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
            k = torch.tensor(ks, device=x.device).unsqueeze(1)
            kth = sorted_x.gather(1, k - 1)  # ties with the k-th value are kept
            x = x.masked_fill(x < kth, float("-inf"))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if use_top_p:
            top_p = torch.tensor([p.top_p for p in params], device=x.device).unsqueeze(1)
            sorted_probs = sorted_x.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            remove_sorted = mass_before >= top_p  # never removes the most likely token
            remove = torch.zeros_like(remove_sorted).scatter(1, sorted_idx, remove_sorted)
            x = x.masked_fill(remove, float("-inf"))
    return x.softmax(dim=-1)
