"""Sampler: greedy, filters, and seeded draws that depend only on (seed, output index)."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from tokenfleet.worker.engine.request import SamplingParams
from tokenfleet.worker.engine.sampler import Sampler, token_seed

PROBS = [0.5, 0.3, 0.2, 0.0]


def logits_of(probs: list[float], rows: int = 1) -> torch.Tensor:
    row = [math.log(p) if p > 0 else -1e9 for p in probs]
    return torch.tensor([row] * rows, dtype=torch.float32)


def test_greedy_takes_the_argmax_per_row() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    assert Sampler(seed=0).sample(logits, [greedy, greedy], [0, 0]) == [1, 0]


def test_seeded_row_is_independent_of_its_batch() -> None:
    torch.manual_seed(0)
    mine = torch.randn(64)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler(seed=1).sample(mine.unsqueeze(0), [seeded], [i])[0] for i in range(20)]
    batched = []
    for i in range(20):
        others = torch.randn(3, 64)
        logits = torch.cat([others[:2], mine.unsqueeze(0), others[2:]])
        params = [SamplingParams(), SamplingParams(seed=9), seeded, SamplingParams(top_k=5)]
        tokens = Sampler(seed=i + 100).sample(logits, params, [7, i, i, 3])
        batched.append(tokens[2])
    assert alone == batched
    assert len(set(alone)) > 3  # the index changes the draw


def test_seeded_draws_follow_the_distribution() -> None:
    sampler = Sampler(seed=0)
    logits = logits_of(PROBS)
    counts = collections.Counter(
        sampler.sample(logits, [SamplingParams(seed=s)], [0])[0] for s in range(3000)
    )
    assert counts[3] == 0
    for token, p in enumerate(PROBS[:3]):
        assert abs(counts[token] / 3000 - p) < 0.04


def test_top_k_and_top_p_remove_the_tail() -> None:
    sampler = Sampler(seed=0)
    logits = logits_of(PROBS)
    top_k = {sampler.sample(logits, [SamplingParams(top_k=2, seed=s)], [0])[0] for s in range(300)}
    top_p = {
        sampler.sample(logits, [SamplingParams(top_p=0.6, seed=s)], [0])[0] for s in range(300)
    }
    assert top_k == {0, 1}
    assert top_p == {0, 1}  # 0.5 < 0.6: the second token is still needed; the third is not
    top_1 = {sampler.sample(logits, [SamplingParams(top_k=1, seed=s)], [0])[0] for s in range(50)}
    assert top_1 == {0}


def test_temperature_sharpens() -> None:
    sampler = Sampler(seed=0)
    logits = logits_of(PROBS)
    cold = [
        sampler.sample(logits, [SamplingParams(temperature=0.05, seed=s)], [0])[0]
        for s in range(200)
    ]
    assert cold.count(0) >= 199


def test_unseeded_rows_use_the_engine_seed() -> None:
    logits = logits_of(PROBS, rows=8)
    params = [SamplingParams()] * 8
    assert Sampler(seed=5).sample(logits, params, [0] * 8) == Sampler(seed=5).sample(
        logits, params, [0] * 8
    )


def test_token_seed_mixes_seed_and_index() -> None:
    seeds = {token_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= x < 2**63 for x in seeds)


def test_shape_mismatch_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="do not match"):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()], [0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": "x"}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids"),
    ],
)
def test_sampling_params_are_validated(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_normalise_sequences() -> None:
    p = SamplingParams(stop="END", stop_token_ids=[3, 4])
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4)
