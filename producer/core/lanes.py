"""``LaneDirectory``: what a producer must know of a fleet spread over lanes (Redis Cluster).

On a cluster each model's queues and requests live in the model's own hash slot, its *lane*
(``shared.keys.Keys``), so that one fleet spreads over several primaries. What one enqueue
script used to see in one slot is then split, and the producer does the cross-lane part here,
with plain reads (``Keys.laned`` False: every plan below is a no-op or answers from one slot):

* **the registry** (the fleet's slot): every model with a lane is in ``Keys.lanes``, added
  before the model's first enqueue, so lane-less readers (status by id, ``tokenfleet queues``)
  find every request; the fleet's ``served`` / ``declared`` decide whether a model is accepted
  (the enqueue script's own check then sees only its lane: it accepts, and only sets whether
  the request waits on a server);
* **a request by id**: its lane is found by asking each lane whether the record exists (cached
  per id); a chosen id that another lane already holds is an ``IdempotencyConflict``, as in
  one slot (checked before the enqueue; two clients racing with one id for two models are not
  stopped, which docs/redis-modes.md says).

Invariant: nothing here writes except the registry's ``SADD`` (idempotent); a refusal raised
here leaves nothing in Redis.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from redis.commands.core import BasicKeyCommands, SetCommands, SortedSetCommands

from tokenfleet.producer.core.effects import Command, Plan, Transaction
from tokenfleet.producer.core.request import Prepared
from tokenfleet.shared.errors import (
    IdempotencyConflict,
    ModelNotServed,
    RedisUnavailable,
    TokenfleetError,
    UnknownRequest,
)
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.record import as_str

REGISTRY_TTL_S = 1.0  # how long a cached read of the fleet's served/declared models is trusted
_IDS_REMEMBERED = 10_000  # request id -> model, for ids this client submitted or looked up


class LaneDirectory:
    """The registry cache and id -> lane cache of one producer (see the module docstring)."""

    __slots__ = ("_entered", "_ids", "_models", "_registry", "keys")

    def __init__(self, keys: Keys) -> None:
        self.keys = keys.fleet
        self._entered: set[str] = set()  # models this client added to the registry
        self._ids: dict[str, str] = {}  # oldest first (insertion order)
        self._registry: tuple[float, dict[str, float], set[str]] | None = None
        self._models: tuple[float, list[str]] | None = None  # (read at, lanes' models)

    def remember(self, request_id: str, model: str) -> None:
        """``request_id`` lives in ``model``'s lane."""
        if self.keys.laned:
            self._ids[request_id] = model
            if len(self._ids) > _IDS_REMEMBERED:  # forget the oldest (cheap: no reordering)
                del self._ids[next(iter(self._ids))]

    # -- entering lanes -------------------------------------------------------------------------
    def enter(self, models: Iterable[str]) -> Plan[dict[str, ModelNotServed]]:
        """Register each model's lane and check that the fleet serves or declares it (or is
        empty). Returns the refusal of each refused model (nothing is written for those)."""
        refused: dict[str, ModelNotServed] = {}
        if not self.keys.laned:
            return refused
        for model in sorted(set(models)):
            error = yield from self._refusal(model)
            if error is not None:
                refused[model] = error
            else:
                yield from self.register(model)
        return refused

    def register(self, model: str) -> Plan[None]:
        """Add ``model``'s lane to the registry (once per client)."""
        if self.keys.laned and model not in self._entered:
            yield Command(SetCommands.sadd, (self.keys.lanes, model))
            self._entered.add(model)

    def _refusal(self, model: str) -> Plan[ModelNotServed | None]:
        fresh = False
        if self._registry is None or time.monotonic() - self._registry[0] >= REGISTRY_TTL_S:
            yield from self._read_registry()
            fresh = True
        assert self._registry is not None
        message = _unserved(model, *self._registry[1:], now=time.time())
        if message is not None and not fresh:  # a stale "no": a server may have come up since
            yield from self._read_registry()
            message = _unserved(model, *self._registry[1:], now=time.time())
        return None if message is None else ModelNotServed(message, model=model)

    def _read_registry(self) -> Plan[None]:
        served = yield Command(SortedSetCommands.zrange, (self.keys.served, 0, -1, False, True))
        declared = yield Command(SetCommands.smembers, (self.keys.declared,))
        scores = {as_str(m) or "": float(s) for m, s in served}
        self._registry = (time.monotonic(), scores, {as_str(m) or "" for m in declared})

    # -- finding requests -----------------------------------------------------------------------
    def lane_models(self, *, fresh: bool = False) -> Plan[list[str]]:
        """Every model with a lane, sorted (empty off a cluster); read at most once per
        ``REGISTRY_TTL_S`` unless ``fresh``."""
        if not self.keys.laned:
            return []
        now = time.monotonic()
        if fresh or self._models is None or now - self._models[0] >= REGISTRY_TTL_S:
            members = yield Command(SetCommands.smembers, (self.keys.lanes,))
            self._models = (now, sorted(as_str(m) or "" for m in members))
        return self._models[1]

    def keys_of(self, request_id: str, *, fresh: bool = False) -> Plan[Keys]:
        """The names of the lane holding ``request_id`` (off a cluster: the fleet's names).

        Raises:
            UnknownRequest: no lane holds a record of that id.
        """
        if not self.keys.laned:
            return self.keys
        model = None if fresh else self._ids.get(request_id)
        if model is None:
            for candidate in (yield from self.lane_models(fresh=fresh)):
                lane = self.keys.for_model(candidate)
                if (yield Command(BasicKeyCommands.exists, (lane.record(request_id),))):
                    model = candidate
                    break
        if model is None:
            raise UnknownRequest(
                f"no request {request_id} (never submitted, or its record expired)"
            )
        self.remember(request_id, model)
        return self.keys.for_model(model)

    def existing(self, ids: list[tuple[str, str]]) -> Plan[set[tuple[str, str]]]:
        """Which ``(model, request id)`` pairs name a record in that model's lane (one round
        trip per lane)."""
        by_model: dict[str, list[str]] = {}
        for model, rid in ids:
            by_model.setdefault(model, []).append(rid)
        found: set[tuple[str, str]] = set()
        for model, rids in by_model.items():
            lane = self.keys.for_model(model)
            reads = tuple(Command(BasicKeyCommands.exists, (lane.record(r),)) for r in rids)
            replies = yield Transaction(reads)
            found.update((model, r) for r, n in zip(rids, replies, strict=True) if n)
        return found

    def held_elsewhere(self, model: str, request_ids: list[str]) -> Plan[set[str]]:
        """Which of the chosen ``request_ids`` (about to go to ``model``'s lane) already name a
        request in another lane: an idempotency conflict (a different model, so a different
        request)."""
        held: set[str] = set()
        if not self.keys.laned or not request_ids:
            return held
        for other in (yield from self.lane_models()):
            if other == model:
                continue
            lane = self.keys.for_model(other)
            reads = tuple(Command(BasicKeyCommands.exists, (lane.record(r),)) for r in request_ids)
            found = yield Transaction(reads)  # one round trip per lane
            held.update(r for r, n in zip(request_ids, found, strict=True) if n)
        return held


def lane_refusals(
    lanes: LaneDirectory, prepared: Sequence[Prepared]
) -> Plan[dict[int, TokenfleetError]]:
    """On a cluster, before any enqueue (``submit``, ``submit_many``): index -> refusal of
    each request whose model the fleet neither serves nor declares (unless its chosen id
    exists: the script answers for it), or whose chosen id another model's lane holds or an
    earlier request of the call takes for another model. Empty off a cluster (the enqueue
    script decides there)."""
    refusals: dict[int, TokenfleetError] = {}
    if not lanes.keys.laned:
        return refusals
    refused = yield from lanes.enter(p.model for p in prepared)
    existing = yield from lanes.existing(
        [(p.model, p.request_id) for p in prepared if p.model in refused and p.chosen_id]
    )
    chosen: dict[str, list[str]] = {}
    model_of: dict[str, str] = {}  # chosen id -> the model of its first request in the call
    for i, p in enumerate(prepared):
        if p.model in refused and (p.model, p.request_id) not in existing:
            refusals[i] = ModelNotServed(str(refused[p.model]), model=p.model)
        elif p.chosen_id:
            if model_of.setdefault(p.request_id, p.model) != p.model:
                refusals[i] = conflict_elsewhere(p.request_id)
            else:
                chosen.setdefault(p.model, []).append(p.request_id)
    held: set[str] = set()
    for model, ids in chosen.items():
        held |= yield from lanes.held_elsewhere(model, ids)
    for i, p in enumerate(prepared):
        if i not in refusals and p.chosen_id and p.request_id in held:
            refusals[i] = conflict_elsewhere(p.request_id)
    return refusals


def lane_failed(model: str, exc: Exception) -> RedisUnavailable:
    """The error of each request of a ``submit_many`` whose lane failed after other lanes took
    theirs (those are enqueued; these are not)."""
    return RedisUnavailable(
        f"model {model!r}'s lane did not take the request ({type(exc).__name__}: {exc}); "
        "the call's requests for other models were enqueued"
    )


def conflict_elsewhere(request_id: str) -> IdempotencyConflict:
    """The refusal of a chosen id that another model's lane already holds."""
    return IdempotencyConflict(
        f"request id {request_id} is already used by a request for another model",
        request_id=request_id,
    )


def _unserved(model: str, served: dict[str, float], declared: set[str], now: float) -> str | None:
    """The enqueue script's refusal message, from the fleet's registry: None when ``model`` is
    served, declared, or the fleet is empty (no live server, nothing declared)."""
    if served.get(model, 0.0) > now or model in declared:
        return None
    live = sorted(m for m, expiry in served.items() if expiry > now)
    if not live and not declared:
        return None
    return (
        f"model '{model}' is not served by any live worker and not declared in this fleet "
        f"(served: {_names(live)}; declared: {_names(sorted(declared))})"
    )


def _names(names: list[str], limit: int = 10) -> str:
    if not names:
        return "none"
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
