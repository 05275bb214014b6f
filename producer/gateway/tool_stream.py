"""A tools request's token events as chat stream chunks: text as ``delta.content``, each call as
one ``delta.tool_calls`` chunk once it is complete, which the OpenAI SDKs reassemble into the
same ``tool_calls`` as the whole answer's.

An output opens with a call or with text, and that is known only after its first characters
(``tools.opens_call``): until then tokens are held back. Text is then streamed as it comes;
calls are read (``tools.parse_calls``) each time a token arrives, and a call is sent whole when
its ``</tool_call>`` has arrived. Each chunk's SSE id is the index of the last token it covers;
the chunks are a function of the token sequence alone, so a resumed stream replays from the
first token and skips the chunks the client already has (``streams``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenfleet.producer.gateway.responses import Framing
from tokenfleet.shared.schema import TerminalEvent, TokenEvent
from tokenfleet.shared.schema.tools import call_id, opens_call, parse_calls


@dataclass(slots=True)
class ToolStream:
    """The reading state of one tools request's stream.

    Invariants: ``sent`` characters of ``text`` are accounted for (sent as content, or part of
    the ``num_calls`` calls sent); ``held`` are the tokens not yet covered by a chunk.
    """

    framing: Framing
    index: int = 0  # the choice's index (n > 1)
    choice_id: str = ""  # the choice's own request id, which its call ids derive from
    text: str = ""
    opens_with_call: bool | None = None  # None: not known yet
    sent: int = 0
    num_calls: int = 0
    held: list[TokenEvent] = field(default_factory=list)

    def feed(self, event: TokenEvent) -> list[dict[str, Any]]:
        """The chunks ``event`` completes (often none while a call is being written)."""
        self.text += event.text
        self.held.append(event)
        if self.opens_with_call is None:
            self.opens_with_call = opens_call(self.text)
            if self.opens_with_call is None:
                return []
        if not self.opens_with_call:
            return self._content(self.text[self.sent :])
        calls, end = parse_calls(self.text)
        out = []
        for i in range(self.num_calls, len(calls)):
            delta = {"tool_calls": [{"index": i, **calls[i].to_openai(self._id(i))}]}
            out.append(self._chunk(delta))
        if len(calls) > self.num_calls:
            self.num_calls, self.sent = len(calls), end
        return out

    def finish(self, terminal: TerminalEvent) -> tuple[list[dict[str, Any]], str | None]:
        """What is left to send when the request ended ``done`` (text not part of a complete
        call, e.g. a call cut by ``length``, goes out as content), and the finish reason."""
        rest = self.text[self.sent :]
        out = self._content(rest.strip() if self.num_calls else rest) if rest.strip() else []
        finish = terminal.finish_reason
        if self.num_calls and finish == "stop":
            finish = "tool_calls"
        return out, finish

    def _content(self, text: str) -> list[dict[str, Any]]:
        self.sent = len(self.text)
        return [self._chunk({"content": text})] if text else []

    def _chunk(self, delta: dict[str, Any]) -> dict[str, Any]:
        chunk = self.framing.chunk("", index=self.index)
        choice = chunk["choices"][0]
        choice["delta"] = delta
        choice["logprobs"] = self.framing.logprobs(self.held)
        self.held = []
        return chunk

    def _id(self, index: int) -> str:
        return call_id(self.choice_id or self.framing.request_id, index)
