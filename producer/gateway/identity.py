"""Request ids the gateway makes, and who owns them.

A gateway request id is ``[OWNER.]KIND-SUFFIX``: ``KIND`` is ``chatcmpl`` or ``cmpl`` (which
endpoint made it, so a resumed stream is framed as the original was; ``chatcmpl-tool`` for a
chat request that offered tools, whose text is read back into calls), ``SUFFIX`` 32 random hex
digits or, with an ``Idempotency-Key``, derived from it, and ``OWNER`` the API key's id when
keys are required. Ownership is read from the id itself — no lookup, so it holds across any
number of gateway processes: a key sees only ids that start with its own id and a dot (others
get 404, as if they did not exist), and two keys sending the same ``Idempotency-Key`` get two
different requests.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Literal

Kind = Literal["chat", "completion"]
_PREFIX: dict[Kind, str] = {"chat": "chatcmpl", "completion": "cmpl"}
_TOOLS_MARK = "tool-"
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # used as is; anything else is hashed


def make_request_id(
    kind: Kind, owner: str | None, idempotency_key: str | None = None, *, tools: bool = False
) -> str:
    """A new request id, or the one ``idempotency_key`` always maps to (for this owner and
    kind). Keys of up to 64 letters, digits, ``_`` or ``-`` appear in the id verbatim (easy
    to find in logs); any other key is hashed (BLAKE2b-128)."""
    if idempotency_key is None:
        suffix = os.urandom(16).hex()
    elif _PLAIN_KEY.match(idempotency_key):
        suffix = "k-" + idempotency_key
    else:
        digest = hashlib.blake2b(idempotency_key.encode("utf-8"), digest_size=16).hexdigest()
        suffix = "h-" + digest
    rid = f"{_PREFIX[kind]}-{_TOOLS_MARK if tools else ''}{suffix}"
    return f"{owner}.{rid}" if owner else rid


def choice_id(request_id: str, index: int) -> str:
    """The request id of choice ``index`` of a request with ``n`` > 1 (each choice is a request
    of its own: resumable, cancellable and crash-safe as any)."""
    return f"{request_id}.{index}"


def owns(owner: str | None, request_id: str) -> bool:
    """May the caller identified by ``owner`` (None: keys are off) see ``request_id``?"""
    return owner is None or request_id.startswith(owner + ".")


def _bare(request_id: str) -> str:
    return request_id.split(".", 1)[1] if "." in request_id.split("-", 1)[0] else request_id


def kind_of(request_id: str) -> Kind:
    """Which endpoint's framing a request's stream uses: chat for ``chatcmpl-`` ids, else
    completion (ids made elsewhere, e.g. by the Python client, read as text completions)."""
    return "chat" if _bare(request_id).startswith("chatcmpl-") else "completion"


def has_tools(request_id: str) -> bool:
    """Did the chat request ``request_id`` offer tools (its text is read back into calls)?"""
    return _bare(request_id).startswith(f"chatcmpl-{_TOOLS_MARK}")
