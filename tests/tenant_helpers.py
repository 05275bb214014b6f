"""Driving one queue (model "default", priority normal) through the scripts, for the tenant tests
of tests/shared (docs/fairness.md): enqueue as a tenant, a worker's streams, Redis's clock."""

from __future__ import annotations

from typing import Any

import redis

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.enqueue import ENQUEUE, EnqueueItem, enqueue_keys_args
from tokenfleet.worker.intake.streams import PriorityStreams

NORMAL = Priority.NORMAL
MODEL = "default"


def enqueue(
    r: redis.Redis,
    keys: Keys,
    tenant: str,
    ids: list[str],
    *,
    now: float = 1.0,
    deadline: float | None = None,
    prompt_tokens: int = 10,
    weight: float | None = None,
) -> list[Any]:
    """Enqueue ``ids`` (``prompt_tokens`` each) as ``tenant`` at ``now``; the script's reply."""
    items = [
        EnqueueItem(rid, b"{}", deadline, tenant=tenant, weight=weight, prompt_tokens=prompt_tokens)
        for rid in ids
    ]
    k, a = enqueue_keys_args(keys, MODEL, NORMAL, items, now=now, ttl_s=600)
    reply: list[Any] = registry.call(r, ENQUEUE, k, a)
    return reply


def streams(r: redis.Redis, keys: Keys, worker: str = "w1") -> PriorityStreams:
    """Worker ``worker``'s streams of the queue, its groups created."""
    s = PriorityStreams(
        r, keys, model_name=MODEL, priorities=[NORMAL], worker_name=worker, starvation_pulls=4
    )
    s.ensure_groups()
    return s


def next_millisecond(r: redis.Redis) -> None:
    """Return once Redis's clock has passed the millisecond it reads now: ids of entries added
    after it are later than those added before in every stream."""
    sec, us = r.time()
    start = sec * 1000 + us // 1000
    while True:
        sec, us = r.time()
        if sec * 1000 + us // 1000 > start:
            return
