"""Early start, in process against the real server: a new request runs in the engine while its
``START`` is on the wire, and nothing is published for it until ``START`` has answered.

The service's loop is driven by hand (``feed.deliver``, ``_step``), mostly with a stand-in for the
intake reader that hands over ``START``'s answer when the loop asks for it, so each ordering is
exact; the last test drives the real reader, waiting for each reply before the loop reads it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from worker_helpers import (
    enqueue,
    make_intake,
    make_request,
    record,
    subscribe,
    token_events,
)

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.schema import SamplingParams, TerminalEvent, TokenEvent
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.engine.request import SamplingParams as EngineParams
from tokenfleet.worker.intake.reader import Delivery
from tokenfleet.worker.publish.publisher import Publisher
from tokenfleet.worker.service import WorkerService

STREAM = "tft:q:default:normal"
PROMPT = [5, 17, 42, 99, 7, 23]
MAX_TOKENS = 8


class AnsweringReader:
    """Stands in for ``IntakeReader``: ``resolve`` hands over the queued deliveries one by one;
    ``poll`` (the loop reading new arrivals) finds nothing."""

    held = 0  # entries read and being started

    def __init__(self, *deliveries: Delivery) -> None:
        self.deliveries = list(deliveries)
        self.resolves = 0

    def poll(self, budget: int, timeout_s: float = 0.0) -> Delivery:
        return Delivery()

    def resolve(self) -> Delivery:
        self.resolves += 1
        return self.deliveries.pop(0) if self.deliveries else Delivery()


def _request(rid: str) -> Any:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return make_request(rid, prompt_token_ids=PROMPT, sampling=params)


def _step(svc: WorkerService) -> None:
    """One engine step as the loop runs it, then the run table's invariants."""
    svc._step()
    svc.table.check_invariants()


def _run_to_end(svc: WorkerService) -> None:
    for _ in range(10 * MAX_TOKENS):
        if not svc.engine.has_unfinished():
            break
        _step(svc)
    svc.outbox.flush()
    assert not svc.engine.has_unfinished()


def _reference(ref_engine: Any) -> list[int]:
    ref_engine.block_manager.reset_prefix_cache()
    params = EngineParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return list(ref_engine.generate([PROMPT], params)[0].token_ids)


def test_early_request_publishes_only_once_started(
    r: redis.Redis, keys: Keys, service: WorkerService, ref_engine: Any
) -> None:
    log = subscribe(r, keys, ["e1"])
    enqueue(r, keys, _request("e1"))
    entries = service.intake.streams.pull(4)
    early = service.intake.starter.early_jobs(entries)
    service.feed.deliver(Delivery(early=early))  # in the engine, START still on the wire
    service.table.check_invariants()
    assert "e1" in service.table.early and "e1" not in service.table.jobs
    jobs, report = service.intake.starter.start(entries)
    reader = AnsweringReader(Delivery(jobs=jobs, reports=[report], resolved=["e1"]))
    service.feed.reader = reader  # type: ignore[assignment]
    _step(service)  # the first token is computed before the answer is taken
    assert reader.resolves == 1 and "e1" in service.table.jobs and not service.table.early
    _run_to_end(service)
    events = token_events(r, keys, "e1")
    assert [e.index for e in events] == list(range(MAX_TOKENS))
    assert [e.token_id for e in events] == _reference(ref_engine)
    rec = record(r, keys, "e1")
    assert rec is not None and rec.status == "done" and rec.attempts == 1
    assert log.tokens("e1") == events and log.terminal("e1") is not None


def test_early_request_refused_by_start_leaves_the_engine_unpublished(
    r: redis.Redis, keys: Keys, service: WorkerService
) -> None:
    log = subscribe(r, keys, ["e2"])
    enqueue(r, keys, _request("e2"))
    entries = service.intake.streams.pull(4)
    service.feed.deliver(Delivery(early=service.intake.starter.early_jobs(entries)))
    service.table.check_invariants()
    r.sadd(keys.cancel_set, "e2")  # cancelled while START is on the wire
    jobs, report = service.intake.starter.start(entries)
    assert jobs == []
    service.feed.reader = AnsweringReader(  # type: ignore[assignment]
        Delivery(reports=[report], resolved=["e2"])
    )
    _step(service)  # computes a token for e2, then drops it
    assert "e2" in service.table.aborting and not service.table.early and not service.table.jobs
    _run_to_end(service)
    assert not service.table.aborting
    assert r.llen(keys.tokens("e2")) == 0
    rec = record(r, keys, "e2")
    assert rec is not None and rec.status == "cancelled"
    log.pump()
    assert [type(e) for e in log.events.get("e2", [])] == [TerminalEvent]


def test_early_request_with_tokens_to_resume_starts_over_from_them(
    r: redis.Redis, settings: Settings, keys: Keys, service: WorkerService, ref_engine: Any
) -> None:
    """An entry handed back by a worker that did not mark it (``h``) looks new, but its record
    holds tokens: the early run is taken back and the request resumes from its token list."""
    ref = _reference(ref_engine)
    req = _request("e3")
    enqueue(r, keys, req)
    old = make_intake(r, settings, worker_name="w0")
    (job0,), _ = old.starter.start(old.streams.pull(1))
    done = [TokenEvent("e3", i, ref[i], f"<{i}>") for i in range(3)]
    publisher = Publisher(r, settings, model_name="default", worker_name="w0")
    assert not publisher.publish([(job0, done)], []).lost
    # an unmarked handback: new entry at the tail, the old one gone, the record queued again
    new = r.xadd(STREAM, {"id": "e3", "d": req.encode(), "dl": ""})
    r.xack(STREAM, CONSUMER_GROUP, job0.entry.entry_id)
    r.xdel(STREAM, job0.entry.entry_id)
    r.hset(keys.record("e3"), mapping={"status": "queued", "worker": "", "stream_id": new})
    r.hincrby(keys.record("e3"), "attempts", -1)

    entries = service.intake.streams.pull(4)
    early = service.intake.starter.early_jobs(entries)
    assert [j.request_id for j in early] == ["e3"]
    service.feed.deliver(Delivery(early=early))
    service.table.check_invariants()
    jobs, report = service.intake.starter.start(entries)
    assert jobs[0].resume_token_ids == ref[:3]
    service.feed.reader = AnsweringReader(  # type: ignore[assignment]
        Delivery(jobs=jobs, reports=[report], resolved=["e3"])
    )
    _step(service)  # its token 0 from scratch is dropped; the run is aborted
    assert service.table.aborting.get("e3") is jobs[0]
    _run_to_end(service)
    events = token_events(r, keys, "e3")
    assert [e.index for e in events] == list(range(MAX_TOKENS))  # no gap, no duplicate
    assert [e.token_id for e in events] == ref
    rec = record(r, keys, "e3")
    assert rec is not None and rec.status == "done" and rec.attempts == 1
    assert rec.text == "".join(e.text for e in events)


def test_an_arrival_behind_a_drained_pull_joins_the_next_step(
    r: redis.Redis, keys: Keys, service: WorkerService
) -> None:
    """The pull sent with a START runs at once; a request that arrives after it, during the
    step, is read by the poll right after that step (which sends the next read) and is in the
    engine when the loop's own poll runs, before the next step: not one step later."""
    enqueue(r, keys, _request("a1"))
    service.feed.deliver(service.feed.reader.poll(service.feed.budget(), timeout_s=5.0))
    service.table.check_invariants()
    assert "a1" in service.table.early  # in the engine; START(a1) and a pull are on the wire
    start = service.feed.reader._start
    assert start is not None and start.ready(5.0)  # answered: the pull found nothing more
    enqueue(r, keys, _request("b1"))  # arrives while a1's prefill step runs
    _step(service)
    assert "a1" in service.table.jobs
    read = service.feed.reader._read  # the read sent right after the step, before publishing
    assert read is not None and read.ready(5.0)
    service.feed.deliver(service.feed.reader.poll(service.feed.budget()))  # the loop's poll
    service.table.check_invariants()
    assert "b1" in service.table.early
    _run_to_end(service)
    for rid in ("a1", "b1"):
        rec = record(r, keys, rid)
        assert rec is not None and rec.status == "done"


def test_messages_the_chat_template_refuses_end_the_request_not_the_worker(
    r: redis.Redis, keys: Keys, service: WorkerService
) -> None:
    """Llama-2, Mistral and Gemma templates raise (``raise_exception``) for roles that do not
    alternate; that is the request's fault, so it ends ``error`` and the worker serves on."""
    service.engine.tokenizer.chat_template = (
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    )
    messages = ({"role": "user", "content": "a"}, {"role": "user", "content": "b"})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    enqueue(r, keys, make_request("c1", messages=messages, sampling=params))
    enqueue(r, keys, _request("c2"))
    entries = service.intake.streams.pull(4)
    service.feed.deliver(Delivery(early=service.intake.starter.early_jobs(entries)))
    service.table.check_invariants()
    assert "c1" not in service.table.early and "c2" in service.table.early
    service.feed.admit(entries)
    service.table.check_invariants()
    _run_to_end(service)
    bad = record(r, keys, "c1")
    assert bad is not None and bad.status == "error" and bad.code == "invalid_request"
    assert "chat template refused" in (bad.message or "")
    assert "roles must alternate" in (bad.message or "")
    good = record(r, keys, "c2")
    assert good is not None and good.status == "done"


def test_a_failed_step_ends_its_requests_and_counts_them(
    r: redis.Redis, keys: Keys, service: WorkerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    enqueue(r, keys, _request("f1"))
    service.feed.admit(service.intake.streams.pull(4))
    service.table.check_invariants()

    def broken_step() -> Any:
        raise RuntimeError("injected: the model runner blew up")

    monkeypatch.setattr(service.engine, "step", broken_step)
    _step(service)
    rec = record(r, keys, "f1")
    assert rec is not None and rec.status == "error" and rec.code == "engine_error"
    assert "injected" in (rec.message or "") and not service.table.jobs
    sample = service.metrics.registry.get_sample_value(
        "tokenfleet:request_success_total",
        {"model_name": "default", "priority": "normal", "status": "error", "finished_reason": ""},
    )
    assert sample == 1


def test_the_first_heartbeat_shows_the_kv_cache_size(
    r: redis.Redis, keys: Keys, service: WorkerService
) -> None:
    service._beat()  # before any step
    beat = r.hgetall(keys.worker("w1"))
    assert int(beat[b"kv_blocks_used"]) == 0
    assert int(beat[b"kv_blocks_total"]) == service.engine.capacity().free_kv_blocks > 0


def test_inherited_requests_go_before_new_arrivals(
    r: redis.Redis, keys: Keys, service: WorkerService
) -> None:
    enqueue(r, keys, _request("old1"))
    service.intake.streams.pull(4)  # read as "w1" by the earlier process of this name, which died
    enqueue(r, keys, _request("new1"))
    assert service.feed.claimer.inherit() == 1
    assert service.feed.budget() > 0 and service.feed.read_budget() == 0  # the intake waits
    service.feed.admit(service.feed.claimer.claim(service.feed.budget()), claimed=True)
    service.table.check_invariants()
    assert "old1" in service.table.jobs and service.feed.claimer.num_inherited == 0
    assert service.feed.read_budget() == service.feed.budget()  # reading again as usual
    _run_to_end(service)
    rec = record(r, keys, "old1")
    assert rec is not None and rec.status == "done" and rec.attempts == 1  # read, never started


def test_an_expired_request_is_not_started_early(
    r: redis.Redis, keys: Keys, service: WorkerService
) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    enqueue(r, keys, make_request("x1", sampling=params, deadline=time.time() - 1))
    entries = service.intake.streams.pull(4)
    service.feed.deliver(Delivery(early=service.intake.starter.early_jobs(entries)))
    service.table.check_invariants()
    assert not service.table.early and not service.engine.has_unfinished()  # no prefill for it
    service.feed.admit(entries)
    service.table.check_invariants()
    rec = record(r, keys, "x1")
    assert rec is not None and rec.status == "expired" and rec.started_at is None
