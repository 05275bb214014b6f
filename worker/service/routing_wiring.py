"""Wiring a worker into routing (README "Routing"): its stealer, its published prefix set.

* every worker steals: aged work of other workers' routed streams (``steal_after_s``);
* an overflow worker (``--overflow-for``) steals with its overflow threshold from the shared
  streams too, reads nothing else, and is never a routing target;
* any other worker, with routing on (``Settings.routing``), is a routing target: its heartbeat
  publishes its prefix set and its score in ``P:routers:MODEL``.
"""

from __future__ import annotations

from tokenfleet.shared.settings import Settings
from tokenfleet.worker.intake.stealer import Stealer
from tokenfleet.worker.service.engine_port import EnginePort
from tokenfleet.worker.service.feed import Feeder
from tokenfleet.worker.service.heartbeat import Heartbeat
from tokenfleet.worker.service.prefix_set import PrefixSet, links_for
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
    if overflow or settings.routing == "off":
        return
    cap = engine.capacity()
    prefixes = PrefixSet(links_for(cap.free_kv_blocks * max(1, cap.block_size)))
    feed.prefixes = heartbeat.prefixes = prefixes
    heartbeat.max_num_seqs = ws.max_num_seqs
    heartbeat.levels = ",".join(p.label for p in ws.priorities)
