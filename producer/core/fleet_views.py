"""``FleetViews``: the plans that read or set the fleet's models and queues, a base of
``ClientCore`` (kept apart so that no module outgrows tests/test_layout.py's limits).

On a cluster they go lane by lane (``core.lanes``): the fleet's registry says which models have
a lane, and each lane's queues, workers and configs are read in its own slot.
"""

from __future__ import annotations

import time
from typing import Any

from redis.commands.core import HashCommands, SetCommands, SortedSetCommands

from tokenfleet.producer.core import ops
from tokenfleet.producer.core.effects import Command, Plan, RunScript, Transaction
from tokenfleet.producer.core.lanes import LaneDirectory
from tokenfleet.producer.core.models import ModelInfo, model_infos
from tokenfleet.shared.keys import CONSUMER_GROUP, DEFAULT_MODEL, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.queue_config import QueueConfig, QueueStats
from tokenfleet.shared.record import as_str
from tokenfleet.shared.scripts.queue_stats import QUEUE_STATS


class FleetViews:
    """Plans over the fleet's models and queues (needs ``_keys`` and ``_lanes``)."""

    _keys: Keys
    _lanes: LaneDirectory

    def _lane_keys(self) -> Plan[list[Keys]]:
        """The names of every lane (on a cluster: each registered model's; else the fleet's)."""
        if not self._keys.laned:
            return [self._keys]
        return [self._keys.for_model(m) for m in (yield from self._lanes.lane_models())]

    def _models(self) -> Plan[list[ModelInfo]]:
        fleet = self._keys.fleet
        served, declared = yield Transaction(
            (
                # (name, start, end, desc, withscores): Command takes positional arguments
                Command(SortedSetCommands.zrange, (fleet.served, 0, -1, False, True)),
                Command(SetCommands.smembers, (fleet.declared,)),
            )
        )
        heartbeats: list[tuple[str, Any]] = []
        for keys in (yield from self._lane_keys()):
            names = yield Command(SortedSetCommands.zrange, (keys.workers, 0, -1))
            workers = [as_str(name) or "" for name in names]
            if workers:  # each one's heartbeat says its model (None once it lapsed)
                models = yield Transaction(
                    tuple(Command(HashCommands.hget, (keys.worker(w), "model")) for w in workers)
                )
                heartbeats += zip(workers, models, strict=True)
        return model_infos(served, declared, now=time.time(), heartbeats=heartbeats)

    def _queue_stats(self) -> Plan[list[QueueStats]]:
        rows: list[QueueStats] = []
        for keys in (yield from self._lane_keys()):
            rows += yield from self._lane_queue_stats(keys)
        return rows

    def _lane_queue_stats(self, keys: Keys) -> Plan[list[QueueStats]]:
        members = yield Command(SetCommands.smembers, (keys.queues,))
        queues = ops.sorted_queues(members)
        if not queues:
            return []
        models = sorted({model for model, _ in queues})
        names = yield Transaction(
            tuple(Command(SortedSetCommands.zrange, (keys.routers(m), 0, -1)) for m in models)
        )
        routers = {m: [as_str(w) or "" for w in ws] for m, ws in zip(models, names, strict=True)}
        k, a = ops.stats_keys_args(keys, queues, routers, CONSUMER_GROUP)
        reply = yield RunScript(QUEUE_STATS, k, a)
        return ops.stats_rows(queues, reply)

    def _queue_config(self, priority: str | Priority, model: str | None) -> Plan[QueueConfig]:
        p, m = Priority.parse(priority), model or DEFAULT_MODEL
        key = self._keys.for_model(m).queue_config(m, p)
        return QueueConfig.from_hash((yield Command(HashCommands.hgetall, (key,))))

    def _set_queue_config(
        self,
        priority: str | Priority,
        model: str | None,
        max_waiting: int | None,
        policy: str | None,
    ) -> Plan[QueueConfig]:
        p = Priority.parse(priority)
        m = model or DEFAULT_MODEL
        config = ops.merged_config((yield from self._queue_config(p, m)), max_waiting, policy)
        yield from self._lanes.register(m)
        keys = self._keys.for_model(m)
        key = keys.queue_config(m, p)
        writes = [
            Command(HashCommands.hset, (key, field, value))
            for field, value in config.to_hash().items()
        ]
        writes.append(Command(SetCommands.sadd, (keys.queues, keys.queue_member(m, p))))
        yield Transaction(tuple(writes))
        return config
