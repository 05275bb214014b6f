"""Which requests compute which tokens this step. Policy only; blocks come from the BlockManager.

One rule: each running request's computed-token count catches up with its token count. A step
spends a token budget (``max_num_batched_tokens``) over at most ``max_num_seqs`` running requests:

1. decode: one token for every running request that is one token behind (decode-maximal; when
   the budget is smaller than the number of running requests, the most urgent decode first);
2. prefill: a chunk for every running request that is further behind (chunked prefill);
3. admission: waiting requests, most urgent first, get blocks for all their known tokens (sharing
   cached prefix blocks, which count as computed) and a first chunk.

Urgency is ``Request.sort_key``: boosted first, then priority, then arrival. When a running
request needs a block and none is free, the least urgent running request (lowest priority, latest
arrival) is preempted by recompute: its blocks are freed and it waits again, ahead of later
arrivals of its priority. A waiting request that has waited ``max_wait_steps`` steps or
``max_wait_s`` seconds is boosted: it goes to the front of admission. At admission, a request that
cannot start may preempt running work (``preemption.admission_victim``): one short of KV blocks
preempts running requests of a strictly less urgent priority that are not boosted; a boosted one
preempts anything less urgent than itself.

Background (``batch``) work sits a step out while more urgent work needs a prefill (running with
more than one token to compute, or waiting), at most ``max_yield_steps`` steps in a row; when the
urgent work cannot start after all, background work takes the step (``_background_yields``).

Shared KV pool (issue 6): the block manager's ``block_limit`` is the member's grant. Admission and
growth stay within it; when it was lowered below the blocks in use, the next ``schedule`` first
preempts the least urgent running requests until within. With a compute share, the pool also caps
the tokens of each step (``token_limit``, at least 1 so work always progresses). What the pool
reads and sets goes through ``pool_port.PoolPort``; a pool's preemption order comes back here as
``preempt`` between steps.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenfleet.shared.block_hash import extend_block_hashes
from tokenfleet.shared.priority import BACKGROUND
from tokenfleet.worker.engine.batch import ScheduledSeq, StepBatch
from tokenfleet.worker.engine.block_manager import AllocStatus, BlockManager, num_blocks_for
from tokenfleet.worker.engine.preemption import admission_victim
from tokenfleet.worker.engine.request import FinishReason, Request, RequestStatus


def sort_key(req: Request) -> tuple[int, int, float, int]:
    return req.sort_key


def background(req: Request) -> bool:
    return req.priority is BACKGROUND


def not_background(req: Request) -> bool:
    return req.priority is not BACKGROUND


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # running requests at most
    max_num_batched_tokens: int = 512  # tokens computed per step at most
    max_model_len: int = 2048  # prompt + output tokens of one request at most
    max_wait_steps: int | None = None  # boost a request waiting this many steps (None = never)
    max_wait_s: float | None = 30.0  # boost a request waiting this many seconds (None = never)
    background_yields: bool = True  # background work sits out steps that prefill urgent work
    max_yield_steps: int = 8  # ... but never more than this many steps in a row
    share_prefill: bool = True  # a prompt whose next blocks a running prefill computes waits

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_wait_steps is not None and self.max_wait_steps < 1:
            raise ValueError(f"max_wait_steps must be >= 1 or None, got {self.max_wait_steps}")
        if self.max_wait_s is not None and not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0 or None, got {self.max_wait_s}")
        if self.max_yield_steps < 1:
            raise ValueError(f"max_yield_steps must be >= 1, got {self.max_yield_steps}")


@dataclass(slots=True)
class SchedulerOutput:
    """What one call to ``schedule`` decided (an empty constructor is an idle step)."""

    batch: StepBatch = field(default_factory=StepBatch)  # what the model runner computes
    requests: list[Request] = field(default_factory=list)  # batch.seqs[i] belongs to requests[i]
    finished: list[Request] = field(default_factory=list)  # refused while scheduling (errors)
    num_preemptions: int = 0  # running requests preempted this step
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admissions


class Scheduler:
    """Owns the waiting and running queues.

    Invariants:
        * ``waiting`` and ``running`` are sorted by ``sort_key`` and disjoint; a request in
          ``running`` is RUNNING and holds blocks, one in ``waiting`` is WAITING or PREEMPTED and
          holds none; FINISHED requests are in neither.
        * ``len(running) <= max_num_seqs``.
        * after ``schedule``, the blocks in use are within the block manager's ``block_limit``.
        * every scheduled chunk ends at or before the request's last known token, and the
          request's block table covers it.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.step_index = 0  # number of schedule() calls so far
        self._num_preempted_between_steps = 0  # by preempt() since the last schedule()
        self.token_limit: int | None = None  # a compute share's per-step cap (None: none)
        self._yielded = 0  # consecutive steps background work sat out (``_background_yields``)

    # ------------------------------------------------------------------------------- queues

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        """Queue a new request (WAITING, no blocks)."""
        self._enqueue(req, RequestStatus.WAITING)

    def refusal(self, req: Request) -> tuple[str, str] | None:
        """(error code, message) when the request can never run, else None."""
        max_len = self.config.max_model_len
        if req.num_prompt_tokens > max_len:
            return (
                "prompt_too_long",
                f"prompt has {req.num_prompt_tokens} tokens; max_model_len is {max_len}",
            )
        pool_tokens = self.block_manager.num_blocks * self.block_size
        if num_blocks_for(req.num_tokens, self.block_size) > self.block_manager.num_blocks:
            return (
                "prompt_too_long",
                f"request has {req.num_tokens} tokens; the KV cache holds at most "
                f"{pool_tokens} tokens ({self.block_manager.num_blocks} blocks of "
                f"{self.block_size})",
            )
        return None

    def abort(self, request_id: str) -> Request | None:
        """Remove the request and free its blocks at once; returns it (None if not queued)."""
        for queue in (self.running, self.waiting):
            for i, req in enumerate(queue):
                if req.request_id == request_id:
                    del queue[i]
                    self.block_manager.free(request_id)
                    self._mark_finished(req, FinishReason.ABORT)
                    return req
        return None

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a running request (after postprocessing) and free its blocks."""
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        self._mark_finished(req, reason)

    def preempt(self, req: Request) -> None:
        """Preempt a running request between steps (a shared KV pool's order): free its blocks
        and queue it again (recompute); the next ``schedule`` counts it in ``num_preemptions``."""
        self._requeue_preempted(req)
        self._num_preempted_between_steps += 1

    # ----------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Decide this step: decode tokens, then prefill chunks, then admissions."""
        self.step_index += 1
        out = SchedulerOutput(num_preemptions=self._num_preempted_between_steps)
        self._num_preempted_between_steps = 0
        decode: dict[str, ScheduledSeq] = {}
        prefill: dict[str, ScheduledSeq] = {}
        self._boost_starving()
        # 0. a lowered block limit: preempt the least urgent until within it
        bm, limit = self.block_manager, self.block_manager.block_limit
        while limit is not None and bm.num_used_blocks > limit and self.running:
            self._preempt(self.running[-1], out)
        budget = self.config.max_num_batched_tokens
        if self.token_limit is not None:
            budget = max(1, min(budget, self.token_limit))
        yielding = self._background_yields()
        urgent_only = not_background if yielding else None
        budget = self._schedule_decodes(out, decode, prefill, budget, urgent_only)  # 1. decode
        budget = self._schedule_prefills(prefill, budget, urgent_only)  # 2. running prefills
        budget = self._admit(out, decode, prefill, budget, stop_at_background=yielding)  # 3.
        if yielding and not any(
            not_background(self._by_id(rid)) for rid in prefill
        ):  # the urgent work could not start: background takes the step after all
            yielding = False
            budget = self._schedule_decodes(out, decode, prefill, budget, background)
            budget = self._schedule_prefills(prefill, budget, background)
        self._yielded = self._yielded + 1 if yielding else 0

        now = self.clock()
        by_id = {r.request_id: r for r in self.running}
        for seq in (*decode.values(), *prefill.values()):
            req = by_id[seq.request_id]
            if req.timings.first_scheduled_time is None:
                req.timings.first_scheduled_time = now
            out.batch.seqs.append(seq)
            out.requests.append(req)
        return out

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Record the chunks the runner computed and offer newly full blocks to the cache."""
        for req, seq in zip(out.requests, out.batch.seqs, strict=True):
            req.num_computed_tokens = seq.end_pos
            extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size)
            self.block_manager.cache_blocks(
                req.request_id, req.block_hashes, req.num_computed_tokens
            )

    # ---------------------------------------------------------------------------- the step's phases

    def _background_yields(self) -> bool:
        """Whether background work sits out this step: more urgent work needs a prefill (running
        with more than one token to compute, or waiting) while background work runs, and it has
        not sat out ``max_yield_steps`` steps in a row (then it joins this one)."""
        cfg = self.config
        if not cfg.background_yields or self._yielded >= cfg.max_yield_steps:
            return False
        if not any(r.priority is BACKGROUND for r in self.running):
            return False
        return any(r.priority is not BACKGROUND for r in self.waiting) or any(
            r.priority is not BACKGROUND and r.num_tokens - r.num_computed_tokens > 1
            for r in self.running
        )

    def _schedule_decodes(
        self,
        out: SchedulerOutput,
        decode: dict[str, ScheduledSeq],
        prefill: dict[str, ScheduledSeq],
        budget: int,
        only: Callable[[Request], bool] | None,
    ) -> int:
        """One token each for running requests one token behind (those ``only`` accepts, if
        given), most urgent first; preempts the least urgent to make room. Returns the budget
        left."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if (
                req.request_id not in decode
                and (only is None or only(req))
                and req.num_tokens - req.num_computed_tokens == 1
            ):
                while not self._reserve_slots(req):
                    victim = self.running[-1]
                    budget += self._preempt(victim, out, decode, prefill)
                    if victim is req:
                        break
                if req.status is not RequestStatus.RUNNING:
                    break  # it was the least urgent: everything after it is preempted too
                decode[req.request_id] = self._chunk(req, 1)
                budget -= 1
            i += 1
        return budget

    def _schedule_prefills(
        self,
        prefill: dict[str, ScheduledSeq],
        budget: int,
        only: Callable[[Request], bool] | None,
    ) -> int:
        """The next chunk of running requests further behind (those ``only`` accepts)."""
        for req in self.running:
            if budget <= 0:
                break
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > 1 and req.request_id not in prefill and (only is None or only(req)):
                n = min(num_new, budget)
                prefill[req.request_id] = self._chunk(req, n)
                budget -= n
        return budget

    def _admit(
        self,
        out: SchedulerOutput,
        decode: dict[str, ScheduledSeq],
        prefill: dict[str, ScheduledSeq],
        budget: int,
        *,
        stop_at_background: bool,
    ) -> int:
        """Admit waiting requests, most urgent first; stop at the first that cannot start (no
        skipping), or at the first background one when ``stop_at_background``."""
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if stop_at_background and req.priority is BACKGROUND:
                break
            refusal = self.refusal(req)
            if refusal is not None:
                self.waiting.pop(0)
                self._mark_finished(req, FinishReason.ERROR, *refusal)
                out.finished.append(req)
                continue
            extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size)
            if self.config.share_prefill and self._prefill_in_flight(req):
                break  # (no skipping) it starts when they are cached: computed once, shared
            fits = (
                len(self.running) < self.config.max_num_seqs
                and self.block_manager.can_allocate(req.num_tokens, req.block_hashes)
                is AllocStatus.NOW
            )
            if not fits:
                make_room = admission_victim(
                    req,
                    self.running,
                    self.block_manager,
                    take_background_slots=self.config.background_yields,
                )
                if make_room is None:
                    break
                budget += self._preempt(make_room, out, decode, prefill)
                continue
            self.waiting.pop(0)
            num_cached = self.block_manager.allocate(
                req.request_id, req.num_tokens, req.block_hashes
            )
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = req.num_cached_tokens = num_cached
            out.num_cached_tokens += num_cached
            bisect.insort(self.running, req, key=sort_key)
            n = min(req.num_tokens - num_cached, budget)
            prefill[req.request_id] = self._chunk(req, n)
            budget -= n
        return budget

    def _prefill_in_flight(self, req: Request) -> bool:
        """Is the first block of ``req``'s prompt that the prefix cache does not hold yet being
        computed now by a running request (the same chained hash, not computed)? Then ``req``
        waits for it (a step or a few: that prefill is scheduled every step) and is admitted
        with those blocks as cache hits, instead of computing the same K/V a second time: the
        ``n`` choices of a request, or requests sent together with one long system prompt,
        prefill their shared prompt once (docs/engine.md, "Prefix caching")."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or not self.running:
            return False
        hits = bm.num_cache_hit_blocks(req.num_tokens, req.block_hashes)
        if hits >= min(len(req.block_hashes), (req.num_tokens - 1) // self.block_size):
            return False  # nothing more could hit
        wanted = req.block_hashes[hits]
        end = (hits + 1) * self.block_size  # the block is computed once a request passed this
        return any(
            len(r.block_hashes) > hits
            and r.block_hashes[hits] == wanted
            and r.num_computed_tokens < end
            for r in self.running
        )

    def _by_id(self, request_id: str) -> Request:
        return next(r for r in self.running if r.request_id == request_id)

    # ------------------------------------------------------------------------------ helpers

    def _chunk(self, req: Request, num_new: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        end = start + num_new
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:end],
            start_pos=start,
            block_table=list(self.block_manager.block_table(req.request_id)),
            needs_logits=end == req.num_tokens,
        )

    def _reserve_slots(self, req: Request) -> bool:
        """Make the request's block table cover all its known tokens; False when out of blocks."""
        bm = self.block_manager
        while bm.num_slots(req.request_id) < req.num_tokens:
            if not bm.can_append(req.request_id):
                return False
            bm.append(req.request_id)
        return True

    def _preempt(
        self,
        req: Request,
        out: SchedulerOutput,
        *scheduled: dict[str, ScheduledSeq],
    ) -> int:
        """Free a running request's blocks and queue it again. Returns tokens unscheduled."""
        self._requeue_preempted(req)
        out.num_preemptions += 1
        refund = 0
        for chunks in scheduled:
            seq = chunks.pop(req.request_id, None)
            if seq is not None:
                refund += len(seq.token_ids)
        return refund

    def _requeue_preempted(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        self._enqueue(req, RequestStatus.PREEMPTED)

    def _enqueue(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.waiting_since_step = self.step_index
        req.waiting_since_s = self.clock()
        bisect.insort(self.waiting, req, key=sort_key)

    def _boost_starving(self) -> None:
        steps, secs = self.config.max_wait_steps, self.config.max_wait_s
        if not self.waiting or (steps is None and secs is None):
            return
        now = self.clock()
        changed = False
        for req in self.waiting:
            if req.boosted:
                continue
            if (steps is not None and self.step_index - req.waiting_since_step >= steps) or (
                secs is not None and now - req.waiting_since_s >= secs
            ):
                req.boosted = changed = True
        if changed:
            self.waiting.sort(key=sort_key)

    def _mark_finished(
        self,
        req: Request,
        reason: FinishReason,
        error_code: str | None = None,
        error_message: str | None = None,
    ) -> None:
        req.status = RequestStatus.FINISHED
        req.num_computed_tokens = 0
        req.finish_reason = reason
        req.error_code = error_code
        req.error_message = error_message
        req.timings.finish_time = self.clock()
