"""The gateway's tools, without processes: bodies checked (400s name the field), an output read
back into ``tool_calls``, and streamed chunks that reassemble (as the OpenAI SDK does it) into
the same message as the whole answer's, at every split of the text into tokens."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from tokenfleet.producer.gateway.errors import ApiError
from tokenfleet.producer.gateway.identity import has_tools, kind_of, make_request_id
from tokenfleet.producer.gateway.openai_api import ChatBody, chat_submission
from tokenfleet.producer.gateway.responses import Framing
from tokenfleet.producer.gateway.streams import StreamState, openai_events
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, TokenEvent
from tokenfleet.shared.schema.tools import call_block

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**fields: Any) -> ChatBody:
    return ChatBody.model_validate({"model": "m", "messages": ASK, **fields})


def test_tools_bodies_become_submit_arguments() -> None:
    sub = chat_submission(chat(tools=[WEATHER], tool_choice="required"), 9)
    assert sub.tools and sub.params["tools"] == [WEATHER]
    assert sub.params["tool_choice"] == "required"
    none = chat_submission(chat(tools=[WEATHER], tool_choice="none"), 9)
    assert not none.tools and "tools" not in none.params  # free text: nothing is read back
    rid = make_request_id("chat", "k1", None, tools=True)
    assert has_tools(rid) and kind_of(rid) == "chat"
    assert not has_tools(make_request_id("chat", None, "x"))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a.b"}}]}, "tools[0].function.name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {"messages": [{"role": "tool", "content": "21 C"}]},
            "messages[0].tool_call_id",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]},
            "messages[0].tool_calls[0]",
        ),
    ],
)
def test_bad_tools_bodies_are_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        chat_submission(ChatBody.model_validate({"model": "m", "messages": ASK, **fields}), 9)
    assert (info.value.status, info.value.param) == (400, param)


CALLS = call_block("get_weather", '{"city": "Paris"}') + "\n" + call_block("add", '{"a": 1}')
OUTPUTS = [
    (CALLS, "stop"),
    ("Paris is sunny today.", "stop"),
    (CALLS[:-5], "length"),  # the second call cut: it stays text
    ("  <tool", "length"),
]


def _tokens(text: str, cuts: list[int]) -> list[TokenEvent]:
    bounds = [0, *cuts, len(text)]
    return [TokenEvent("r", i, i, text[a:b]) for i, (a, b) in enumerate(itertools.pairwise(bounds))]


def _reassemble(chunks: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """What the OpenAI SDK's stream accumulation makes of the chunks (content appended,
    tool_calls merged by index, arguments appended)."""
    content, finish = "", None
    calls: dict[int, dict[str, Any]] = {}
    for c in chunks:
        if not c["choices"]:
            continue
        choice = c["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls", []):
            got = calls.setdefault(tc["index"], {"function": {"name": "", "arguments": ""}})
            got["id"], got["type"] = tc.get("id", got.get("id")), "function"
            got["function"]["name"] += tc["function"].get("name", "")
            got["function"]["arguments"] += tc["function"].get("arguments", "")
        finish = choice["finish_reason"] or finish
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


async def _stream(tokens: list[TokenEvent], end: TerminalEvent, framing: Framing, at: int) -> Any:
    async def events() -> AsyncIterator[Any]:
        for t in tokens:
            yield t
        yield end

    out = []
    async for sse in openai_events(
        events(), framing, from_index=at, include_usage=False, state=StreamState()
    ):
        if sse.data != "[DONE]":
            out.append((sse.id, orjson.loads(str(sse.data))))
    return out


@pytest.mark.parametrize(("text", "finish"), OUTPUTS)
def test_streamed_chunks_reassemble_into_the_whole_answer(text: str, finish: str) -> None:
    framing = Framing("chatcmpl-tool-x", "chat", "m", 0, tools=True)
    end = TerminalEvent(framing.request_id, TerminalStatus.DONE, finish_reason=finish)
    for step in (1, 3, 7, len(text)):
        tokens = _tokens(text, list(range(step, len(text), step)))
        whole = framing.response(tokens, end)["choices"][0]
        expected = (dict(whole["message"]), whole["finish_reason"])
        if expected[0]["content"] == "":
            expected[0]["content"] = None
        chunks = asyncio.run(_stream(tokens, end, framing, 0))
        assert _reassemble([c for _, c in chunks]) == expected
        # a client resuming after any chunk with an id gets exactly the chunks it lacks
        for i, (sid, _) in enumerate(chunks):
            if sid is None:
                continue
            rest = asyncio.run(_stream(tokens, end, framing, int(sid) + 1))
            later = [c for c in chunks[i + 1 :] if c[0] is None or int(c[0]) > int(sid)]
            assert rest == later
    if "tool_calls" in whole["message"]:
        assert finish != "stop" or whole["finish_reason"] == "tool_calls"
        assert all(c["id"].startswith("call_") for c in whole["message"]["tool_calls"])


def test_n_cursors_and_usage() -> None:
    from tokenfleet.producer.gateway.choices import combined_usage, parse_cursor

    assert parse_cursor("4,-1,7", 3) == [5, 0, 8]
    for bad in (None, "", "4,5", "a,b,c", "1,2,-3", "5"):
        assert parse_cursor(bad, 3) == [0, 0, 0]
    ends = [
        TerminalEvent(
            f"r.{i}", TerminalStatus.DONE, usage={"prompt_tokens": 9, "completion_tokens": i}
        )
        for i in range(1, 4)
    ]
    assert combined_usage(ends) == {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}
    sub = chat_submission(chat(n=3, max_tokens=10), 9)
    assert sub.n == 3 and sub.estimated_tokens >= 30  # the key is charged for every choice
    with pytest.raises(ApiError) as info:
        chat_submission(chat(n=0), 9)
    assert info.value.param == "n"


def test_a_batch_line_with_n_above_1_is_refused() -> None:
    from tokenfleet.producer.gateway.batches.lines import LineError, submission

    body = {"model": "m", "messages": ASK, "n": 2}
    with pytest.raises(LineError, match="n > 1"):
        submission("/v1/chat/completions", body, 9)


class _FakeHandle:
    """A handle whose stream replays fixed events (from an index), as the durable record does."""

    def __init__(self, request_id: str, texts: list[str]) -> None:
        self.request_id = request_id
        self.events: list[Any] = [TokenEvent(request_id, i, i, t) for i, t in enumerate(texts)]
        self.events.append(
            TerminalEvent(request_id, TerminalStatus.DONE, len(texts), finish_reason="length")
        )

    async def stream(self, from_index: int = 0) -> AsyncIterator[Any]:
        for e in self.events:
            if not isinstance(e, TokenEvent) or e.index >= from_index:
                yield e

    def close(self) -> None:
        pass


async def _choice_chunks(cursor: list[int], tools: bool = False) -> list[tuple[str | None, Any]]:
    from tokenfleet.producer.gateway.choices import choice_events

    framing = Framing("chatcmpl-x", "chat", "m", 0, tools=tools)
    texts = [["a", "b", "c"], ["x", "y"], ["p", "q", "r", "s"]]
    handles: Any = [_FakeHandle(f"chatcmpl-x.{i}", t) for i, t in enumerate(texts)]

    async def cancel(_rid: str) -> bool:
        raise AssertionError("nothing to cancel")

    out = []
    async for sse in choice_events(
        handles, framing, cursor=cursor, include_usage=True, state=StreamState(), cancel=cancel
    ):
        out.append((sse.id, sse.data if sse.data == "[DONE]" else orjson.loads(str(sse.data))))
    return out


def test_n_streams_resume_every_choice_from_its_cursor() -> None:
    whole = asyncio.run(_choice_chunks([0, 0, 0]))
    texts: dict[int, str] = {}
    for _, data in whole:
        for c in data["choices"] if isinstance(data, dict) else []:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    assert texts == {0: "abc", 1: "xy", 2: "pqrs"}
    assert whole[-2][1]["usage"]["completion_tokens"] == 9 and whole[-1][1] == "[DONE]"
    # resume after some chunk: each choice continues after its own last index, nothing twice
    for at, (sid, _) in enumerate(whole):
        if sid is None:
            continue
        cursor = [int(p) + 1 for p in sid.split(",")]
        rest = asyncio.run(_choice_chunks(cursor))
        seen = {
            (c["index"], c["delta"].get("content"))
            for _, d in whole[: at + 1]
            if isinstance(d, dict)
            for c in d["choices"]
            if c["delta"].get("content")
        }
        again = {
            (c["index"], c["delta"].get("content"))
            for _, d in rest
            if isinstance(d, dict)
            for c in d["choices"]
            if c["delta"].get("content")
        }
        assert not seen & again
        assert len(seen | again) == 9
