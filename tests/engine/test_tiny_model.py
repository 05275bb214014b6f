"""The tiny model maker: loadable, deterministic, a working tokenizer, non-degenerate output."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenfleet.worker.devtools.tiny_model import FLAVOURS, make_tiny_model


@pytest.fixture(autouse=True)
def _few_threads() -> Iterator[None]:
    """One torch thread: the suite shares a small machine; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_loads_with_auto_classes(flavour: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder = request.getfixturevalue(f"tiny_{flavour}_dir")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    config = model.config
    assert config.model_type == flavour
    assert config.vocab_size == len(tokenizer)
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    assert config.max_position_embeddings >= 2048
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.bos_token is not None and tokenizer.pad_token is not None
    generation = GenerationConfig.from_pretrained(folder)
    assert tokenizer.eos_token_id in generation.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in generation.eos_token_id


def test_same_seed_same_files_other_seed_other_weights(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    again = make_tiny_model(tmp_path / "again", flavour="llama", seed=0)
    assert digests(again) == digests(tiny_llama_dir)
    other = make_tiny_model(tmp_path / "other", flavour="llama", seed=1)
    assert digests(other)["model.safetensors"] != digests(again)["model.safetensors"]
    assert digests(other)["tokenizer.json"] == digests(again)["tokenizer.json"]


def test_unknown_flavour_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="flavour"):
        make_tiny_model(tmp_path, flavour="bloom")


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii, queues and workers.",
        "café naïve Straße",
        "東京 你好 Привет",
        "🚀✨ 👩‍💻",
        "\n\t  x",
    ],
)
def test_utf8_round_trip(text: str, tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_chat_template(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n"
    )
    encoded: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    ids: list[int] = encoded if isinstance(encoded, list) else encoded["input_ids"]
    im_start: Any = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_greedy_output_is_deterministic_and_depends_on_the_prompt(
    flavour: str, request: pytest.FixtureRequest
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = request.getfixturevalue(f"tiny_{flavour}_dir")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts = ["The queue", "Workers die.", "Memory is the scarce thing", "Tokens flow back"]
    outputs = []
    with torch.inference_mode():
        for text in prompts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            first = model.generate(ids, max_new_tokens=12, do_sample=False)
            second = model.generate(ids, max_new_tokens=12, do_sample=False)
            assert torch.equal(first, second)
            new = first[0, ids.shape[1] :].tolist()
            assert len(set(new)) > 3, f"degenerate greedy output {new} for {text!r}"
            outputs.append(tuple(new))
            top2 = model(ids).logits[0, -1].topk(2).values
            assert float(top2[0] - top2[1]) > 1e-3  # a clear greedy winner, no near-tie
    assert len(set(outputs)) == len(prompts)


def test_cli_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from tokenfleet.worker.devtools import tiny_model
    from tokenfleet.worker.devtools.commands import make_tiny_model as command

    assert command.FLAVOURS == tiny_model.FLAVOURS
    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["make-tiny-model", str(tmp_path / "m"), "--flavour", "qwen2"])
    assert args.func(args) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert "qwen2" in capsys.readouterr().out
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "m").model_type == "qwen2"
