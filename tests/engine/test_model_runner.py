"""ModelRunner: paged, packed forwards must reproduce Hugging Face's own attention."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenfleet.worker.engine.batch import ScheduledSeq, StepBatch
from tokenfleet.worker.engine.model_runner import (
    ModelRunner,
    UnsupportedModel,
    _similar_width_groups,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 64
# Logits against transformers' own attention: float32 storage differs by reordering only; a
# 16-bit cache rounds every stored K/V once (relative 2^-11 for float16, 2^-8 for bfloat16), which
# moved these tiny models' logits by at most 0.0037 (float16) and 0.036 (bfloat16): the
# tolerances are about 3x that. The attention functions themselves are checked exactly on the
# stored values (test_*_attention_matches_reference).
ATOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 1e-1}


@pytest.fixture(autouse=True)
def _few_threads() -> Iterator[None]:
    """One torch thread: the suite shares a small machine; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(
    scope="module",
    params=[(flavour, kv) for kv in ATOL for flavour in ("llama", "qwen2")],
    ids=lambda param: "-".join(param),
)
def tiny_pair(request: pytest.FixtureRequest) -> tuple[ModelRunner, torch.nn.Module]:
    """(runner, HF model with its default attention) for each tiny flavour and KV storage dtype
    (``runner.kv_dtype``; compute is float32 throughout)."""
    from transformers import AutoModelForCausalLM

    flavour, kv_dtype = request.param
    model_dir = request.getfixturevalue(f"tiny_{flavour}_dir")
    runner = ModelRunner(
        model_dir, block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, kv_dtype=kv_dtype
    )
    assert runner.kv_dtype == getattr(torch, kv_dtype) and runner.dtype == torch.float32
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return runner, reference


def atol(runner: ModelRunner) -> float:
    """The logit tolerance against transformers for ``runner``'s KV storage dtype."""
    return ATOL[str(runner.kv_dtype).removeprefix("torch.")]


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Logits of every position of ``tokens``, one unpadded sequence, transformers' attention."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, vocab) for _ in range(length)]


def shuffled_blocks(seed: int) -> list[int]:
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    return blocks


def run_chunks(
    runner: ModelRunner, tokens: list[int], bounds: list[int], table: list[int]
) -> dict[int, torch.Tensor]:
    """Feed ``tokens`` in chunks ending at each of ``bounds``; logits keyed by last position."""
    out, start = {}, 0
    for end in bounds:
        seq = ScheduledSeq("r", tokens[start:end], start, table, needs_logits=True)
        out[end - 1] = runner.execute(StepBatch([seq]))[0]
        start = end
    return out


def test_single_chunk_matches_hf(tiny_pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, hf = tiny_pair
    tokens = prompt(0, 23, runner.vocab_size)
    got = run_chunks(runner, tokens, [23], shuffled_blocks(0))
    torch.testing.assert_close(got[22], hf_logits(hf, tokens)[22], atol=atol(runner), rtol=0)


def test_chunked_prefill_and_decode_match_hf(
    tiny_pair: tuple[ModelRunner, torch.nn.Module],
) -> None:
    runner, hf = tiny_pair
    tokens = prompt(1, 30, runner.vocab_size)
    # Chunks that start and end mid-block, a whole block, then single-token decodes.
    got = run_chunks(runner, tokens, [3, 8, 13, 14, 22, 27, 28, 29, 30], shuffled_blocks(1))
    ref = hf_logits(hf, tokens)
    for pos, logits in got.items():
        torch.testing.assert_close(
            logits, ref[pos], atol=atol(runner), rtol=0, msg=f"position {pos}"
        )


def test_packed_mixed_batch_matches_hf(tiny_pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    """Decodes and prefill chunks of different sequences share one forward; rows come back in
    batch order even when prefill chunks are listed before decodes."""
    runner, hf = tiny_pair
    vocab = runner.vocab_size
    blocks = shuffled_blocks(2)
    tables = {name: blocks[i * 10 : (i + 1) * 10] for i, name in enumerate("abcd")}
    tokens = {
        name: prompt(10 + i, n, vocab)
        for i, (name, n) in enumerate(zip("abcd", (10, 17, 12, 6), strict=True))
    }
    refs = {name: hf_logits(hf, toks) for name, toks in tokens.items()}

    def seq(name: str, start: int, end: int, needs_logits: bool = True) -> ScheduledSeq:
        return ScheduledSeq(name, tokens[name][start:end], start, tables[name], needs_logits)

    steps = [
        [seq("a", 0, 8), seq("b", 0, 6, needs_logits=False)],
        [seq("b", 6, 16), seq("a", 8, 9), seq("c", 0, 4, needs_logits=False)],
        [seq("c", 4, 11), seq("d", 0, 5), seq("b", 16, 17)],
        [seq("c", 11, 12), seq("a", 9, 10), seq("d", 5, 6)],  # decodes only
    ]
    for step in steps:
        logits = runner.execute(StepBatch(step))
        wanted = [s for s in step if s.needs_logits]
        assert logits.shape == (len(wanted), runner.vocab_size)
        assert logits.dtype == torch.float32
        for row, s in zip(logits, wanted, strict=True):
            torch.testing.assert_close(
                row, refs[s.request_id][s.end_pos - 1], atol=atol(runner), rtol=0
            )


def test_decodes_of_very_different_lengths(tiny_pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    """Decodes are batched by similar context length (padding stays bounded); all still match."""
    runner, hf = tiny_pair
    lengths = [40, 2, 23, 3, 9]
    blocks = shuffled_blocks(9)
    tokens, tables, offset = [], [], 0
    for i, n in enumerate(lengths):
        tokens.append(prompt(20 + i, n + 1, runner.vocab_size))
        size = n // BLOCK_SIZE + 1
        tables.append(blocks[offset : offset + size])
        offset += size
        run_chunks(runner, tokens[i], [n], tables[i])
    step = [
        ScheduledSeq(str(i), [t[n]], n, tables[i], True)
        for i, (t, n) in enumerate(zip(tokens, lengths, strict=True))
    ]
    logits = runner.execute(StepBatch(step))
    for row, toks in zip(logits, tokens, strict=True):
        torch.testing.assert_close(row, hf_logits(hf, toks)[-1], atol=atol(runner), rtol=0)


def test_similar_width_groups() -> None:
    assert _similar_width_groups([]) == []
    assert _similar_width_groups([3, 3, 3]) == [(0, 3)]
    assert _similar_width_groups([1, 1, 3, 6, 11, 12]) == [(0, 2), (2, 4), (4, 6)]


def test_shared_prefix_blocks(tiny_pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    """A sequence that starts at start_pos > 0 on blocks another sequence computed."""
    runner, hf = tiny_pair
    vocab = runner.vocab_size
    shared = prompt(3, 2 * BLOCK_SIZE, vocab)
    first = [*shared, *prompt(4, 5, vocab)]
    second = [*shared, *prompt(5, 7, vocab)]
    blocks = shuffled_blocks(3)
    table_first = [blocks[0], blocks[1], blocks[2], blocks[3]]
    table_second = [blocks[0], blocks[1], blocks[4], blocks[5]]
    run_chunks(runner, first, [len(first)], table_first)
    start = len(shared)
    step = StepBatch([ScheduledSeq("second", second[start:], start, table_second, True)])
    got = runner.execute(step)[0]
    torch.testing.assert_close(got, hf_logits(hf, second)[-1], atol=atol(runner), rtol=0)


def test_reversed_block_table(tiny_pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, hf = tiny_pair
    tokens = prompt(6, 19, runner.vocab_size)
    table = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 7, -1))
    got = run_chunks(runner, tokens, [10, 18, 19], table)
    ref = hf_logits(hf, tokens)
    for pos, logits in got.items():
        torch.testing.assert_close(logits, ref[pos], atol=atol(runner), rtol=0)


def test_no_logits_wanted_returns_empty(tiny_pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, _ = tiny_pair
    seq = ScheduledSeq("r", [5, 6, 7], 0, [0], needs_logits=False)
    assert runner.execute(StepBatch([seq])).shape == (0, runner.vocab_size)
    assert runner.execute(StepBatch([])).shape == (0, runner.vocab_size)


def test_attributes(tiny_llama_dir: Path) -> None:
    from transformers import AutoConfig

    runner = ModelRunner(tiny_llama_dir, kv_memory_bytes=1 << 20, block_size=8)
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    per_block = ModelRunner.kv_bytes_per_block(config, 8, torch.float16)  # a CPU's default
    assert runner.kv_dtype == torch.float16
    assert runner.num_kv_blocks == (1 << 20) // per_block
    assert sum(t.numel() * t.element_size() for t in runner.cache.layers) == (
        runner.num_kv_blocks * per_block
    )
    assert runner.max_model_len == min(config.max_position_embeddings, runner.num_kv_blocks * 8)
    assert runner.vocab_size == config.vocab_size
    assert runner.eos_token_ids == frozenset({2, 4})  # <|endoftext|> and <|im_end|>
    assert runner.dtype == torch.float32
    assert runner.device == torch.device("cpu")
    assert runner.model.config._attn_implementation == "tokenfleet_paged"


def test_invalid_steps_are_refused(tiny_pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, _ = tiny_pair
    bad = [
        ScheduledSeq("r", [5, 6], 0, [NUM_BLOCKS], True),  # block id out of range
        ScheduledSeq("r", [5, 6], 0, [-1], True),
        ScheduledSeq("r", [5] * 5, 0, [0], True),  # table too short for 5 tokens
        ScheduledSeq("r", [], 0, [0], True),
        ScheduledSeq("r", [5], runner.max_model_len, list(range(NUM_BLOCKS)), True),
    ]
    for seq in bad:
        with pytest.raises(ValueError):
            runner.execute(StepBatch([seq]))


def save_random_model(config: object, path: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


TINY: dict[str, Any] = {"vocab_size": 101, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _mistral_sliding() -> object:
    from transformers import MistralConfig

    return MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=5, **TINY,
    )  # fmt: skip


def _gemma2_softcap() -> object:
    from transformers import Gemma2Config

    return Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=5, attn_logit_softcapping=2.0,
        query_pre_attn_scalar=24, **TINY,
    )  # fmt: skip


def _gemma3_text() -> object:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=6, **TINY,
    )  # fmt: skip


def _gpt2() -> object:
    from transformers import GPT2Config

    return GPT2Config(n_embd=64, n_layer=2, n_head=4, **TINY)


@pytest.mark.parametrize(
    "make_config",
    [_mistral_sliding, _gemma2_softcap, _gemma3_text, _gpt2],
    ids=["mistral-sliding-window", "gemma2-softcap-sliding", "gemma3-text", "gpt2"],
)
def test_other_architectures_match_hf_eager(
    make_config: Callable[[], object], tmp_path: Path
) -> None:
    """Sliding windows (5–6 tokens, contexts of 22) and Gemma2's logit softcap are honoured,
    in prefill chunks, single-token decodes, and both packed into one step."""
    from transformers import AutoModelForCausalLM

    path = save_random_model(make_config(), tmp_path / "model")
    runner = ModelRunner(path, block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    first, second = prompt(7, 22, 101), prompt(8, 20, 101)
    ref_first, ref_second = hf_logits(hf, first), hf_logits(hf, second)
    blocks = shuffled_blocks(7)
    table_first, table_second = blocks[:8], blocks[8:16]
    got = run_chunks(runner, first, [9, 10, 17, 18, 19, 22], table_first)
    for pos, logits in got.items():
        torch.testing.assert_close(
            logits, ref_first[pos], atol=atol(runner), rtol=0, msg=f"pos {pos}"
        )
    # The second sequence prefills in chunks while the first keeps "decoding" its own tokens
    # again from position 12 on (rewriting identical K/V), packed in the same steps.
    start_second = 0
    for pos_first, end_second in zip((12, 13, 14), (7, 15, 20), strict=True):
        step = StepBatch(
            [
                ScheduledSeq(
                    "2", second[start_second:end_second], start_second, table_second, True
                ),
                ScheduledSeq("1", [first[pos_first]], pos_first, table_first, True),
            ]
        )
        logits = runner.execute(step)
        torch.testing.assert_close(logits[0], ref_second[end_second - 1], atol=atol(runner), rtol=0)
        torch.testing.assert_close(logits[1], ref_first[pos_first], atol=atol(runner), rtol=0)
        start_second = end_second


def test_model_that_never_calls_the_function_is_refused(tmp_path: Path) -> None:
    """Bloom loads with a custom attn_implementation but never calls it: the smoke forward sees."""
    from transformers import BloomConfig

    path = save_random_model(BloomConfig(hidden_size=64, n_layer=2, n_head=4, **TINY), tmp_path)
    with pytest.raises(UnsupportedModel, match=r"'bloom'.*never call"):
        ModelRunner(path, num_kv_blocks=8)


def test_model_with_its_own_attention_table_is_refused(tmp_path: Path) -> None:
    from transformers import FalconConfig

    config = FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **TINY)
    path = save_random_model(config, tmp_path)
    with pytest.raises(UnsupportedModel, match=r"'falcon'.*AttentionInterface"):
        ModelRunner(path, num_kv_blocks=8)


def test_smoke_forward_detects_a_layer_that_skips_the_function(
    tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If one layer silently used another attention function, loading must fail."""
    from transformers.models.qwen2 import modeling_qwen2

    original = modeling_qwen2.Qwen2Attention.forward

    def forward(self, *args, **kwargs):
        if self.layer_idx == 1:
            self.config._attn_implementation = "sdpa"
            try:
                return original(self, *args, **kwargs)
            finally:
                self.config._attn_implementation = "tokenfleet_paged"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(modeling_qwen2.Qwen2Attention, "forward", forward)
    with pytest.raises(UnsupportedModel, match=r"layers \[0\], expected each of 0\.\.1 once"):
        ModelRunner(tiny_qwen2_dir, num_kv_blocks=8)


def random_cache(kv_dtype: torch.dtype, kv_heads: int, head_dim: int, bs: int) -> Any:
    """A one-layer ``PagedKVCache`` storing ``kv_dtype``, computing float32, random contents."""
    from tokenfleet.worker.engine.paged_attention import PagedKVCache

    cache = PagedKVCache(
        num_layers=1,
        num_blocks=NUM_BLOCKS,
        block_size=bs,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=kv_dtype,
        device=torch.device("cpu"),
        compute_dtype=torch.float32,
    )
    layer = cache.layers[0]
    layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(0)))
    assert layer.dtype == kv_dtype
    return cache


def reference_attention(
    layer: torch.Tensor,
    table: list[int],
    query: torch.Tensor,
    pos: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """``[heads, head_dim]``: per-head float32 softmax attention of ``query`` (``[heads,
    head_dim]``) at ``pos`` over the stored keys it may see, the stored values widened exactly."""
    _, kv_heads, _, bs, _ = layer.shape
    group = query.shape[0] // kv_heads
    visible = [p for p in range(pos + 1) if window is None or p > pos - window]
    out = []
    for h in range(query.shape[0]):
        kvh = h // group
        k = torch.stack([layer[0, kvh, table[p // bs], p % bs] for p in visible]).float()
        v = torch.stack([layer[1, kvh, table[p // bs], p % bs] for p in visible]).float()
        scores = k @ query[h] * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out.append(torch.softmax(scores, dim=0) @ v)
    return torch.stack(out)


KV_STORAGE = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("kv_dtype", KV_STORAGE, ids=str)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("enable_gqa", [True, False], ids=["sdpa-gqa", "kv-repeated"])
def test_prefill_chunk_attention_matches_reference(
    window: int | None,
    softcap: float | None,
    enable_gqa: bool,
    kv_dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every token of a chunk that starts mid-block (4-D SDPA with ``enable_gqa`` or, as on torch
    < 2.5, with K/V repeated; and the softcap path) equals a per-head softmax over its visible
    keys, for grouped-query heads; with a 16-bit cache, exactly over the stored (rounded) K/V."""
    from tokenfleet.worker.engine import paged_attention
    from tokenfleet.worker.engine.paged_attention import PrefillChunk, _prefill_attention

    monkeypatch.setattr(paged_attention, "SDPA_ENABLE_GQA", enable_gqa)

    kv_heads, heads, head_dim, bs, start, m = 2, 6, 8, 4, 6, 9
    cache = random_cache(kv_dtype, kv_heads, head_dim, bs)
    gen = torch.Generator().manual_seed(1)
    layer = cache.layers[0]
    table = shuffled_blocks(3)[: -(-(start + m) // bs)]
    chunk = PrefillChunk(
        token_start=2,
        token_end=2 + m,
        start_pos=start,
        num_blocks=len(table),
        rows=cache.gather_rows(torch.tensor(table)),
    )
    query = torch.randn(1, m + 5, heads, head_dim, generator=gen).transpose(1, 2)  # strided
    scale = 0.3
    got = _prefill_attention(chunk, cache, layer, query, scale, window, softcap)
    assert got.dtype == torch.float32
    for t in range(m):
        want = reference_attention(
            layer, table, query[0, :, 2 + t], start + t, scale, window, softcap
        )
        torch.testing.assert_close(got[t], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_dtype", KV_STORAGE, ids=str)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_decode_group_attention_matches_reference(
    window: int | None, softcap: float | None, kv_dtype: torch.dtype
) -> None:
    """A decode group of sequences of different context lengths on shuffled blocks (padded
    tables) equals the per-head reference over each one's stored K/V, whatever the storage."""
    from tokenfleet.worker.engine.paged_attention import DecodeGroup, _decode_attention

    kv_heads, heads, head_dim, bs = 2, 6, 8, 4
    cache = random_cache(kv_dtype, kv_heads, head_dim, bs)
    layer = cache.layers[0]
    positions = [9, 13, 4]  # the new token's position in each sequence
    width = max(positions) // bs + 1
    blocks = shuffled_blocks(4)
    tables = [blocks[i * width : i * width + p // bs + 1] for i, p in enumerate(positions)]
    padded = [t + [t[0]] * (width - len(t)) for t in tables]
    group = DecodeGroup(
        token_start=1,
        num_seqs=len(positions),
        num_blocks=width,
        rows=cache.gather_rows(torch.tensor(padded).view(-1)),
        positions=torch.tensor(positions),
    )
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(1, heads, len(positions) + 2, head_dim, generator=gen)
    scale = 0.3
    got = _decode_attention(group, cache, layer, query, scale, window, softcap)
    assert got.shape == (kv_heads, len(positions), heads // kv_heads, head_dim)
    assert got.dtype == torch.float32
    for i, (pos, table) in enumerate(zip(positions, tables, strict=True)):
        want = reference_attention(layer, table, query[0, :, 1 + i], pos, scale, window, softcap)
        torch.testing.assert_close(
            got[:, i].reshape(heads, head_dim), want, atol=1e-5, rtol=0, msg=f"sequence {i}"
        )


@pytest.mark.parametrize("kv_dtype", KV_STORAGE, ids=str)
def test_write_rounds_once_into_the_storage_dtype(kv_dtype: torch.dtype) -> None:
    """New K/V land in their rows rounded to the storage dtype; float16 storage saturates at its
    largest value instead of overflowing to inf (which would make the softmax NaN)."""
    cache = random_cache(kv_dtype, 2, 8, 4)
    layer = cache.layers[0]
    rows = cache.write_rows(torch.tensor([5, 17]))  # K rows then V rows of slots 5 and 17
    values = torch.randn(len(rows), 8, generator=torch.Generator().manual_seed(3))
    values[0, 0], values[1, 1] = 1e6, -1e6
    cache.write(layer, rows, values)
    stored = layer.view(-1, 8)[rows]
    limit = torch.finfo(kv_dtype).max
    want = values.clamp(-limit, limit).to(kv_dtype)
    assert torch.equal(stored, want)
    assert torch.equal(layer[0, 1, 17 // 4, 17 % 4], want[3])  # K of head 1, slot 17


def test_auto_dtype_follows_the_model_where_the_device_computes_it_well() -> None:
    from types import SimpleNamespace

    from tokenfleet.worker.engine.model_runner import _resolve_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for declared in (torch.float32, torch.bfloat16, torch.float16, None, "bfloat16"):
        cfg = SimpleNamespace(dtype=declared)
        assert _resolve_dtype("auto", cpu, cfg) == torch.float32  # 16-bit CPU matmuls are slow
    assert _resolve_dtype("auto", cuda, SimpleNamespace(dtype=torch.float16)) == torch.float16
    assert _resolve_dtype("auto", cuda, SimpleNamespace(dtype=torch.float32)) == torch.float32
    assert _resolve_dtype("bfloat16", cpu, None) == torch.bfloat16  # explicit wins
    with pytest.raises(ValueError, match="dtype must be auto"):
        _resolve_dtype("int8", cpu, None)
