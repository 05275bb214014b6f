"""Tools on the wire: OpenAI's ``tools`` / ``tool_choice`` checked (the 400 names the field),
the grammar of a call compiled by llguidance, an output read back into calls, and the messages
of a conversation that continues after calls."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from llguidance import LLMatcher

from tokenfleet.producer.core.request import build
from tokenfleet.producer.core.structured import tools_constraint
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.schema import Constraint, GenerationRequest, ToolSpec, tool_spec_of
from tokenfleet.shared.schema.tools import call_block, call_id, opens_call, parse_calls
from tokenfleet.shared.settings import Settings

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {"type": "function", "function": {"name": "add"}}


def test_tool_choice_modes() -> None:
    assert tool_spec_of(None) is None
    assert tool_spec_of([WEATHER], "none") is None  # nothing asked: free text, no tools
    auto = tool_spec_of([WEATHER, ADD])
    assert auto is not None and (auto.mode, auto.name, auto.parallel) == ("auto", None, True)
    required = tool_spec_of([WEATHER, ADD], "required", False)
    assert required is not None and (required.mode, required.parallel) == ("required", False)
    named = tool_spec_of([WEATHER, ADD], {"type": "function", "function": {"name": "add"}})
    assert named is not None and named.callable() == (named.functions[1],)
    assert ToolSpec.from_dict(orjson.loads(orjson.dumps(named.to_dict()))) == named


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (None, "required", "tool_choice"),
        ([], "auto", "tool_choice"),
        ("f", None, "tools"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "x": 1}}], None, "tools[0].function"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            None,
            "tools[0].function.parameters",
        ),
        ([ADD, ADD], None, "tools[1].function.name"),
        ([ADD], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([ADD], "sometimes", "tool_choice"),
        ([ADD], {"type": "function"}, "tool_choice"),
    ],
)
def test_bad_tools_name_the_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        tools_constraint(None, tools, choice, None)
    assert info.value.param == param


def test_a_schema_the_grammar_library_refuses_names_its_function() -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    with pytest.raises(InvalidRequest) as info:
        tools_constraint(None, [ADD, bad], "auto", None)
    assert info.value.param == "tools[1].function.parameters"
    with pytest.raises(InvalidRequest, match="cannot be combined") as info:
        tools_constraint(Constraint("regex", "a+"), [ADD], "auto", None)
    assert info.value.param == "tools"


@pytest.mark.parametrize(
    "choice", ["auto", "required", {"type": "function", "function": {"name": "add"}}]
)
@pytest.mark.parametrize("parallel", [True, False])
def test_every_mode_compiles(choice: Any, parallel: bool) -> None:
    constraint = tools_constraint(None, [WEATHER, ADD], choice, parallel)
    assert constraint is not None and constraint.kind == "tools"
    grammar = constraint.check()
    assert not LLMatcher.validate_grammar_with_warnings(grammar)[0]
    again = Constraint.from_dict(orjson.loads(orjson.dumps(constraint.to_dict())))
    assert again == constraint


def test_outputs_read_back_into_calls() -> None:
    one = call_block("get_weather", '{"city": "Paris"}')
    assert (
        one == '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
    )
    calls, end = parse_calls(one)
    assert [(c.name, orjson.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert end == len(one)
    two = one + "\n" + call_block("add", '{"a": 1, "b": 2}')
    calls, end = parse_calls("  " + two + " trailing")
    assert [c.name for c in calls] == ["get_weather", "add"] and end == len(two) + 2
    assert parse_calls(one[:-3]) == ([], 0)  # cut before its end: no call yet
    assert parse_calls("Paris is sunny.") == ([], 0)
    assert parse_calls('<tool_call>\n{"name": 3}\n</tool_call>') == ([], 0)
    assert [opens_call(t) for t in ("", "  <tool", "<tool_call>{", "The", "<b>")] == [
        None,
        None,
        True,
        False,
        False,
    ]
    assert call_id("r1", 0) == call_id("r1", 0) != call_id("r1", 1) != call_id("r2", 1)
    assert call_id("r1", 0).startswith("call_")


def test_conversation_messages_with_calls_and_results() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"},
    ]
    request = build(Settings(), now=0.0, messages=messages, tools=[WEATHER])
    wire = GenerationRequest.decode(request.encode(), 1 << 20)
    assert wire.messages is not None
    assert wire.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert wire.messages[2]["tool_call_id"] == "call_1"
    assert wire.sampling.structured is not None and wire.sampling.structured.kind == "tools"
    plain = build(Settings(), now=0.0, messages=messages[:1])
    assert b"tool" not in plain.encode()  # a request without tools encodes as before
    cases: list[tuple[dict[str, Any], str]] = [
        ({"role": "user", "content": "x", "tool_calls": [call]}, "messages[0].tool_calls"),
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
        (
            {
                "role": "assistant",
                "tool_calls": [{**call, "function": {"name": "f", "arguments": "{"}}],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ]
    for bad, param in cases:
        with pytest.raises(InvalidRequest) as info:
            build(Settings(), now=0.0, messages=[bad])
        assert info.value.param == param
