"""What a request's output must match (structured outputs): a JSON schema, any JSON object, a
regular expression, one of a list of strings, or a grammar.

A :class:`Constraint` travels in the request's sampling parameters; the worker's engine turns it
into a grammar (:meth:`Constraint.grammar`) and masks every step's logits with it
(docs/structured-outputs.md). Building one checks its shape and size (``InvalidRequest`` naming
the field); :meth:`Constraint.check` also compiles it, without a tokenizer, so a spec that can
never work (a schema that is not JSON Schema, a keyword the grammar library does not implement, a
regex or grammar that does not compile) is refused before anything touches Redis.

The grammar library is llguidance, over xgrammar: it has no dependencies (xgrammar pulls torch and
about 1 GB of triton), checks a spec without a tokenizer (so the torch-free client and gateway
refuse exactly what the worker would) and fills masks with the GIL released, so the engine
overlaps that with the forward pass (benchmarks/RESULTS.md, "Grammar libraries").
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

import orjson

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.schema.fields import check_text
from tokenfleet.shared.schema.tools import ToolSpec

if typing.TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tools")
MAX_CONSTRAINT_BYTES = 65_536  # a spec's JSON form at most (schemas, grammars, choice lists)
MAX_CHOICES = 1024
# JSON without free whitespace between tokens (as vLLM's disable_any_whitespace): a small model
# given the choice can emit whitespace until max_tokens and never close the object. A schema's own
# "x-guidance" options still win over these defaults.
_JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False}
MAX_CHOICE_CHARS = 4096


@dataclass(frozen=True, slots=True)
class Constraint:
    """One output constraint. ``kind`` is one of :data:`CONSTRAINT_KINDS`; ``spec`` is, by kind:

    * ``json_schema``: the schema (a JSON object);
    * ``json_object``: None (any JSON object);
    * ``regex``: the pattern (the whole output matches it; Rust ``regex`` syntax);
    * ``choice``: a tuple of non-empty strings (the output is exactly one of them);
    * ``grammar``: a Lark grammar (llguidance's dialect, ``start`` rule) or a GBNF grammar
      (``root ::= ...``, converted to Lark);
    * ``tools``: a :class:`ToolSpec` (the offered functions and ``tool_choice``: the output is
      a valid call, or in mode ``auto`` text or valid calls; ``shared/schema/tools.py``).

    ``name`` is what the caller called it (``response_format.json_schema.name``), for messages.
    Invariant: the JSON form (:meth:`to_dict`) is at most ``MAX_CONSTRAINT_BYTES``.
    """

    kind: str
    spec: Any = None
    name: str | None = None

    def __post_init__(self) -> None:  # noqa: C901, PLR0912 (one check per field, in order)
        field = f"structured.{self.kind}"
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequest(
                f"structured output kind must be one of {', '.join(CONSTRAINT_KINDS)}, got "
                f"{self.kind!r}",
                param="structured",
            )
        if self.kind == "json_schema":
            if isinstance(self.spec, str | bytes):
                try:
                    object.__setattr__(self, "spec", orjson.loads(self.spec))
                except orjson.JSONDecodeError as exc:
                    raise InvalidRequest(
                        f"{field}: the schema is not valid JSON: {exc}", param=field
                    ) from None
            if not isinstance(self.spec, dict):
                raise InvalidRequest(
                    f"{field}: the schema must be a JSON object, got {type(self.spec).__name__}",
                    param=field,
                )
        elif self.kind == "tools":
            if not isinstance(self.spec, ToolSpec):
                object.__setattr__(self, "spec", ToolSpec.from_dict(self.spec))
        elif self.kind == "json_object":
            if self.spec is not None:
                raise InvalidRequest(f"{field} takes no spec", param=field)
        elif self.kind == "choice":
            choices = self.spec
            if isinstance(choices, str) or not isinstance(choices, list | tuple):
                raise InvalidRequest(f"{field} must be a list of strings", param=field)
            if not choices:
                raise InvalidRequest(f"{field} is empty: give at least one choice", param=field)
            if len(choices) > MAX_CHOICES:
                raise InvalidRequest(
                    f"{field} has {len(choices)} choices; the limit is {MAX_CHOICES}", param=field
                )
            for i, c in enumerate(choices):
                _text(f"{field}[{i}]", c, field)
                if not c or len(c) > MAX_CHOICE_CHARS:
                    raise InvalidRequest(
                        f"{field}[{i}] must be 1-{MAX_CHOICE_CHARS} characters", param=field
                    )
            object.__setattr__(self, "spec", tuple(choices))
        else:  # regex, grammar: a non-empty string
            text = _text(field, self.spec, field)
            if not text.strip():
                raise InvalidRequest(f"{field} is empty", param=field)
            object.__setattr__(self, "spec", text)
        if self.name is not None:
            _text("structured.name", self.name, "structured.name")
        try:
            size = len(orjson.dumps(self.to_dict()))
        except TypeError as exc:
            raise InvalidRequest(f"{field} is not JSON-serialisable: {exc}", param=field) from None
        if size > MAX_CONSTRAINT_BYTES:
            raise InvalidRequest(
                f"{field} is {size} bytes encoded; the limit is {MAX_CONSTRAINT_BYTES}",
                param=field,
            )

    @property
    def field(self) -> str:
        """How messages name it."""
        return f"structured.{self.kind}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (in the request's sampling parameters)."""
        out: dict[str, Any] = {"type": self.kind}
        if self.kind == "tools":
            out["spec"] = self.spec.to_dict()
        elif self.kind != "json_object":
            out["spec"] = list(self.spec) if self.kind == "choice" else self.spec
        if self.name is not None:
            out["name"] = self.name
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Constraint:
        """Inverse of :meth:`to_dict`; ``InvalidRequest`` for any other shape."""
        if not isinstance(data, dict) or set(data) - {"type", "spec", "name"}:
            raise InvalidRequest(
                "structured must be an object with 'type', 'spec' and 'name'", param="structured"
            )
        return cls(data.get("type", ""), data.get("spec"), data.get("name"))

    def grammar(self) -> str:
        """The llguidance grammar this constraint stands for (compiled by the worker)."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            return str(LLMatcher.grammar_from_json_schema(self.spec, defaults=_JSON_LAYOUT))
        if self.kind == "json_object":
            any_object = {"type": "object"}
            return str(LLMatcher.grammar_from_json_schema(any_object, defaults=_JSON_LAYOUT))
        if self.kind == "regex":
            return str(LLMatcher.grammar_from_regex(self.spec))
        if self.kind == "tools":
            return str(LLMatcher.grammar_from_lark(self.spec.grammar()))
        if self.kind == "choice":  # JSON string literals are Lark string literals
            return "start: " + " | ".join(orjson.dumps(c).decode() for c in self.spec)
        if "::=" in self.spec and "start:" not in self.spec:  # GBNF (llama.cpp, vLLM)
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                return str(gbnf_to_lark(self.spec))
            except Exception as exc:  # the converter's own parse errors
                raise InvalidRequest(
                    f"{self.field}: the GBNF grammar does not parse: {exc}", param=self.field
                ) from None
        return str(LLMatcher.grammar_from_lark(self.spec))

    def check(self) -> str:
        """Compile the grammar (no tokenizer needed) and return it; ``InvalidRequest`` naming
        the field and the library's reason (an invalid schema, the unimplemented keywords, a
        regex or grammar that does not compile)."""
        from llguidance import LLMatcher

        if self.kind == "tools":  # each function's schema first: the error names its field
            for i, f in enumerate(self.spec.functions):
                try:
                    Constraint("json_schema", f.params).check()
                except InvalidRequest as exc:
                    where = f"tools[{i}].function.parameters"
                    raise InvalidRequest(
                        str(exc).replace("structured.json_schema", where, 1), param=where
                    ) from None
        try:
            grammar = self.grammar()
        except ValueError as exc:
            raise InvalidRequest(f"{self.field}: {exc}", param=self.field) from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            reason = messages[0].strip() if messages else "it does not compile"
            raise InvalidRequest(
                f"{self.field} cannot be used: {_unsupported(reason)}", param=self.field
            )
        return grammar


def _text(name: str, value: Any, param: str) -> str:
    try:
        return check_text(name, value)
    except InvalidRequest as exc:
        raise InvalidRequest(str(exc), param=param) from None


def _unsupported(reason: str) -> str:
    """llguidance's message, with its "Unimplemented keys" said as what it means here."""
    if reason.startswith("Unimplemented keys:"):
        keys = reason.partition(":")[2].strip()
        return f"unsupported JSON Schema keyword(s) {keys} (docs/structured-outputs.md)"
    return reason
