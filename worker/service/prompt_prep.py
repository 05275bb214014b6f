"""Prompts that could stall the loop: refused on a cheap bound, or tokenized on a thread.

Tokenizing is the one part of adding a request whose cost grows with the prompt: about 0.2 µs
per character (1 MiB: 0.2-0.5 s, GIL held by ``tokenizer.encode``), during which every other
stream of the worker gets no token. So, for each new request (:meth:`PromptPrep.check` and
:meth:`PromptPrep.off_loop`, on the loop):

* **refused at once** when its length alone proves it cannot fit: token ids over
  ``max_model_len``, or text over ``max_model_len`` × the most bytes one token can stand for
  (``prompt_bound``): :class:`PromptTooLong`, the engine's own code ``prompt_too_long``;
* **tokenized inline** (by the engine, as before) up to ``INLINE_PROMPT_CHARS`` characters:
  at most about 1 ms, and a short prompt joins the very next step;
* **prepared on a thread** above it (:meth:`PromptPrep.submit`): chat template, the bound again
  on the rendered text, then ``encode_batch_fast`` (Rust, GIL released); a prompt with more
  than ``max_model_len`` tokens is refused without ever becoming a Python list. The loop takes
  finished ones with :meth:`PromptPrep.finished` between steps and adds them to the engine.

The thread shares the engine's tokenizer: both only read it (nothing sets truncation or padding).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

from tokenfleet.shared.schema import GenerationRequest
from tokenfleet.worker.intake.jobs import Job
from tokenfleet.worker.service.prompt_bound import token_bound_for, utf8_length

log = logging.getLogger(__name__)

INLINE_PROMPT_CHARS = 4096  # longer prompts go to a thread (docs/workers.md: ~0.9 ms at this)
PROMPT_THREADS = 1  # one is enough: the Rust part runs with the GIL released


class PromptTooLong(ValueError):
    """A prompt that can never fit ``max_model_len``; ``code`` is the engine's for it."""

    code = "prompt_too_long"


@dataclass(slots=True)
class Prepared:
    """A prompt prepared on the thread: its token ids, or why it is refused."""

    job: Job
    token_ids: list[int] | None  # None: refused
    error: ValueError | None = None


ChatPrompt = Callable[[GenerationRequest], str]


class PromptPrep:
    """Cheap refusals and off-loop tokenizing (see the module docstring).

    Invariant: ``_pending`` holds, in submission order, each submitted job whose result
    :meth:`finished` has not returned yet, with its future.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        chat_text: ChatPrompt,
        *,
        inline_chars: int = INLINE_PROMPT_CHARS,
        threads: int = PROMPT_THREADS,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chat_text = chat_text
        self.inline_chars = inline_chars
        self.bound, why = token_bound_for(tokenizer)
        if self.bound is None:
            log.warning(
                "no cheap bound on prompt length for this tokenizer (%s): long prompts are "
                "tokenized (off the loop) before they can be refused",
                why,
            )
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast = getattr(backend, "encode_batch_fast", None)
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None  # started at the first long prompt
        self._pending: list[tuple[Job, Future[list[int]]]] = []

    # -- on the loop ---------------------------------------------------------------------------
    def check(self, req: GenerationRequest) -> None:
        """Raise :class:`PromptTooLong` if ``req``'s length alone proves it cannot fit (cheap:
        no tokenizing; a length, or one UTF-8 pass over non-ASCII text)."""
        limit = self.max_model_len
        if req.prompt_token_ids is not None:
            if len(req.prompt_token_ids) > limit:
                raise PromptTooLong(
                    f"prompt has {len(req.prompt_token_ids)} tokens; max_model_len is {limit}"
                )
        elif req.prompt is not None:
            self._check_text(req.prompt)

    def off_loop(self, req: GenerationRequest) -> bool:
        """Whether ``req``'s prompt is long enough to be prepared on the thread."""
        if req.prompt is not None:
            return len(req.prompt) > self.inline_chars
        if req.messages is not None:
            return sum(len(m.get("content", "")) for m in req.messages) > self.inline_chars
        return False

    def submit(self, job: Job) -> None:
        """Prepare ``job``'s prompt on the thread (:meth:`finished` hands it back)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="prompt-prep")
        self._pending.append((job, self._pool.submit(self._token_ids, job.request)))

    @property
    def num_pending(self) -> int:
        """Prompts submitted whose result :meth:`finished` has not handed back yet."""
        return len(self._pending)

    def finished(self, timeout_s: float = 0.0) -> list[Prepared]:
        """The prompts prepared since the last call (waiting up to ``timeout_s`` for one)."""
        if not self._pending:
            return []
        if timeout_s > 0:
            wait_futures([f for _, f in self._pending], timeout_s, "FIRST_COMPLETED")
        done: list[Prepared] = []
        left: list[tuple[Job, Future[list[int]]]] = []
        for job, fut in self._pending:
            if not fut.done():
                left.append((job, fut))
                continue
            exc = fut.exception()
            if exc is None:
                done.append(Prepared(job, fut.result()))
            elif isinstance(exc, ValueError):  # PromptTooLong, InvalidRequest, ...
                done.append(Prepared(job, None, exc))
            else:
                done.append(Prepared(job, None, ValueError(f"{type(exc).__name__}: {exc}")))
        self._pending[:] = left
        return done

    def close(self) -> None:
        """Stop the thread (what it is still tokenizing is dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- on the thread -------------------------------------------------------------------------
    def _token_ids(self, req: GenerationRequest) -> list[int]:
        """``req``'s prompt as the engine would tokenize it; :class:`PromptTooLong` past
        ``max_model_len`` (its token ids never made into a list then)."""
        if req.messages is not None:
            text, special = self.chat_text(req), False
        else:
            text, special = req.prompt or "", True
        self._check_text(text)
        if self._fast is None:  # a slow tokenizer: the engine's own call
            enc = self.tokenizer(text, add_special_tokens=special)["input_ids"]
            self._check_count(len(enc))
            return list(enc)
        encoding = self._fast([text], add_special_tokens=special)[0]
        self._check_count(len(encoding))
        ids: list[int] = encoding.ids
        return ids

    def _check_text(self, text: str) -> None:
        bound = self.bound
        if bound is None or len(text) <= self.max_model_len:  # one char is at least one byte
            return
        if bound.min_tokens(text) > self.max_model_len:
            raise PromptTooLong(
                f"prompt has at least {bound.min_tokens(text)} tokens ({utf8_length(text)} "
                f"bytes, at most {bound.max_bytes_per_token} per token); max_model_len is "
                f"{self.max_model_len}"
            )

    def _check_count(self, num_tokens: int) -> None:
        if num_tokens > self.max_model_len:
            raise PromptTooLong(
                f"prompt has {num_tokens} tokens; max_model_len is {self.max_model_len}"
            )
