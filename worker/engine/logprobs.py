"""Log-probabilities of sampled tokens and of the most likely alternatives.

The values are the log-softmax of the model's raw logits for that position: before temperature,
top-k, top-p and any grammar mask (what the model itself gave each token; vLLM's default and
OpenAI's meaning). So a greedy unconstrained token is the top alternative, and a token a grammar
forced may have a low logprob. Computed in one batched call per step for the rows that ask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tokenfleet.worker.engine.outputs import TokenLogprob, TokenLogprobs

TokenBytes = Callable[[int], bytes]  # a token id's bytes (the grammar library's tokenizer)


def raw_logprobs(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``log_softmax`` of ``rows`` of ``logits`` (float32), before anything masks them."""
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    return logits.index_select(0, index).float().log_softmax(dim=-1)


def pick(
    logprobs: torch.Tensor,
    token_ids: Sequence[int],
    top_ks: Sequence[int],
    token_bytes: TokenBytes,
) -> list[TokenLogprobs]:
    """Row ``i`` of ``logprobs``: the logprob of ``token_ids[i]`` and its ``top_ks[i]`` most
    likely tokens (ties in id order), with their texts."""
    chosen = logprobs.gather(1, torch.tensor([[t] for t in token_ids])).squeeze(1).tolist()
    k_max = max(top_ks, default=0)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k_max > 0:
        values, ids = logprobs.topk(k_max, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    out = []
    for i, (token_id, lp) in enumerate(zip(token_ids, chosen, strict=True)):
        top = (
            [
                _entry(tid, value, token_bytes)
                for tid, value in zip(
                    top_ids[i][: top_ks[i]], top_values[i][: top_ks[i]], strict=True
                )
            ]
            if top_ks[i]
            else []
        )
        out.append(TokenLogprobs(_entry(token_id, lp, token_bytes), top))
    return out


def _entry(token_id: int, logprob: float, token_bytes: TokenBytes) -> TokenLogprob:
    raw = token_bytes(token_id)
    # -inf (a token the model rules out entirely) is reported as OpenAI does: -9999.0
    return TokenLogprob(token_id, raw.decode("utf-8", "replace"), raw, max(logprob, -9999.0))
