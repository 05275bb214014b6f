"""The text-level prefix chain producers route by and workers publish: no tokenizer involved.

Why text and not tokens: producers (web apps, cron jobs, the gateway) have no tokenizer (the
producer package must not pull in the model stack), and two workers of one model tokenize the
same text identically, so a chain over the *text* identifies the same leading KV blocks as the
engine's token-block hashes would, without either side knowing the other's block size.

The chain: link ``i`` is ``H(link i-1 || piece i)`` (BLAKE2b, 8 bytes, hex), so equal link ``i``
means equal pieces ``0..i``. Pieces are, for chat requests, each message as canonical JSON
(``{"content":…,"role":…}``, sorted keys); for text prompts, fixed chunks of
:data:`CHUNK_CHARS` characters (a partial last chunk is left out: it is not a full KV block
yet); for token-id prompts, chunks of :data:`CHUNK_TOKENS` ids. At most :data:`MAX_LINKS`
links. Invariant: the function is pure and identical on both sides (one definition, here).

The session key: ``metadata["session"]``, else ``metadata["user"]`` (what the gateway stores
from the OpenAI ``user`` field); hashed before it becomes part of a key name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

CHUNK_CHARS = 256  # characters per piece of a text prompt
CHUNK_TOKENS = 64  # token ids per piece of a token-id prompt
MAX_LINKS = 16  # links of a chain at most


def _link(prev: bytes, piece: bytes) -> bytes:
    return hashlib.blake2b(prev + piece, digest_size=8).digest()


def _chain(pieces: Sequence[bytes]) -> tuple[str, ...]:
    out: list[str] = []
    prev = b""
    for piece in pieces[:MAX_LINKS]:
        prev = _link(prev, piece)
        out.append(prev.hex())
    return tuple(out)


def prefix_chain(
    *,
    prompt: str | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> tuple[str, ...]:
    """The request's chain (module doc): one of the three prompt forms; empty for none."""
    if messages is not None:
        return _chain(
            [
                orjson.dumps(
                    {"content": m.get("content", ""), "role": m.get("role", "")},
                    option=orjson.OPT_SORT_KEYS,
                )
                for m in messages[:MAX_LINKS]
            ]
        )
    if prompt is not None:
        full = min(len(prompt) // CHUNK_CHARS, MAX_LINKS)
        return _chain(
            [
                prompt[i * CHUNK_CHARS : (i + 1) * CHUNK_CHARS].encode("utf-8", "surrogatepass")
                for i in range(full)
            ]
        )
    if prompt_token_ids is not None:
        full = min(len(prompt_token_ids) // CHUNK_TOKENS, MAX_LINKS)
        return _chain(
            [
                orjson.dumps(list(prompt_token_ids[i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS]))
                for i in range(full)
            ]
        )
    return ()


def session_of(metadata: Mapping[str, Any] | None) -> str | None:
    """The session key of a request's metadata (module doc), or None."""
    if not metadata:
        return None
    value = metadata.get("session") or metadata.get("user")
    return str(value) if value else None


def session_hash(session: str) -> str:
    """The hash naming a session's key (``Keys.session``): any text becomes a safe key part."""
    return hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()
