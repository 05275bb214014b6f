"""The phases of one scheduling step — decodes, running prefills, admissions — and the rule
by which background (``batch``) work sits a step out: a base class of ``Scheduler``
(``scheduler.py`` owns the queues and the step's order; this module, what each phase does).

Every method here reads and changes the scheduler's queues through the attributes and helpers
declared below, which ``Scheduler`` provides; its invariants hold here too.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenfleet.shared.block_hash import extend_block_hashes
from tokenfleet.shared.priority import BACKGROUND
from tokenfleet.worker.engine.batch import ScheduledSeq
from tokenfleet.worker.engine.block_manager import AllocStatus, BlockManager
from tokenfleet.worker.engine.preemption import admission_victim
from tokenfleet.worker.engine.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from tokenfleet.worker.engine.scheduler import SchedulerConfig, SchedulerOutput


def sort_key(req: Request) -> tuple[int, int, float, int]:
    return req.sort_key


def background(req: Request) -> bool:
    return req.priority is BACKGROUND


def not_background(req: Request) -> bool:
    return req.priority is not BACKGROUND


class StepPhases:
    """The step's phases (see the module docstring); ``Scheduler`` is the only subclass."""

    config: SchedulerConfig
    block_manager: BlockManager
    waiting: list[Request]
    running: list[Request]
    _yielded: int

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def refusal(self, req: Request) -> tuple[str, str] | None:
        raise NotImplementedError

    def _chunk(self, req: Request, num_new: int) -> ScheduledSeq:
        raise NotImplementedError

    def _reserve_slots(self, req: Request) -> bool:
        raise NotImplementedError

    def _preempt(
        self, req: Request, out: SchedulerOutput, *scheduled: dict[str, ScheduledSeq]
    ) -> int:
        raise NotImplementedError

    def _mark_finished(
        self,
        req: Request,
        reason: FinishReason,
        error_code: str | None = None,
        error_message: str | None = None,
    ) -> None:
        raise NotImplementedError

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

    def _by_id(self, request_id: str) -> Request:
        return next(r for r in self.running if r.request_id == request_id)
