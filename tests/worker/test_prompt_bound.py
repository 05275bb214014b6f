"""The cheap bound on a prompt's token count: never above the real count where it is given, and
not given for tokenizers that can shorten or drop text."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tokenfleet.worker.service.prompt_bound import token_bound_for, utf8_length


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _texts(tokenizer: Any) -> list[str]:
    """Texts meant to pack many bytes into few tokens: the vocabulary's longest tokens and added
    tokens repeated, whitespace runs, multi-byte characters, random bytes of the vocabulary."""
    rng = random.Random(0)
    vocab = sorted(tokenizer.get_vocab(), key=len, reverse=True)
    decoded = [tokenizer.convert_tokens_to_string([t]) for t in vocab[:50]]
    added = [str(t) for t in tokenizer.all_special_tokens]
    texts = [d * 40 for d in decoded] + [a * 40 for a in added]
    texts += [" " * 4000, "\n" * 4000, "é" * 1000, "日本語" * 300, "🙂" * 500, "x"]
    texts += ["".join(rng.choice(decoded + added) for _ in range(300)) for _ in range(20)]
    return texts


def test_the_bound_never_exceeds_the_token_count(tiny_tokenizer: Any) -> None:
    bound, why = token_bound_for(tiny_tokenizer)
    assert bound is not None, why
    for text in _texts(tiny_tokenizer):
        num_tokens = len(tiny_tokenizer.encode(text, add_special_tokens=False))
        assert bound.min_tokens(text) <= num_tokens, (text[:40], num_tokens)
    assert bound.min_tokens("a" * 1_000_000) > 1_000_000 // (bound.max_bytes_per_token + 1)


def test_utf8_length() -> None:
    for text in ("", "abc", "é", "日本語", "🙂a"):
        assert utf8_length(text) == len(text.encode())


def _wrap(backend: Tokenizer) -> Any:
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _bpe(**kw: Any) -> Tokenizer:
    vocab = {"a": 0, "b": 1, "ab": 2, "<unk>": 3}
    return Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], **kw))


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (lambda t: setattr(t, "normalizer", normalizers.NFKC()), "normalizer (NFKC)"),
        (lambda t: setattr(t, "normalizer", normalizers.Strip()), "normalizer (Strip)"),
        (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Whitespace()), "Whitespace"),
        (
            lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Split(" ", "removed")),
            "removes the matches",
        ),
    ],
)
def test_no_bound_for_tokenizers_that_shorten_or_drop_text(setup: Any, reason: str) -> None:
    backend = _bpe(unk_token="<unk>")
    setup(backend)
    bound, why = token_bound_for(_wrap(backend))
    assert bound is None and reason in why


def test_no_bound_where_unknown_characters_vanish_or_fuse() -> None:
    bound, why = token_bound_for(_wrap(_bpe()))  # no unknown token: unknown text is dropped
    assert bound is None and "unknown characters" in why
    bound, why = token_bound_for(_wrap(_bpe(unk_token="<unk>", fuse_unk=True)))
    assert bound is None and "unknown characters" in why
    backend = _bpe()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel()  # byte-level, but bytes missing
    bound, why = token_bound_for(_wrap(backend))
    assert bound is None and "byte symbols" in why


def test_bound_with_an_unknown_token_per_character() -> None:
    bound, why = token_bound_for(_wrap(_bpe(unk_token="<unk>")))
    assert bound is not None and bound.max_bytes_per_token == 5, why  # "<unk>" itself
