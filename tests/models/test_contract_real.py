"""Tools (and, below, ``n``) as a user meets them: a real ``tokenfleet serve`` (uvicorn), a real
worker on SmolLM2 (whose chat template does not know tools: the generic tools prompt), the
official ``openai`` SDK. Every call's arguments are validated with ``jsonschema`` against the
function's ``parameters``; a streamed answer is reassembled by the SDK's own stream helper and
must equal the whole one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import MODEL_CACHE

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
PREFIX = "tfcontract-real"
WORKER = "contract-a"


def _poll(check: Any, what: str, timeout_s: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return value


class Fleet:
    def __init__(self, url: str, procs: dict[str, subprocess.Popen[bytes]], logs: Path) -> None:
        self.url = url
        self.procs = procs
        self.logs = logs


@pytest.fixture(scope="module")
def fleet(
    redis_server: Any, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("contract-logs")
    env = {
        **os.environ,
        "REDIS_URL": redis_server.url,
        "TOKENFLEET_KEY_PREFIX": PREFIX,
        "TOKENFLEET_MODEL_CACHE": str(MODEL_CACHE),
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = [sys.executable, "-m", "tokenfleet.worker.cli"]
    commands = {
        WORKER: ["worker", "--model", "smollm2", "--name", WORKER, "--threads", "1"],
        "gateway": ["serve", "--port", str(port), "--log-level", "warning"],
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name, args in commands.items():
        with open(logs / f"{name}.log", "wb") as log:
            procs[name] = subprocess.Popen(
                [*cli, *args], env=env, stdout=log, stderr=subprocess.STDOUT
            )
    url = f"http://127.0.0.1:{port}/v1"
    try:

        def ready() -> bool:
            for name, p in procs.items():
                assert p.poll() is None, (logs / f"{name}.log").read_text()[-3000:]
            try:
                models = httpx.get(url + "/models", timeout=2).json()["data"]
            except httpx.HTTPError:
                return False
            return bool(models) and models[0]["tokenfleet"]["workers"] == [WORKER]

        _poll(ready, "the worker and the gateway")
        yield Fleet(url, procs, logs)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait(60)


@pytest.fixture(scope="module")
def sdk(fleet: Fleet) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=fleet.url, api_key="unused", max_retries=0, timeout=600) as c:
        yield c


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
