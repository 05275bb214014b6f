"""What the scheduler hands the model runner for one step: the contract between policy and compute.

A step computes KV for a chunk of tokens of each scheduled sequence. The runner writes the chunk's
K/V into the paged cache at the slots its block table maps, attends each token over everything the
sequence has cached up to and including itself, and returns next-token logits for the sequences
whose chunk reaches their last known token.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step.

    Invariants:
        * ``token_ids`` is non-empty; token ``token_ids[i]`` sits at position ``start_pos + i``.
        * ``block_table`` covers positions ``0 .. start_pos + len(token_ids) - 1``:
          position ``p`` lives in block ``block_table[p // block_size]`` at offset
          ``p % block_size``.
        * positions ``0 .. start_pos - 1`` already hold valid K/V (computed in earlier steps or
          shared through the prefix cache).
    """

    request_id: str
    token_ids: list[int]  # tokens whose K/V this step computes
    start_pos: int  # number of tokens already in the cache = position of token_ids[0]
    block_table: list[int]  # physical KV block ids, in position order
    needs_logits: bool  # True when the chunk ends at the last known token: sample the next one

    @property
    def end_pos(self) -> int:
        """One past the last position computed this step (the context length afterwards)."""
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class StepBatch:
    """All sequences of one step, decode sequences first, then prefill chunks."""

    seqs: list[ScheduledSeq] = field(default_factory=list)  # in the order logits are returned
    # Rows of the returned logits whose every logit is read (sampled with a temperature, asked
    # for logprobs, masked by a grammar), not only their argmax: a runner with a quantized LM
    # head computes these with the float head (quantization.QuantizedHead). Set by the engine.
    full_logit_rows: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step (the ``max_num_batched_tokens`` budget spent)."""
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_logits(self) -> int:
        """Rows of logits the runner returns: one per sequence with ``needs_logits``."""
        return sum(1 for s in self.seqs if s.needs_logits)
