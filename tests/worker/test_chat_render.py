"""Tools and tool messages through a chat template: a template that knows tools gets them as
``tools=`` and the messages in transformers' shape; one that does not (SmolLM2's shape) gets
the generic tools prompt, calls written as ``<tool_call>`` blocks and results as user turns."""

from __future__ import annotations

from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenfleet.shared.schema import tool_spec_of
from tokenfleet.shared.schema.tools import TOOL_CALL_OPEN, parse_calls
from tokenfleet.worker.service.chat_render import render_inputs, template_knows_tools

PLAIN = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
KNOWS_TOOLS = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n"
    "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}[{{ c['function']['name'] }}"
    "({{ c['function']['arguments']['city'] }})]{% endfor %}\n{% endfor %}<|assistant|>"
)
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


def render(template: str, messages: list[dict[str, Any]], spec: Any) -> str:
    msgs, tools = render_inputs(messages, spec, template)
    return ImmutableSandboxedEnvironment().from_string(template).render(messages=msgs, tools=tools)


def test_plain_messages_are_untouched() -> None:
    msgs, tools = render_inputs(CONVERSATION[:1], None, PLAIN)
    assert (msgs, tools) == (CONVERSATION[:1], None)


def test_a_template_that_knows_tools_renders_them_itself() -> None:
    assert template_knows_tools(KNOWS_TOOLS) and not template_knows_tools(PLAIN)
    text = render(KNOWS_TOOLS, CONVERSATION, tool_spec_of([WEATHER], "auto"))
    assert text == (
        "<|tools|>get_weather;\n<|user|>Weather in Paris?\n"
        "<|assistant|>[get_weather(Paris)]\n<|tool|>sunny\n<|assistant|>"
    )


def test_a_template_without_tools_gets_the_generic_prompt() -> None:
    spec = tool_spec_of([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    msgs, tools = render_inputs(CONVERSATION, spec, PLAIN)
    assert tools is None
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert '"name":"get_weather"' in msgs[0]["content"]
    assert "Call the function get_weather now." in msgs[0]["content"]
    calls, _ = parse_calls(msgs[2]["content"])  # written in the output's own format
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city":"Paris"}')]
    assert msgs[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    system_first = [{"role": "system", "content": "Be brief."}, *CONVERSATION]
    merged, _ = render_inputs(system_first, spec, PLAIN)
    assert merged[0]["content"].startswith("Be brief.\n\n") and len(merged) == 4
    # a conversation that continues after calls, without offering tools again
    again, _ = render_inputs(CONVERSATION, None, PLAIN)
    assert again[0]["role"] == "user" and TOOL_CALL_OPEN in again[1]["content"]
