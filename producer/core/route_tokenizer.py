"""``RouteTokenizer``: a prompt's routing chain, tokenized exactly as the model's workers do.

Built from the ``RouteSpec`` a worker published (``shared.route_spec``): the fast tokenizer's
JSON loaded with ``tokenizers`` (Rust; no torch, no transformers), the chat template rendered
with Jinja2 the way transformers renders it (a sandboxed environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter, ``raise_exception`` and
``strftime_now``, the special tokens as variables, ``add_generation_prompt=True``). Then the
chain is ``prefix_chain(token_ids, block_size)``: the engine's own block hashes.

Routing is an optimisation, so nothing here refuses a request: a template this module cannot
render (or that raises for these messages) gives an empty chain, and the request is routed by
its session or goes to the shared stream. Only the leading ``max_chars`` of a long text
are tokenized (the chain covers at most ``MAX_LINKS`` links); the tokens nearest the cut are
dropped, since a cut can change how the last word is split.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from redis.commands.core import HashCommands

from tokenfleet.producer.core.effects import Command, Compute, Plan
from tokenfleet.producer.core.request import Prepared
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.prefix_chain import link_positions, prefix_chain
from tokenfleet.shared.record import as_str
from tokenfleet.shared.route_spec import RouteSpec

log = logging.getLogger(__name__)
ROUTE_SPEC_TTL_S = 30.0  # how often a client re-reads a model's route tokenizer digest

_CUT_MARGIN_TOKENS = 8  # tokens dropped at the end of a cut text
# Route inputs up to this many characters are tokenized in place; longer ones (about 0.2 ms of
# tokenizing and more) off the asyncio event loop (``effects.Compute``), worth the thread hop.
INLINE_ROUTE_CHARS = 1000


def route_input_size(route_input: tuple[Any, Any, Any] | None) -> int:
    """About how many characters a route input (prompt, messages, token ids) has to tokenize."""
    if route_input is None:
        return 0
    prompt, messages, token_ids = route_input
    if token_ids is not None:
        return 0  # hashed, not tokenized
    if messages is not None:
        return sum(len(str(m.get("content") or "")) for m in messages)
    return len(prompt or "")


def _raise(message: str) -> None:
    raise ValueError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _generation_tag() -> Any:
    """A Jinja extension for ``{% generation %}...{% endgeneration %}`` (transformers marks
    assistant text with it for training masks): rendered as its body, as transformers does."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}  # noqa: RUF012 - jinja2's own class attribute

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


def _compile(template: str) -> Any:
    """The Jinja template object, or None where it does not compile here."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_tag()]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError:
        return None


class RouteTokenizer:
    """One model's prompt -> chain (module doc). Immutable once built; safe to share."""

    def __init__(self, spec: RouteSpec) -> None:
        from tokenizers import Tokenizer

        self.digest = spec.digest
        self.block_size = spec.block_size
        self._tokenizer = Tokenizer.from_str(spec.tokenizer)
        # as transformers calls it: the file's own truncation and padding do not apply
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._fast = getattr(self._tokenizer, "encode_batch_fast", None)  # tokenizers >= 0.21
        self._template = _compile(spec.chat_template) if spec.chat_template else None
        self._special = dict(spec.special)
        # tokens the chain can use at most, and (generously) the characters that hold them
        self.max_tokens = (link_positions()[-1] + 1) * spec.block_size + 1
        self.max_chars = 16 * self.max_tokens

    def chain(
        self,
        *,
        prompt: str | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> tuple[str, ...]:
        """The request's chain; empty when there is nothing to route by."""
        if prompt_token_ids is not None:
            return prefix_chain(prompt_token_ids, self.block_size)
        if messages is not None:
            if self._template is None:
                return ()
            try:
                text = self._template.render(
                    messages=list(messages),
                    tools=None,
                    documents=None,
                    add_generation_prompt=True,
                    **self._special,
                )
            except Exception:  # a template that refuses these messages: route without a chain
                return ()
            return self._chain_of_text(text, special=False)
        if prompt:
            return self._chain_of_text(prompt, special=True)
        return ()

    def _chain_of_text(self, text: str, *, special: bool) -> tuple[str, ...]:
        cut = len(text) > self.max_chars
        piece = text[: self.max_chars] if cut else text
        if self._fast is not None:  # no offsets computed: about half the time
            ids = self._fast([piece], add_special_tokens=special)[0].ids
        else:
            ids = self._tokenizer.encode(piece, add_special_tokens=special).ids
        if cut:
            ids = ids[: max(0, len(ids) - _CUT_MARGIN_TOKENS)]
        return prefix_chain(ids, self.block_size)


def compute_chains(work: list[tuple[Prepared, RouteTokenizer]]) -> Plan[list[tuple[str, ...]]]:
    """The chains of ``work``, in order: computed here when their inputs are short, else in one
    ``Compute`` (the asyncio face runs it on a thread: a long prompt's tokenizing does not hold
    up the event loop)."""

    def run() -> list[tuple[str, ...]]:
        return [chain_of(p, tok) for p, tok in work]

    if sum(route_input_size(p.route_input) for p, _ in work) <= INLINE_ROUTE_CHARS:
        return run()
    chains: list[tuple[str, ...]] = yield Compute(run)
    return chains


def chain_of(prepared: Prepared, tokenizer: RouteTokenizer) -> tuple[str, ...]:
    """The routing chain of ``prepared``'s route input (empty without one)."""
    if prepared.route_input is None:
        return ()
    prompt, messages, token_ids = prepared.route_input
    return tokenizer.chain(prompt=prompt, messages=messages, prompt_token_ids=token_ids)


def build_route_tokenizer(raw: Mapping[bytes, bytes], model: str) -> RouteTokenizer | None:
    """The ``RouteTokenizer`` of a published spec; None (and a warning) if it cannot be built."""
    spec = RouteSpec.from_hash(raw)
    if spec is None:
        log.warning("tokenfleet: the route tokenizer of model %r is malformed; not used", model)
        return None
    try:
        return RouteTokenizer(spec)
    except Exception as exc:  # tokenizers missing, or a tokenizer JSON it cannot read
        log.warning("tokenfleet: cannot build model %r's route tokenizer: %s", model, exc)
        return None


class RouteTokenizers:
    """One client's ``RouteTokenizer`` per model, read from ``Keys.route_tokenizer``: the digest
    is re-read every ``ROUTE_SPEC_TTL_S`` (the spec itself only when it changed), and every
    ``absent_ttl_s`` while no worker has published one."""

    def __init__(self, keys: Keys, absent_ttl_s: float) -> None:
        self._keys = keys
        self._absent_ttl_s = absent_ttl_s
        self._cache: dict[str, tuple[float, RouteTokenizer | None]] = {}  # model -> (read at, it)

    def get(self, model: str) -> Plan[RouteTokenizer | None]:
        """``model``'s tokenizer (None: none published yet, or it cannot be built here)."""
        now = time.monotonic()
        cached = self._cache.get(model)
        if cached is not None:
            age, tok = now - cached[0], cached[1]
            if age < (ROUTE_SPEC_TTL_S if tok is not None else self._absent_ttl_s):
                return tok
        key = self._keys.for_model(model).route_tokenizer(model)  # (in the model's lane)
        digest = as_str((yield Command(HashCommands.hget, (key, "digest"))))
        tok = cached[1] if cached is not None else None
        if digest is None:
            tok = None
        elif tok is None or tok.digest != digest:
            tok = build_route_tokenizer((yield Command(HashCommands.hgetall, (key,))), model)
        self._cache[model] = (now, tok)
        return tok
