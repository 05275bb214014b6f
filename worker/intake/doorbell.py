"""The doorbell: tells a busy engine, between two layers, that more urgent work is in Redis.

While a worker runs only ``batch`` work, a request of a more urgent level that arrives mid-step
would wait for the rest of that step (a whole forward pass over every batch sequence) before
the loop even reads it. The doorbell watches the streams of the more urgent levels the worker
serves with a plain ``XREAD BLOCK 0 STREAMS ... $`` on a connection of its own: it reads nothing
for the worker (no consumer group: the entry stays for whoever pulls it) and answers the moment an
entry is added. :meth:`Doorbell.rang` looks at that connection's socket without a round trip, so
the engine can ask it before every layer (``Engine.set_interrupt``); once it has rung the engine
cuts its batch-only step short and the loop reads the new request at once.

It is an accelerator, never a source of truth: entries added while it is not armed are read by
the ordinary pulls; a connection error disarms it quietly (the loop's own round trips notice and
ride out an outage), and it is armed again at most once per ``RETRY_S`` after a failure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import redis

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import BACKGROUND
from tokenfleet.worker.pipelined import dedicated_connection
from tokenfleet.worker.worker_settings import WorkerSettings

log = logging.getLogger(__name__)

RETRY_S = 1.0  # after a failed arm or read, wait this long before arming again


class Doorbell:
    """Rings once per urgent arrival after :meth:`arm` (see the module docstring).

    Invariant: ``_armed`` is True exactly while an ``XREAD BLOCK`` is unanswered on ``_conn``.
    """

    def __init__(self, client: redis.Redis, streams: Sequence[str]) -> None:
        self.client = client
        self.streams = list(streams)
        self.rings = 0  # times it rang (the worker's metrics read it)
        self._conn: Any = None
        self._armed = False
        self._retry_at = 0.0

    @property
    def armed(self) -> bool:
        """An ``XREAD BLOCK`` is waiting on the doorbell's connection."""
        return self._armed

    def arm(self) -> None:
        """Watch for entries added from now on (no-op while armed or backing off)."""
        if self._armed or not self.streams or time.monotonic() < self._retry_at:
            return
        try:
            if self._conn is None:
                self._conn = dedicated_connection(self.client)
            n = len(self.streams)
            self._conn.send_command("XREAD", "BLOCK", 0, "STREAMS", *self.streams, *(["$"] * n))
            self._armed = True
        except (redis.RedisError, OSError) as exc:
            self._fail(exc)

    def _refused(self, exc: redis.ResponseError) -> None:
        """An error reply (an ACL user without ``XREAD``): said once, never armed again."""
        log.warning(
            "the doorbell's XREAD was refused (%s): urgent arrivals no longer cut batch steps "
            "short (grant +xread: docs/security.md, 'Redis ACL roles')",
            exc,
        )
        self.close()
        self.streams = []

    def rang(self) -> bool:
        """Whether an entry was added since :meth:`arm` (then it is disarmed). No round trip."""
        if not self._armed:
            return False
        try:
            if not self._conn.can_read(timeout=0):
                return False
            self._conn.read_response()
        except redis.ResponseError as exc:
            self._refused(exc)
            return False
        except (redis.RedisError, OSError) as exc:
            self._fail(exc)
            return False
        self._armed = False
        self.rings += 1
        return True

    def close(self) -> None:
        """Drop the connection (its blocked read ends with it)."""
        self._armed = False
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = None

    def _fail(self, exc: BaseException) -> None:
        log.debug("doorbell disarmed: %s", exc)
        self.close()
        self._retry_at = time.monotonic() + RETRY_S


def wire_doorbell(
    engine: Any, client: redis.Redis, keys: Keys, ws: WorkerSettings
) -> Doorbell | None:
    """A doorbell on the streams of the levels more urgent than ``batch`` that the worker
    serves, given to the engine as its interrupt (``Engine.set_interrupt``, not part of the
    service's ``EnginePort``). None when batch work does not yield (``batch_yields``), the worker
    serves no batch or nothing more urgent, or the engine cannot be interrupted."""
    urgent = [p for p in ws.priorities if p < BACKGROUND]
    set_interrupt = getattr(engine, "set_interrupt", None)
    if not ws.batch_yields or BACKGROUND not in ws.priorities or not urgent:
        return None
    if not callable(set_interrupt):
        return None
    streams = [keys.stream(ws.model_name, p) for p in urgent]
    streams += [keys.routed(ws.model_name, p, ws.name) for p in urgent]  # routed work too
    doorbell = Doorbell(client, streams)
    set_interrupt(doorbell.rang)
    return doorbell
