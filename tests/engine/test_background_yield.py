"""Background (``batch``) work yields to more urgent work inside one engine: it sits out steps
that prefill urgent work (the scheduler), and its own steps can be cut short between layers
(``Engine.set_interrupt``) without changing any token it produces."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from test_scheduler import make_request, make_scheduler, scheduled_ids, step

from tokenfleet.shared.priority import Priority
from tokenfleet.worker.engine.engine import Engine, EngineConfig, RequestOutput
from tokenfleet.worker.engine.request import SamplingParams

BATCH, NORMAL, CRITICAL = Priority.BATCH, Priority.NORMAL, Priority.CRITICAL


def test_background_sits_out_the_step_that_prefills_urgent_work() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add(make_request("b1", 6, priority=BATCH))
    sched.add(make_request("b2", 6, priority=BATCH))
    step(sched)  # both prefilled: decoding from now on
    sched.add(make_request("n", 10, priority=NORMAL))
    out = step(sched)
    assert scheduled_ids(out) == ["n"]  # the urgent prefill alone
    out = step(sched)  # n decodes now: background runs with it again
    assert sorted(scheduled_ids(out)) == ["b1", "b2", "n"]
    assert all(r.priority is BATCH for r in sched.running if r.request_id.startswith("b"))


def test_urgent_work_takes_a_sequence_slot_from_batch_work() -> None:
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    sched.add(make_request("b", 6, priority=BATCH, max_tokens=3))
    step(sched)
    sched.add(make_request("n", 6, priority=NORMAL, max_tokens=2))
    out = step(sched)
    assert scheduled_ids(out) == ["n"] and out.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["b"]  # recomputed once n is done
    assert scheduled_ids(step(sched)) == ["n"]
    assert scheduled_ids(step(sched)) == ["b"]
    off = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, background_yields=False)
    off.add(make_request("b", 6, priority=BATCH, max_tokens=3))
    step(off)
    off.add(make_request("n", 6, priority=NORMAL))
    assert scheduled_ids(step(off)) == ["b"]  # without yielding: n waits for the slot


def test_background_takes_the_step_when_the_urgent_request_cannot_start() -> None:
    """No slot for the urgent request and the batch request is boosted (the starvation guard:
    never a victim): batch work must not stall behind a request that cannot run."""
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    sched.add(make_request("b", 6, priority=BATCH, max_tokens=3))
    step(sched)
    sched.running[0].boosted = True
    sched.add(make_request("n", 6, priority=NORMAL))
    assert scheduled_ids(step(sched)) == ["b"]
    assert scheduled_ids(step(sched)) == ["b"]  # b finishes at its third token
    assert scheduled_ids(step(sched)) == ["n"]


def test_background_sits_out_at_most_max_yield_steps_in_a_row() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, max_yield_steps=2)
    sched.add(make_request("b", 4, priority=BATCH))
    step(sched)
    sched.add(make_request("n", 60, priority=NORMAL))  # a prefill of 8 chunks
    runs = ["b" in scheduled_ids(step(sched)) for _ in range(6)]
    assert runs == [False, False, True, False, False, True]


def test_background_does_not_sit_out_for_urgent_decodes_or_without_the_setting() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add(make_request("n", 6, priority=NORMAL))
    sched.add(make_request("b", 6, priority=BATCH))
    assert sorted(scheduled_ids(step(sched))) == ["b", "n"]  # both prefills, nobody ran before
    assert sorted(scheduled_ids(step(sched))) == ["b", "n"]  # decodes only
    off = make_scheduler(max_num_batched_tokens=64, background_yields=False)
    off.add(make_request("b", 6, priority=BATCH))
    step(off)
    off.add(make_request("c", 6, priority=CRITICAL))
    assert sorted(scheduled_ids(step(off))) == ["b", "c"]


# -- cut steps, on a real (tiny) model ------------------------------------------------------------


def _engine(model_dir: Path) -> Engine:
    return Engine(
        model_dir,
        EngineConfig(
            block_size=8, num_kv_blocks=64, max_num_batched_tokens=24, device="cpu", seed=0
        ),
    )


def _run(engine: Engine, prompts: list[str], params: SamplingParams) -> dict[str, list[int]]:
    for i, text in enumerate(prompts):
        engine.add_request(f"r{i}", text, params, priority=BATCH)
    tokens: dict[str, list[int]] = {}
    outs: list[RequestOutput] = []
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        outs = engine.step()
        for out in outs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True])
def test_cut_steps_change_no_token(tiny_llama_dir: Path, sampled: bool) -> None:
    prompts = ["Hello there", "The fleet of workers", "A longer prompt that takes two chunks"]
    params = SamplingParams(temperature=0.8 if sampled else 0, seed=3, max_tokens=12)
    expected = _run(_engine(tiny_llama_dir), prompts, params)

    engine = _engine(tiny_llama_dir)
    calls = {"n": 0}

    def every_fifth_layer() -> bool:  # cuts whenever allowed, at varying depths
        calls["n"] += 1
        return calls["n"] % 5 == 0

    engine.set_interrupt(every_fifth_layer)
    cuts: list[bool] = []
    real_step = engine.step

    def counting_step() -> list[RequestOutput]:
        outs = real_step()
        cuts.append(engine.last_step_stats.cut)
        return outs

    engine.step = counting_step  # type: ignore[method-assign]
    assert _run(engine, prompts, params) == expected
    assert sum(cuts) >= 3  # it did cut
    assert not any(a and b for a, b in itertools.pairwise(cuts))  # never twice in a row
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.slow
def test_steps_with_urgent_work_are_never_cut(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir)
    engine.set_interrupt(lambda: True)
    engine.add_request("n", "Hello", SamplingParams(temperature=0, max_tokens=4), priority=NORMAL)
    engine.add_request("b", "World", SamplingParams(temperature=0, max_tokens=4), priority=BATCH)
    while engine.has_unfinished():
        engine.step()
        assert not engine.last_step_stats.cut
