"""OpenAI request bodies → the producer's ``submit`` arguments.

The body models are pydantic (strict: ``"1"`` is not a number, ``true`` is not an integer), so
a wrong type is a 400 that names the field. Every field OpenAI defines that tokenfleet does not
support is refused with a 400 naming it when it asks for something (penalties other than 0,
``logit_bias``, the deprecated ``functions``, ...); it is accepted when it holds the value that
means "off". A field OpenAI does
not define and we do not add is refused too: nothing is silently ignored.

Structured outputs and logprobs (docs/structured-outputs.md): chat's ``response_format``
(``text``, ``json_object``, ``json_schema``), vLLM's ``structured_outputs`` on both endpoints
(``json``, ``json_object``, ``regex``, ``choice``, ``grammar``), chat's ``logprobs`` +
``top_logprobs`` and completions' ``logprobs: k``. A bad spec is a 400 naming the field.

Tools (docs/structured-outputs.md, "Tools"): chat's ``tools``, ``tool_choice`` and
``parallel_tool_calls``; an assistant message's ``tool_calls`` and ``role: "tool"`` messages
with their ``tool_call_id``. The answer's text is read back into ``message.tool_calls``
(``responses``; ``tool_stream`` when streamed).

Extensions (docs/gateway.md): ``priority`` (critical | normal | batch), ``deadline_s``,
``top_k``, ``ignore_eos``, ``stop_token_ids``, ``structured_outputs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from tokenfleet.producer.core.structured import constraint_of, tools_constraint
from tokenfleet.producer.gateway.errors import ApiError
from tokenfleet.producer.gateway.identity import Kind
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.schema import MAX_TOP_LOGPROBS, Constraint
from tokenfleet.shared.schema.tools import check_tool_message

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # what OpenAI's legacy completions endpoint defaults to
JSON_OBJECT = {"type": "json_object"}


class StreamOptions(BaseModel):
    """``stream_options``: only ``include_usage``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (sent through the SDKs' ``extra_body``): one of these."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Common(BaseModel):
    """Fields both endpoints share. ``extra="allow"`` so unknown fields reach
    :func:`_refuse_unsupported`, which names them (pydantic's own message is less clear)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extensions
    priority: str | None = None
    deadline_s: float | None = None
    top_k: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputs | None = None
    # OpenAI fields we accept only when they ask for nothing
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None


class CompletionBody(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    """One part of a message's content: only text parts are supported."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: str
    text: str | None = None


class Message(BaseModel):
    """One chat message. ``name`` is accepted and not used (documented); ``tool_calls`` (an
    assistant's) and ``tool_call_id`` (a tool result's) are checked by
    ``shared.schema.tools.check_tool_message``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class ChatBody(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None


# field -> test that the value asks for nothing (so accepting it ignores nothing)
_OFF: dict[str, Callable[[Any], bool]] = {
    "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0,
    "logit_bias": lambda v: not v,
    "service_tier": lambda v: v in ("auto", "default"),
    "echo": lambda v: v is False,
    "best_of": lambda v: v == 1,
    "suffix": lambda v: v == "",
    "functions": lambda v: not v,  # deprecated by OpenAI: send tools
    "function_call": lambda v: v == "none",
    "store": lambda v: v is False,
}
_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


@dataclass(frozen=True, slots=True)
class Submission:
    """A parsed body: what to submit, and how to answer."""

    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    params: dict[str, Any]  # submit() keyword arguments, without request_id / priority
    priority: str | None  # from the body (the header is the route's)
    estimated_tokens: int  # prompt (about 4 characters a token) + max_tokens: what TPM charges
    tools: bool = False  # tools were offered: the answer's text is read back into tool_calls
    n: int = 1  # choices: n > 1 is n requests, <id>.0 .. <id>.n-1 (gateway.submit, choices.py)


def _refuse_unsupported(body: _Common) -> None:
    for name in sorted(body.model_extra or {}):
        raise ApiError(400, f"unknown parameter '{name}'", code="unknown_parameter", param=name)
    for name, is_off in _OFF.items():
        value = getattr(body, name, None)
        if value is not None and not is_off(value):
            raise ApiError(
                400,
                f"'{name}' = {value!r} is not supported by tokenfleet",
                code="unsupported_parameter",
                param=name,
            )
    if body.stream_options is not None and not body.stream:
        raise ApiError(
            400, "stream_options is only allowed with stream: true", param="stream_options"
        )


def _structured(body: _Common, params: dict[str, Any]) -> None:
    """``structured_outputs`` (and chat's ``response_format``) as submit()'s arguments; a bad
    spec is a 400 naming the field (checked here, before the key is charged)."""
    so = body.structured_outputs
    given: list[tuple[str, str, Any]] = []  # (param name in the body, submit keyword, value)
    if so is not None:
        if so.json_ is not None:
            given.append(("structured_outputs.json", "json_schema", so.json_))
        if so.json_object:
            given.append(("structured_outputs.json_object", "response_format", JSON_OBJECT))
        for name in ("regex", "choice", "grammar"):
            value = getattr(so, name)
            if value is not None:
                given.append((f"structured_outputs.{name}", name, value))
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format != {"type": "text"}:
        given.append(("response_format", "response_format", response_format))
    if len(given) > 1:
        raise ApiError(
            400,
            f"give one structured output, not {len(given)} ({', '.join(g[0] for g in given)})",
            param=given[1][0],
        )
    if not given:
        return
    param, keyword, value = given[0]
    try:
        constraint_of(**{keyword: value})
    except InvalidRequest as exc:
        message, named = str(exc), exc.param or keyword
        if param != "response_format":  # named as the body names it
            message, named = message.replace(named, param, 1), param
        raise ApiError(400, message, code="invalid_structured_output", param=named) from None
    params[keyword] = value


def _logprobs(body: _Common, params: dict[str, Any], kind: Kind) -> None:
    """Chat's ``logprobs: true`` + ``top_logprobs`` (0-20); completions' ``logprobs: k``."""
    lp, top = body.logprobs, body.top_logprobs
    if kind == "completion":
        if top is not None:
            raise ApiError(
                400, "top_logprobs is a chat parameter: send logprobs: k", param="top_logprobs"
            )
        if lp is None or lp is False:
            return
        if isinstance(lp, bool) or not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise ApiError(
                400,
                f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {lp!r}",
                param="logprobs",
            )
        params["logprobs"], params["top_logprobs"] = True, lp
        return
    if lp is not None and not isinstance(lp, bool):
        raise ApiError(400, f"logprobs must be a boolean, got {lp!r}", param="logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400,
            f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top}",
            param="top_logprobs",
        )
    if top and not lp:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if lp:
        params["logprobs"], params["top_logprobs"] = True, top or 0


def _sampling(body: _Common, max_tokens: int | None, default_max: int) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": default_max if max_tokens is None else max_tokens}
    for name in ("temperature", "top_p", "seed", "top_k", "ignore_eos"):
        value = getattr(body, name)
        if value is not None:
            params[name] = value
    if body.stop is not None:
        params["stop"] = body.stop
    if body.stop_token_ids is not None:
        params["stop_token_ids"] = body.stop_token_ids
    if body.deadline_s is not None:
        params["deadline_s"] = body.deadline_s
    if body.user is not None:
        params["metadata"] = {"user": body.user}
    return params


def _submission(
    kind: Kind, body: _Common, params: dict[str, Any], prompt_size: int, *, tools: bool = False
) -> Submission:
    return Submission(
        kind,
        body.model,
        body.stream,
        bool(body.stream_options and body.stream_options.include_usage),
        params,
        body.priority,
        prompt_size + _n(body) * params["max_tokens"],
        tools,
        _n(body),
    )


def _n(body: _Common) -> int:
    """``n`` (1 when absent); below 1 is a 400 (the gateway's limit is checked at submit)."""
    if body.n is None:
        return 1
    if body.n < 1:
        raise ApiError(400, f"n must be at least 1, got {body.n}", param="n")
    return body.n


def completion_submission(body: CompletionBody) -> Submission:
    """A ``/v1/completions`` body as a submission (``ApiError`` 400 names what is wrong)."""
    _refuse_unsupported(body)
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(
                400, "a list of several prompts is not supported: send one", param="prompt"
            )
        prompt = prompt[0]
    params = _sampling(body, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
    _structured(body, params)
    _logprobs(body, params, "completion")
    params["prompt"] = prompt
    size = len(prompt) // 4 if isinstance(prompt, str) else len(prompt)
    return _submission("completion", body, params, size)


def _message_text(i: int, message: Message) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise ApiError(
                400,
                f"messages[{i}].content[{j}] is a '{part.type}' part: only text is supported",
                param=f"messages[{i}].content[{j}]",
            )
        texts.append(part.text)
    return "".join(texts)


def chat_submission(body: ChatBody, default_max_tokens: int) -> Submission:
    """A ``/v1/chat/completions`` body as a submission."""
    _refuse_unsupported(body)
    messages = []
    for i, message in enumerate(body.messages):
        role = _ROLES.get(message.role)
        if role is None:
            raise ApiError(
                400,
                f"messages[{i}].role '{message.role}' is not supported "
                "(system, developer, user, assistant, tool)",
                param=f"messages[{i}].role",
            )
        wire: dict[str, Any] = {"role": role, "content": _message_text(i, message)}
        if message.tool_calls is not None:
            wire["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            wire["tool_call_id"] = message.tool_call_id
        try:
            wire.update(check_tool_message(i, wire))
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), code="invalid_request", param=exc.param) from None
        messages.append(wire)
    both = body.max_tokens is not None and body.max_completion_tokens is not None
    if both and body.max_tokens != body.max_completion_tokens:
        raise ApiError(
            400,
            "max_tokens and max_completion_tokens disagree: send one",
            param="max_completion_tokens",
        )
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else None
    params = _sampling(body, limit if limit is not None else body.max_tokens, default_max_tokens)
    _structured(body, params)
    offered = _tools(body, params)
    _logprobs(body, params, "chat")
    params["messages"] = messages
    size = (sum(len(m["content"]) for m in messages) + offered) // 4
    return _submission("chat", body, params, size, tools=offered > 0)


def _tools(body: ChatBody, params: dict[str, Any]) -> int:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as submit()'s arguments, checked
    and compiled here (a 400 names the field, before the key is charged); the offered tools'
    size in characters (0: no tools in play: none offered, or ``tool_choice: "none"``)."""
    other = None
    if any(k in params for k in ("response_format", "json_schema", "regex", "choice", "grammar")):
        other = Constraint("json_object")  # stands for the structured output already given
    try:
        constraint = tools_constraint(other, body.tools, body.tool_choice, body.parallel_tool_calls)
    except InvalidRequest as exc:
        message = str(exc)
        if other is not None and exc.param == "tools":
            message = "tools cannot be combined with response_format or structured_outputs"
        raise ApiError(400, message, code="invalid_tools", param=exc.param or "tools") from None
    if constraint is None or constraint.kind != "tools":
        return 0
    params["tools"] = body.tools
    if body.tool_choice is not None:
        params["tool_choice"] = body.tool_choice
    if body.parallel_tool_calls is not None:
        params["parallel_tool_calls"] = body.parallel_tool_calls
    return len(orjson.dumps(body.tools))
