"""Tools and ``n`` as a user meets them: a real ``tokenfleet serve`` (uvicorn), two real workers
on SmolLM2 (whose chat template does not know tools: the generic tools prompt; the session's
fleet, tests/models/real_fleet.py), the official ``openai`` SDK. Every call's arguments are
validated with ``jsonschema`` against the function's ``parameters``; a streamed answer is
reassembled by the SDK's own stream helper and must equal the whole one. ``n`` choices:
identical when greedy, distinct and each reproducible alone when seeded; cancelled, left or
crashed, every choice ends once. The workers' heartbeats are short (3 s) so a takeover happens
within the test."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from real_fleet import FLOAT32_WORKERS, RealFleet
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


# -- tools --------------------------------------------------------------------------------------

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 100},
        "b": {"type": "integer"},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers", "parameters": ADD_PARAMS},
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}
ASK_WEATHER: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
# an earlier call in the conversation: SmolLM2-135M then calls again on its own (tool_choice auto)
EARLIER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Tokyo", "unit": "celsius"}'},
}
FOLLOW_UP: list[Any] = [
    {"role": "user", "content": "What is the weather in Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": [EARLIER_CALL]},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def _valid_calls(message: Any, names: set[str]) -> list[tuple[str, Any]]:
    """The message's calls as (name, arguments), each checked against its schema."""
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def _both_ways(sdk: openai.OpenAI, **kw: Any) -> tuple[Any, Any]:
    """The whole answer, and the streamed one as the SDK's stream helper reassembles it."""
    whole = sdk.chat.completions.create(model="default", temperature=0, **kw).choices[0]
    with sdk.chat.completions.stream(model="default", temperature=0, **kw) as stream:
        streamed = stream.get_final_completion().choices[0]
    return whole, streamed


def test_required_gives_a_valid_call_streamed_and_not(sdk: openai.OpenAI) -> None:
    whole, streamed = _both_ways(
        sdk,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
    )
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    calls = _valid_calls(whole.message, set(SCHEMAS))
    assert len(calls) == 1 and calls == _valid_calls(streamed.message, set(SCHEMAS))
    assert whole.message.content is None


def test_a_named_function_is_the_one_called(sdk: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    whole, streamed = _both_ways(
        sdk,
        messages=[{"role": "user", "content": "What is 2 plus 3?"}],
        tools=TOOLS,
        tool_choice=named,
        max_tokens=60,
    )
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    calls = _valid_calls(whole.message, {"add"})
    assert calls == _valid_calls(streamed.message, {"add"}) and len(calls) == 1


def test_parallel_calls_end_at_max_tokens_with_only_complete_calls(sdk: openai.OpenAI) -> None:
    r = sdk.chat.completions.create(
        model="default",
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=70,
        temperature=0,
    )
    choice = r.choices[0]
    if choice.finish_reason == "length":  # SmolLM2 repeats its call: the cut one stays text
        assert choice.message.content is None or "<tool_call>" in choice.message.content
    else:
        assert choice.finish_reason == "tool_calls"
    _valid_calls(choice.message, set(SCHEMAS))


def test_auto_calls_or_answers_and_a_conversation_continues(sdk: openai.OpenAI) -> None:
    whole, streamed = _both_ways(sdk, messages=FOLLOW_UP, tools=TOOLS, max_tokens=80)
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    calls = _valid_calls(whole.message, set(SCHEMAS))
    assert calls == _valid_calls(streamed.message, set(SCHEMAS))
    # the call answered: the model goes on in text (or calls again: either is parseable)
    answered = [
        *FOLLOW_UP,
        {"role": "assistant", "content": None, "tool_calls": [whole.message.tool_calls[0]]},
        {"role": "tool", "tool_call_id": whole.message.tool_calls[0].id, "content": "sunny"},
    ]
    after = sdk.chat.completions.create(
        model="default", messages=answered, tools=TOOLS, max_tokens=40, temperature=0
    ).choices[0]
    if after.message.tool_calls:
        _valid_calls(after.message, set(SCHEMAS))
    else:
        assert after.message.content and "<tool_call>" not in after.message.content
    # tool_choice none: free text, the tools not offered
    text = sdk.chat.completions.create(
        model="default",
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=20,
        temperature=0,
    ).choices[0]
    assert text.message.content and not text.message.tool_calls


def test_bad_tools_are_400s_naming_the_field(sdk: openai.OpenAI) -> None:
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [bad_schema]}, "tools[0].function.parameters"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].function.name",
        ),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model="default", messages=ASK_WEATHER, **kw)
        assert info.value.param == param, kw


# -- n > 1 --------------------------------------------------------------------------------------

POEM: list[Any] = [{"role": "user", "content": "Write a short poem about the sea."}]


def _streamed_choices(sdk: openai.OpenAI, **kw: Any) -> tuple[dict[int, str], dict[int, Any]]:
    """Each choice's text and finish reason, from the chunks (each carries its index)."""
    texts: dict[int, str] = {}
    finishes: dict[int, Any] = {}
    for chunk in sdk.chat.completions.create(model="default", stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                assert c.index not in finishes  # each choice ends once
                finishes[c.index] = c.finish_reason
    return texts, finishes


def test_n_greedy_choices_are_identical_streamed_and_not(sdk: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"messages": POEM, "max_tokens": 24, "temperature": 0, "n": 3}
    r = sdk.chat.completions.create(model="default", **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert texts[0] and texts == [texts[0]] * 3
    one = sdk.chat.completions.create(model="default", **{**kw, "n": 1})
    assert r.usage is not None and one.usage is not None
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the shared prompt, once
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    streamed, finishes = _streamed_choices(sdk, **kw)
    assert streamed == dict(enumerate(texts))
    assert finishes == {i: c.finish_reason for i, c in enumerate(r.choices)}
    legacy = sdk.completions.create(
        model="default", prompt="The sea is", max_tokens=8, temperature=0, n=2
    )
    assert [c.index for c in legacy.choices] == [0, 1]
    assert legacy.choices[0].text == legacy.choices[1].text


def test_n_seeded_choices_differ_and_each_is_reproducible_alone(sdk: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"messages": POEM, "max_tokens": 24, "temperature": 1.0, "seed": 40}
    r = sdk.chat.completions.create(model="default", n=3, **kw)
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3, texts
    again, _ = _streamed_choices(sdk, n=3, **kw)
    assert again == dict(enumerate(texts))
    for i in range(3):  # choice i is the request with seed + i, whatever else runs with it
        alone = sdk.chat.completions.create(model="default", **{**kw, "seed": 40 + i})
        assert alone.choices[0].message.content == texts[i]


def _status(fleet: RealFleet, rid: str) -> str:
    record: dict[str, Any] = httpx.get(f"{fleet.url}/requests/{rid}", timeout=10).json()
    return str(record["status"])


def test_cancelling_an_n_request_ends_every_choice_once(fleet: RealFleet) -> None:
    body = {
        "model": "default",
        "messages": POEM,
        "max_tokens": 2000,
        "ignore_eos": True,
        "n": 3,
        "stream": True,
    }
    with httpx.stream("POST", fleet.url + "/chat/completions", json=body, timeout=120) as resp:
        rid = resp.headers["x-request-id"]
        seen: set[int] = set()
        errors = []
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                errors.append(data["error"])
                continue
            seen |= {c["index"] for c in data["choices"]}
            if seen == {0, 1, 2} and not errors:
                answer = httpx.post(f"{fleet.url}/requests/{rid}/cancel", timeout=10).json()
                assert answer["cancelled"] and len(answer["choices"]) == 3
                seen.add(-1)  # cancel once
    assert len(errors) == 1 and errors[0]["code"] == "cancelled"
    wait_for(  # a running choice ends at its worker's next step
        lambda: [_status(fleet, f"{rid}.{i}") for i in range(3)] == ["cancelled"] * 3,
        "every choice cancelled",
        60,
    )


def test_a_client_leaving_an_n_stream_cancels_every_choice(fleet: RealFleet) -> None:
    body = {
        "model": "default",
        "messages": POEM,
        "max_tokens": 2000,
        "ignore_eos": True,
        "n": 2,
        "stream": True,
    }
    headers = {"X-On-Disconnect": "cancel"}
    with httpx.stream(
        "POST", fleet.url + "/chat/completions", json=body, headers=headers, timeout=120
    ) as resp:
        rid = resp.headers["x-request-id"]
        for line in resp.iter_lines():
            if line.startswith("id: "):
                break  # a token came: leave
    wait_for(
        lambda: [_status(fleet, f"{rid}.{i}") for i in range(2)] == ["cancelled"] * 2,
        "both choices cancelled",
        60,
    )


def test_n_above_the_limit_is_a_400_naming_n(sdk: openai.OpenAI) -> None:
    for n in (9, 0):
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model="default", messages=POEM, n=n)
        assert info.value.param == "n"


def test_every_choice_ends_once_when_a_worker_dies_mid_answer(fleet: RealFleet) -> None:
    """Runs last: it kills a worker running a choice; the other resumes it. On the float32
    model: as int4 a resumed greedy answer may flip at a near-tie (tests/models/real_fleet.py)."""
    body = {
        "model": fleet.float32_model(),
        "messages": POEM,
        "max_tokens": 60,
        "ignore_eos": True,
        "temperature": 0,
        "n": 2,
        "stream": True,
    }
    texts = {0: "", 1: ""}
    killed = None
    finishes: dict[int, str] = {}
    with httpx.stream("POST", fleet.url + "/chat/completions", json=body, timeout=300) as resp:
        rid = resp.headers["x-request-id"]
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            for c in data["choices"]:
                texts[c["index"]] += c["delta"].get("content") or ""
                if c["finish_reason"]:
                    assert c["index"] not in finishes
                    finishes[c["index"]] = c["finish_reason"]
            if killed is None and min(len(t) for t in texts.values()) > 10:
                record = httpx.get(f"{fleet.url}/requests/{rid}.0", timeout=30).json()
                killed = record["worker"]
                assert killed in FLOAT32_WORKERS, record
                fleet.workers[killed].kill()  # SIGKILL, reaped
    assert killed is not None and finishes == {0: "length", 1: "length"}
    assert texts[0] == texts[1]  # greedy: the resumed choice goes on exactly as the other
    for i in range(2):
        record = httpx.get(f"{fleet.url}/requests/{rid}.{i}", timeout=30).json()
        assert record["status"] == "done" and record["text"] == texts[i], record
        assert record["num_tokens"] == 60
    record = httpx.get(f"{fleet.url}/requests/{rid}.0", timeout=30).json()
    assert record["attempts"] == 2 and record["ran_on"] != killed
