"""The engine's side of a shared KV pool (issue 6), through its pool port: a block limit, and what
the pool call reports.

Fake-runner tests (the paged fake of test_engine_fake: a wrong block table changes the output)
plus one real tiny model against HF greedy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_engine_fake import drain, make_engine, reference, tokens_of

from tokenfleet.shared.priority import Priority
from tokenfleet.worker.engine.block_manager import AllocStatus, BlockManager, check_invariants
from tokenfleet.worker.engine.engine import Engine, EngineConfig, RequestOutput
from tokenfleet.worker.engine.request import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def prompt(i: int, n: int = 6) -> list[int]:
    return [20 + (i * 13 + j) % 500 for j in range(n)]


def over_limit(bm: BlockManager) -> bool:
    """More blocks in use than the limit allows (it was lowered below use)."""
    return bm.block_limit is not None and bm.num_used_blocks > bm.block_limit


def run_until(engine: Engine, outs: dict[str, list[RequestOutput]], steps: int) -> None:
    for _ in range(steps):
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)


# -- block manager --------------------------------------------------------------------------------
def test_block_manager_allocates_and_appends_only_within_the_limit() -> None:
    bm = BlockManager(16, 4)
    bm.set_block_limit(3)
    assert bm.num_allocatable_blocks == 3
    assert bm.can_allocate(13) is AllocStatus.LATER  # 4 blocks > limit 3; the pool may grant
    assert bm.can_allocate(100) is AllocStatus.NEVER  # more than the cache itself
    bm.allocate("a", 12)  # 3 blocks
    assert bm.num_allocatable_blocks == 0 and not bm.can_append("a")
    with pytest.raises(ValueError, match="not enough free"):
        bm.allocate("b", 1)
    bm.set_block_limit(2)  # lowered below use: frees nothing, flags it
    assert over_limit(bm) and bm.num_used_blocks == 3
    bm.set_block_limit(None)
    assert not over_limit(bm) and bm.can_append("a")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="block limit"):
            bm.set_block_limit(bad)  # type: ignore[arg-type]  # deliberately bad values
    check_invariants(bm)


def test_reviving_a_cached_block_counts_against_the_limit() -> None:
    from tokenfleet.shared.block_hash import extend_block_hashes

    bm = BlockManager(16, 4)
    ids = list(range(100, 109))  # 2 full blocks + 1 token
    hashes: list[bytes] = []
    extend_block_hashes(hashes, ids, 4)
    bm.allocate("a", 9, hashes)
    bm.cache_blocks("a", hashes, 9)
    bm.free("a")  # two free cached blocks, not in use
    assert bm.num_used_blocks == 0
    assert bm.num_blocks_to_take(9, hashes) == 3  # 2 revived + 1 new
    bm.allocate("b", 9, hashes)  # shares both cached blocks, now in use
    assert bm.num_blocks_to_take(9, hashes) == 1  # hits on in-use blocks are free
    bm.set_block_limit(3)  # 3 in use + 1 new > 3
    assert bm.can_allocate(9, hashes) is AllocStatus.LATER
    bm.set_block_limit(4)
    assert bm.can_allocate(9, hashes) is AllocStatus.NOW
    check_invariants(bm)


# -- admission and growth within the limit --------------------------------------------------------
@pytest.mark.parametrize("limit", [7, 9, 14])
def test_used_blocks_never_exceed_the_limit_and_outputs_match(tok: Any, limit: int) -> None:
    engine = make_engine(tok, 64, max_num_batched_tokens=16, max_num_seqs=8)
    port = engine.pool_port()
    port.set_kv_block_limit(limit)
    prompts = [prompt(i, 3 + 2 * i) for i in range(6)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    outs: dict[str, list[RequestOutput]] = {}
    preemptions = 0
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        assert port.num_used_blocks <= limit
        cap = engine.capacity()
        assert cap.free_kv_blocks <= max(0, limit - port.num_used_blocks)
        preemptions += engine.last_step_stats.num_preemptions
    for i, p in enumerate(prompts):
        assert tokens_of(outs[f"r{i}"]) == reference(p, 12, len(tok))
    if limit == 7:
        assert preemptions > 0  # six requests growing to 4-7 blocks each cannot all run


def test_lowering_the_limit_preempts_the_least_urgent_latest_at_the_next_step(tok: Any) -> None:
    engine = make_engine(tok, 64)
    port = engine.pool_port()
    specs = [("c", Priority.CRITICAL), ("b1", Priority.BATCH), ("n", Priority.NORMAL)]
    specs.append(("b2", Priority.BATCH))
    for i, (rid, prio) in enumerate(specs):
        engine.add_request(rid, prompt(i), GREEDY, priority=prio)
    outs: dict[str, list[RequestOutput]] = {}
    run_until(engine, outs, 2)
    assert port.num_used_blocks == 8  # 4 requests x 2 blocks (6 prompt + 1 token)
    port.set_kv_block_limit(5)
    assert port.num_used_blocks == 8  # nothing happens until the next step
    run_until(engine, outs, 1)
    # b2 (latest batch), then b1 went; b1 cannot come back (2 more blocks > 5)
    assert engine.last_step_stats.num_preemptions == 2
    assert {r.request_id for r in engine.scheduler.running} == {"c", "n"}
    assert port.num_used_blocks == 4
    port.set_kv_block_limit(None)
    outs.update({k: outs.get(k, []) + v for k, v in drain(engine).items()})
    for i, (rid, _) in enumerate(specs):
        assert tokens_of(outs[rid]) == reference(prompt(i), 12, len(tok))


# -- what the pool call reports -------------------------------------------------------------------
def test_wanted_blocks_by_priority_and_shortfall(tok: Any) -> None:
    engine = make_engine(tok, 64, max_num_seqs=3, background_yields=False)
    port = engine.pool_port()
    port.set_kv_block_limit(0)
    assert not port.has_work and port.num_blocks_wanted == 0
    engine.add_request("b", prompt(1, 8), GREEDY, priority=Priority.BATCH)  # 8 tokens: 2 blocks
    assert port.has_work
    assert port.num_blocks_wanted == 2
    assert port.kv_block_shortfall() == (Priority.BATCH, 2)
    engine.step()  # nothing fits under limit 0
    assert port.num_used_blocks == 0 and not engine.last_step_stats.num_seqs
    port.set_kv_block_limit(2)
    assert port.kv_block_shortfall() is None
    engine.step()  # admitted: 2 blocks; its 9th token needs a third block next step
    assert port.num_used_blocks == 2
    assert port.num_blocks_wanted == 1
    engine.add_request("c", prompt(2, 5), GREEDY, priority=Priority.CRITICAL)  # 2 blocks
    assert port.num_blocks_wanted == 1 + 2
    # issue 15: the engine preempts "b" (batch) for "c" itself at the next step: nothing to ask
    assert port.kv_block_shortfall() is None
    port.set_kv_block_limit(10)
    engine.step()
    assert port.blocks_by_priority() == [2, 0, 3]
    assert sum(port.blocks_by_priority()) == port.num_used_blocks
    # a full engine (no free sequence slot) wants no admission blocks and asks for nothing
    engine.add_request("n", prompt(3), GREEDY, priority=Priority.NORMAL)
    engine.step()
    engine.add_request("late", prompt(4), GREEDY, priority=Priority.CRITICAL)
    port.set_kv_block_limit(port.num_used_blocks)
    assert len(engine.scheduler.running) == 3
    assert port.kv_block_shortfall() is None


def test_the_pool_is_asked_only_for_what_the_engine_cannot_free_itself(tok: Any) -> None:
    engine = make_engine(tok, 64)
    port = engine.pool_port()
    port.set_kv_block_limit(4)
    engine.add_request("c1", prompt(1, 5), GREEDY, priority=Priority.CRITICAL)  # 2 blocks
    engine.add_request("b", prompt(2, 5), GREEDY, priority=Priority.BATCH)  # 2 blocks
    engine.step()
    assert port.num_used_blocks == 4
    engine.add_request("c2", prompt(3, 5), GREEDY, priority=Priority.CRITICAL)
    assert port.kv_block_shortfall() is None  # "b" is less urgent: the engine preempts it
    engine.step()
    assert engine.last_step_stats.num_preemptions == 1
    assert [r.request_id for r in engine.scheduler.running] == ["c1", "c2"]
    assert port.num_used_blocks == 4
    engine.add_request("c3", prompt(4, 5), GREEDY, priority=Priority.CRITICAL)
    assert port.kv_block_shortfall() == (Priority.CRITICAL, 2)  # only equals run: ask the pool


def test_shared_prefix_blocks_count_once_for_the_most_urgent(tok: Any) -> None:
    engine = make_engine(tok, 64)
    port = engine.pool_port()
    common = prompt(7, 8)  # two full blocks
    engine.add_request("b", [*common, 1], GREEDY, priority=Priority.BATCH)
    engine.step()
    engine.add_request("c", [*common, 2], GREEDY, priority=Priority.CRITICAL)
    engine.step()
    assert engine.last_step_stats.num_prefix_cache_hit_tokens == 8
    by_prio = port.blocks_by_priority()
    assert by_prio[Priority.CRITICAL] == 3 and by_prio[Priority.BATCH] == 1
    assert sum(by_prio) == port.num_used_blocks


def test_preempt_for_pool_uses_spare_first_then_strictly_less_urgent_latest_first(
    tok: Any,
) -> None:
    engine = make_engine(tok, 64)
    port = engine.pool_port()
    specs = [("n1", Priority.NORMAL), ("b1", Priority.BATCH), ("c1", Priority.CRITICAL)]
    specs += [("b2", Priority.BATCH), ("n2", Priority.NORMAL)]
    for i, (rid, prio) in enumerate(specs):
        engine.add_request(rid, prompt(i), GREEDY, priority=prio)
    port.set_kv_block_limit(13)
    engine.step()
    assert port.num_used_blocks == 10  # 5 x 2 blocks: spare 3

    def order(num_blocks: int, priority: Priority) -> int:
        freed = port.preempt_for_pool(num_blocks, priority)
        limit = port.kv_block_limit
        assert limit is not None
        port.set_kv_block_limit(limit - freed)  # what the pool link does
        assert port.num_used_blocks <= limit - freed
        return freed

    assert order(2, Priority.CRITICAL) == 2  # spare only
    assert len(engine.scheduler.running) == 5
    assert order(3, Priority.CRITICAL) == 3  # spare 1 + b2 (2 blocks)
    assert {r.request_id for r in engine.scheduler.running} == {"n1", "b1", "c1", "n2"}
    # only work strictly less urgent than NORMAL (batch) goes for a NORMAL order
    assert order(10, Priority.NORMAL) == 2
    assert {r.request_id for r in engine.scheduler.running} == {"n1", "c1", "n2"}
    assert order(10, Priority.BATCH) == 0  # nothing is less urgent than batch
    assert order(3, Priority.CRITICAL) == 3  # n2 (latest normal), then n1; 1 more than asked
    assert {r.request_id for r in engine.scheduler.running} == {"c1"}
    assert port.kv_block_limit == 3 and port.num_used_blocks == 2  # the extra one stays
    assert order(0, Priority.CRITICAL) == 0
    port.set_kv_block_limit(2)
    engine.step()
    assert engine.last_step_stats.num_preemptions == 4  # counted in the next step's stats
    port.set_kv_block_limit(None)
    outs = drain(engine)
    assert {rid for rid, o in outs.items() if o[-1].finished} == {rid for rid, _ in specs}


def test_ports_of_one_engine_agree_and_the_limits_live_in_the_engine(tok: Any) -> None:
    engine = make_engine(tok, 64)
    first, second = engine.pool_port(), engine.pool_port()
    first.set_kv_block_limit(7)
    first.set_token_limit(5)
    assert (second.kv_block_limit, second.token_limit) == (7, 5)
    assert engine.block_manager.block_limit == 7 and engine.scheduler.token_limit == 5
    engine.add_request("r", prompt(0), GREEDY)
    assert second.has_work and second.num_tokens_wanted == 6
    engine.step()
    assert second.last_step_stats is engine.last_step_stats
    assert second.last_step_stats.num_tokens == 5  # the token limit capped the step
    assert second.num_used_blocks == engine.block_manager.num_used_blocks == 2
    assert second.num_kv_blocks == 64
    for bad in (0, -1):
        with pytest.raises(ValueError, match="token limit must be >= 1"):
            second.set_token_limit(bad)
    second.set_token_limit(None)
    assert first.token_limit is None


# -- a real model -------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_tight_limit_preempts_yet_greedy_output_matches_hf(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    engine = Engine(
        tiny_llama_dir,
        EngineConfig(block_size=4, num_kv_blocks=64, device="cpu", max_wait_s=None, seed=0),
    )
    port = engine.pool_port()
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    texts = ["Hello there", "The fleet of workers", "Blocks are a budget", "Zebra"]
    prompts = [engine.tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=10)
    port.set_kv_block_limit(6)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, priority=Priority(i % 3))
    outs: dict[str, list[RequestOutput]] = {}
    assert max(len(p) for p in prompts) + 10 <= 6 * 4  # each fits the limit alone
    preemptions = 0
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        assert port.num_used_blocks <= 6
        preemptions += engine.last_step_stats.num_preemptions
    assert preemptions > 0
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.inference_mode():
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10
            )
        assert tokens_of(outs[f"r{i}"]) == [int(t) for t in ref[0, len(p) :]], texts[i]
