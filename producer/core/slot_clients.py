"""``SlotClients``: which redis client (and pub/sub subscriber) a producer uses for a key.

Off a cluster there is one of each, whatever the key. On a cluster a fleet spans several hash
slots (``shared.keys.Keys``: a lane per model, the fleet's own slot), and each client built by
``shared.redis_connect`` is pinned to the primary of one slot; so the drivers pick, per effect,
the client of the slot its key's hash tag names, building it (and its subscriber) the first
time that slot is used.

Invariants: every key a plan hands the driver starts with a hash tag on a cluster (``Keys``
builds no other), so ``root_of`` finds its slot; the face closes the clients built here
(:meth:`SlotClients.owned`) with itself, and the first one only if it created it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

R = TypeVar("R")  # a redis client (sync or asyncio)
S = TypeVar("S")  # its subscriber


def root_of(key: object) -> str:
    """The hash tag a cluster key starts with (``{prefix|lane}``), or "" for a plain key."""
    if isinstance(key, bytes):
        key = key.decode("utf-8", "replace")
    if isinstance(key, str) and key.startswith("{"):
        end = key.find("}")
        if end > 0:
            return key[: end + 1]
    return ""


class SlotClients(Generic[R, S]):
    """The redis client and subscriber of each hash slot a producer has used.

    ``first`` (and ``first_subscriber``) serve ``first_root`` and, off a cluster (``cluster``
    False), every key; ``make(root)`` builds the client of another slot's root and
    ``subscriber_of(client)`` its subscriber.
    """

    __slots__ = ("_by_root", "_cluster", "_lock", "_make", "_owned", "_subscriber_of")

    def __init__(
        self,
        first: R,
        first_subscriber: S,
        *,
        first_root: str,
        cluster: bool,
        make: Callable[[str], R],
        subscriber_of: Callable[[R], S],
    ) -> None:
        self._by_root: dict[str, tuple[R, S]] = {first_root: (first, first_subscriber)}
        self._cluster = cluster
        self._make = make
        self._subscriber_of = subscriber_of
        self._owned: list[R] = []
        self._lock = threading.Lock()  # a sync client may be shared by threads

    @classmethod
    def single(cls, client: R, subscriber: S) -> SlotClients[R, S]:
        """One client and subscriber for every key (off a cluster; tests)."""

        def no_other(root: str) -> R:
            raise AssertionError(f"a single-slot producer got a key of slot {root}")

        return cls(
            client,
            subscriber,
            first_root="",
            cluster=False,
            make=no_other,
            subscriber_of=lambda _: subscriber,
        )

    def pair(self, key: object) -> tuple[R, S]:
        """The client and subscriber serving ``key``'s slot."""
        if not self._cluster:
            return next(iter(self._by_root.values()))
        root = root_of(key)
        found = self._by_root.get(root)
        if found is None:
            with self._lock:  # (built once: a second subscriber would never be closed)
                found = self._by_root.get(root)
                if found is None:
                    client = self._make(root)
                    found = (client, self._subscriber_of(client))
                    self._by_root[root] = found
                    self._owned.append(client)
        return found

    def client(self, key: object) -> R:
        """The redis client serving ``key``'s slot."""
        return self.pair(key)[0]

    def subscriber(self, key: object) -> S:
        """The subscriber serving ``key``'s slot (a channel's)."""
        return self.pair(key)[1]

    def subscribers(self) -> Iterator[S]:
        """Every subscriber built so far, the first one first."""
        return (s for _, s in list(self._by_root.values()))

    def owned(self) -> list[R]:
        """The clients built here (to close with the producer)."""
        return list(self._owned)
