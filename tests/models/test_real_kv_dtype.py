"""SmolLM2 with its KV cache in 16 bits (issue 31): greedy output equal to a float32 cache's on
the real-model prompts, except at near-ties, unquantized and as int4.

The 16-bit cache (``kv_dtype="auto"`` on a CPU: float16) rounds each stored K/V once, to 11
significant bits; attention still computes in float32. Measured over 96 new tokens of these
eight prompts, float16 storage moved a chosen token's logprob by at most 0.006 (bfloat16: 0.026)
and changed no greedy choice unquantized. As int4 it flipped four of the eight answers, each at a
near-tie (float32 gaps 0.008 to 0.035): the int4 kernels take their activations in bfloat16, so
any small change to a hidden state can move it across a bfloat16 rounding step (the int4 path is
deterministic: two float32-cache runs agree exactly). A near-tie
here is a position where the float32 cache's own two candidates are within
``QUANT_TIE_TOLERANCE`` (the near-tie rule of test_real_quantized.py); a cache that stored the
wrong rows or dtype diverges at once by whole logits. Once a sequence diverges, the rest of it is
not comparable and is not compared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import MAX_NEW_TOKENS
from test_real_quantized import QUANT_TIE_TOLERANCE, first_divergence

from tokenfleet.worker.engine.engine import Engine, EngineConfig
from tokenfleet.worker.engine.outputs import TokenLogprobs
from tokenfleet.worker.engine.request import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

TOP = 5  # alternatives the float32 run reports at each position


def greedy_with_logprobs(
    engine: Engine, prompts: list[list[int]]
) -> list[tuple[list[int], list[TokenLogprobs]]]:
    """All ``prompts`` in one batch, greedy: each answer's tokens and their top-``TOP``
    logprobs."""
    params = SamplingParams(
        temperature=0, max_tokens=MAX_NEW_TOKENS, logprobs=True, top_logprobs=TOP
    )
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    got: dict[str, tuple[list[int], list[TokenLogprobs]]] = {rid: ([], []) for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.new_logprobs or [])
    return [got[rid] for rid in ids]


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_greedy_with_a_16_bit_kv_cache_equals_float32_except_near_ties(
    smollm2_dir: Path, chat_prompts: list[list[int]], quantization: str
) -> None:
    answers = {}
    for kv_dtype in ("float32", "auto"):
        config = EngineConfig(
            device="cpu", quantization=quantization, kv_dtype=kv_dtype, num_kv_blocks=256, seed=0
        )
        engine = Engine(smollm2_dir, config)
        runner: Any = engine.runner  # a ModelRunner
        assert runner.dtype == torch.float32 and runner.quantization.applied == quantization
        assert {t.dtype for t in runner.cache.layers} == {
            torch.float32 if kv_dtype == "float32" else torch.float16
        }
        answers[kv_dtype] = greedy_with_logprobs(engine, chat_prompts)
    # real answers, mostly full length (as test_real_model_equivalence.py checks HF's)
    assert sum(len(ref) for ref, _ in answers["float32"]) >= 6 * MAX_NEW_TOKENS
    same, ties, drift = 0, [], 0.0
    for (ref, ref_lps), (ours, lps) in zip(answers["float32"], answers["auto"], strict=True):
        k = first_divergence(ours, ref)
        for a, b in zip(ref_lps[:k], lps[:k], strict=False):  # the same tokens so far
            drift = max(drift, abs(a.chosen.logprob - b.chosen.logprob))
        if k is None:
            same += 1
            continue
        alternatives = {alt.token_id: alt.logprob for alt in ref_lps[k].top}
        assert ours[k] in alternatives, (
            f"token {k}: the 16-bit cache chose {ours[k]}, not among the float32 cache's top "
            f"{TOP} {sorted(alternatives)}"
        )
        gap = alternatives[ref[k]] - alternatives[ours[k]]  # logprob gaps are logit gaps
        assert gap <= QUANT_TIE_TOLERANCE, (
            f"token {k}: the 16-bit cache chose {ours[k]}, float32 {ref[k]}; float32's gap "
            f"between them is {gap:.4g}, more than a near-tie"
        )
        ties.append(f"token {k}: gap {gap:.3g}")
    if quantization == "none":
        # rounding, not a wrong cache: logprobs move by hundredths at most (as int4 the int8
        # LM head's approximate tail enters the logprobs' normaliser: not compared)
        assert drift < 0.05, drift
        assert same >= len(chat_prompts) - 2, ties  # measured: all eight equal
    else:
        assert same >= 3, ties  # measured: four of eight; as test_real_quantized.py allows
