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
from tokenfleet.worker.engine.model_runner import ModelRunner
from tokenfleet.worker.engine.quantization import (
    SOURCE_FILE,
    Int4Linear,
    Int8Head,
    Int8Linear,
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


def test_the_int8_head_serves_few_rows_and_the_float_head_many() -> None:
    gen = torch.Generator().manual_seed(2)
    linear = nn.Linear(64, 200, bias=True)
    linear.weight.data = torch.randn(200, 64, generator=gen)
    head = Int8Head(linear, max_rows=4, exact_top=8, margin=0.0)
    assert head.float_head is linear  # the float weights are kept (often tied), not copied
    few, many = torch.randn(1, 4, 64, generator=gen), torch.randn(1, 5, 64, generator=gen)
    with torch.no_grad():
        assert torch.equal(head(many), linear(many))  # enough rows: the float head itself
        got, want = head(few), linear(few)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert head.num_float_rows == 0
    assert not torch.equal(got, want)  # few rows: the int8 weights ...
    assert (got - want).abs().max() < 0.02 * want.abs().max()  # ... of the same head,
    top = got.topk(8, dim=-1).indices  # and the candidates recomputed in float32
    torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), atol=1e-5, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_int8_head_hands_unsure_rows_to_the_float_head() -> None:
    """A row whose best recomputed logit is not ``margin`` above the int8 candidates left out
    is computed whole in float32."""
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(64, 200, bias=False)
    linear.weight.data = torch.randn(200, 64, generator=gen)
    head = Int8Head(linear, max_rows=4, exact_top=8, margin=1e9)
    x = torch.randn(3, 64, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(head(x), linear(x), atol=1e-5, rtol=0)
    assert head.num_float_rows == 3


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
    assert isinstance(runner.model.lm_head, Int8Head)  # the LM head as int8, float kept
    assert report.head == "int8"
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
