"""Build a tiny, randomly initialised causal LM with a real tokenizer, for tests and the demo.

No weights can be downloaded here, so the project makes its own model: a byte-level BPE tokenizer
trained on a few KB of prose shipped with the package (``data/tiny_corpus.txt``) and a small Llama
or Qwen2 network initialised from a seeded generator. Everything is written with
``save_pretrained`` so it loads through the same ``from_pretrained`` path as a real model.
``cached_tiny_model()`` builds it once into a cache folder (the demo and the e2e benchmark).

Invariants:
    * Same ``flavour`` and ``seed`` → byte-identical files (weights, tokenizer, configs).
    * Byte-level BPE: every UTF-8 string round-trips through encode/decode.
    * ``config.vocab_size == len(tokenizer)``: every id the model can emit decodes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

FLAVOURS: tuple[str, ...] = ("llama", "qwen2")

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END)

# ChatML-style: each message framed by <|im_start|>role ... <|im_end|>; the assistant's turn ends
# with <|im_end|>, which is therefore an end-of-sequence token for generation.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TARGET_VOCAB_SIZE = 1024  # BPE stops earlier if the corpus runs out of merges
MAX_POSITION_EMBEDDINGS = 4096
# Wider than the usual 0.02 so that logits are spread out: greedy decoding then has clear winners
# (no near-ties that flip between attention implementations) and depends on the prompt.
INITIALIZER_RANGE = 0.08

DEFAULT_TINY_MODEL_DIR = Path(".tiny-model") / "llama-seed0"


def _corpus_text() -> str:
    corpus = resources.files("tokenfleet.worker.devtools.data").joinpath("tiny_corpus.txt")
    return corpus.read_text("utf-8")


def _train_tokenizer() -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on the shipped corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_text().splitlines(keepends=True), trainer=trainer)
    return tokenizer


def _model_config(flavour: str, vocab_size: int, special_ids: dict[str, int]) -> Any:
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "initializer_range": INITIALIZER_RANGE,
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": special_ids[EOS_TOKEN],
        "pad_token_id": special_ids[PAD_TOKEN],
        "dtype": "float32",
    }
    if flavour == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            **common,
        )
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        **common,
    )


def make_tiny_model(
    out_dir: str | os.PathLike[str], *, flavour: str = "llama", seed: int = 0
) -> Path:
    """Write a tiny ``flavour`` model ("llama" or "qwen2") and its tokenizer to ``out_dir``.

    The folder loads with ``AutoTokenizer.from_pretrained`` and
    ``AutoModelForCausalLM.from_pretrained``; returns it as a ``Path``.
    """
    if flavour not in FLAVOURS:
        raise ValueError(f"unknown tiny-model flavour {flavour!r}; choose one of {FLAVOURS}")
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    backend = _train_tokenizer()
    special_ids = {tok: backend.token_to_id(tok) for tok in SPECIAL_TOKENS}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(out)

    config = _model_config(flavour, backend.get_vocab_size(), special_ids)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config = GenerationConfig(
        bos_token_id=special_ids[BOS_TOKEN],
        eos_token_id=[special_ids[EOS_TOKEN], special_ids[IM_END]],
        pad_token_id=special_ids[PAD_TOKEN],
    )
    model.save_pretrained(out)
    return out


def cached_tiny_model(folder: Path | None = None) -> Path:
    """The tiny Llama (seed 0) in ``folder`` (default ``./.tiny-model/llama-seed0``), built on
    first use into a temporary sibling and renamed, so concurrent callers never see half."""
    folder = Path(folder or DEFAULT_TINY_MODEL_DIR)
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
    try:
        make_tiny_model(tmp, flavour="llama", seed=0)
        try:
            tmp.rename(folder)
        except OSError:  # someone else finished first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
