"""The in-process inference engine: add requests, call ``step()``, read what each request produced.

``step()`` is schedule → run → postprocess. No Redis here: the worker service feeds the engine
between steps and publishes what ``step()`` returns.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any, Protocol

import torch

from tokenfleet.shared.priority import BACKGROUND, Priority
from tokenfleet.worker.engine.batch import StepBatch
from tokenfleet.worker.engine.block_manager import BlockManager, CacheWatcher, num_blocks_for
from tokenfleet.worker.engine.config import EngineConfig, with_overrides
from tokenfleet.worker.engine.detokenizer import IncrementalDetokenizer
from tokenfleet.worker.engine.guided import (
    GRAMMAR_UNSATISFIABLE,
    INVALID_GRAMMAR,
    GrammarCompiler,
    GrammarError,
    MaskFiller,
    allowed_tokens,
    apply_mask,
)
from tokenfleet.worker.engine.logprobs import pick, raw_logprobs
from tokenfleet.worker.engine.offline import generate
from tokenfleet.worker.engine.outputs import (
    CompletionOutput,
    EngineCapacity,
    RequestOutput,
    StepStats,
    TokenLogprobs,
    step_stats,
)
from tokenfleet.worker.engine.paged_attention import StepInterrupted
from tokenfleet.worker.engine.pool_port import PoolPort
from tokenfleet.worker.engine.request import (
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
    checked_token_ids,
)
from tokenfleet.worker.engine.sampler import Sampler
from tokenfleet.worker.engine.scheduler import Scheduler, SchedulerOutput

__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineCapacity",
    "EngineConfig",
    "RequestOutput",
    "StepStats",
]


class ModelRunnerLike(Protocol):
    """What the engine needs from ``model_runner.ModelRunner`` (fakes in tests provide it too)."""

    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    device: torch.device

    def execute(
        self, batch: StepBatch, interrupt: Callable[[], bool] | None = None
    ) -> torch.Tensor: ...


class Engine:
    """Continuous batching over a paged KV cache.

    Invariants:
        * every request added is reported finished exactly once by ``step()`` (stop, length,
          abort or error), after which its id may be reused;
        * output token ``i`` of a request is reported once, with ``first_index`` counting from
          the resumed tokens, and its text pieces concatenate to the request's final text;
        * the engine's own state changes only inside ``add_request``, ``abort`` and ``step``, and
          between steps through its pool port (``pool_port()``: limits, a preemption order);
          single-threaded: call them from one thread. (Its helper threads compile grammars and
          fill token masks; what they touch is theirs until their futures are done.)
        * a request with a grammar (or logprobs) waits in ``_preparing`` until its matcher (the
          grammar library's tokenizer) is ready, and is scheduled only then; a scheduled
          constrained request always has a matcher positioned after its last output token.
    """

    tokenizer: Any  # public: the worker applies chat templates with it

    def __init__(
        self,
        model: str | os.PathLike[str],
        config: EngineConfig | None = None,
        **overrides: Any,
    ) -> None:
        config = with_overrides(config or EngineConfig(), overrides)
        from transformers import AutoTokenizer

        from tokenfleet.worker.engine.model_runner import ModelRunner

        runner = ModelRunner(os.fspath(model), **config.runner_kwargs())
        self._setup(runner, AutoTokenizer.from_pretrained(os.fspath(model)), config)

    @classmethod
    def from_runner(
        cls, runner: ModelRunnerLike, tokenizer: Any, config: EngineConfig | None = None
    ) -> Engine:
        """An engine over an existing runner and tokenizer (tests, or a runner built elsewhere)."""
        engine = cls.__new__(cls)
        engine._setup(runner, tokenizer, config or EngineConfig())
        return engine

    def _setup(self, runner: ModelRunnerLike, tokenizer: Any, config: EngineConfig) -> None:
        pool_tokens = runner.num_kv_blocks * runner.block_size
        if config.max_model_len is not None and config.max_model_len > pool_tokens:
            raise ValueError(
                f"max_model_len is {config.max_model_len} but the KV cache holds only "
                f"{pool_tokens} tokens ({runner.num_kv_blocks} blocks of {runner.block_size}); "
                "give more KV memory or a smaller max_model_len"
            )
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = min(config.max_model_len or runner.max_model_len, pool_tokens)
        self.block_manager = BlockManager(
            runner.num_kv_blocks,
            runner.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config.scheduler_config(self.max_model_len), self.block_manager)
        self.sampler = Sampler(device=runner.device, seed=config.seed)
        self.eos_token_ids = frozenset(runner.eos_token_ids)
        self.last_step_stats = StepStats()
        self._requests: dict[str, Request] = {}  # every request not yet reported finished
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []  # finished outside step(): reported by the next
        self._arrivals = itertools.count()
        self._generate_ids = itertools.count()
        self._interrupt: Callable[[], bool] | None = None  # set_interrupt
        self._cut_last = False  # the last background step was cut short
        # requests waiting for their grammar's matcher (or the token table): id -> future
        self._preparing: dict[str, tuple[Request, Future[Any]]] = {}
        self._grammars: GrammarCompiler | None = None  # made at the first request needing it
        self._masks: MaskFiller | None = None  # made once the grammar tokenizer is ready

    # ---------------------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: Priority = Priority.NORMAL,
        arrival_time: float | None = None,
        resume_output_ids: Sequence[int] = (),
    ) -> None:
        """Queue a request. Raises ``ValueError`` for a duplicate id or invalid tokens.

        ``resume_output_ids``: tokens a previous worker already generated and published. They
        count toward ``max_tokens``, are part of the context (recomputed), prime the text and
        stop-string state, and the next token reported has index ``len(resume_output_ids)``.
        A request that can never run (prompt over ``max_model_len`` or the KV pool) or that the
        resumed tokens already ended is reported finished by the next ``step()``.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        params = params or SamplingParams()
        if isinstance(prompt, str):
            prompt_ids = list(self.tokenizer.encode(prompt))
        else:
            prompt_ids = checked_token_ids(prompt, self.runner.vocab_size, "prompt")
        if not prompt_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        resume_ids = checked_token_ids(
            resume_output_ids, self.runner.vocab_size, "resume_output_ids"
        )
        req = Request(
            request_id,
            prompt_ids,
            params,
            priority=Priority(priority),
            arrival_time=time.time() if arrival_time is None else arrival_time,
            arrival_seq=next(self._arrivals),
            resume_output_ids=resume_ids,
        )
        detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop
        )
        for token_id in resume_ids:
            detok.push(token_id)  # already published by the previous worker
        self._requests[request_id] = req
        self._detokenizers[request_id] = detok

        refusal = self.scheduler.refusal(req)
        reason = FinishReason.ERROR if refusal else None
        if reason is None and req.output_token_ids:  # the resumed tokens alone may end it
            reason = self._stop_reason(req, req.output_token_ids[-1], detok)
        if reason is not None:
            self._finish_now(req, reason, *(refusal or (None, None)))
        elif params.grammar is not None:  # compiled (and resumed) off this thread
            self._preparing[request_id] = (
                req,
                self.grammar_compiler().matcher(params.grammar, resume_ids),
            )
        elif params.logprobs:  # token texts come from the grammar library's tokenizer
            self._preparing[request_id] = (req, self.grammar_compiler().tokenizer())
        else:
            self.scheduler.add(req)

    def grammar_compiler(self) -> GrammarCompiler:
        """This engine's grammar compiler (made the first time it is needed)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, sorted(self.eos_token_ids))
        return self._grammars

    def _finish_now(
        self,
        req: Request,
        reason: FinishReason,
        code: str | None = None,
        message: str | None = None,
    ) -> None:
        """End a request the scheduler does not hold; the next ``step()`` reports it."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error_code, req.error_message = code, message
        req.timings.finish_time = time.time()
        self._pending.append(_output(req, [], []))

    def _take_prepared(self) -> None:
        """Schedule the requests whose matchers are ready; end those whose grammar failed. When
        nothing else can run, wait a little for one (rather than spin the caller's loop)."""
        if not self._preparing:
            return
        if not self.scheduler.has_unfinished() and not self._pending:
            wait_futures([f for _, f in self._preparing.values()], 0.05, FIRST_COMPLETED)
        for rid, (req, future) in list(self._preparing.items()):
            if not future.done():
                continue
            del self._preparing[rid]
            try:
                ready = future.result()
            except GrammarError as exc:
                self._finish_now(req, FinishReason.ERROR, exc.code, str(exc))
                continue
            except Exception as exc:  # the library refused this tokenizer: this request's end
                message = f"the grammar library cannot serve this request: {exc}"
                self._finish_now(req, FinishReason.ERROR, INVALID_GRAMMAR, message)
                continue
            if self._masks is None:
                self._masks = MaskFiller(self.grammar_compiler().tokenizer().result())
            if req.params.grammar is not None:
                req.matcher = ready
                if ready.is_stopped():  # the resumed tokens completed the grammar
                    self._finish_now(req, FinishReason.STOP)
                    continue
            self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. True if it was unfinished.

        The next ``step()`` reports it finished with ``FinishReason.ABORT``."""
        req = self.scheduler.abort(request_id)
        if req is None:
            preparing = self._preparing.pop(request_id, None)
            if preparing is None:
                return False
            self._finish_now(preparing[0], FinishReason.ABORT)
            return True
        self._pending.append(_output(req, [], []))
        return True

    def has_unfinished(self) -> bool:
        """True while some request is not yet reported finished."""
        return bool(self._requests)

    def capacity(self) -> EngineCapacity:
        waiting, running = self.scheduler.waiting, self.scheduler.running
        waiting = [*waiting, *(req for req, _ in self._preparing.values())]
        block_size = self.block_manager.block_size
        num_needed = sum(num_blocks_for(r.num_tokens, block_size) for r in waiting)
        return EngineCapacity(
            free_seq_slots=max(0, self.config.max_num_seqs - len(running) - len(waiting)),
            free_kv_blocks=max(0, self.block_manager.num_allocatable_blocks - num_needed),
            num_waiting=len(waiting),
            num_running=len(running),
            block_size=block_size,
        )

    def watch_prefix_cache(self, watcher: CacheWatcher | None) -> None:
        """Tell ``watcher`` of blocks entering or leaving the prefix cache from now on."""
        self.block_manager.watcher = watcher

    def pool_port(self) -> PoolPort:
        """This engine's one pool-facing object, which ``tokenfleet.worker.pool.link.PoolLink``
        drives (docs/kv-pools.md). It holds no state of its own: any number of them agree."""
        return PoolPort(self.scheduler, self)

    # -------------------------------------------------------------------------------- step

    def set_interrupt(self, check: Callable[[], bool] | None) -> None:
        """Let ``check`` cut background steps short (None: never). It is asked before each
        layer of a step whose every sequence is of the ``BACKGROUND`` priority, except the step
        right after one it cut (so background work always progresses: at least every other of
        its steps completes); True stops the step there and ``step()`` returns without tokens
        for it. The worker answers True when more urgent work has arrived in Redis, so that work
        waits a layer, not a whole background step."""
        self._interrupt = check

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns what each request produced (new tokens or its end)."""
        start = time.perf_counter()
        self._take_prepared()
        scheduled = self.scheduler.schedule()
        sampling = [
            req
            for req, seq in zip(scheduled.requests, scheduled.batch.seqs, strict=True)
            if seq.needs_logits
        ]
        masks = self._start_masks(sampling)  # filled while the model runs
        scheduled.batch.full_logit_rows = [
            i
            for i, req in enumerate(sampling)
            if not req.params.greedy or req.params.logprobs or req.matcher is not None
        ]
        try:
            logits = self._execute(scheduled)
        except StepInterrupted:
            if masks is not None:
                masks[1].result()  # the matchers are the filler's until it is done
            self._cut_last = True
            outputs = self._postprocess_cut(scheduled)
            self.last_step_stats = step_stats(
                self.scheduler, scheduled, outputs, time.perf_counter() - start, cut=True
            )
            return outputs
        outputs = self._postprocess(scheduled, logits, sampling, masks)
        self.last_step_stats = step_stats(
            self.scheduler, scheduled, outputs, time.perf_counter() - start
        )
        return outputs

    def _execute(self, scheduled: SchedulerOutput) -> torch.Tensor | None:
        """Run the scheduled batch; interruptible when ``set_interrupt`` allows it."""
        batch = scheduled.batch
        if not batch.seqs:
            return None
        background = [req.priority is BACKGROUND for req in scheduled.requests]
        if self._interrupt is not None and not self._cut_last and all(background):
            logits = self.runner.execute(batch, self._interrupt)
        else:
            logits = self.runner.execute(batch)
        if any(background):  # background work progressed: the next may be cut again
            self._cut_last = False
        return logits

    def _postprocess_cut(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """A step cut short: nothing was computed (the scheduler's counts are unchanged, so
        the same chunks run again next step); only ends decided outside the model are reported."""
        outputs, self._pending = self._pending, []
        outputs.extend(_output(req, [], []) for req in scheduled.finished)
        for out in outputs:
            del self._requests[out.request_id]
            del self._detokenizers[out.request_id]
        return outputs

    def _start_masks(self, sampling: list[Request]) -> tuple[list[int], Future[Any]] | None:
        """Start filling the token masks of the constrained rows among ``sampling`` (the rows of
        this step's logits): their row indices and the future of their bitmask."""
        rows = [i for i, req in enumerate(sampling) if req.matcher is not None]
        if not rows or self._masks is None:
            return None
        return rows, self._masks.start([sampling[i].matcher for i in rows])

    def _postprocess(
        self,
        scheduled: SchedulerOutput,
        logits: torch.Tensor | None,
        sampling: list[Request],
        masks: tuple[list[int], Future[Any]] | None,
    ) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        outputs.extend(_output(req, [], []) for req in scheduled.finished)
        self.scheduler.update_after_step(scheduled)
        if sampling:
            if logits is None or logits.shape[0] != len(sampling):
                raise RuntimeError(
                    f"model runner returned {None if logits is None else logits.shape[0]} "
                    f"rows of logits for {len(sampling)} sequences"
                )
            lp_rows = [i for i, req in enumerate(sampling) if req.params.logprobs]
            raw = raw_logprobs(logits, lp_rows) if lp_rows else None  # before any mask
            failed = self._apply_masks(logits, sampling, masks) if masks is not None else {}
            token_ids = self.sampler.sample(
                logits, [r.params for r in sampling], [r.num_output_tokens for r in sampling]
            )
            refused = self._consume(sampling, token_ids, failed)
            logprobs: dict[int, TokenLogprobs] = {}
            if raw is not None:
                tok = self.grammar_compiler().tokenizer().result()
                picked = pick(
                    raw,
                    [token_ids[i] for i in lp_rows],
                    [sampling[i].params.top_logprobs for i in lp_rows],
                    lambda t: bytes(tok.decode_bytes([t])),
                )
                logprobs = dict(zip(lp_rows, picked, strict=True))
            now = time.time()
            for i, (req, token_id) in enumerate(zip(sampling, token_ids, strict=True)):
                if i in failed or i in refused:
                    code, message = failed.get(i) or refused[i]
                    self.scheduler.finish(req, FinishReason.ERROR)
                    req.error_code, req.error_message = code, message
                    outputs.append(_output(req, [], []))
                    continue
                outputs.append(self._advance(req, token_id, now, logprobs.get(i)))
        for out in outputs:
            if out.finished:
                del self._requests[out.request_id]
                del self._detokenizers[out.request_id]
        return outputs

    def _apply_masks(
        self,
        logits: torch.Tensor,
        sampling: list[Request],
        masks: tuple[list[int], Future[Any]],
    ) -> dict[int, tuple[str, str]]:
        """Mask the constrained rows' logits; the rows whose grammar allows no token (error
        code and message by row), which are left unmasked and must not be advanced."""
        rows, future = masks
        allowed = allowed_tokens(future.result(), logits.shape[1])
        dead = (~allowed.any(dim=1)).tolist()
        failed: dict[int, tuple[str, str]] = {}
        for j, i in enumerate(rows):
            matcher = sampling[i].matcher
            if dead[j] or matcher.is_error():
                failed[i] = (
                    GRAMMAR_UNSATISFIABLE,
                    "no token of this model's vocabulary can continue the output under its "
                    f"grammar ({matcher.get_error() or 'no token is allowed'})",
                )
        keep = [j for j, i in enumerate(rows) if i not in failed]
        if keep:
            apply_mask(logits, [rows[j] for j in keep], allowed[keep])
        return failed

    def _consume(
        self, sampling: list[Request], token_ids: list[int], failed: dict[int, tuple[str, str]]
    ) -> dict[int, tuple[str, str]]:
        """Advance the matchers of the constrained rows by their sampled tokens (all at once);
        the rows whose matcher refused its token (error code and message by row)."""
        rows = [i for i, req in enumerate(sampling) if req.matcher is not None and i not in failed]
        if not rows or self._masks is None:
            return {}
        ok = self._masks.consume([sampling[i].matcher for i in rows], [token_ids[i] for i in rows])
        return {
            i: (
                GRAMMAR_UNSATISFIABLE,
                f"the grammar refused token {token_ids[i]}: {sampling[i].matcher.get_error()}",
            )
            for i, accepted in zip(rows, ok, strict=True)
            if not accepted
        }

    def _advance(
        self,
        req: Request,
        token_id: int,
        now: float,
        logprobs: TokenLogprobs | None = None,
    ) -> RequestOutput:
        """Append one sampled token, decode it, and finish the request if it must stop."""
        timings = req.timings
        if timings.first_token_time is None:
            timings.first_token_time = now
        timings.num_generated_tokens += 1
        req.append_token(token_id)
        detok = self._detokenizers[req.request_id]
        piece = detok.push(token_id)
        reason = self._stop_reason(req, token_id, detok)
        if reason is not None:
            if not detok.stopped:
                piece += detok.finish()
                if detok.stopped:  # the flushed tail completed a stop string
                    reason = FinishReason.STOP
            self.scheduler.finish(req, reason)
        return _output(req, [token_id], [piece], None if logprobs is None else [logprobs])

    def _stop_reason(
        self, req: Request, token_id: int, detok: IncrementalDetokenizer
    ) -> FinishReason | None:
        params = req.params
        if detok.stopped or token_id in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if req.matcher is not None and req.matcher.is_stopped():  # the grammar is complete
            return FinishReason.STOP
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    # ---------------------------------------------------------------------------- offline

    def prompt_token_ids(self, request_id: str) -> list[int]:
        """The prompt tokens of an unfinished request (``KeyError`` for an unknown id)."""
        return list(self._requests[request_id].prompt_token_ids)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run ``prompts`` to completion (offline use; the engine must be idle), in order."""
        return generate(self, prompts, params, batch_id=next(self._generate_ids))


def _output(
    req: Request,
    token_ids: list[int],
    texts: list[str],
    logprobs: list[TokenLogprobs] | None = None,
) -> RequestOutput:
    finished = req.status is RequestStatus.FINISHED
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=token_ids,
        new_texts=texts,
        new_logprobs=logprobs,
        first_index=req.num_output_tokens - len(token_ids),
        finished=finished,
        finish_reason=req.finish_reason if finished else None,
        error_code=req.error_code,
        error_message=req.error_message,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        timings=dataclasses.replace(req.timings) if finished else None,
    )
