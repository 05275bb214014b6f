"""Translation between the wire and the engine, both ways, in one place.

Wire → engine: a :class:`GenerationRequest` becomes ``engine.add_request``'s prompt (token ids,
text, or ``messages`` through the model's chat template) and ``SamplingParams``. Engine → wire:
a step's ``RequestOutput`` list becomes :class:`TokenEvent` batches and :class:`TerminalEvent`
finishes for the jobs this worker publishes (``RunTable``), and an aborted run's end is
reported to the table instead of published.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.schema import GenerationRequest, TerminalEvent, TerminalStatus, TokenEvent
from tokenfleet.worker.engine.outputs import RequestOutput, TokenLogprob, TokenLogprobs
from tokenfleet.worker.engine.request import SamplingParams
from tokenfleet.worker.intake.jobs import Job
from tokenfleet.worker.service.chat_render import render_inputs
from tokenfleet.worker.service.engine_port import EnginePort
from tokenfleet.worker.service.run_table import RunTable

MakeParams = Callable[[GenerationRequest], SamplingParams]


@dataclass(slots=True)
class StepEvents:
    """One engine step on the wire, for the requests this worker publishes."""

    # new tokens per job, first tokens (TTFT) first: Redis runs and PUBLISHes them first
    tokens: list[tuple[Job, list[TokenEvent]]] = field(default_factory=list)
    # jobs that finished, with their terminal event and their tokens of this same step
    finishes: list[tuple[Job, TerminalEvent, list[TokenEvent]]] = field(default_factory=list)
    # runs taken back whose end the engine reported now: to be added again (resumed)
    restarts: list[Job] = field(default_factory=list)


class EngineAdapter:
    """Puts wire requests into the engine and turns its outputs into wire events.

    ``avg_prompt_tokens`` is a running average (weight 0.1) of the prompts added, in tokens
    (text prompts: characters), for the intake's KV-budget estimate.
    """

    def __init__(
        self, engine: EnginePort, make_params: MakeParams, *, avg_prompt_tokens: float
    ) -> None:
        self.engine = engine
        self.make_params = make_params
        self.avg_prompt_tokens = avg_prompt_tokens

    def add(self, job: Job, token_ids: list[int] | None = None) -> None:
        """``engine.add_request`` for ``job``, with its prompt's ``token_ids`` if they were
        prepared already (off the loop), else built here (raises what it raises:
        ``InvalidRequest`` for messages the chat template refuses, ``ValueError`` or
        ``TypeError`` from the engine)."""
        req = job.request
        prompt = self.prompt(req) if token_ids is None else token_ids
        self.engine.add_request(
            req.request_id,
            prompt,
            self.make_params(req),
            priority=req.priority,
            arrival_time=req.enqueued_at or time.time(),
            resume_output_ids=job.resume_token_ids,
        )
        self.avg_prompt_tokens += 0.1 * (len(prompt) - self.avg_prompt_tokens)

    def prompt(self, req: GenerationRequest) -> str | list[int]:
        """The engine's prompt for ``req``: its token ids, its chat ``messages`` rendered by the
        model's chat template and tokenized, or its text."""
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.messages is not None:
            text = self.chat_text(req)
            return list(self.engine.tokenizer(text, add_special_tokens=False)["input_ids"])
        return req.prompt or ""

    def chat_text(self, req: GenerationRequest) -> str:
        """``req.messages`` rendered by the model's chat template, with the offered tools and
        tool messages as ``chat_render`` lays them out (``InvalidRequest`` if it has none or
        refuses them). Only reads the tokenizer: callable from the prompt thread."""
        tok = self.engine.tokenizer
        template = getattr(tok, "chat_template", None)
        if not template:
            raise InvalidRequest("this model's tokenizer has no chat template; send a prompt")
        structured = req.sampling.structured
        spec = structured.spec if structured is not None and structured.kind == "tools" else None
        messages, tools = render_inputs(req.messages or (), spec, template)
        try:
            extra = {} if tools is None else {"tools": tools}
            text: str = tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **extra
            )
        except Exception as exc:  # jinja2's TemplateError, or what the template raises
            raise InvalidRequest(
                f"the model's chat template refused these messages: {exc}"
            ) from exc
        return text

    def step_events(self, outputs: list[RequestOutput], table: RunTable) -> StepEvents:
        """The wire events of one step's ``outputs``: tokens and finishes of ``table``'s jobs;
        outputs of runs being aborted are dropped (their end reported to the table), outputs of
        other ids (early ones) ignored."""
        jobs, aborting = table.jobs, table.aborting
        firsts: list[tuple[Job, list[TokenEvent]]] = []  # requests' first tokens (TTFT)
        tokens: list[tuple[Job, list[TokenEvent]]] = []
        finishes: list[tuple[Job, TerminalEvent, list[TokenEvent]]] = []
        restarts: list[Job] = []
        for out in outputs:
            rid = out.request_id
            if rid in aborting:  # a run we took back: nothing is published
                if out.finished:
                    restart = table.end_reported(rid)
                    if restart is not None:
                        restarts.append(restart)
                continue
            job = jobs.get(rid)
            if job is None:
                continue
            lps = out.new_logprobs
            events = [
                TokenEvent(
                    rid,
                    out.first_index + i,
                    tid,
                    text,
                    None if lps is None else wire_logprobs(lps[i]),
                )
                for i, (tid, text) in enumerate(zip(out.new_token_ids, out.new_texts, strict=True))
            ]
            if events:
                (firsts if events[0].index == 0 else tokens).append((job, events))
            if out.finished:
                finishes.append((job, self.terminal(job, out, len(events)), events))
        # first tokens lead the pipeline: Redis runs (and PUBLISHes) them before the others
        return StepEvents(firsts + tokens, finishes, restarts)

    def terminal(self, job: Job, out: RequestOutput, num_new: int) -> TerminalEvent:
        """The terminal event of a finished output with ``num_new`` new tokens."""
        reason = getattr(out.finish_reason, "value", out.finish_reason)
        usage = {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens}
        num_tokens = out.first_index + num_new  # == every token published, resumed ones included
        if reason in ("stop", "length"):
            return TerminalEvent(
                job.request_id,
                TerminalStatus.DONE,
                num_tokens=num_tokens,
                finish_reason=reason,
                usage=usage,
                timings=timings_dict(out.timings),
            )
        code = out.error_code or ("aborted" if reason == "abort" else "engine_error")
        message = out.error_message or f"the engine ended the request ({reason})"
        return TerminalEvent(
            job.request_id,
            TerminalStatus.ERROR,
            num_tokens=num_tokens,
            code=code,
            message=message,
            usage=usage,
            timings=timings_dict(out.timings),
        )


def timings_dict(timings: Any) -> dict[str, float]:
    """The engine's ``RequestTimings`` as the terminal event's ``timings`` (known values only)."""
    if timings is None:
        return {}
    out: dict[str, float] = {}
    for name in ("queue_s", "ttft_s", "tpot_s", "e2e_s"):
        value = getattr(timings, name, None)
        if value is not None:
            out[name] = round(float(value), 6)
    return out


def wire_logprobs(lp: TokenLogprobs) -> dict[str, Any]:
    """A token's logprobs as its event carries them (OpenAI's per-token object)."""
    out = _entry(lp.chosen)
    out["top_logprobs"] = [_entry(e) for e in lp.top]
    return out


def _entry(e: TokenLogprob) -> dict[str, Any]:
    return {"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes)}


def engine_sampling_params(req: GenerationRequest) -> SamplingParams:
    """The engine's ``SamplingParams`` for a wire request (a structured-output constraint
    becomes its grammar: ``Constraint.grammar``, checked when the request was submitted)."""
    s = req.sampling
    return SamplingParams(
        grammar=None if s.structured is None else s.structured.grammar(),
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        max_tokens=s.max_tokens,
        stop=s.stop,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
    )
