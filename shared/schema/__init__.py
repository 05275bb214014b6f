"""The wire schema: requests on the streams and events on the per-request channels.

Everything is JSON encoded with orjson and carries ``"v": SCHEMA_VERSION``. Decoding checks the
size before parsing, then every field, and raises ``ProtocolError`` naming the fault; it never
evaluates or unpickles anything. Building a request from user input raises ``InvalidRequest``
with a message that names the field, before anything touches Redis.

One concept per module, every public name re-exported here (``from tokenfleet.shared.schema
import X`` is the way to import them):

* ``wire``: ``SCHEMA_VERSION`` and the size-checked JSON reader;
* ``fields``: checks of single values (``check_text``, integers, token ids);
* ``status``: ``TerminalStatus`` and ``RequestStatus``;
* ``tools``: ``ToolSpec`` and the tool-call format (OpenAI's ``tools``: what is offered, the
  grammar of a call, reading an output back into calls);
* ``constraint``: ``Constraint`` (structured outputs: what the output must match);
* ``sampling``: ``SamplingParams``;
* ``request``: ``GenerationRequest``, the stream payload, and ``request_fingerprint`` (what
  idempotent resubmits compare);
* ``events``: ``TokenEvent``, ``TerminalEvent``, ``Event`` and ``decode_event``.
"""

from __future__ import annotations

from tokenfleet.shared.schema.constraint import (
    CONSTRAINT_KINDS,
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_CONSTRAINT_BYTES,
    Constraint,
)
from tokenfleet.shared.schema.events import (
    MAX_EVENT_BYTES,
    Event,
    TerminalEvent,
    TokenEvent,
    check_logprobs,
    decode_event,
)
from tokenfleet.shared.schema.fields import check_text
from tokenfleet.shared.schema.request import (
    MAX_METADATA_BYTES,
    GenerationRequest,
    request_fingerprint,
)
from tokenfleet.shared.schema.sampling import (
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)
from tokenfleet.shared.schema.status import RequestStatus, TerminalStatus
from tokenfleet.shared.schema.tools import (
    MAX_DESCRIPTION_CHARS,
    MAX_TOOLS,
    MESSAGE_KEYS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_MODES,
    ToolCall,
    ToolFunction,
    ToolSpec,
    call_block,
    call_id,
    check_tool_message,
    opens_call,
    parse_calls,
    tool_spec_of,
)
from tokenfleet.shared.schema.wire import SCHEMA_VERSION

__all__ = [
    "CONSTRAINT_KINDS",
    "MAX_CHOICES",
    "MAX_CHOICE_CHARS",
    "MAX_CONSTRAINT_BYTES",
    "MAX_DESCRIPTION_CHARS",
    "MAX_EVENT_BYTES",
    "MAX_METADATA_BYTES",
    "MAX_SEED",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_TOOLS",
    "MAX_TOP_LOGPROBS",
    "MESSAGE_KEYS",
    "SCHEMA_VERSION",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TOOL_MODES",
    "Constraint",
    "Event",
    "GenerationRequest",
    "RequestStatus",
    "SamplingParams",
    "TerminalEvent",
    "TerminalStatus",
    "TokenEvent",
    "ToolCall",
    "ToolFunction",
    "ToolSpec",
    "call_block",
    "call_id",
    "check_logprobs",
    "check_text",
    "check_tool_message",
    "decode_event",
    "opens_call",
    "parse_calls",
    "request_fingerprint",
    "tool_spec_of",
]
