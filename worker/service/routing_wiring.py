"""Wiring a worker into routing (docs/routing.md): its stealer, its published prefix set.

* every worker steals: aged work of other workers' routed streams (``steal_after_s``);
* an overflow worker (``--overflow-for``) steals with its overflow threshold from the shared
  streams too, reads nothing else, claims a dead worker's entries only once it has found that
  worker dead for its threshold (``Claimer.dead_for_s``), and is never a routing target;
* any other worker, with routing on (``Settings.routing``), is a routing target: it publishes
  its model's route tokenizer spec (``shared.route_spec``) once, and its heartbeat publishes
  its prefix set (the links its engine's prefix cache holds) and its score in
  ``P:routers:MODEL``.
"""

from __future__ import annotations

from typing import Any, cast

import redis

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.route_spec import RouteSpec
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake.stealer import Stealer
from tokenfleet.worker.service.engine_port import EnginePort
from tokenfleet.worker.service.feed import Feeder
from tokenfleet.worker.service.heartbeat import Heartbeat
from tokenfleet.worker.service.prefix_set import PrefixSet
from tokenfleet.worker.worker_settings import WorkerSettings


def wire_routing(
    feed: Feeder,
    heartbeat: Heartbeat,
    engine: EnginePort,
    settings: Settings,
    ws: WorkerSettings,
) -> None:
    """Give ``feed`` its stealer (and the overflow role) and ``heartbeat`` its prefix set."""
    overflow = ws.overflow_for is not None
    after_s = ws.overflow_after_s if overflow else ws.steal_after_s
    feed.stealer = Stealer(
        feed.intake.client,
        feed.intake.streams,
        steal_after_ms=int(after_s * 1000),
        overflow=overflow,
    )
    feed.overflow = overflow
    if overflow:
        feed.claimer.dead_for_s = ws.overflow_after_s
    if overflow or settings.routing == "off":
        return
    heartbeat.prefixes = PrefixSet()
    engine.watch_prefix_cache(heartbeat.prefixes)
    spec = route_spec_of(engine.tokenizer, engine.capacity().block_size)
    if spec is not None:  # else producers route this model by session only
        publish_route_spec(heartbeat.client, heartbeat.keys, heartbeat.model_name, spec)
    heartbeat.max_num_seqs = ws.max_num_seqs
    heartbeat.levels = ",".join(p.label for p in ws.priorities)


def route_spec_of(tokenizer: Any, block_size: int) -> RouteSpec | None:
    """The route spec of a Hugging Face tokenizer (None for a slow one: no tokenizer JSON)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    special = {
        name: value
        for name, value in (getattr(tokenizer, "special_tokens_map", None) or {}).items()
        if isinstance(value, str)
    }
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the worker renders with "default"
        template = template.get("default")
    return RouteSpec(
        backend.to_str(), template if isinstance(template, str) else "", special, block_size
    )


def publish_route_spec(client: redis.Redis, keys: Keys, model: str, spec: RouteSpec) -> None:
    """Write ``spec`` as ``model``'s route tokenizer unless the same one is there already."""
    key = keys.route_tokenizer(model)
    digest = spec.digest
    if client.hget(key, "digest") != digest.encode():
        client.hset(key, mapping=cast(Any, spec.to_hash()))  # str -> str: redis-py's stubs
