"""Engine API over a fake model runner that keeps a paged "KV cache" of token ids.

The fake reads each sequence's context back through its block table, so a wrong block table, a
wrongly shared prefix block or a chunk computed twice changes its output: the next token is a
hash of the whole context, exactly as a reference computed from the plain token list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenfleet.shared.priority import Priority
from tokenfleet.worker.engine.batch import StepBatch
from tokenfleet.worker.engine.block_manager import check_invariants
from tokenfleet.worker.engine.engine import Engine, EngineConfig, RequestOutput
from tokenfleet.worker.engine.request import FinishReason, SamplingParams

FIRST_ORDINARY_ID = 5  # ids below are the tiny tokenizer's special tokens


def next_token(context: list[int], vocab_size: int) -> int:
    digest = hashlib.blake2b(repr(context).encode(), digest_size=8).digest()
    return FIRST_ORDINARY_ID + int.from_bytes(digest) % (vocab_size - FIRST_ORDINARY_ID)


class PagedFakeRunner:
    """Writes token ids into block slots; 'attention' reads the context back from the slots."""

    def __init__(self, vocab_size: int, *, num_kv_blocks: int, block_size: int = 4) -> None:
        self.vocab_size = vocab_size
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = 4096
        self.eos_token_ids = frozenset({2})
        self.device = torch.device("cpu")
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_kv_blocks)]
        self.batches: list[StepBatch] = []

    def execute(
        self, batch: StepBatch, interrupt: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        self.batches.append(batch)
        bs = self.block_size
        rows = []
        for seq in batch.seqs:
            for i, t in enumerate(seq.token_ids):
                p = seq.start_pos + i
                self.kv[seq.block_table[p // bs]][p % bs] = t
            if seq.needs_logits:
                context = [self.kv[seq.block_table[p // bs]][p % bs] for p in range(seq.end_pos)]
                assert None not in context
                row = torch.zeros(self.vocab_size)
                row[next_token(context, self.vocab_size)] = 10.0  # type: ignore[arg-type]
                rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, self.vocab_size)


def reference(prompt: list[int], max_tokens: int, vocab_size: int) -> list[int]:
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(next_token(context, vocab_size))
    return context[len(prompt) :]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def make_engine(tok: Any, num_kv_blocks: int = 64, **config: Any) -> Engine:
    config.setdefault("max_wait_s", None)
    runner = PagedFakeRunner(len(tok), num_kv_blocks=num_kv_blocks, block_size=4)
    return Engine.from_runner(runner, tok, EngineConfig(block_size=4, **config))


def drain(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return outs
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    tokens: list[int] = []
    for out in outs:
        assert out.first_index == len(tokens)
        tokens.extend(out.new_token_ids)
    return tokens


PROMPTS = [[10 + (i * 7 + j) % 600 for j in range(n)] for i, n in enumerate([3, 9, 17, 30, 5, 41])]
SHARED = [[100 + j for j in range(20)] + [200 + i] * (i + 1) for i in range(4)]


@pytest.mark.parametrize(
    ("num_kv_blocks", "max_num_batched_tokens", "max_num_seqs"),
    [(256, 512, 32), (40, 8, 4), (26, 16, 8), (256, 3, 2)],
)
def test_outputs_match_the_reference_under_chunking_and_preemption(
    tok: Any, num_kv_blocks: int, max_num_batched_tokens: int, max_num_seqs: int
) -> None:
    engine = make_engine(
        tok,
        num_kv_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
    )
    prompts = PROMPTS + SHARED
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i) for i in range(len(prompts))]
    outs: dict[str, list[RequestOutput]] = {}
    preemptions = hits = 0
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        for i, prompt in pending[:2]:  # staggered: two new requests per step
            engine.add_request(f"r{i}", prompt, params[i])
        pending = pending[2:]
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        preemptions += engine.last_step_stats.num_preemptions
        hits += engine.last_step_stats.num_prefix_cache_hit_tokens
        check_invariants(engine.block_manager)
    for i, prompt in enumerate(prompts):
        got = outs[f"r{i}"]
        assert tokens_of(got) == reference(prompt, params[i].max_tokens, len(tok)), i
        assert got[-1].finished and got[-1].finish_reason is FinishReason.LENGTH
        assert sum(o.finished for o in got) == 1
        text = "".join(p for o in got for p in o.new_texts)
        assert text == tok.decode(tokens_of(got), skip_special_tokens=True)
    assert engine.block_manager.num_used_blocks == 0
    if num_kv_blocks < 30:
        assert preemptions > 0
    assert hits > 0


def test_eos_stop_token_and_ignore_eos(tok: Any) -> None:
    prompt = PROMPTS[2]
    ref = reference(prompt, 10, len(tok))
    engine = make_engine(tok)
    engine.eos_token_ids = frozenset({ref[3]})
    engine.add_request("eos", prompt, SamplingParams(temperature=0, max_tokens=10))
    engine.add_request(
        "ignore", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )
    engine.add_request(
        "stop-id",
        prompt,
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(ref[5],), ignore_eos=True),
    )
    outs = drain(engine)
    assert tokens_of(outs["eos"]) == ref[:4]
    assert outs["eos"][-1].finish_reason is FinishReason.STOP
    assert tokens_of(outs["ignore"]) == ref
    assert outs["ignore"][-1].finish_reason is FinishReason.LENGTH
    assert tokens_of(outs["stop-id"]) == ref[:6]
    assert outs["stop-id"][-1].finish_reason is FinishReason.STOP


def test_abort_frees_blocks_and_reports_once(tok: Any) -> None:
    engine = make_engine(tok)
    engine.add_request("a", PROMPTS[5], SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=5))
    first = {o.request_id: o for o in engine.step()}
    used = engine.block_manager.num_used_blocks
    assert engine.abort("a")
    assert engine.block_manager.num_used_blocks < used
    assert not engine.abort("a")
    assert not engine.abort("unknown")
    outs = drain(engine)
    assert len(outs["a"]) == 1 and outs["a"][0].finished
    assert outs["a"][0].finish_reason is FinishReason.ABORT
    assert tokens_of([first["b"], *outs["b"]]) == reference(PROMPTS[1], 5, len(tok))


def test_abort_a_waiting_request(tok: Any) -> None:
    engine = make_engine(tok)
    engine.add_request("w", PROMPTS[0])
    assert engine.abort("w")
    (out,) = engine.step()
    assert out.finished and out.finish_reason is FinishReason.ABORT and not out.new_token_ids
    assert not engine.has_unfinished()


def test_too_long_prompt_finishes_at_once_with_an_error(tok: Any) -> None:
    engine = make_engine(tok, max_model_len=32)
    engine.add_request("long", list(range(10, 50)))
    (out,) = engine.step()
    assert out.finished and out.finish_reason is FinishReason.ERROR
    assert out.error_code == "prompt_too_long"
    assert out.error_message == "prompt has 40 tokens; max_model_len is 32"
    assert not engine.has_unfinished()


def test_generation_stops_at_max_model_len(tok: Any) -> None:
    engine = make_engine(tok, max_model_len=20)
    engine.add_request("a", PROMPTS[2], SamplingParams(temperature=0, max_tokens=100))
    outs = drain(engine)
    assert len(tokens_of(outs["a"])) == 20 - 17  # prompt + output tokens reach max_model_len
    assert outs["a"][-1].finish_reason is FinishReason.LENGTH


def test_max_model_len_over_the_pool_is_a_config_error(tok: Any) -> None:
    with pytest.raises(ValueError, match=r"max_model_len is 1000 but the KV cache holds only 64"):
        make_engine(tok, num_kv_blocks=16, max_model_len=1000)


def test_add_request_validation(tok: Any) -> None:
    engine = make_engine(tok)
    engine.add_request("a", "Hello")
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("a", "Hello")
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("b", [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("c", [1, 10**6])
    with pytest.raises(ValueError, match="unknown engine settings: bogus"):
        Engine("unused", bogus=1)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(num_kv_blocks=4, kv_memory_bytes=4)


def test_request_id_is_reusable_once_reported_finished(tok: Any) -> None:
    engine = make_engine(tok)
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=1))
    drain(engine)
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=1))
    assert drain(engine)["a"][-1].finished


def test_resume_continues_the_same_sequence(tok: Any) -> None:
    prompt = PROMPTS[3]
    params = SamplingParams(temperature=0, max_tokens=12)
    full = reference(prompt, 12, len(tok))
    engine = make_engine(tok)
    engine.add_request("r", prompt, params, resume_output_ids=full[:5])
    outs = drain(engine)["r"]
    assert outs[0].first_index == 5
    assert [t for o in outs for t in o.new_token_ids] == full[5:]
    assert outs[-1].num_output_tokens == 12 and outs[-1].num_prompt_tokens == len(prompt)


def test_resumed_tokens_that_already_ended_the_request(tok: Any) -> None:
    engine = make_engine(tok)
    prompt = PROMPTS[0]
    engine.add_request("done", prompt, SamplingParams(max_tokens=3), resume_output_ids=[7, 8, 9])
    engine.add_request("eos", prompt, SamplingParams(), resume_output_ids=[7, 2])
    outs = {o.request_id: o for o in engine.step()}
    assert outs["done"].finish_reason is FinishReason.LENGTH and outs["done"].first_index == 3
    assert outs["eos"].finish_reason is FinishReason.STOP
    assert not engine.has_unfinished()


def test_capacity_counts_slots_and_blocks(tok: Any) -> None:
    engine = make_engine(tok, num_kv_blocks=20, max_num_seqs=3)
    cap = engine.capacity()
    assert (cap.free_seq_slots, cap.free_kv_blocks, cap.num_waiting, cap.num_running) == (
        3,
        20,
        0,
        0,
    )
    engine.add_request("a", PROMPTS[2])  # 17 tokens: 5 blocks of 4
    cap = engine.capacity()
    assert (cap.free_seq_slots, cap.free_kv_blocks, cap.num_waiting) == (2, 15, 1)
    engine.step()
    cap = engine.capacity()
    assert (cap.free_seq_slots, cap.num_waiting, cap.num_running) == (2, 0, 1)
    assert cap.free_kv_blocks == 20 - 5  # the sampled token still fits the fifth block
    assert cap.block_size == 4


def test_step_stats_and_timings(tok: Any) -> None:
    engine = make_engine(tok, max_num_batched_tokens=8)
    engine.add_request("a", PROMPTS[3], SamplingParams(max_tokens=4), arrival_time=0.0)
    engine.step()
    stats = engine.last_step_stats
    assert (stats.num_seqs, stats.num_prefill_seqs, stats.num_tokens) == (1, 1, 8)
    assert stats.num_output_tokens == 0 and stats.num_running == 1
    assert stats.num_kv_blocks_used + stats.num_kv_blocks_free == 64
    outs = drain(engine)["a"]
    timings = outs[-1].timings
    assert timings is not None
    assert timings.queue_s is not None and timings.queue_s > 0  # arrival_time 0 = long ago
    assert timings.ttft_s is not None and timings.e2e_s is not None
    assert timings.tpot_s is not None and timings.tpot_s >= 0
    assert timings.num_generated_tokens == 4
    assert all(o.timings is None for o in outs[:-1])


def test_priority_orders_admission(tok: Any) -> None:
    engine = make_engine(tok, max_num_seqs=1)
    engine.add_request("batch", PROMPTS[0], SamplingParams(max_tokens=1), priority=Priority.BATCH)
    engine.add_request("crit", PROMPTS[1], SamplingParams(max_tokens=1), priority=Priority.CRITICAL)
    first = engine.step()
    assert [o.request_id for o in first] == ["crit"]


def test_generate_returns_completions_in_order(tok: Any) -> None:
    engine = make_engine(tok)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 6)]
    outs = engine.generate([PROMPTS[0], PROMPTS[1]], params)
    assert [o.token_ids for o in outs] == [
        reference(PROMPTS[0], 3, len(tok)),
        reference(PROMPTS[1], 6, len(tok)),
    ]
    assert outs[1].text == tok.decode(outs[1].token_ids)
    engine.add_request("x", PROMPTS[0])
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate(["Hello"])


def test_urgent_request_preempts_and_the_victim_recomputes_the_same_tokens(tok: Any) -> None:
    # 6 blocks of 4: "low" (12-token prompt) holds 4 after a step; "crit" needs 3, finds 2.
    # (With background_yields "low" would sit out crit's prefill and leave it the blocks.)
    engine = make_engine(tok, num_kv_blocks=6, background_yields=False)
    low, crit = list(range(10, 22)), list(range(50, 62))
    engine.add_request(
        "low", low, SamplingParams(temperature=0, max_tokens=12), priority=Priority.BATCH
    )
    outs: dict[str, list[RequestOutput]] = {}
    for out in engine.step():
        outs.setdefault(out.request_id, []).append(out)
    engine.add_request(
        "crit", crit, SamplingParams(temperature=0, max_tokens=12), priority=Priority.CRITICAL
    )
    preemptions, finished = [], []
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
            finished += [out.request_id] if out.finished else []
        preemptions.append(engine.last_step_stats.num_preemptions)
    assert preemptions[0] == 1 and sum(preemptions) == 1  # at once, once
    assert tokens_of(outs["low"]) == reference(low, 12, len(tok))
    assert tokens_of(outs["crit"]) == reference(crit, 12, len(tok))
    assert finished == ["crit", "low"]
    assert engine.block_manager.num_used_blocks == 0
