"""What KEDA reads for a queue against what really waits in it (docs/deployment.md, "Tenants"):
the shared stream's lag (``XINFO GROUPS``, KEDA's redis-streams scaler) plus the length of the
queue's tenant backlog (KEDA's ``redis`` list trigger), and the requests still ``queued`` whose
entry no worker has read (routing off: a request waits in the shared stream or in a tenant
queue), both read in one MULTI so that they describe the same instant."""

from __future__ import annotations

import redis

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str


def keda_and_waiting(
    r: redis.Redis, keys: Keys, model: str, priority: Priority, ids: list[str]
) -> tuple[int, int]:
    """(lag + backlog length, requests of ``ids`` really waiting) for queue (model, priority).
    Raises AssertionError when Redis cannot compute the lag (entries deleted past the group's
    position: KEDA has no figure then either)."""
    stream = keys.stream(model, priority)
    pipe = r.pipeline(transaction=True)
    pipe.xinfo_groups(stream)
    pipe.llen(keys.tenant_backlog(model, priority))
    pipe.xpending_range(stream, CONSUMER_GROUP, "-", "+", 100_000)
    for rid in ids:
        pipe.hmget(keys.record(rid), "status", "stream_id", "tenant_queued")
    groups, backlog, pending, *records = pipe.execute()
    (group,) = [g for g in groups if as_str(g["name"]) == CONSUMER_GROUP]
    assert group["lag"] is not None, "Redis could not compute the lag"
    read = {as_str(p["message_id"]) for p in pending}
    # (a tenant-queued request's stream_id is an id in its tenant queue, which may equal one of
    # the shared stream's: ids are per stream)
    waiting = sum(
        1
        for status, sid, tenant_queued in records
        if as_str(status) == "queued" and (as_str(tenant_queued) == "1" or as_str(sid) not in read)
    )
    return int(group["lag"]) + int(backlog), waiting
