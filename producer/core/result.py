"""What ``Handle.result()`` returns, and how a terminal event becomes a result or an error."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.shared.errors import RequestFailed
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, TokenEvent


@dataclass(frozen=True, slots=True)
class Result:
    """A finished request (status ``done``).

    Invariants: ``text`` is the concatenation of the token events' texts in index order and
    ``token_ids`` their token ids in index order.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" or "length"
    usage: dict[str, int] = field(default_factory=dict)  # prompt_tokens, completion_tokens
    timings: dict[str, float] = field(default_factory=dict)  # queue_s, ttft_s, tpot_s, e2e_s

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the rq job's return value, ``tokenfleet submit --json``)."""
        return {
            "request_id": self.request_id,
            "status": "done",
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "usage": dict(self.usage),
            "timings": dict(self.timings),
        }


def failure(terminal: TerminalEvent) -> RequestFailed:
    """The error for a terminal event other than ``done``."""
    return RequestFailed(
        terminal.request_id,
        terminal.status.value,
        terminal.code or terminal.status.value,
        terminal.message or f"the request ended {terminal.status.value}",
    )


def build_result(tokens: Sequence[TokenEvent], terminal: TerminalEvent) -> Result:
    """The result of a request that ended ``done``; raises ``RequestFailed`` otherwise."""
    if terminal.status is not TerminalStatus.DONE:
        raise failure(terminal)
    return Result(
        request_id=terminal.request_id,
        text="".join(t.text for t in tokens),
        token_ids=[t.token_id for t in tokens],
        finish_reason=terminal.finish_reason,
        usage=dict(terminal.usage),
        timings=dict(terminal.timings),
    )
