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
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from tokenfleet.shared.prefix_chain import link_positions, prefix_chain
from tokenfleet.shared.route_spec import RouteSpec

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
