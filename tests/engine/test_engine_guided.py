"""Constrained decoding and logprobs in the engine, over a fake runner whose logits are random
(seeded by the context): whatever the "model" prefers, every output must match its grammar.

The tokenizer is the tiny Llama's byte-level BPE (a real fast tokenizer llguidance wraps); the
real model's outputs are checked in tests/models/test_structured_real.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from test_engine_fake import drain

from tokenfleet.shared.schema import Constraint
from tokenfleet.worker.engine.batch import StepBatch
from tokenfleet.worker.engine.engine import Engine, EngineConfig, RequestOutput
from tokenfleet.worker.engine.guided import GRAMMAR_MISMATCH, GRAMMAR_UNSATISFIABLE
from tokenfleet.worker.engine.request import FinishReason, SamplingParams


class RandomRunner:
    """Logits drawn from a generator seeded by the whole context (so a request resumed from
    its first tokens sees the same logits as the original run); records what it returned."""

    def __init__(self, vocab_size: int, *, num_kv_blocks: int = 256, block_size: int = 4) -> None:
        self.vocab_size = vocab_size
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = 4096
        self.eos_token_ids = frozenset({2})
        self.device = torch.device("cpu")
        self.contexts: dict[str, list[int]] = {}
        self.returned: list[tuple[list[int], torch.Tensor]] = []

    def execute(
        self, batch: StepBatch, interrupt: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        rows = []
        for seq in batch.seqs:
            ctx = self.contexts.setdefault(seq.request_id, [])
            del ctx[seq.start_pos :]
            ctx.extend(seq.token_ids)
            if seq.needs_logits:
                digest = hashlib.blake2b(repr(ctx).encode(), digest_size=8).digest()
                gen = torch.Generator().manual_seed(int.from_bytes(digest) >> 1)
                row = torch.randn(self.vocab_size, generator=gen) * 3
                self.returned.append((list(ctx), row.clone()))
                rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, self.vocab_size)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def make_engine(tok: Any, **config: Any) -> tuple[Engine, RandomRunner]:
    runner = RandomRunner(len(tok))
    config.setdefault("max_wait_s", None)
    return Engine.from_runner(runner, tok, EngineConfig(block_size=4, **config)), runner


def text_of(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


def finish_of(outs: list[RequestOutput]) -> RequestOutput:
    (last,) = [o for o in outs if o.finished]
    assert last is outs[-1]
    return last


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {
            "type": "array",
            "items": {"enum": ["a", "b", "c"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "nested": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "nested"],
    "additionalProperties": False,
}


def grammar(kind: str, spec: Any = None) -> str:
    return Constraint(kind, spec).check()


def test_every_constrained_output_matches_its_grammar(tok: Any) -> None:
    engine, _ = make_engine(tok)
    specs = {
        "json": ("json_schema", SCHEMA),
        "regex": ("regex", r"[a-c]{2}-[0-9]{3}"),
        "choice": ("choice", ["red", "green", "blue  sky"]),
        "lark": ("grammar", 'start: "x" NUM\nNUM: /[0-9]{1,4}/'),
    }
    for name, (kind, spec) in specs.items():
        for i in range(4):
            params = SamplingParams(
                temperature=1.0, seed=i, max_tokens=400, grammar=grammar(kind, spec)
            )
            engine.add_request(f"{name}-{i}", [5, 6, 7 + i], params)
    outs = drain(engine)
    for rid, out in outs.items():
        text, end = text_of(out), finish_of(out)
        assert end.finish_reason is FinishReason.STOP, (rid, text, end)
        if rid.startswith("json"):
            jsonschema.validate(json.loads(text), SCHEMA)
        elif rid.startswith("regex"):
            assert re.fullmatch(r"[a-c]{2}-[0-9]{3}", text), text
        elif rid.startswith("choice"):
            assert text in ("red", "green", "blue  sky"), text
        else:
            assert re.fullmatch(r"x[0-9]{1,4}", text), text
    stats = engine.grammar_compiler().stats
    assert (stats.num_compiled, stats.num_cached) == (4, 12)  # each grammar once


def test_a_constrained_request_ends_length_at_max_tokens(tok: Any) -> None:
    engine, _ = make_engine(tok)
    params = SamplingParams(temperature=0, max_tokens=3, grammar=grammar("regex", "[a-z]{20}"))
    engine.add_request("r", [5, 6], params)
    out = drain(engine)["r"]
    assert finish_of(out).finish_reason is FinishReason.LENGTH
    assert finish_of(out).num_output_tokens == 3


def test_a_grammar_no_token_can_continue_ends_error_with_its_code(tok: Any) -> None:
    engine, _ = make_engine(tok)
    ok = SamplingParams(temperature=0, max_tokens=5)
    engine.add_request("free", [5, 6], ok)
    engine.add_request("dead", [5, 6], SamplingParams(grammar=grammar("regex", "[a&&b]")))
    outs = drain(engine)
    end = finish_of(outs["dead"])
    assert end.finish_reason is FinishReason.ERROR
    assert end.error_code == GRAMMAR_UNSATISFIABLE and "grammar" in (end.error_message or "")
    assert finish_of(outs["free"]).num_output_tokens == 5  # its neighbour was unaffected


def test_a_resumed_request_re_advances_its_grammar(tok: Any) -> None:
    """The second half of a request resumed from its first tokens (another worker's) is the
    same as the uninterrupted run's, and valid: the matcher was advanced over them."""
    g = grammar("json_schema", SCHEMA)
    whole_engine, _ = make_engine(tok)
    whole_engine.add_request("r", [5, 6, 7], SamplingParams(seed=7, max_tokens=400, grammar=g))
    whole = drain(whole_engine)["r"]
    ids = [t for o in whole for t in o.new_token_ids]
    assert len(ids) > 6
    for cut in (1, len(ids) // 2, len(ids) - 1):
        engine, _ = make_engine(tok)
        params = SamplingParams(seed=7, max_tokens=400, grammar=g)
        engine.add_request("r", [5, 6, 7], params, resume_output_ids=ids[:cut])
        rest = drain(engine)["r"]
        assert rest[0].first_index == cut
        assert [t for o in rest for t in o.new_token_ids] == ids[cut:]
        jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), SCHEMA)


def test_resumed_tokens_the_grammar_refuses_end_error(tok: Any) -> None:
    engine, _ = make_engine(tok)
    bad = tok.encode("zz", add_special_tokens=False)
    params = SamplingParams(grammar=grammar("regex", "[0-9]+"))
    engine.add_request("r", [5, 6], params, resume_output_ids=bad)
    end = finish_of(drain(engine)["r"])
    assert (end.finish_reason, end.error_code) == (FinishReason.ERROR, GRAMMAR_MISMATCH)


def test_resumed_tokens_that_complete_the_grammar_end_it_stop(tok: Any) -> None:
    engine, _ = make_engine(tok)
    done = tok.encode("red", add_special_tokens=False)
    params = SamplingParams(grammar=grammar("choice", ["red", "green"]))
    engine.add_request("r", [5, 6], params, resume_output_ids=done)
    out = drain(engine)["r"]
    assert [o.new_token_ids for o in out] == [[]]
    assert finish_of(out).finish_reason is FinishReason.STOP


def test_preemption_by_recompute_keeps_the_matcher(tok: Any) -> None:
    engine, _ = make_engine(tok, max_num_seqs=2)
    g = grammar("json_schema", SCHEMA)
    for i in range(3):
        engine.add_request(
            f"r{i}", [5, 6, 7 + i], SamplingParams(seed=i, max_tokens=400, grammar=g)
        )
    outs: dict[str, list[RequestOutput]] = {}
    preempted = False
    for _ in range(20_000):
        if not engine.has_unfinished():
            break
        running = list(engine.scheduler.running)
        if running and not preempted and running[-1].num_output_tokens > 3:
            engine.scheduler.preempt(running[-1])
            preempted = True
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert preempted
    for done in outs.values():
        assert finish_of(done).finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(text_of(done)), SCHEMA)


def test_aborting_a_request_whose_grammar_is_compiling_ends_it_once(tok: Any) -> None:
    engine, _ = make_engine(tok)
    engine.add_request("r", [5, 6], SamplingParams(grammar=grammar("json_schema", SCHEMA)))
    assert engine.capacity().num_waiting == 1
    assert engine.abort("r")
    assert not engine.abort("r")
    out = drain(engine)["r"]
    assert [(o.finished, o.finish_reason) for o in out] == [(True, FinishReason.ABORT)]


def test_logprobs_are_the_log_softmax_of_the_raw_logits(tok: Any) -> None:
    engine, runner = make_engine(tok)
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=6, logprobs=True, top_logprobs=3)
    engine.add_request("r", [5, 6], params)
    constrained = SamplingParams(
        temperature=0, max_tokens=6, logprobs=True, grammar=grammar("regex", "[0-9]+")
    )
    engine.add_request("g", [5, 9], constrained)
    outs = drain(engine)
    by_context = {tuple(ctx): row for ctx, row in runner.returned}
    for rid, prompt in (("r", [5, 6]), ("g", [5, 9])):
        context = list(prompt)
        for out in outs[rid]:
            assert out.new_logprobs is not None or not out.new_token_ids
            for token_id, lp in zip(out.new_token_ids, out.new_logprobs or [], strict=True):
                expected = by_context[tuple(context)].log_softmax(-1)
                assert lp.chosen.token_id == token_id
                assert lp.chosen.logprob == pytest.approx(float(expected[token_id]), abs=1e-5)
                assert lp.chosen.bytes == tok.decode([token_id]).encode() or lp.chosen.bytes
                if rid == "r":
                    top = expected.topk(3)
                    assert [e.token_id for e in lp.top] == top.indices.tolist()
                    assert [e.logprob for e in lp.top] == pytest.approx(top.values.tolist())
                else:  # raw logits: the grammar forced a digit, not the model's favourite
                    assert lp.top == []
                context.append(token_id)
