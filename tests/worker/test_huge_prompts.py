"""Huge prompts never stall other streams, in process against the real server.

An oversize prompt is refused (``error``/``prompt_too_long``) without being tokenized: a
tokenizer that records every call proves it. A long prompt that fits is tokenized on the prompt
thread, held at a gate here so that the order of events is exact: the loop keeps stepping (and
publishing the other streams' tokens) while it waits, and adds it once its tokens are ready.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from worker_helpers import enqueue, make_request, record, token_events, wait_for

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.schema import SamplingParams
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.engine.request import SamplingParams as EngineParams
from tokenfleet.worker.intake.reader import Delivery
from tokenfleet.worker.service import WorkerService
from tokenfleet.worker.service.prompt_prep import INLINE_PROMPT_CHARS
from tokenfleet.worker.worker_settings import WorkerSettings

MAX_TOKENS = 6
TOKENIZING = {"encode", "__call__", "encode_batch", "encode_batch_fast", "apply_chat_template"}


class Recording:
    """Delegates to a tokenizer (or its backend), recording the calls that tokenize or render."""

    def __init__(self, inner: Any, calls: list[str]) -> None:
        self._inner = inner
        self._calls = calls

    def __call__(self, *args: Any, **kw: Any) -> Any:
        self._calls.append("__call__")
        return self._inner(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name == "backend_tokenizer":
            return Recording(value, self._calls)
        if name in TOKENIZING and callable(value):

            def recorded(*args: Any, **kw: Any) -> Any:
                self._calls.append(name)
                return value(*args, **kw)

            return recorded
        return value


class NoReader:
    """Stands in for ``IntakeReader``: the tests feed the entries themselves (``_take_in``)."""

    held = 0  # entries read and being started

    def poll(self, budget: int, timeout_s: float = 0.0) -> Delivery:
        return Delivery()

    def resolve(self) -> Delivery:
        return Delivery()

    def stop(self) -> Delivery:
        return Delivery()

    def close(self) -> None:
        pass


@pytest.fixture
def calls() -> list[str]:
    return []


@pytest.fixture
def service(
    r: redis.Redis, settings: Settings, tiny_model_dir: Path, calls: list[str]
) -> Iterator[WorkerService]:
    from tokenfleet.worker.engine.engine import Engine

    engine = Engine(tiny_model_dir, device="cpu")
    engine.tokenizer = Recording(engine.tokenizer, calls)
    svc = WorkerService(
        engine, settings, WorkerSettings(model=str(tiny_model_dir), name="w1"), client=r
    )
    svc.intake.streams.ensure_groups()
    svc.feed.reader = NoReader()  # type: ignore[assignment]
    yield svc
    svc.outbox.flush()
    svc.table.check_invariants()
    svc.feed.prep.close()


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _take_in(svc: WorkerService, r: redis.Redis, keys: Keys, *reqs: Any) -> None:
    """Enqueue ``reqs`` and feed them as the loop does: early start, then ``START``'s answer."""
    for req in reqs:
        enqueue(r, keys, req)
    entries = svc.intake.streams.pull(len(reqs))
    assert len(entries) == len(reqs)
    for job in svc.intake.starter.early_jobs(entries):
        svc.feed._add_early(job)
    svc.table.check_invariants()
    svc.feed.admit(entries)
    svc.table.check_invariants()


def _step(svc: WorkerService) -> None:
    svc._step()
    svc.table.check_invariants()


def _run_to_end(svc: WorkerService) -> None:
    for _ in range(200):
        if not svc.engine.has_unfinished():  # idle: wait for the prompt thread (deadline)
            wait_for(lambda: svc.feed.add_prepared(0.05) or not svc.table.preparing, "a prompt")
        if not svc.engine.has_unfinished() and not svc.table.preparing:
            break
        _step(svc)
    svc.outbox.flush()
    assert not svc.engine.has_unfinished() and not svc.table.preparing


def _reference(ref_engine: Any, prompt: str) -> list[int]:
    ref_engine.block_manager.reset_prefix_cache()
    params = EngineParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return list(ref_engine.generate([prompt], params)[0].token_ids)


def _oversize_text(svc: WorkerService) -> str:
    bound = svc.feed.prep.bound
    assert bound is not None  # the tiny model's byte-level BPE has a sound bound
    return "ab " * (svc.engine.max_model_len * bound.max_bytes_per_token // 3 + 1)


def test_oversize_prompts_end_error_without_being_tokenized(
    r: redis.Redis, keys: Keys, service: WorkerService, calls: list[str]
) -> None:
    limit = service.engine.max_model_len
    text = _oversize_text(service)
    _take_in(
        service,
        r,
        keys,
        make_request("big-text", prompt=text, sampling=_params()),
        make_request("big-ids", prompt_token_ids=[7] * (limit + 1), sampling=_params()),
    )
    assert calls == []  # nothing was tokenized: refused on length alone, early start included
    assert not service.engine.has_unfinished() and not service.table.knows("big-text")
    rec = record(r, keys, "big-text")
    assert rec is not None and rec.status == "error" and rec.code == "prompt_too_long"
    assert rec.message is not None and rec.message.startswith("prompt has at least ")
    assert f"max_model_len is {limit}" in rec.message and f"{len(text)} bytes" in rec.message
    rec = record(r, keys, "big-ids")
    assert rec is not None and rec.status == "error" and rec.code == "prompt_too_long"
    assert rec.message == f"prompt has {limit + 1} tokens; max_model_len is {limit}"


def test_oversize_chat_messages_are_rendered_but_never_tokenized(
    r: redis.Redis, keys: Keys, service: WorkerService, calls: list[str]
) -> None:
    messages = [{"role": "user", "content": _oversize_text(service)}]
    _take_in(service, r, keys, make_request("big-chat", messages=messages, sampling=_params()))
    assert "big-chat" in service.table.preparing  # its template renders on the prompt thread
    wait_for(lambda: not service.feed.add_prepared(0.05), "the prompt thread to refuse it")
    service.table.check_invariants()
    assert calls == ["apply_chat_template"]  # rendered, then refused on the rendered length
    rec = record(r, keys, "big-chat")
    assert rec is not None and rec.status == "error" and rec.code == "prompt_too_long"


def test_long_prompt_is_tokenized_off_the_loop_while_others_stream(
    r: redis.Redis, keys: Keys, service: WorkerService, calls: list[str], ref_engine: Any
) -> None:
    gate = threading.Event()
    prep = service.feed.prep
    fast = prep._fast
    assert fast is not None

    def gated(*args: Any, **kw: Any) -> Any:
        assert threading.current_thread() is not threading.main_thread()
        gate.wait(30)
        return fast(*args, **kw)

    prep._fast = gated
    _take_in(service, r, keys, make_request("short", prompt="The quick brown", sampling=_params()))
    _step(service)  # "short" is running
    calls.clear()  # (its prompt was tokenized inline, by the engine)
    long_text = ("The quick brown fox jumps over the lazy dog. " * 200)[
        : INLINE_PROMPT_CHARS + 1000
    ]
    _take_in(service, r, keys, make_request("long", prompt=long_text, sampling=_params()))
    assert "long" in service.table.preparing and "long" not in service.table.early
    assert not calls  # the loop tokenized nothing: the thread waits at the gate
    for _ in range(MAX_TOKENS):  # the loop steps on: "short" gets every token meanwhile
        _step(service)
    service.outbox.flush()
    assert len(token_events(r, keys, "short")) == MAX_TOKENS
    assert "long" in service.table.preparing and r.llen(keys.tokens("long")) == 0
    gate.set()
    _run_to_end(service)
    assert calls == ["encode_batch_fast"]  # once, on the thread
    events = token_events(r, keys, "long")
    assert [e.index for e in events] == list(range(MAX_TOKENS))
    assert [e.token_id for e in events] == _reference(ref_engine, long_text)
    rec = record(r, keys, "long")
    assert rec is not None and rec.status == "done"
    assert rec.usage["prompt_tokens"] == len(ref_engine.tokenizer.encode(long_text))


def test_long_chat_prompt_matches_the_inline_path(
    r: redis.Redis, keys: Keys, service: WorkerService, ref_engine: Any
) -> None:
    content = "tell me about the fox and the dog. " * 200
    messages = [{"role": "user", "content": content}]
    inline = service.adapter.prompt(make_request("x", messages=messages))
    _take_in(service, r, keys, make_request("chat", messages=messages, sampling=_params()))
    assert "chat" in service.table.preparing
    _run_to_end(service)
    ref_engine.block_manager.reset_prefix_cache()
    params = EngineParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = list(ref_engine.generate([inline], params)[0].token_ids)
    assert [e.token_id for e in token_events(r, keys, "chat")] == ref


def test_shutdown_hands_back_a_job_whose_prompt_is_being_prepared(
    r: redis.Redis, keys: Keys, service: WorkerService
) -> None:
    gate = threading.Event()
    fast = service.feed.prep._fast
    assert fast is not None
    service.feed.prep._fast = lambda *a, **kw: (gate.wait(30), fast(*a, **kw))[1]
    long_text = "word " * INLINE_PROMPT_CHARS
    _take_in(service, r, keys, make_request("held", prompt=long_text, sampling=_params()))
    assert "held" in service.table.preparing
    service.hand_back_all()
    service.table.check_invariants()
    assert not service.table.knows("held")
    rec = record(r, keys, "held")
    assert rec is not None and rec.status == "queued"
    gate.set()
    assert not service.feed.add_prepared(5.0)  # its tokens come back to nobody
    assert not service.engine.has_unfinished()
