"""Per-stream lag as KEDA's ``redis-streams`` scaler reads it, for ``tokenfleet status --json``.

KEDA (``lagCount``) scales on the consumer group's ``lag`` from ``XINFO GROUPS <stream>``
(Redis >= 7): entries added to the stream that the group has not yet delivered to any worker,
i.e. the requests still queued. ``pending`` (delivered, not yet acknowledged) is what workers are
running. Redis reports ``lag`` as nil when it cannot compute it (entries deleted after the
group's last-delivered id, e.g. by a drop-oldest eviction); it is reported here as ``None``, the
same figure KEDA gets.

Invariant: ``queue_lags`` issues only reads (``XINFO GROUPS``), one per known queue, in one
non-transactional pipeline; a stream or group that does not exist yet has lag 0 and pending 0.
"""

from __future__ import annotations

from typing import Any

import redis

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str


def queue_lags(client: Any, keys: Keys, queues: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``{stream, consumer_group, lag, pending}`` for each queue dict (``model``, ``priority``)
    of ``Client.queue_stats()``, in the same order."""
    streams = [keys.stream(q["model"], Priority.parse(q["priority"])) for q in queues]
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        pipe.xinfo_groups(stream)
    rows = []
    for stream, groups in zip(streams, pipe.execute(raise_on_error=False), strict=True):
        lag: int | None = 0
        pending = 0
        if not isinstance(groups, redis.ResponseError):  # no such stream yet: nothing queued
            for group in groups:
                info = {as_str(k): v for k, v in group.items()}
                if as_str(info.get("name")) == CONSUMER_GROUP:
                    raw = info.get("lag")
                    lag = None if raw is None else int(raw)
                    pending = int(info.get("pending") or 0)
        rows.append(
            {"stream": stream, "consumer_group": CONSUMER_GROUP, "lag": lag, "pending": pending}
        )
    return rows
