"""The worker service: one engine served against the fleet's Redis.

* ``loop``: :class:`WorkerService`, the loop (timers → read → feed → step → publish → ack);
* ``feed``: the intake → engine side (admission budget, early start, claimed entries);
* ``adapter``: wire ↔ engine translation (prompts, sampling parameters, token and terminal
  events);
* ``outbox``: each step's publish in flight and the application of its results;
* ``run_table``: every request's state (jobs, early starts, aborted runs) and its invariants;
* ``engine_port``: the typed protocol of what the service uses of the engine;
* ``step_failure``, ``handback``, ``heartbeat``, ``metrics``: the policies and reporting around
  it.
"""

from tokenfleet.worker.service.loop import WorkerService

__all__ = ["WorkerService"]
