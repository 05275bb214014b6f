"""What this worker's prefix cache holds, as the routing sees it: the links among its blocks.

The engine's block manager tells this set (a ``CacheWatcher``) of every full block that enters
its prefix cache and every one that leaves it (evicted for another block, or reset). A block
at one of the chain's link positions (``tokenfleet.shared.prefix_chain``) is a link: its hash
prefix joins the set while the block is cached, and leaves with it. So the set is exactly the
routable part of the cache: a producer's chain matches it only as far as the cache would reuse.
The heartbeat publishes the changes to ``Keys.prefixes(NAME)`` (``SADD`` new links, ``SREM``
gone ones) in its existing round trip, and the set expires with the heartbeat.

Invariants: ``_added`` and ``_removed`` are disjoint; after :meth:`changes` the published set
equals the held links (the heartbeat applies both; every ``RESYNC_BEATS``-th beat rewrites the
whole set, which also repairs a set Redis lost); the set holds at most one link per cached
block, so it is bounded by the KV cache. Touched only on the service's thread (the engine steps
there).
"""

from __future__ import annotations

from tokenfleet.shared.prefix_chain import LINK_INDEX, link_of


class PrefixSet:
    """The links of the cached blocks plus the changes not yet published (module doc)."""

    def __init__(self) -> None:
        self._held: dict[bytes, str] = {}  # block hash -> its link
        self._added: set[str] = set()
        self._removed: set[str] = set()

    def __len__(self) -> int:
        return len(self._held)

    def cached(self, index: int, block_hash: bytes) -> None:
        """The engine cached the block at ``index`` of its sequence (``CacheWatcher``)."""
        if index not in LINK_INDEX or block_hash in self._held:
            return
        link = self._held[block_hash] = link_of(block_hash)
        self._removed.discard(link)
        self._added.add(link)

    def forgotten(self, block_hash: bytes) -> None:
        """The block left the cache (``CacheWatcher``)."""
        link = self._held.pop(block_hash, None)
        if link is None:
            return
        if link in self._added:
            self._added.discard(link)
        else:
            self._removed.add(link)

    def changes(self) -> tuple[list[str], list[str]]:
        """(links to add, links to remove) since the last call; the caller publishes them."""
        added, removed = sorted(self._added), sorted(self._removed)
        self._added.clear()
        self._removed.clear()
        return added, removed

    def snapshot(self) -> list[str]:
        """Every link held (a full rewrite of the published set)."""
        return list(self._held.values())
