"""Weight-only int4/int8 linear layers (issue 31): the kernels' products, the modes, the fallback.

Tiny models only; the real Q4_1 file's greedy equivalence is tests/models/test_real_quantized.py.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tokenfleet.shared.errors import SettingsError
from tokenfleet.worker.engine.batch import ScheduledSeq, StepBatch
from tokenfleet.worker.engine.config import EngineConfig
from tokenfleet.worker.engine.fusion import fused_parts
from tokenfleet.worker.engine.model_runner import ModelRunner
from tokenfleet.worker.engine.quantization import (
    SOURCE_FILE,
    Int4Linear,
    Int8Linear,
    QuantizedHead,
    file_precision,
    kernels_available,
    mode_for_gguf_type,
)
from tokenfleet.worker.engine.request import SamplingParams
from tokenfleet.worker.worker_settings import WorkerSettings

LOGGER = "tokenfleet.worker.engine.quantization"


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_this_torch_has_the_kernels() -> None:
    assert kernels_available()


def test_int4_reproduces_a_q4_1_grid_and_its_product() -> None:
    """Weights on a Q4_1 grid (q * d + m per group of 32, d and m exact in bfloat16) come back up
    to bfloat16 rounding (of the zero point m + 8 d and of the kernel's output); the product
    differs from float32's by that and the activations' bfloat16 rounding."""
    gen = torch.Generator().manual_seed(0)
    out_f, in_f = 48, 96
    q = torch.randint(0, 16, (out_f, in_f // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # each group spans the grid, as llama.cpp's Q4_1 makes it
    d = torch.rand(out_f, in_f // 32, 1, generator=gen).to(torch.bfloat16).float() / 8
    m = -torch.rand(out_f, in_f // 32, 1, generator=gen).to(torch.bfloat16).float()
    linear = nn.Linear(in_f, out_f, bias=True)
    linear.weight.data = (q * d + m).view(out_f, in_f)
    layer = Int4Linear(linear)
    x = torch.randn(5, 3, in_f, generator=gen)
    with torch.no_grad():
        ref = linear(x.to(torch.bfloat16).float())  # the same activations, float32 weights
        got = layer(x)
    assert got.shape == (5, 3, out_f) and got.dtype == torch.float32
    # bfloat16 output: ~3 significant digits of the largest values
    torch.testing.assert_close(got, ref, atol=1e-2 * float(ref.abs().max()), rtol=0)
    ones = torch.eye(in_f)  # one-hot rows read the dequantized weights back
    with torch.no_grad():
        read_back = layer(ones) - linear.bias
    torch.testing.assert_close(read_back, linear.weight.T, atol=8e-3, rtol=0)
    assert not torch.allclose(read_back, linear.weight.T.flip(0), atol=0.1)  # not any weights


def test_int8_product_is_close_to_float() -> None:
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(64, 40, bias=False)
    linear.weight.data = torch.randn(40, 64, generator=gen)
    x = torch.randn(7, 64, generator=gen)
    with torch.no_grad():
        got, ref = Int8Linear(linear)(x), linear(x)
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()


def random_head(out_f: int, in_f: int, seed: int, bias: bool = True) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_f, out_f, bias=bias)
    linear.weight.data = torch.randn(out_f, in_f, generator=gen)
    if bias:
        linear.bias.data = torch.randn(out_f, generator=gen)
    return linear.requires_grad_(False)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_quantized_head_serves_few_rows_and_the_float_head_many(kind: str) -> None:
    linear = random_head(208, 64, seed=2)
    head = QuantizedHead(linear, max_rows=4, kind=kind, exact_top=8, margin=0.0)
    assert head.float_head is linear  # the float weights are kept (often tied), not copied
    float32 = {t.data_ptr(): t.numel() for t in head.state_dict().values()
               if t.dtype == torch.float32}  # fmt: skip
    assert sum(float32.values()) == linear.weight.numel() + linear.bias.numel()  # no float copy
    gen = torch.Generator().manual_seed(3)
    few, many = torch.randn(1, 4, 64, generator=gen), torch.randn(1, 5, 64, generator=gen)
    with torch.no_grad():
        assert torch.equal(head(many), linear(many))  # enough rows: the float head itself
        got, want = head(few), linear(few)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert head.num_float_rows == 0
    assert not torch.equal(got, want)  # few rows: the quantized weights ...
    off = {"int4": 0.2, "int8": 0.02}[kind]  # 4 bits of Gaussian weights: ~10 % off
    assert (got - want).abs().max() < off * want.abs().max()  # ... of the same head,
    with torch.no_grad():
        top = head.quantized(few).topk(8, dim=-1).indices  # the candidates, recomputed in f32
    torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), atol=1e-4, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_quantized_head_widens_or_hands_unsure_rows_to_the_float_head(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row whose best recomputed logit is not ``margin`` above the quantized candidates left
    out has every token within ``margin`` recomputed too (here: all of them), or, with more of
    those than ``WIDE_CANDIDATES``, is computed whole in float32."""
    import tokenfleet.worker.engine.quantization as quantization

    linear = random_head(208, 64, seed=3, bias=False)
    head = QuantizedHead(linear, max_rows=4, kind=kind, exact_top=8, margin=1e9)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(head(x), linear(x), atol=1e-5, rtol=0)
    assert (head.num_wide_rows, head.num_float_rows) == (3, 0)
    monkeypatch.setattr(quantization, "WIDE_CANDIDATES", 207)
    with torch.no_grad():
        torch.testing.assert_close(head(x), linear(x), atol=1e-5, rtol=0)
    assert (head.num_wide_rows, head.num_float_rows) == (3, 3)


def head_error(head: QuantizedHead, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float((head.quantized(x) - head.float_head(x)).abs().max())


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_quantized_head_picks_the_float_heads_token_on_random_rows(kind: str) -> None:
    """Random rows in batches of up to ``max_rows``: the argmax is the float head's wherever
    the quantized logits are off by less than the margin (checked: the head's precondition),
    though the quantized logits alone pick another token in some rows."""
    linear = random_head(1024, 96, seed=5)
    head = QuantizedHead(linear, max_rows=8, kind=kind)  # its default margin and candidates
    x = torch.randn(400, 96, generator=torch.Generator().manual_seed(6)) * 0.5
    assert head_error(head, x) < head.margin
    with torch.no_grad():
        got = torch.cat([head(x[i : i + 8]) for i in range(0, len(x), 8)])
        want, alone = linear(x), head.quantized(x)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert not torch.equal(alone.argmax(-1), want.argmax(-1))  # the test can fail


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_quantized_head_picks_the_float_heads_token_at_near_ties(kind: str) -> None:
    """Adversarial rows: each row's best token has a twin whose float logit is 1e-3 above or
    below it (the quantized logits cannot tell them apart); and rows over a flat stretch of 100
    near-equal logits, more than the candidates recomputed (these go whole to the float head)."""
    gen = torch.Generator().manual_seed(7)
    linear = random_head(512, 64, seed=8)
    x = torch.randn(24, 64, generator=gen) * 0.5
    with torch.no_grad():
        best = linear(x).argmax(-1)
        for r in range(16):  # token 256 + r: row r's best token, moved by +-1e-3 in row r
            direction = torch.randn(64, generator=gen)
            twin, row = 256 + r, x[r]
            gap = (1e-3 if r % 2 else -1e-3) - float(direction @ row) * 1e-4
            linear.weight[twin] = linear.weight[best[r]] + direction * 1e-4
            linear.bias[twin] = linear.bias[best[r]] + gap
        flat = torch.arange(400, 500)  # rows 16..23: 100 tokens within 1e-3 of each other
        linear.weight[flat] = linear.weight[0] + torch.randn(100, 64, generator=gen) * 1e-5
        linear.bias[flat] = 50 + torch.rand(100, generator=gen) * 1e-3
        x[16:] = x[16:] * 1e-2
    head = QuantizedHead(linear, max_rows=8, kind=kind)
    assert head_error(head, x) < head.margin and head.exact_top < 100
    with torch.no_grad():
        want, alone = linear(x), head.quantized(x)
        got = torch.cat([head(x[i : i + 8]) for i in range(0, len(x), 8)])
    near = want.topk(2, -1).values
    assert float((near[:16, 0] - near[:16, 1]).max()) < 2e-3  # near-ties indeed
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert not torch.equal(alone.argmax(-1), want.argmax(-1))  # the test can fail
    assert head.num_wide_rows + head.num_float_rows >= 8  # the flat rows: all near recomputed


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_rows_whose_every_logit_matters_are_the_float_heads(kind: str) -> None:
    """``float_rows`` (sampled, logprobs, grammar-masked): those rows' logits, and so their
    logprobs and top logprobs, are the float head's bit for bit; the others keep the quantized
    path and its guarantee."""
    linear = random_head(208, 64, seed=9)
    head = QuantizedHead(linear, max_rows=4, kind=kind, exact_top=8, margin=0.0)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(10))
    exact = [1, 4, 5]
    head.float_rows = exact
    with torch.no_grad():
        got = head(x.unsqueeze(0))[0]
        want = linear(x[exact])
        full = linear(x)
    assert torch.equal(got[exact], want)
    assert torch.equal(got[exact].log_softmax(-1), want.log_softmax(-1))  # logprobs equal
    assert torch.equal(got.argmax(-1), full.argmax(-1))
    greedy = [0, 2, 3]
    assert not torch.equal(got[greedy], full[greedy])  # those are the quantized path's
    head.float_rows = [0, 1, 2, 3, 4, 5]
    with torch.no_grad():
        assert torch.equal(head(x), linear(x))


def test_the_engine_asks_for_float_logits_where_every_logit_is_read(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy rows take the quantized head's fast path; rows sampled with a temperature or asked
    for logprobs are flagged (``StepBatch.full_logit_rows``) and get the float head's logits."""
    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.engine.request import SamplingParams

    engine = Engine(tiny_llama_dir, EngineConfig(num_kv_blocks=16, quantization="int4", seed=0))
    runner: Any = engine.runner
    head = runner.model.lm_head
    assert isinstance(head, QuantizedHead)
    seen: list[tuple[list[str], list[int], list[int]]] = []  # ids, flagged, the head's rows
    execute = engine.runner.execute

    def spy(batch: StepBatch, *args: Any) -> torch.Tensor:
        ids = [s.request_id for s in batch.seqs if s.needs_logits]
        seen.append((ids, list(batch.full_logit_rows), []))
        return execute(batch, *args)

    monkeypatch.setattr(engine.runner, "execute", spy)
    head.register_forward_pre_hook(lambda m, a: seen[-1][2].extend(m.float_rows))
    prompt = [5, 17, 99, 3]
    requests = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=3),
        "sampled": SamplingParams(temperature=0.8, max_tokens=3, seed=1),
        "logprobs": SamplingParams(temperature=0.0, max_tokens=3, logprobs=True, top_logprobs=2),
    }
    for rid, params in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert len(seen) >= 3
    for ids, flagged, at_head in seen:
        assert flagged == [i for i, rid in enumerate(ids) if rid != "greedy"], (ids, flagged)
        assert at_head == flagged  # what the head was told during that forward
    assert sum("greedy" in ids for ids, _, _ in seen) == 3  # every token of each was computed
    assert head.float_rows == []  # cleared after each forward


def test_joined_layers_pack_as_the_float_join_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused layer packed straight from its parts (chunks of rows that cross the parts'
    borders) equals the packing of the joined float weights, byte for byte, and computes the
    separate layers' outputs side by side."""
    import tokenfleet.worker.engine.quantization as quantization
    from tokenfleet.worker.engine.fusion import _join

    gen = torch.Generator().manual_seed(11)
    parts = [nn.Linear(96, n, bias=True).requires_grad_(False) for n in (80, 48, 48)]
    for part in parts:
        part.weight.data = torch.randn(part.out_features, 96, generator=gen)
    float_join = _join(parts)
    monkeypatch.setattr(quantization, "PACK_CHUNK_ROWS", 64)  # chunks 0-63, 64-127, 128-175
    for cls in (Int4Linear, Int8Linear):
        joined, whole = cls.joined(parts), cls(float_join)
        assert fused_parts(joined) == (80, 48, 48)
        for (name, got), (_, want) in zip(
            joined.state_dict().items(), whole.state_dict().items(), strict=True
        ):
            assert torch.equal(got, want), (cls.__name__, name)
        x = torch.randn(3, 96, generator=gen)
        with torch.no_grad():
            side_by_side = torch.cat([cls(part)(x) for part in parts], -1)
            assert torch.equal(joined(x), side_by_side)
    q = torch.randint(0, 16, (176, 96), dtype=torch.int32, generator=gen)  # the layout's rule
    packs = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[i : i + 64], 1) for i in
             range(0, 176, 64)]  # fmt: skip
    assert torch.equal(torch.cat(packs), torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))


def test_gguf_types_map_to_modes() -> None:
    assert [mode_for_gguf_type(t) for t in ("Q4_0", "Q4_1", "Q4_K", "IQ4_NL")] == ["int4"] * 4
    assert [mode_for_gguf_type(t) for t in ("Q8_0", "Q6_K", "Q5_1")] == ["int8"] * 3
    assert [mode_for_gguf_type(t) for t in ("F32", "F16", "BF16")] == ["none"] * 3


def test_the_flag_and_variable_reach_the_engine() -> None:
    ws = WorkerSettings.from_env({"TOKENFLEET_QUANTIZATION": "int8"}, model="m", name=None)
    assert ws.quantization == "int8"
    assert EngineConfig(**ws.engine_overrides()).quantization == "int8"
    flag = WorkerSettings.from_env(
        {"TOKENFLEET_QUANTIZATION": "int8"}, model="m", quantization="auto"
    )
    assert flag.quantization == "auto"  # the flag wins
    default = WorkerSettings.from_env({}, model="m")
    assert default.quantization == "auto"  # a GGUF file's own precision, unless told otherwise
    assert (
        EngineConfig().quantization
        == "auto"
        == EngineConfig(**default.engine_overrides()).quantization
    )
    with pytest.raises(SettingsError, match=r"quantization.*int4"):
        WorkerSettings.from_env({"TOKENFLEET_QUANTIZATION": "int3"}, model="m")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="fp8")


def last_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    seq = ScheduledSeq("r", tokens, 0, [0, 1], needs_logits=True)
    return runner.execute(StepBatch([seq]))[0]


def snap_to_int4_grid(model: nn.Module) -> None:
    """Round every decoder linear weight to its int4 group grid, in float32 (the reference for
    a model run as int4: same weights, float32 arithmetic)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":
            w = module.weight.data
            groups = w.view(w.shape[0], -1, 32)
            low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
            scale = (high - low) / 15
            module.weight.data = ((groups - low) / scale).round().mul(scale).add(low).view_as(w)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_a_tiny_model_runs_quantized(tiny_llama_dir: Path, mode: str) -> None:
    ref = ModelRunner(tiny_llama_dir, num_kv_blocks=4, block_size=16)
    if mode == "int4":  # 4 bits move a random tiny model's logits far: compare on the grid
        snap_to_int4_grid(ref.model)
    runner = ModelRunner(tiny_llama_dir, num_kv_blocks=4, block_size=16, quantization=mode)
    report = runner.quantization
    assert (report.applied, report.num_quantized, report.num_skipped) == (mode, 4 * 7, 0)
    layer = runner.model.model.layers[0]
    # q/k/v and gate/up fused (fusion.py), then quantized; 28 counts the layers they join
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear if mode == "int4" else Int8Linear)
    assert isinstance(layer.mlp.gate_up_proj, Int4Linear if mode == "int4" else Int8Linear)
    head = runner.model.lm_head
    assert isinstance(head, QuantizedHead)  # the LM head quantized, float kept
    assert report.head == head.kind == ("int4" if head.out_features % 16 == 0 else "int8")
    tokens = [5, 17, 99, 3, 42, 7]
    got, want = last_logits(runner, tokens), last_logits(ref, tokens)
    assert not torch.equal(got, want)  # really another computation ...
    assert (got - want).abs().max() < 0.1 * want.abs().max()  # ... of nearly the same function


def odd_llama(path: Path) -> Path:
    """A tiny Llama whose hidden size (48) no int4 group of 32 divides."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_a_model_that_cannot_run_int4_falls_back_with_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = odd_llama(tmp_path / "odd")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        runner = ModelRunner(path, num_kv_blocks=4, block_size=16, quantization="int4")
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, lines
    assert "model type 'llama' cannot be executed as int4" in lines[0]
    assert "in_features % 32" in lines[0] and "running its weights as loaded" in lines[0]
    assert runner.quantization.applied == "none"
    assert runner.quantization.describe().startswith("none (int4 fell back: none of its")
    assert type(runner.model.model.layers[0].mlp.gate_up_proj) is nn.Linear
    assert type(runner.model.lm_head) is nn.Linear and runner.quantization.head == "as loaded"
    assert torch.isfinite(last_logits(runner, [1, 2, 3])).all()  # and it still serves


def test_auto_keeps_the_file_precision(
    tiny_llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert file_precision(tiny_llama_dir) is None  # not converted from a GGUF file
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        plain = ModelRunner(tiny_llama_dir, num_kv_blocks=4)  # the default: auto
    assert plain.quantization.applied == "none" and caplog.records == []  # float: nothing to say
    assert plain.quantization.describe() == "none (auto: not a quantized GGUF file)"
    assert type(plain.model.lm_head) is nn.Linear and not plain.fused.get("qkv")  # as loaded
    q4 = q4_copy(tiny_llama_dir, tmp_path / "q4")
    assert file_precision(q4) == "int4"
    report = ModelRunner(q4, num_kv_blocks=4).quantization
    assert report.applied == "int4"
    assert report.describe() == "int4 (auto: the GGUF file's precision, 28 linear layers)"
    (q4 / SOURCE_FILE).write_text(json.dumps({"gguf": "/gone.gguf"}))  # older cache, file gone
    assert file_precision(q4) is None


def q4_copy(tiny_llama_dir: Path, path: Path) -> Path:
    """``tiny_llama_dir`` as if converted from a Q4_1 GGUF file (its source record)."""
    q4 = shutil.copytree(tiny_llama_dir, path)
    source = {"gguf": "/gone.gguf", "linear_types": {"Q4_1": 28, "Q8_0": 1}}
    (q4 / SOURCE_FILE).write_text(json.dumps(source))
    return q4


def test_auto_on_a_q4_file_without_kernels_or_on_cuda_runs_as_loaded_with_one_line(
    tiny_llama_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default must be safe for every model: where the file's int4 cannot run (this torch
    lacks the kernels, or the model is on CUDA), the weights run as loaded and one warning and
    the start line say why."""
    from tokenfleet.worker.engine import quantization
    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.models.startup import model_summary

    q4 = q4_copy(tiny_llama_dir, tmp_path / "q4")
    monkeypatch.setattr(quantization, "kernels_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        engine = Engine(q4, EngineConfig(num_kv_blocks=4))  # quantization: the default, auto
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, lines
    assert "quantization auto: model type 'llama' cannot be executed as int4" in lines[0]
    assert "lacks the CPU weight-only int4 kernels" in lines[0], lines[0]
    runner: Any = engine.runner
    assert runner.quantization.applied == "none"
    assert type(runner.model.model.layers[0].mlp.up_proj) is nn.Linear  # not joined either
    assert type(runner.model.lm_head) is nn.Linear
    line = model_summary("q4", q4, engine)
    assert "quantization none (auto fell back: this torch" in line, line
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].token_ids) == 4  # and it still serves
    monkeypatch.undo()
    caplog.clear()
    model = ModelRunner(tiny_llama_dir, num_kv_blocks=4, quantization="none").model
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        report = quantization.quantize_model(model, "auto", torch.device("cuda"), source=q4)
    assert (report.requested, report.applied) == ("auto", "none")
    assert report.fallback_reason == "int4 weights run on a CPU only, this model is on cuda"
    assert [r.getMessage() for r in caplog.records].count(
        "quantization auto: model type 'llama' cannot be executed as int4: "
        "int4 weights run on a CPU only, this model is on cuda; running its weights as loaded"
    ) == 1
    assert type(model.lm_head) is nn.Linear


def test_the_start_line_says_what_runs_quantized(tiny_llama_dir: Path) -> None:
    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.models.startup import model_summary

    engine = Engine(tiny_llama_dir, EngineConfig(num_kv_blocks=4, quantization="int4"))
    line = model_summary("tiny", tiny_llama_dir, engine)
    assert "dtype float32, quantization int4 (28 linear layers), device cpu" in line, line
    plain = Engine(tiny_llama_dir, EngineConfig(num_kv_blocks=4, quantization="none"))
    params = model_summary("tiny", tiny_llama_dir, plain).split(" parameters")[0].split(" ")[-1]
    assert f"LlamaForCausalLM, {params} parameters" in line  # int4 weights counted as loaded
