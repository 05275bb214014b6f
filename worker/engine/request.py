"""One generation request inside the engine: its tokens, sampling parameters and progress."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenfleet.shared.priority import Priority


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy (argmax). ``top_k = 0`` and ``top_p = 1.0`` disable those
    filters. With a ``seed``, token ``i`` of the output is drawn from a generator seeded by
    ``(seed, i)`` only, so the continuation does not depend on batching, nor on whether the request
    was resumed on another worker from its first ``i`` tokens. Lists given for ``stop`` and
    ``stop_token_ids`` are stored as tuples.

    ``grammar`` (an llguidance grammar, ``Constraint.grammar()``) constrains every token: the
    logits of tokens it does not allow are ``-inf`` before sampling, and the request ends
    ``stop`` once the grammar is complete (``guided``). ``logprobs``: each new token comes with
    its log-probability and the ``top_logprobs`` most likely tokens' (``logprobs``).
    """

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # per-request reproducibility; None = engine randomness
    max_tokens: int = 256  # output tokens at most (resumed tokens count)
    stop: Sequence[str] = ()  # stop strings: the text ends before them (stored as a tuple)
    stop_token_ids: Sequence[int] = ()  # generation ends after any of these (stored as a tuple)
    ignore_eos: bool = False  # keep going past the model's EOS tokens
    skip_special_tokens: bool = True  # passed to tokenizer.decode for the streamed text
    grammar: str | None = None  # an llguidance grammar the output must match (None: free)
    logprobs: bool = False  # report each token's log-probability
    top_logprobs: int = 0  # ... and that of the this many most likely tokens (0-20)

    def __post_init__(self) -> None:
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be integers >= 0, got {t!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError(f"grammar must be a non-empty string or None, got {self.grammar!r}")
        if not 0 <= self.top_logprobs <= 20 or (self.top_logprobs and not self.logprobs):
            raise ValueError(
                f"top_logprobs must be in [0, 20] with logprobs, got {self.top_logprobs}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks
    RUNNING = "running"  # holds KV blocks; computed-token count catching up with its token count
    PREEMPTED = "preempted"  # was running, blocks freed, queued again to be recomputed
    FINISHED = "finished"  # terminal; blocks freed


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # Engine.abort()
    ERROR = "error"  # refused or failed; see error_code / error_message


@dataclass(slots=True)
class RequestTimings:
    """Wall-clock times (``time.time()`` seconds) of one request and intervals derived from them.

    ``first_token_time`` is the first token this engine produced (a resumed request's earlier
    tokens came from another worker). Intervals are None when their endpoints are missing.
    """

    arrival_time: float = 0.0  # when the request arrived (given by the caller or add_request time)
    first_scheduled_time: float | None = None  # first step that computed any of its tokens
    first_token_time: float | None = None  # first new token sampled
    finish_time: float | None = None  # when it finished
    num_generated_tokens: int = 0  # tokens sampled by this engine (resumed ones excluded)

    @property
    def queue_s(self) -> float | None:
        """Arrival → first scheduled."""
        return (
            None
            if self.first_scheduled_time is None
            else self.first_scheduled_time - self.arrival_time
        )

    @property
    def ttft_s(self) -> float | None:
        """Arrival → first token (time to first token)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if (
            self.first_token_time is None
            or self.finish_time is None
            or self.num_generated_tokens < 2
        ):
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        """Arrival → finish."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time


class Request:
    """A request and its progress.

    Invariants:
        * ``all_token_ids == prompt + output_token_ids``; output token ``i`` is ``all_token_ids[
          num_prompt_tokens + i]`` (resumed tokens are outputs ``0 .. num_resumed_tokens - 1``).
        * ``0 <= num_computed_tokens <= num_tokens``: tokens whose K/V sit in the request's blocks
          (``num_cached_tokens`` of them came from the prefix cache at its last admission).
        * A WAITING, PREEMPTED or FINISHED request holds no KV blocks and has
          ``num_computed_tokens == 0``.
        * ``block_hashes[i]`` is the chained hash of full block ``i`` of ``all_token_ids``.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_seq",
        "block_hashes",
        "boosted",
        "error_code",
        "error_message",
        "finish_reason",
        "matcher",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_tokens",
        "num_resumed_tokens",
        "output_token_ids",
        "params",
        "priority",
        "request_id",
        "status",
        "timings",
        "waiting_since_s",
        "waiting_since_step",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: Priority = Priority.NORMAL,
        arrival_time: float,
        arrival_seq: int = 0,
        resume_output_ids: Sequence[int] = (),
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.priority = Priority(priority)
        self.arrival_seq = arrival_seq  # tie-breaker between equal arrival times
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_resumed_tokens = len(resume_output_ids)
        self.output_token_ids: list[int] = list(resume_output_ids)
        self.all_token_ids: list[int] = [*prompt_token_ids, *resume_output_ids]
        self.block_hashes: list[bytes] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.boosted = False  # admitted ahead of its priority after waiting too long
        self.waiting_since_step = 0
        self.waiting_since_s = arrival_time
        self.finish_reason: FinishReason | None = None
        self.matcher: Any = None  # its grammar's matcher (guided), set before it is scheduled
        self.error_code: str | None = None
        self.error_message: str | None = None
        self.timings = RequestTimings(arrival_time=arrival_time)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens: the context needed to sample the next token."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int, float, int]:
        """Smaller = more urgent: boosted first (by arrival), then priority, then arrival."""
        if self.boosted:
            return (0, 0, self.timings.arrival_time, self.arrival_seq)
        return (1, int(self.priority), self.timings.arrival_time, self.arrival_seq)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, priority={self.priority.label})"
        )


def checked_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> list[int]:
    """``token_ids`` as a list of ints; ``ValueError`` naming ``what`` for an id outside the
    vocabulary ``[0, vocab_size)``."""
    ids = [int(t) for t in token_ids]
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ValueError(f"{what} has token id {t}, outside the vocabulary [0, {vocab_size})")
    return ids
