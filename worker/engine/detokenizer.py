"""Streamed text for one request, one piece per generated token.

Contract: the pieces returned by ``push`` (one per token, possibly "") followed by the piece
returned by ``finish`` concatenate to ``tokenizer.decode(output_ids, skip_special_tokens=...)``
— the output tokens only, decoded as a whole (so a leading space that the tokenizer strips at
the start of a text is stripped here too) — truncated just before the first occurrence of any
stop string when one occurs. The engine glues the ``finish`` piece onto the last token's piece,
so per-token pieces concatenate to the final text.

Text is held back while it may still change or be cut:
    * a trailing U+FFFD: a multi-byte character split across tokens decodes as U+FFFD until
      its last byte arrives (the window is decoded again with the next token);
    * a tail that is a prefix of a stop string: it is emitted once it can no longer start one,
      and dropped if the stop string completes.

Decoding is incremental (the TGI/vLLM window scheme): each token decodes a short window of the
recent ids, ``ids[prefix_offset:]``, and emits what it adds to ``ids[prefix_offset:read_offset]``;
windows start at character boundaries, so joining window pieces equals the whole decode for
byte-level and SentencePiece tokenizers. ``finish`` decodes the whole output once and, when the
emitted text is a prefix of it (it always is for these tokenizers), emits the rest from it, so
the contract holds exactly even for tokenizers whose decode is not window-separable.

Replaying the same ids through a fresh detokenizer reproduces the same pieces and state, which is
how a request resumed on another worker continues its text without a gap or a duplicate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: Any, skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Invariants: ``emitted`` is a prefix of ``text``; ``text[len(emitted):]`` (the held-back
    tail) is shorter than the longest stop string or ends in an incomplete character; once
    ``stopped``, ``emitted`` is final and no stop string occurs in it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (complete characters), held-back tail included
        self.emitted = ""  # returned so far
        self.stopped = False  # a stop string matched; the request must end
        self._prefix_offset = 0
        self._read_offset = 0
        self._searched = 0  # text[:_searched] holds no stop string start that fits in it
        self._decode = _decoder(tokenizer, skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text piece it releases (possibly "")."""
        self.token_ids.append(token_id)
        if self.stopped:
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended (for any reason but a stop string): release everything held."""
        if self.stopped:
            return ""
        full = self._decode(self.token_ids)
        if full.startswith(self.emitted):
            self.text = full
        else:  # not window-separable: keep the window text, add the undecoded tail
            tail = self._decode(self.token_ids[self._prefix_offset :])
            head = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
            self.text += tail[len(head) :]
            self._searched = len(self.emitted)
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        text = self.text
        if self.stop:
            # no stop string starts inside the emitted text, nor early enough to fit before
            # _searched (it would have been found by an earlier search)
            start = max(len(self.emitted), self._searched - self.max_stop_len + 1)
            cut = min((i for s in self.stop if (i := text.find(s, start)) != -1), default=-1)
            if cut != -1:
                self.stopped = True
                self.text = text[:cut]
                return self._emit(self.text)
            self._searched = len(text)
        if final or not self.stop:
            return self._emit(text)
        return self._emit(text[: len(text) - _partial_stop_len(text, self.stop)])

    def _emit(self, upto: str) -> str:
        piece = upto[len(self.emitted) :]
        self.emitted = upto
        return piece


def _decoder(tokenizer: Tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` with the flag bound; for a fast tokenizer that cleans up nothing, its
    Rust backend directly (the same text without the Python wrapper's per-call overhead)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        backend is not None
        and callable(getattr(backend, "decode", None))
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    ):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
