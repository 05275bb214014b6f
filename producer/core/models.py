"""Which models the fleet serves and declares, as ``Client.models()`` reports them (no I/O).

Two keys say it (docs/models.md): ``Keys.served``, where each live worker's
heartbeat raises its model's expiry to ``now + heartbeat TTL`` (``ZADD GT``), and
``Keys.declared``, the names an operator declared. A model is *served* while its expiry is in
the future. The same test decides at submit (the enqueue script), so what ``models()`` says is
what the next submit meets, give or take a heartbeat.

Its *workers* are the live workers whose heartbeat hash (``Keys.worker``, which expires with the
heartbeat) names it as their ``model``: the same test as ``tokenfleet status`` and ``tokenfleet
models fleet``, so a worker in its shutdown grace period is still listed (it beats, it no longer
extends the served mark), and so is an overflow worker (it takes no routed work). The routers
sets (``Keys.routers``) are no substitute: they list only workers that take routed work.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenfleet.shared.record import as_str


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One model the fleet knows of.

    Attributes:
        name: the served-model name (its queues are ``P:q:<name>:<priority>``).
        served: a live worker serves it now (``expires_at`` is in the future).
        declared: the fleet's configuration declares it (``tokenfleet models declare``), so a
            request for it is accepted (and waits) even while no live worker serves it.
        expires_at: epoch seconds at which the latest heartbeat of its servers lapses (in the
            past when none is live); None when no worker has served it within the last hour.
        workers: names of the live workers whose heartbeat names this model, sorted (empty
            when none beats now).
    """

    name: str
    served: bool
    declared: bool
    expires_at: float | None
    workers: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``tokenfleet models fleet --json``, ``status --json``)."""
        return {
            "name": self.name,
            "served": self.served,
            "declared": self.declared,
            "expires_at": self.expires_at,
            "workers": list(self.workers),
        }


def model_infos(
    served: Iterable[tuple[bytes | str, float]],
    declared: Iterable[bytes | str],
    *,
    now: float,
    heartbeats: Iterable[tuple[str, bytes | str | None]] = (),
) -> list[ModelInfo]:
    """``ZRANGE served 0 -1 WITHSCORES``, ``SMEMBERS declared`` and, per worker name of
    ``Keys.workers``, its heartbeat's ``model`` (None: no live heartbeat) -> one ``ModelInfo``
    per model named in the first two, sorted by name. A live worker of a model named in neither
    (it never beat as serving: stopping since its start) is not listed."""
    expiry = {as_str(name) or "": float(score) for name, score in served}
    names = {as_str(name) or "" for name in declared}
    workers: dict[str, list[str]] = {}
    for worker, model in heartbeats:
        if model is not None:
            workers.setdefault(as_str(model) or "", []).append(worker)
    return [
        ModelInfo(
            name=name,
            served=expiry.get(name, 0.0) > now,
            declared=name in names,
            expires_at=expiry.get(name),
            workers=tuple(sorted(workers.get(name, ()))),
        )
        for name in sorted(names | expiry.keys())
    ]
