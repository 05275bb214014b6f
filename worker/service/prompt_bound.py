"""A sound lower bound on a text prompt's token count, from its UTF-8 length alone.

A tokenizer that covers every byte of its input (nothing dropped or merged into one unknown
token) and never makes the text shorter before splitting it cannot turn ``n`` bytes into fewer
than ``ceil(n / L)`` tokens, ``L`` being the most bytes one token stands for. ``L`` is read once
from the vocabulary (the longest token string in UTF-8 bytes; for byte-level BPE, in
characters, each one byte). A prompt whose bound already passes ``max_model_len`` is refused
without tokenizing it: a 1 MiB prompt costs a ``len()``, not a second of the worker's loop.

The bound holds only where these are true, so :func:`token_bound_for` checks them on the
tokenizer's own pipeline and gives no bound (None, with the reason) otherwise:

* the model is BPE and covers every byte: byte-level (all 256 byte symbols in the vocabulary),
  byte fallback, or an unknown token per unknown character (``fuse_unk`` off: at most 4 bytes);
* no normalizer, or only ``Prepend`` and string ``Replace`` steps that never shorten the text
  (Unicode normalization and case folding can: the Kelvin sign's 3 bytes become ``k``'s one);
* no pre-tokenizer that removes text (``Whitespace``, ``WhitespaceSplit``, ``Bert``, ``Split``
  with behaviour ``Removed``).

Added tokens (``<|im_start|>``) are matched in the raw text and count with their own length.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# pre-tokenizers that keep every character of their input (in some piece)
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split", "Sequence"}
)


@dataclass(frozen=True, slots=True)
class TokenBound:
    """``min_tokens(text)`` never exceeds the number of tokens the tokenizer makes of ``text``.

    ``max_bytes_per_token`` is the most UTF-8 bytes of input one token can stand for (>= 1).
    """

    max_bytes_per_token: int

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(tokenizer.encode(text))`` (special tokens not counted)."""
        return math.ceil(utf8_length(text) / self.max_bytes_per_token)


def utf8_length(text: str) -> int:
    """``len(text.encode())``, without the copy for ASCII text (one byte per character)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def token_bound_for(tokenizer: Any) -> tuple[TokenBound | None, str]:
    """The bound for a Hugging Face tokenizer, or None and why there is none (module doc)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, "not a fast (Rust) tokenizer"
    try:
        config = json.loads(backend.to_str())
    except Exception as exc:  # a tokenizer that cannot describe itself: no bound
        return None, f"its configuration is unreadable ({exc})"
    reason = _normalizer_problem(config.get("normalizer")) or _pre_tokenizer_problem(
        config.get("pre_tokenizer")
    )
    if reason:
        return None, reason
    model = config.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"its model is {model.get('type')}, not BPE"
    vocab: dict[str, int] = model.get("vocab") or {}
    byte_level = _has_type(config.get("pre_tokenizer"), "ByteLevel")
    if byte_level:
        from tokenizers import pre_tokenizers

        if not set(pre_tokenizers.ByteLevel.alphabet()) <= vocab.keys():
            return None, "its byte-level vocabulary lacks some of the 256 byte symbols"
        longest = max((len(t) for t in vocab), default=1)  # one character per byte
    elif model.get("byte_fallback"):
        longest = max((len(t.encode()) for t in vocab), default=1)
    elif model.get("unk_token") and not model.get("fuse_unk"):
        longest = max(4, max((len(t.encode()) for t in vocab), default=1))
    else:
        return None, "unknown characters may be dropped or fused into one token"
    added = config.get("added_tokens") or []
    longest = max([longest, *(len(str(a.get("content", "")).encode()) for a in added)])
    return TokenBound(max(1, longest)), "sound"


def _normalizer_problem(norm: dict[str, Any] | None) -> str:
    """Why ``norm`` may shorten a text ('' if it never does)."""
    if norm is None:
        return ""
    kind = norm.get("type")
    if kind == "Sequence":
        return next((p for p in map(_normalizer_problem, norm.get("normalizers", [])) if p), "")
    if kind == "Prepend":
        return ""
    if kind == "Replace":
        pattern = norm.get("pattern") or {}
        if "String" in pattern and len(str(norm.get("content", "")).encode()) >= len(
            str(pattern["String"]).encode()
        ):
            return ""
    return f"its normalizer ({kind}) may shorten the text"


def _pre_tokenizer_problem(pre: dict[str, Any] | None) -> str:
    """Why ``pre`` may remove part of a text ('' if it keeps all of it)."""
    if pre is None:
        return ""
    kind = pre.get("type")
    if kind not in _KEEPING_PRE_TOKENIZERS:
        return f"its pre-tokenizer ({kind}) may remove text"
    if kind == "Split" and pre.get("behavior") == "Removed":
        return "its Split pre-tokenizer removes the matches"
    if kind == "Sequence":
        return next((p for p in map(_pre_tokenizer_problem, pre.get("pretokenizers", [])) if p), "")
    return ""


def _has_type(component: dict[str, Any] | None, kind: str) -> bool:
    if component is None:
        return False
    if component.get("type") == kind:
        return True
    return any(_has_type(c, kind) for c in component.get("pretokenizers", []))
