"""What the engine reports: per-request step outputs, whole completions, step stats, capacity."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenfleet.worker.engine.request import FinishReason, RequestTimings

if TYPE_CHECKING:
    from tokenfleet.worker.engine.scheduler import Scheduler, SchedulerOutput


@dataclass(slots=True)
class TokenLogprob:
    """One token and its log-probability; ``token`` is its text (``bytes`` decoded, invalid
    UTF-8 replaced), ``bytes`` its exact bytes."""

    token_id: int
    token: str
    bytes: bytes
    logprob: float


@dataclass(slots=True)
class TokenLogprobs:
    """A sampled token's log-probability and the ``top_logprobs`` most likely tokens'."""

    chosen: TokenLogprob
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    """What one request produced in one step (a diff: only the new tokens).

    A request appears in a step's outputs when it got new tokens or finished; a finished request
    (including an aborted or refused one) appears exactly once with ``finished=True``.
    """

    request_id: str = ""
    new_token_ids: list[int] = field(default_factory=list)  # tokens sampled this step
    new_texts: list[str] = field(default_factory=list)  # one text piece per new token
    # one per new token when the request asked for logprobs, else None
    new_logprobs: list[TokenLogprobs] | None = None
    first_index: int = 0  # output index of new_token_ids[0] (resumed tokens count)
    finished: bool = False
    finish_reason: FinishReason | None = None  # set when finished
    error_code: str | None = None  # machine-readable, with finish_reason ERROR
    error_message: str | None = None  # for a person, names the numbers involved
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # output tokens so far, resumed ones included
    timings: RequestTimings | None = None  # set when finished

    @property
    def new_text(self) -> str:
        return "".join(self.new_texts)


@dataclass(slots=True)
class CompletionOutput:
    """A whole request, as ``Engine.generate`` returns it."""

    request_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # output tokens
    text: str = ""  # decoded output, truncated before a stop string
    finish_reason: FinishReason | None = None
    error_code: str | None = None
    error_message: str | None = None
    timings: RequestTimings | None = None


@dataclass(slots=True)
class StepStats:
    """One engine step, for metrics and logs."""

    step_index: int = 0  # steps run so far, this one included
    num_seqs: int = 0  # sequences the model computed
    num_decode_seqs: int = 0  # of which computed one token to sample the next
    num_prefill_seqs: int = 0  # of which computed a prefill chunk
    num_tokens: int = 0  # tokens computed (the batched-token budget spent)
    num_output_tokens: int = 0  # tokens sampled
    num_kv_blocks_used: int = 0  # after the step
    num_kv_blocks_free: int = 0  # after the step, evictable cached blocks included
    num_prefix_cache_hit_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0  # running requests preempted (recompute) this step
    num_finished: int = 0  # requests that finished this step (any reason)
    num_waiting: int = 0  # after the step
    num_running: int = 0  # after the step
    duration_s: float = 0.0  # schedule + model + postprocess
    cut: bool = False  # cut short by more urgent work (Engine.set_interrupt): nothing computed


def step_stats(
    scheduler: Scheduler,
    scheduled: SchedulerOutput,
    outputs: list[RequestOutput],
    duration_s: float,
    *,
    cut: bool = False,
) -> StepStats:
    """The stats of the step ``scheduler`` just scheduled as ``scheduled`` and that produced
    ``outputs`` in ``duration_s`` seconds (queues and blocks as they are after it)."""
    seqs = scheduled.batch.seqs
    num_decode = sum(1 for s in seqs if len(s.token_ids) == 1 and s.start_pos > 0)
    bm = scheduler.block_manager
    return StepStats(
        step_index=scheduler.step_index,
        num_seqs=len(seqs),
        num_decode_seqs=num_decode,
        num_prefill_seqs=len(seqs) - num_decode,
        num_tokens=scheduled.batch.num_tokens,
        num_output_tokens=sum(len(o.new_token_ids) for o in outputs),
        num_kv_blocks_used=bm.num_used_blocks,
        num_kv_blocks_free=bm.num_free_blocks,
        num_prefix_cache_hit_tokens=scheduled.num_cached_tokens,
        num_preemptions=scheduled.num_preemptions,
        num_finished=sum(1 for o in outputs if o.finished),
        num_waiting=len(scheduler.waiting),
        num_running=len(scheduler.running),
        duration_s=duration_s,
        cut=cut,
    )


@dataclass(slots=True)
class EngineCapacity:
    """What the engine can take now (the worker pulls only this much from Redis)."""

    free_seq_slots: int = 0  # max_num_seqs - running - waiting, at least 0
    free_kv_blocks: int = 0  # free blocks (evictable cached included) minus waiting requests' needs
    num_waiting: int = 0
    num_running: int = 0
    block_size: int = 16  # tokens per KV block: a request needs ceil(tokens / block_size) blocks
