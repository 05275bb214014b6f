"""The routing chain: the engine's own prefix-cache block hashes at a few positions of a prompt.

Producers route a request to the worker whose KV cache holds the longest leading part of its
prompt. Both sides use the engine's chained block hash (``block_hash``): the producer tokenizes
the prompt as the worker will (``producer.core.route_tokenizer``, from the tokenizer and chat
template each worker publishes for its model), and a worker publishes the hashes of the blocks
its prefix cache holds as they enter and leave it (``worker.service.prefix_set``).

Only blocks at :func:`link_positions` are links (a bounded chain for any prompt length): every
block for the first 8, then every 2nd, 4th, 8th and 16th block, 8 links each — 40 links
covering 248 blocks (3,968 tokens at 16 tokens a block), finest where prompts differ most
often. A link is the first 8 bytes of the block's hash, hex. Because the hash is chained, link
``i`` of two prompts is equal only if their tokens are equal up to the end of that block, so
the leading run of a chain's links found in a worker's set is the cached prefix it would reuse.

The session key: ``metadata["session"]``, else ``metadata["user"]`` (what the gateway stores
from the OpenAI ``user`` field); hashed before it becomes part of a key name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from tokenfleet.shared.block_hash import hash_block

LINKS_PER_STRIDE = 8  # links at each stride before it doubles
STRIDES = (1, 2, 4, 8, 16)  # blocks between links
MAX_LINKS = LINKS_PER_STRIDE * len(STRIDES)


@cache
def link_positions(max_blocks: int = 1 << 30) -> tuple[int, ...]:
    """Block indices whose hashes are links, in order (those below ``max_blocks``)."""
    out: list[int] = []
    at = -1
    for stride in STRIDES:
        for _ in range(LINKS_PER_STRIDE):
            at += stride
            if at >= max_blocks:
                return tuple(out)
            out.append(at)
    return tuple(out)


LINK_INDEX = {p: i for i, p in enumerate(link_positions())}  # block index -> link number
LAST_LINK_BLOCK = link_positions()[-1]


def link_of(block_hash: bytes) -> str:
    """The published form of a block hash that is a link."""
    return block_hash[:8].hex()


def prefix_chain(token_ids: Sequence[int], block_size: int) -> tuple[str, ...]:
    """The links of a prompt of ``token_ids`` for an engine of ``block_size`` (module doc).

    Only blocks lying within the first ``len - 1`` tokens count, as in the engine (the last
    prompt token is always computed)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_blocks = (len(token_ids) - 1) // block_size if token_ids else 0
    positions = link_positions(min(num_blocks, LAST_LINK_BLOCK + 1))  # a bounded cache
    if not positions:
        return ()
    out: list[str] = []
    parent: bytes | None = None
    wanted = iter(positions)
    next_at = next(wanted)
    for i in range(positions[-1] + 1):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        if i == next_at:
            out.append(link_of(parent))
            next_at = next(wanted, -1)
    return tuple(out)


def session_of(metadata: Mapping[str, Any] | None) -> str | None:
    """The session key of a request's metadata (module doc), or None."""
    if not metadata:
        return None
    value = metadata.get("session") or metadata.get("user")
    return str(value) if value else None


def session_hash(session: str) -> str:
    """The hash naming a session's key (``Keys.session``): any text becomes a safe key part."""
    return hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


def model_session_hash(model: str, session: str) -> str:
    """What names a session of ``model`` (``Keys.session``): the producer pins it at enqueue, a
    worker that steals the session's request re-pins it (one definition for both)."""
    return session_hash(f"{model}|{session}")
