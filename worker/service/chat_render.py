"""A chat request's messages (and offered tools) as the model's chat template takes them.

Without tools and tool messages the messages go to the template unchanged. With them, one of
two renderings (docs/structured-outputs.md, "Tools"):

* the template knows tools (its source uses a ``tools`` variable, as those of Qwen2.5, Llama 3.1
  and Hermes models do): the offered functions go in as ``tools=`` and the messages in the
  shape transformers documents (an assistant's ``tool_calls`` with ``arguments`` as an object,
  ``role: "tool"`` results with their ``tool_call_id``);
* it does not (SmolLM2's, for one): the generic tools prompt (:func:`tools_prompt`) opens the
  system message, an assistant's calls are written into its content in the output's own
  format (``<tool_call>`` blocks) and each tool result becomes a user message holding a
  ``<tool_response>`` block, so any template that renders user and assistant turns renders it.

Either way the output is constrained to the ``<tool_call>`` format by the request's ``tools``
constraint (``shared/schema/tools.py``), which the gateway reads back into ``tool_calls``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from tokenfleet.shared.schema import ToolSpec
from tokenfleet.shared.schema.tools import call_block

TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"


def template_knows_tools(template: str | None) -> bool:
    """Does a chat template render a ``tools`` variable? (A template that never reads it
    would drop the offered functions silently.)"""
    return bool(template) and "tools" in str(template)


def has_tool_parts(messages: Sequence[dict[str, Any]]) -> bool:
    """Do any of ``messages`` carry calls or tool results?"""
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def tools_prompt(spec: ToolSpec) -> str:
    """The generic tools prompt: the offered functions, one JSON object a line, and how to
    call them; what the request's ``tool_choice`` asks is said last."""
    lines = [
        "You can call functions to help answer. The functions, one JSON object per line:",
        *(orjson.dumps(f.to_dict()).decode() for f in spec.functions),
        "To call a function, answer with only this, one block per call:",
        '<tool_call>\n{"name": "<function name>", "arguments": {<the arguments as a JSON '
        "object>}}\n</tool_call>",
        f"Each result comes back as {TOOL_RESPONSE_OPEN}...{TOOL_RESPONSE_CLOSE}.",
    ]
    if spec.mode == "named":
        lines.append(f"Call the function {spec.name} now.")
    elif spec.mode == "required":
        lines.append("Call one of the functions now.")
    else:
        lines.append("If no function helps, answer the user directly in text.")
    return "\n".join(lines)


def render_inputs(
    messages: Sequence[dict[str, Any]], spec: ToolSpec | None, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools=`` argument for ``apply_chat_template`` (module doc)."""
    if spec is None and not has_tool_parts(messages):
        return [dict(m) for m in messages], None
    if template_knows_tools(template):
        tools = None
        if spec is not None:
            tools = [{"type": "function", "function": f.to_dict()} for f in spec.functions]
        return [_native(m) for m in messages], tools
    return _generic(messages, spec), None


def _native(message: dict[str, Any]) -> dict[str, Any]:
    out = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": orjson.loads(c["function"]["arguments"] or "{}"),
                },
            }
            for c in message["tool_calls"]
        ]
    if "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _generic(messages: Sequence[dict[str, Any]], spec: ToolSpec | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            body = f"{TOOL_RESPONSE_OPEN}\n{m['content']}\n{TOOL_RESPONSE_CLOSE}"
            out.append({"role": "user", "content": body})
        elif m.get("tool_calls"):
            blocks = [
                call_block(c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            ]
            text = "\n".join([m["content"], *blocks] if m["content"] else blocks)
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if spec is not None:
        prompt = tools_prompt(spec)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
