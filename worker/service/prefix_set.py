"""What this worker's cache holds, as the routing sees it: a bounded LRU of prefix-chain links.

After each request it starts, the worker records the request's chain
(``tokenfleet.shared.prefix_chain``, computed from the request exactly as the producer computed
it) here; the heartbeat publishes the changes to ``Keys.prefixes(NAME)`` (``SADD`` new links,
``SREM`` evicted ones) in its existing round trip, and the set expires with the heartbeat. The
capacity comes from the KV cache: about one link per ``TOKENS_PER_LINK`` tokens it can hold,
between ``MIN_LINKS`` and ``MAX_LINKS``: links of prompts the engine's own prefix cache has long
evicted stop attracting requests.

Invariants: ``len(_lru) <= capacity``; ``_added`` and ``_removed`` are disjoint, and after
:meth:`changes` the published set equals the LRU's keys (the heartbeat applies both; every
``RESYNC_BEATS``-th beat rewrites the whole set, which also repairs a set Redis lost).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from tokenfleet.shared.prefix_chain import prefix_chain
from tokenfleet.shared.schema import GenerationRequest

TOKENS_PER_LINK = 64  # a link covers a message or 256 characters: about this many tokens
MIN_LINKS = 64
MAX_LINKS = 4096


def links_for(kv_tokens: int) -> int:
    """The LRU's capacity for a KV cache of ``kv_tokens`` tokens."""
    return max(MIN_LINKS, min(MAX_LINKS, kv_tokens // TOKENS_PER_LINK))


class PrefixSet:
    """A bounded LRU of chain links plus the changes not yet published (module doc)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._added: set[str] = set()
        self._removed: set[str] = set()

    def __len__(self) -> int:
        return len(self._lru)

    def note(self, chain: Iterable[str]) -> None:
        """A request with ``chain`` ran here: its links are the most recently used."""
        lru = self._lru
        for link in chain:
            if link in lru:
                lru.move_to_end(link)
                continue
            lru[link] = None
            self._removed.discard(link)
            self._added.add(link)
            if len(lru) > self.capacity:
                old, _ = lru.popitem(last=False)
                if old in self._added:
                    self._added.discard(old)
                else:
                    self._removed.add(old)

    def note_request(self, req: GenerationRequest) -> None:
        """``req`` ran here: note its chain, computed as its producer computed it."""
        self.note(
            prefix_chain(
                prompt=req.prompt, messages=req.messages, prompt_token_ids=req.prompt_token_ids
            )
        )

    def changes(self) -> tuple[list[str], list[str]]:
        """(links to add, links to remove) since the last call; the caller publishes them."""
        added, removed = sorted(self._added), sorted(self._removed)
        self._added.clear()
        self._removed.clear()
        return added, removed

    def snapshot(self) -> list[str]:
        """Every link held (a full rewrite of the published set)."""
        return list(self._lru)
