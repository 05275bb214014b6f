"""Scheduler policy without a model: the "model" samples token 7 for every sequence."""

from __future__ import annotations

import itertools

import pytest

from tokenfleet.shared.priority import Priority
from tokenfleet.worker.engine.block_manager import BlockManager, check_invariants
from tokenfleet.worker.engine.outputs import StepStats
from tokenfleet.worker.engine.pool_port import PoolPort
from tokenfleet.worker.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from tokenfleet.worker.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

_seq = itertools.count()


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    prefix_caching: bool = True,
    clock_values: list[float] | None = None,
    **config: object,
) -> Scheduler:
    config.setdefault("max_wait_s", None)
    config.setdefault("max_model_len", num_blocks * block_size)  # as the engine derives it
    cfg = SchedulerConfig(**config)  # type: ignore[arg-type]
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(cfg, bm, clock=lambda: 0.0)


def make_request(
    rid: str,
    num_prompt_tokens: int,
    *,
    priority: Priority = Priority.NORMAL,
    arrival: float = 0.0,
    max_tokens: int = 100,
    first_token: int | None = None,
) -> Request:
    """Prompts differ from the first token on unless ``first_token`` is given (no sharing)."""
    if first_token is None:
        first_token = 100 * next(_seq)
    prompt = [first_token + i for i in range(num_prompt_tokens)]
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens),
        priority=priority,
        arrival_time=arrival,
        arrival_seq=next(_seq),
    )


def step(sched: Scheduler) -> SchedulerOutput:
    """One step with a fake model: sample token 7, finish at max_tokens."""
    out = sched.schedule()
    sched.update_after_step(out)
    for req, seq in zip(out.requests, out.batch.seqs, strict=True):
        assert seq.end_pos <= req.num_tokens
        if seq.needs_logits:
            req.append_token(7)
            if (
                req.num_output_tokens >= req.params.max_tokens
                or req.num_tokens >= sched.config.max_model_len
            ):
                sched.finish(req, FinishReason.LENGTH)
    check(sched)
    return out


def check(sched: Scheduler) -> None:
    check_invariants(sched.block_manager)
    assert len(sched.running) <= sched.config.max_num_seqs
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        assert req.request_id in sched.block_manager
    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert req.request_id not in sched.block_manager
        assert req.num_computed_tokens == 0


class NoSteps:
    """The stats source of a scheduler driven without an engine."""

    last_step_stats = StepStats()


def scheduled_ids(out: SchedulerOutput) -> list[str]:
    return [s.request_id for s in out.batch.seqs]


def test_decode_tokens_come_first_then_prefill_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add(make_request("a", 5))
    sched.add(make_request("b", 5))
    step(sched)  # both prefilled, each sampled one token
    sched.add(make_request("c", 40))
    out = step(sched)
    assert scheduled_ids(out) == ["a", "b", "c"]
    assert [len(s.token_ids) for s in out.batch.seqs] == [1, 1, 14]  # c gets what is left
    assert [s.needs_logits for s in out.batch.seqs] == [True, True, False]
    assert out.batch.num_tokens == 16


def test_chunked_prefill_respects_the_token_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add(make_request("long", 100))
    chunks = []
    for _ in range(4):
        out = step(sched)
        (seq,) = out.batch.seqs
        chunks.append((seq.start_pos, len(seq.token_ids), seq.needs_logits))
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert sched.running[0].num_output_tokens == 1


def test_a_token_limit_caps_each_step_and_decodes_the_most_urgent_first() -> None:
    """A pool's compute share lowers the per-step budget; work still progresses (at least 1)."""
    sched = make_scheduler(max_num_batched_tokens=64, background_yields=False)
    port = PoolPort(sched, NoSteps())  # what the pool reads: the tokens wanted
    sched.add(make_request("batch", 6, priority=Priority.BATCH))
    sched.add(make_request("critical", 6, priority=Priority.CRITICAL))
    assert port.num_tokens_wanted == 12
    step(sched)
    assert port.num_tokens_wanted == 2  # one decode token each
    sched.add(make_request("long", 100, priority=Priority.NORMAL))
    assert port.num_tokens_wanted == 64  # 2 + 100, at most the step's budget
    sched.token_limit = 1
    assert port.num_tokens_wanted == 64  # what it would compute without the cap
    out = step(sched)
    assert scheduled_ids(out) == ["critical"] and out.batch.num_tokens == 1
    sched.token_limit = 10
    out = step(sched)
    assert scheduled_ids(out) == ["critical", "batch", "long"]
    assert [len(s.token_ids) for s in out.batch.seqs] == [1, 1, 8]
    sched.token_limit = 0  # a cap below one still computes one token
    assert step(sched).batch.num_tokens == 1
    sched.token_limit = None
    assert step(sched).batch.num_tokens == 64


def test_max_num_seqs_limits_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for rid in "abc":
        sched.add(make_request(rid, 4))
    out = step(sched)
    assert scheduled_ids(out) == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_admission_by_priority_then_arrival() -> None:
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    sched.add(make_request("batch-early", 4, priority=Priority.BATCH, arrival=0.0, max_tokens=1))
    sched.add(make_request("normal-late", 4, priority=Priority.NORMAL, arrival=2.0, max_tokens=1))
    sched.add(make_request("critical", 4, priority=Priority.CRITICAL, arrival=3.0, max_tokens=1))
    sched.add(make_request("normal-early", 4, priority=Priority.NORMAL, arrival=1.0, max_tokens=1))
    order = []
    while sched.has_unfinished():
        order.extend(scheduled_ids(step(sched)))
    assert order == ["critical", "normal-early", "normal-late", "batch-early"]


def test_out_of_blocks_preempts_lowest_priority_latest_arrival() -> None:
    # 8 blocks of 4 slots; four 8-token prompts take 2 blocks each: the pool is full
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    sched.add(make_request("batch-0", 8, priority=Priority.BATCH, arrival=0.0))
    sched.add(make_request("normal-1", 8, priority=Priority.NORMAL, arrival=1.0))
    sched.add(make_request("normal-2", 8, priority=Priority.NORMAL, arrival=2.0))
    sched.add(make_request("critical-3", 8, priority=Priority.CRITICAL, arrival=3.0))
    step(sched)
    assert sched.block_manager.num_free_blocks == 0
    # each now has 9 tokens and needs a third block: batch-0 goes first, then normal-2
    out = step(sched)
    assert out.num_preemptions == 2
    assert scheduled_ids(out) == ["critical-3", "normal-1"]
    assert [r.request_id for r in sched.waiting] == ["normal-2", "batch-0"]
    preempted = sched.waiting[0]
    assert preempted.status is RequestStatus.PREEMPTED
    assert preempted.num_output_tokens == 1  # kept: recomputed with the prompt on re-admission


def test_preemption_picks_by_priority_not_by_admission_order() -> None:
    sched = make_scheduler(
        num_blocks=5, block_size=4, max_num_batched_tokens=64, background_yields=False
    )
    sched.add(make_request("batch", 8, priority=Priority.BATCH, arrival=0.0))
    step(sched)  # batch runs alone
    sched.add(make_request("critical", 8, priority=Priority.CRITICAL, arrival=5.0))
    step(sched)  # batch takes a third block, critical is admitted with two: the pool is full
    assert sched.block_manager.num_free_blocks == 0
    out = step(sched)  # critical needs a third block
    assert out.num_preemptions == 1
    assert [r.request_id for r in sched.running] == ["critical"]
    assert [r.request_id for r in sched.waiting] == ["batch"]


def test_preempted_request_is_recomputed_with_its_output() -> None:
    sched = make_scheduler(
        num_blocks=4, block_size=4, max_num_batched_tokens=64, prefix_caching=False
    )
    sched.add(make_request("a", 8, arrival=0.0, max_tokens=20))
    sched.add(make_request("b", 8, arrival=1.0, max_tokens=20))
    step(sched)
    out = step(sched)  # both need a third block: b is preempted
    assert out.num_preemptions == 1
    b = sched.waiting[0]
    assert b.request_id == "b" and b.num_tokens == 9
    while b.status is not RequestStatus.RUNNING:
        out = step(sched)
    (seq,) = [s for s in out.batch.seqs if s.request_id == "b"]
    assert seq.start_pos == 0
    assert seq.token_ids == b.all_token_ids[:9]  # prompt + the token sampled before preemption


def test_starving_request_preempts_a_less_urgent_running_one() -> None:
    # 5 blocks of 4: while "hog" (13+ tokens, 4 blocks) runs, "old" (3 blocks) cannot start
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=16, max_wait_steps=3)
    sched.add(make_request("hog", 13, priority=Priority.CRITICAL, arrival=1.0, max_tokens=1000))
    step(sched)
    sched.add(make_request("old", 9, priority=Priority.BATCH, arrival=0.0, max_tokens=2))
    preempted_at = None
    for i in range(6):
        out = step(sched)
        if out.num_preemptions:
            preempted_at = i
            break
    assert preempted_at == 2  # waited 3 steps
    assert [r.request_id for r in sched.running] == ["old"]
    assert sched.running[0].boosted
    assert [r.request_id for r in sched.waiting] == ["hog"]
    while sched.running and sched.running[0].request_id == "old":
        step(sched)
    step(sched)
    assert [r.request_id for r in sched.running] == ["hog"]  # hog resumes once old finished


def test_without_anti_starvation_the_waiting_request_just_waits() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=16)
    sched.add(make_request("hog", 13, priority=Priority.CRITICAL, arrival=1.0, max_tokens=1000))
    step(sched)
    sched.add(make_request("old", 9, priority=Priority.BATCH, arrival=0.0))
    for _ in range(5):
        assert step(sched).num_preemptions == 0
    assert [r.request_id for r in sched.waiting] == ["old"]


def test_starving_request_does_not_preempt_a_more_urgent_boosted_one() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=16, max_wait_steps=2)
    sched.add(make_request("first", 13, arrival=0.0, max_tokens=30))
    step(sched)
    sched.running[0].boosted = True  # as if it had starved before
    sched.add(make_request("second", 9, arrival=1.0))
    for _ in range(5):
        assert step(sched).num_preemptions == 0
    assert sched.waiting[0].request_id == "second"
    assert sched.waiting[0].boosted


def test_abort_frees_blocks_at_once() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    sched.add(make_request("a", 10))
    sched.add(make_request("w", 4))
    step(sched)
    used = sched.block_manager.num_used_blocks
    req = sched.abort("a")
    assert req is not None and req.finish_reason is FinishReason.ABORT
    assert req.status is RequestStatus.FINISHED
    assert sched.block_manager.num_used_blocks == used - 3
    assert sched.abort("a") is None
    assert sched.abort("nope") is None
    check(sched)


def test_prompt_over_max_model_len_is_refused_naming_both_numbers() -> None:
    sched = make_scheduler(max_model_len=64)
    sched.add(make_request("long", 65))
    out = step(sched)
    (req,) = out.finished
    assert req.finish_reason is FinishReason.ERROR
    assert req.error_code == "prompt_too_long"
    assert req.error_message == "prompt has 65 tokens; max_model_len is 64"
    assert not sched.has_unfinished()


def test_request_over_the_whole_pool_is_refused() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    sched.add(make_request("big", 17))
    (req,) = step(sched).finished
    assert req.error_code == "prompt_too_long"
    assert "17 tokens" in (req.error_message or "") and "16 tokens" in (req.error_message or "")


def test_prefix_cache_hits_skip_computing_cached_blocks() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    sched.add(make_request("a", 10, first_token=0))
    step(sched)
    sched.add(make_request("b", 11, first_token=0))  # same first 10 tokens
    out = step(sched)
    (seq,) = [s for s in out.batch.seqs if s.request_id == "b"]
    assert out.num_cached_tokens == 8
    assert seq.start_pos == 8 and len(seq.token_ids) == 3
    b = next(r for r in sched.running if r.request_id == "b")
    assert b.num_cached_tokens == 8


@pytest.mark.parametrize("budget", [64, 6])  # the prompt's prefill in one step, or in four
def test_a_prompt_being_prefilled_is_shared_by_one_that_arrives_with_it(budget: int) -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=budget)
    for rid in ("a", "b", "c"):  # the n choices of one request: the same 18-token prompt
        sched.add(make_request(rid, 18, first_token=0, max_tokens=3))
    computed = {"a": 0, "b": 0, "c": 0}
    cached: dict[str, int] = {}
    while sched.has_unfinished():
        out = step(sched)
        for req, seq in zip(out.requests, out.batch.seqs, strict=True):
            if seq.start_pos < req.num_prompt_tokens:
                computed[req.request_id] += len(seq.token_ids)
                cached.setdefault(req.request_id, req.num_cached_tokens)
    # the first computes the whole prompt; the others read its 4 full blocks (16 tokens) from
    # the cache and compute the rest (the last block is not full; the last token is computed)
    assert computed == {"a": 18, "b": 2, "c": 2}
    assert cached == {"a": 0, "b": 16, "c": 16}


def test_without_prefill_sharing_each_computes_the_whole_prompt() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, share_prefill=False)
    for rid in ("a", "b"):
        sched.add(make_request(rid, 18, first_token=0, max_tokens=1))
    out = step(sched)
    assert sorted(s.request_id for s in out.batch.seqs) == ["a", "b"]
    assert all(len(s.token_ids) == 18 for s in out.batch.seqs)
    # and a prompt nobody is prefilling never waits
    shared = make_scheduler(num_blocks=32, block_size=4)
    shared.add(make_request("x", 18, first_token=0))
    shared.add(make_request("y", 18, first_token=1000))
    assert len(step(shared).batch.seqs) == 2


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_wait_s"):
        SchedulerConfig(max_wait_s=0)
