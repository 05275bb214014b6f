"""The ways a caller asks for structured output, reduced to one :class:`Constraint`.

``submit()`` takes ``response_format=`` (OpenAI's shapes, or a Pydantic model class),
``json_schema=`` (a schema dict, a JSON string or a Pydantic model class), ``regex=``,
``choice=``, ``grammar=`` — at most one of them; the gateway passes OpenAI's ``response_format``
and vLLM's ``structured_outputs`` through the same functions. Every constraint is compiled once
here (without a tokenizer; ``Constraint.check``) so a spec that can never work is refused
before anything touches Redis; the result is remembered by the constraint's JSON form, so a
batch of 10,000 requests with one schema compiles it once.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import orjson

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.schema import Constraint, tool_spec_of

STRUCTURED_FIELDS = ("response_format", "json_schema", "regex", "choice", "grammar")


def schema_of(value: Any, field: str) -> dict[str, Any]:
    """A JSON schema given as a dict, a JSON string, or a Pydantic model class."""
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        schema = value.model_json_schema()
        return dict(schema)
    if isinstance(value, str | bytes):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"{field} is not valid JSON: {exc}", param=field) from None
    if not isinstance(value, Mapping):
        raise InvalidRequest(
            f"{field} must be a JSON schema (an object) or a Pydantic model class, got "
            f"{type(value).__name__}",
            param=field,
        )
    return dict(value)


def from_response_format(value: Any, field: str = "response_format") -> Constraint | None:
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with ``name``,
    ``schema``, ``strict``), or a Pydantic model class; None for ``text``."""
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        return Constraint("json_schema", schema_of(value, field), value.__name__)
    if not isinstance(value, Mapping):
        raise InvalidRequest(
            f"{field} must be an object with a 'type' or a Pydantic model class", param=field
        )
    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return Constraint("json_object")
    if kind == "json_schema" and set(value) == {"type", "json_schema"}:
        spec = value["json_schema"]
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise InvalidRequest(
                f"{field}.json_schema must be an object with 'name' and 'schema'",
                param=f"{field}.json_schema",
            )
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise InvalidRequest(
                f"{field}.json_schema has unknown key(s): {', '.join(sorted(unknown))}",
                param=f"{field}.json_schema",
            )
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequest(
                f"{field}.json_schema.name must be a string", param=f"{field}.json_schema.name"
            )
        schema = schema_of(spec["schema"], f"{field}.json_schema.schema")
        return Constraint("json_schema", schema, name)
    raise InvalidRequest(
        f"{field} must be {{'type': 'text'}}, {{'type': 'json_object'}} or {{'type': "
        f"'json_schema', 'json_schema': {{'name', 'schema'}}}}, got {dict(value)!r}",
        param=field,
    )


def constraint_of(
    *,
    response_format: Any = None,
    json_schema: Any = None,
    regex: Any = None,
    choice: Any = None,
    grammar: Any = None,
) -> Constraint | None:
    """The one constraint the keyword arguments ask for (None: free text), checked
    (``InvalidRequest`` names the argument)."""
    given = {
        name: value
        for name, value in (
            ("response_format", response_format),
            ("json_schema", json_schema),
            ("regex", regex),
            ("choice", choice),
            ("grammar", grammar),
        )
        if value is not None
    }
    if len(given) > 1:
        raise InvalidRequest(
            f"give at most one of {', '.join(STRUCTURED_FIELDS)} (got {', '.join(given)})",
            param=next(iter(given)),
        )
    if not given:
        return None
    name, value = next(iter(given.items()))
    constraint: Constraint | None
    if isinstance(value, Constraint):
        constraint = value
    elif name == "response_format":
        constraint = from_response_format(value)
    elif name == "json_schema":
        constraint = Constraint("json_schema", schema_of(value, name))
    else:
        constraint = _with_param(name, lambda: Constraint(name, value))
    if constraint is not None:
        checked(constraint, name)
    return constraint


def tools_constraint(
    other: Constraint | None, tools: Any, tool_choice: Any, parallel_tool_calls: Any
) -> Constraint | None:
    """``other`` (a structured output), or the ``tools`` constraint OpenAI's ``tools``,
    ``tool_choice`` and ``parallel_tool_calls`` ask for (checked and compiled, each function's
    ``parameters`` named on its own); the two cannot be combined (``InvalidRequest``)."""
    spec = tool_spec_of(tools, tool_choice, parallel_tool_calls)
    if spec is None:
        return other
    if other is not None:
        raise InvalidRequest(
            "tools (with tool_choice auto, required or a function) cannot be combined with "
            f"{other.field.replace('structured.', '')}: send one of them",
            param="tools",
        )
    constraint = Constraint("tools", spec)
    checked(constraint, "tools")
    return constraint


def _with_param(name: str, make: Any) -> Constraint:
    try:
        result: Constraint = make()
    except InvalidRequest as exc:
        raise InvalidRequest(str(exc).replace(f"structured.{name}", name), param=name) from None
    return result


def checked(constraint: Constraint, param: str | None = None) -> None:
    """Compile ``constraint`` (cached by its JSON form); ``InvalidRequest`` naming ``param``."""
    key = orjson.dumps(constraint.to_dict(), option=orjson.OPT_SORT_KEYS)
    found = _compile_error(key)
    if found is not None:
        error, named = found
        if named != constraint.field:  # the library named a part (a tool's parameters)
            raise InvalidRequest(error, param=named)
        if param is not None:  # name it as the caller did
            error = error.replace(constraint.field, param, 1)
        raise InvalidRequest(error, param=param or constraint.field)


@functools.lru_cache(maxsize=512)
def _compile_error(key: bytes) -> tuple[str, str] | None:
    """(message, the field it names) of a constraint that does not compile; None if it does."""
    constraint = Constraint.from_dict(orjson.loads(key))
    try:
        constraint.check()
    except InvalidRequest as exc:
        return str(exc), exc.param or constraint.field
    return None
