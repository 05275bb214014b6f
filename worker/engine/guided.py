"""Constrained decoding: grammars compiled off the engine's thread, one matcher per constrained
request, and each step's token masks filled for all constrained rows at once.

The grammar library is llguidance (why: ``tokenfleet.shared.schema.constraint``). Its matchers
are built from an llguidance tokenizer made once per engine from the model's Hugging Face
tokenizer (about a second: on the compile thread, the first time a request needs it).

* :class:`GrammarCompiler` runs on a thread of its own: a request's grammar is compiled there
  (once per grammar: the compiled matcher is kept in an LRU cache and each request gets a copy,
  about 10 µs), and a resumed request's matcher is advanced there over the tokens it resumes
  from. The engine holds the request back until that is done, so a heavy schema never stalls
  the other streams.
* :class:`MaskFiller` fills the bitmask of every constrained row of a step in one call (the
  library's own threads, the GIL released), on a thread started before the forward pass, so the
  mask is ready when the logits are (the matchers' states are known once the previous step's
  tokens are consumed). :func:`apply_mask` then sets every disallowed logit to ``-inf``.

Failures are the request's own: a grammar the library cannot build for this tokenizer ends the
request ``error`` / ``invalid_grammar``; a matcher left with no allowed token (a grammar the
vocabulary cannot satisfy) ends it ``error`` / ``grammar_unsatisfiable``; a resumed token the
grammar refuses ends it ``error`` / ``grammar_mismatch``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

INVALID_GRAMMAR = "invalid_grammar"
GRAMMAR_UNSATISFIABLE = "grammar_unsatisfiable"
GRAMMAR_MISMATCH = "grammar_mismatch"


class GrammarError(Exception):
    """A request's grammar failed: ``code`` (one of the three above) and a message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class CompileStats:
    """What the compiler did (cumulative): for metrics and the benchmark."""

    num_compiled: int = 0  # grammars built (cache misses)
    num_cached: int = 0  # requests served from the cache
    compile_s: float = 0.0  # seconds spent building grammars
    cached_s: float = 0.0  # seconds spent copying cached matchers (and resuming them)
    tokenizer_s: float = 0.0  # seconds spent wrapping the tokenizer (once)


class GrammarCompiler:
    """Builds matchers for one tokenizer on one thread of its own, each grammar once.

    Invariants: the cache and the llguidance tokenizer are touched only on the compile thread;
    a returned matcher is a fresh copy, advanced over the request's resumed tokens, owned by that
    request alone.
    """

    def __init__(
        self, hf_tokenizer: Any, eos_token_ids: Sequence[int], *, cache_size: int = 256
    ) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._eos = sorted(eos_token_ids)
        self._cache: OrderedDict[str, Any] = OrderedDict()  # grammar -> pristine matcher
        self._cache_size = cache_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._tokenizer: Future[Any] | None = None
        self._lock = threading.Lock()  # guards _tokenizer's creation only
        self.stats = CompileStats()

    def tokenizer(self) -> Future[Any]:
        """The llguidance tokenizer (made on the compile thread the first time it is asked)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(self._wrap)
            return self._tokenizer

    def _wrap(self) -> Any:
        import llguidance.hf

        start = time.perf_counter()
        tok = llguidance.hf.from_tokenizer(self._hf_tokenizer, eos_token=self._eos or None)
        self.stats.tokenizer_s = time.perf_counter() - start
        return tok

    def matcher(self, grammar: str, resume_ids: Sequence[int] = ()) -> Future[Any]:
        """A matcher for ``grammar`` advanced over ``resume_ids``, built on the compile thread;
        the future raises :class:`GrammarError` for the request's faults."""
        tokenizer = self.tokenizer()
        return self._pool.submit(self._build, tokenizer, grammar, list(resume_ids))

    def _build(self, tokenizer: Future[Any], grammar: str, resume_ids: list[int]) -> Any:
        from llguidance import LLMatcher

        tok = tokenizer.result()
        start = time.perf_counter()
        pristine = self._cache.get(grammar)
        if pristine is None:
            pristine = LLMatcher(tok, grammar, log_level=0)
            if pristine.is_error():
                raise GrammarError(
                    INVALID_GRAMMAR, f"the grammar cannot be built: {pristine.get_error()}"
                )
            self._cache[grammar] = pristine
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self.stats.num_compiled += 1
            self.stats.compile_s += time.perf_counter() - start
            start = time.perf_counter()
        else:
            self._cache.move_to_end(grammar)
            self.stats.num_cached += 1
        matcher = pristine.deep_copy()
        if resume_ids and not matcher.consume_tokens(resume_ids):
            raise GrammarError(
                GRAMMAR_MISMATCH,
                "the tokens this request resumes from do not match its grammar: "
                f"{matcher.get_error()}",
            )
        self.stats.cached_s += time.perf_counter() - start
        return matcher

    def close(self) -> None:
        """Stop the compile thread (what is queued still runs)."""
        self._pool.shutdown(wait=False)


class MaskFiller:
    """Fills one step's token bitmask for all constrained rows in one call, on its own thread.

    ``vocab_size`` is the tokenizer's (the bitmask's width, in bits, rounded up to 32).
    """

    def __init__(self, tokenizer: Any) -> None:
        from llguidance import LLExecutor

        self.vocab_size = int(tokenizer.vocab_size)
        self._executor = LLExecutor()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def start(self, matchers: Sequence[Any]) -> Future[torch.Tensor]:
        """Begin filling the masks of ``matchers`` (row ``i`` of the result for ``matchers[i]``);
        the matchers must not change until the future is done."""
        return self._pool.submit(self._fill, list(matchers))

    def _fill(self, matchers: list[Any]) -> torch.Tensor:
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros((len(matchers), words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, len(matchers)
        )
        return bitmask

    def consume(self, matchers: Sequence[Any], token_ids: Sequence[int]) -> list[bool]:
        """Advance each matcher by its sampled token (in parallel); False where refused."""
        return list(self._executor.consume_token_par(list(zip(matchers, token_ids, strict=True))))

    def close(self) -> None:
        self._pool.shutdown(wait=False)


_BITS = None


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bitmask (int32 words, bit ``t % 32`` of word ``t // 32`` allows token ``t``) as a
    bool tensor ``[rows, vocab_size]``; tokens past the mask's width are not allowed."""
    global _BITS
    if _BITS is None:
        _BITS = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1  # [rows, words, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros((bitmask.shape[0], vocab_size - width), dtype=torch.bool)
    return torch.cat([allowed, pad], dim=1)


@torch.inference_mode()
def apply_mask(logits: torch.Tensor, rows: Sequence[int], allowed: torch.Tensor) -> None:
    """Set the disallowed logits of ``rows`` of ``logits`` to ``-inf`` (in place)."""
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, index)
    sub.masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, index, sub)
