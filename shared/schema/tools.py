"""Tool calling (OpenAI's ``tools`` + ``tool_choice``): the offered functions, the grammar a
call is written in, and how an output is read back into calls.

A call is written in the output as (the Hermes / Qwen format, which many chat models know)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, several separated by a newline when parallel calls are allowed. A
:class:`ToolSpec` travels in the request as a ``Constraint`` of kind ``tools``; its
:meth:`ToolSpec.grammar` makes ``required`` and a named function a valid call (arguments valid
against the function's ``parameters`` schema, checked by the same grammar path as JSON schemas),
and ``auto`` either plain text that never contains ``<tool_call>`` or valid calls, so a call is
always parseable. ``tool_choice: none`` asks for nothing: no spec, no tools in the prompt.

Conversation messages may carry an assistant turn's ``tool_calls`` (OpenAI's shape, arguments
as a JSON string) and ``role: "tool"`` results with their ``tool_call_id``
(:func:`check_tool_message`). How they reach the model is the worker's business
(``worker/service/chat_render.py``, docs/structured-outputs.md).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.schema.fields import check_text

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_MODES = ("auto", "required", "named")
MAX_TOOLS = 128
MAX_DESCRIPTION_CHARS = 8192
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True, slots=True)
class ToolFunction:
    """One offered function. ``parameters`` is its arguments' JSON schema (``{"type":
    "object"}`` when the caller gave none)."""

    name: str
    description: str = ""
    parameters: Any = None  # (None reads as {"type": "object"})

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's ``function`` object."""
        return {"name": self.name, "description": self.description, "parameters": self.params}

    @property
    def params(self) -> dict[str, Any]:
        """The arguments' schema (never None)."""
        return self.parameters if isinstance(self.parameters, dict) else {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """What tools a request offers and how it must use them.

    ``mode``: ``auto`` (text or calls), ``required`` (one call or more), ``named`` (a call of
    ``name``). ``parallel``: several calls may follow each other (OpenAI's
    ``parallel_tool_calls``, default true); ``named`` is always one call.
    Invariants: function names are unique and valid; ``name`` is one of them iff ``mode`` is
    ``named``.
    """

    functions: tuple[ToolFunction, ...]
    mode: str = "auto"
    name: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.mode not in TOOL_MODES:
            raise InvalidRequest(
                f"tool mode must be one of {', '.join(TOOL_MODES)}, got {self.mode!r}",
                param="tool_choice",
            )
        names = [f.name for f in self.functions]
        if len(set(names)) != len(names):
            raise InvalidRequest("tools name the same function twice", param="tools")
        if (self.mode == "named") != (self.name is not None):
            raise InvalidRequest(
                "tool_choice names a function only in mode named", param="tool_choice"
            )
        if self.name is not None and self.name not in names:
            raise InvalidRequest(
                f"tool_choice names the function '{self.name}', which tools does not offer "
                f"({', '.join(names)})",
                param="tool_choice",
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the ``spec`` of a ``tools`` constraint)."""
        return {
            "functions": [f.to_dict() for f in self.functions],
            "mode": self.mode,
            "name": self.name,
            "parallel": self.parallel,
        }

    @classmethod
    def from_dict(cls, data: Any) -> ToolSpec:
        """Inverse of :meth:`to_dict` (checked as a caller's ``tools`` would be)."""
        if not isinstance(data, dict) or set(data) != {"functions", "mode", "name", "parallel"}:
            raise InvalidRequest(
                "structured.tools must be an object with functions, mode, name and parallel",
                param="structured.tools",
            )
        functions = data["functions"]
        if not isinstance(functions, list):
            raise InvalidRequest(
                "structured.tools.functions must be a list", param="structured.tools"
            )
        parallel = data["parallel"]
        if not isinstance(parallel, bool):
            raise InvalidRequest(
                "structured.tools.parallel must be a bool", param="structured.tools"
            )
        return cls(
            tuple(_function(f"tools[{i}].function", f) for i, f in enumerate(functions)),
            data["mode"],
            data["name"],
            parallel,
        )

    def callable(self) -> tuple[ToolFunction, ...]:
        """The functions the output may call (``named``: that one only)."""
        if self.name is None:
            return self.functions
        return tuple(f for f in self.functions if f.name == self.name)

    def grammar(self) -> str:
        """The Lark grammar (llguidance's dialect: ``%json`` for each function's arguments) of
        what the output may be (module doc)."""
        functions = self.callable()
        rules = [
            f"call_{i}: {_lark_str(_call_head(f.name))} %json {_compact(f.params)} "
            f"{_lark_str(_CALL_TAIL)}"
            for i, f in enumerate(functions)
        ]
        call = "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))
        many = self.parallel and self.mode != "named"
        calls = 'calls: call ("\\n" call)*' if many else "calls: call"
        if self.mode == "auto":  # text that never opens a call, or calls
            start = "start: calls | TEXT\nTEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/"
        else:
            start = "start: calls"
        return "\n".join([start, calls, call, *rules])


_CALL_TAIL = "}\n" + TOOL_CALL_CLOSE


def _call_head(name: str) -> str:
    return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": '


def _lark_str(text: str) -> str:
    return orjson.dumps(text).decode()  # a JSON string literal is a Lark string literal


def _compact(schema: Any) -> str:
    return orjson.dumps(schema).decode()


def _function(where: str, value: Any) -> ToolFunction:
    """One function object (OpenAI's ``name``, ``description``, ``parameters``, ``strict``)."""
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"{where} must be an object with a 'name'", param=where)
    unknown = set(value) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise InvalidRequest(
            f"{where} has unknown key(s): {', '.join(sorted(unknown))}", param=where
        )
    name = value.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidRequest(
            f"{where}.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
            param=f"{where}.name",
        )
    description = value.get("description") or ""
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS:
        raise InvalidRequest(
            f"{where}.description must be a string of at most {MAX_DESCRIPTION_CHARS} characters",
            param=f"{where}.description",
        )
    check_text(f"{where}.description", description)
    parameters = value.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise InvalidRequest(
            f"{where}.parameters must be a JSON schema (an object)", param=f"{where}.parameters"
        )
    if "strict" in value and not isinstance(value["strict"], bool | None):
        raise InvalidRequest(f"{where}.strict must be a boolean", param=f"{where}.strict")
    schema = dict(parameters) if parameters is not None else {"type": "object"}
    return ToolFunction(name, description, schema)


def tool_spec_of(
    tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None
) -> ToolSpec | None:
    """OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as a spec (None: no
    tools offered, or ``tool_choice: "none"``); ``InvalidRequest`` names the field.

    ``tool_choice`` is ``"auto"`` (the default with tools), ``"none"``, ``"required"`` or
    ``{"type": "function", "function": {"name": NAME}}``; without tools only ``"none"`` (or
    nothing) is accepted, as OpenAI does."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if not tools:
        if tools is not None and not isinstance(tools, list | tuple):
            raise InvalidRequest("tools must be a list of function tools", param="tools")
        if tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools: none were given", param="tool_choice")
        return None
    if not isinstance(tools, list | tuple):
        raise InvalidRequest("tools must be a list of function tools", param="tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise InvalidRequest(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}: only function "
                "tools are supported",
                param=f"tools[{i}].type",
            )
        if set(tool) - {"type", "function"} or "function" not in tool:
            raise InvalidRequest(
                f"tools[{i}] must have exactly 'type' and 'function'", param=f"tools[{i}]"
            )
        functions.append(_function(f"tools[{i}].function", tool["function"]))
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequest(
                f"tools[{i}].function.name '{name}' is offered twice",
                param=f"tools[{i}].function.name",
            )
    mode, named = _choice(tool_choice)
    if mode == "none":
        return None
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolSpec(tuple(functions), mode, named, parallel)


def _choice(value: Any) -> tuple[str, str | None]:
    if value is None or value == "auto":
        return "auto", None
    if value in ("none", "required"):
        return value, None
    if (
        isinstance(value, Mapping)
        and value.get("type") == "function"
        and set(value) == {"type", "function"}
        and isinstance(value["function"], Mapping)
        and set(value["function"]) == {"name"}
        and isinstance(value["function"]["name"], str)
    ):
        return "named", value["function"]["name"]
    raise InvalidRequest(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
        f"{{'name': NAME}}}}, got {value!r}",
        param="tool_choice",
    )


# -- conversation messages -------------------------------------------------------------------

MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})


def check_tool_message(i: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """The tool parts of ``messages[i]`` (an assistant's ``tool_calls``; a ``tool`` message's
    ``tool_call_id``), checked and in the wire's form; {} when it has none."""
    out: dict[str, Any] = {}
    role = message.get("role")
    calls = message.get("tool_calls")
    if calls is not None:
        where = f"messages[{i}].tool_calls"
        if role != "assistant":
            raise InvalidRequest(f"{where}: only an assistant message has tool_calls", param=where)
        if not isinstance(calls, list | tuple) or not calls:
            raise InvalidRequest(f"{where} must be a non-empty list", param=where)
        out["tool_calls"] = [_wire_call(f"{where}[{j}]", c) for j, c in enumerate(calls)]
    call_id = message.get("tool_call_id")
    if role == "tool":
        where = f"messages[{i}].tool_call_id"
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequest(f"{where} is required on a tool message", param=where)
        out["tool_call_id"] = check_text(where, call_id)
    elif call_id is not None:
        raise InvalidRequest(
            f"messages[{i}].tool_call_id: only a tool message has one",
            param=f"messages[{i}].tool_call_id",
        )
    return out


def _wire_call(where: str, call: Any) -> dict[str, Any]:
    if (
        not isinstance(call, Mapping)
        or call.get("type", "function") != "function"
        or not isinstance(call.get("function"), Mapping)
        or set(call) - {"id", "type", "function"}
    ):
        raise InvalidRequest(
            f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
            param=where,
        )
    fn = call["function"]
    name, arguments = fn.get("name"), fn.get("arguments", "{}")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidRequest(
            f"{where}.function.name must be a function name", param=f"{where}.function.name"
        )
    if not isinstance(arguments, str):
        raise InvalidRequest(
            f"{where}.function.arguments must be a JSON string",
            param=f"{where}.function.arguments",
        )
    try:
        orjson.loads(arguments)
    except orjson.JSONDecodeError:
        raise InvalidRequest(
            f"{where}.function.arguments is not valid JSON",
            param=f"{where}.function.arguments",
        ) from None
    call_id = call.get("id", "")
    if not isinstance(call_id, str):
        raise InvalidRequest(f"{where}.id must be a string", param=f"{where}.id")
    return {
        "id": check_text(f"{where}.id", call_id),
        "type": "function",
        "function": {"name": name, "arguments": check_text(f"{where}.arguments", arguments)},
    }


def call_block(name: str, arguments: str) -> str:
    """One call as the output writes it (arguments: a JSON string, written compactly)."""
    args = _compact(orjson.loads(arguments)) if arguments.strip() else "{}"
    return f"{_call_head(name)}{args}{_CALL_TAIL}"


# -- reading an output back -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call read from an output: ``arguments`` is its JSON text, as OpenAI sends it."""

    name: str
    arguments: str

    def to_openai(self, call_id: str) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` element."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def call_id(request_id: str, index: int) -> str:
    """The id of a request's ``index``-th call: the same wherever and whenever it is read
    (a resumed stream, ``GET``), so it is derived, not random."""
    digest = hashlib.blake2b(f"{request_id}:{index}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"


def parse_calls(text: str) -> tuple[list[ToolCall], int]:
    """The complete calls at the start of ``text`` (after any whitespace) and how many
    characters they span; ``([], 0)`` when ``text`` does not open with a call."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    at = end = len(text) - len(text.lstrip())
    while text.startswith(TOOL_CALL_OPEN, at):
        pos = _skip_ws(text, at + len(TOOL_CALL_OPEN))
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        pos = _skip_ws(text, pos)
        if not text.startswith(TOOL_CALL_CLOSE, pos) or not _is_call(obj):
            break
        args = obj.get("arguments", {})
        calls.append(ToolCall(obj["name"], orjson.dumps(args).decode()))
        end = pos + len(TOOL_CALL_CLOSE)
        at = _skip_ws(text, end)
    return calls, end if calls else 0


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _is_call(obj: Any) -> bool:
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("name"), str)
        and isinstance(obj.get("arguments", {}), dict)
    )


def opens_call(text: str) -> bool | None:
    """Does an output that starts with ``text`` open with a call? None: not known yet (only
    whitespace, or a prefix of ``<tool_call>``)."""
    stripped = text.lstrip()
    if stripped.startswith(TOOL_CALL_OPEN):
        return True
    if TOOL_CALL_OPEN.startswith(stripped):
        return None
    return False
