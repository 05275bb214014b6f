"""The lanes a command-line reader goes through (``tokenfleet status``, ``models``).

Off a cluster a fleet is one keyspace on one server: one client, the fleet's names. On a
cluster each model's queues, requests and workers live in the model's lane, a hash slot that
may be on any primary (``shared.keys.Keys``), and a client reaches one slot; so a reader of the
whole fleet opens a client per lane the fleet's registry (``Keys.lanes``) lists.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.record import as_str
from tokenfleet.shared.redis_connect import redis_client
from tokenfleet.shared.settings import Settings


@contextmanager
def lane_clients(client: Any, settings: Settings) -> Iterator[list[tuple[Keys, Any]]]:
    """``(names, client)`` of each lane, by model name (``client``: the fleet's, for the
    registry; off a cluster the only one). The clients opened here close on exit."""
    keys = Keys.for_settings(settings)
    if not keys.laned:
        yield [(keys, client)]
        return
    models = sorted(as_str(m) or "" for m in client.smembers(keys.fleet.lanes))
    opened = [redis_client(replace(settings, lane=m)) for m in models]
    try:
        yield [(keys.for_model(m), c) for m, c in zip(models, opened, strict=True)]
    finally:
        for c in opened:
            c.close()
