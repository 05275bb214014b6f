"""``ClientCore``: what a client knows and decides, written once for ``Client`` and
``AsyncClient``.

Every operation is a plan (see ``effects.py``): it validates, builds the script's KEYS/ARGV,
yields what Redis must do and turns the replies into results or exceptions. The faces add only
how a plan runs (``_run``: blocking or awaited) and which handle class they hand out.
"""

from __future__ import annotations

import contextlib
import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, Self, TypeVar

import redis
from redis.commands.core import HashCommands, SetCommands, SortedSetCommands

from tokenfleet.producer.core import ops
from tokenfleet.producer.core.effects import (
    Command,
    LazyCalls,
    Mailbox,
    Plan,
    RunScript,
    RunScripts,
    Sleep,
    Subscribe,
    Transaction,
)
from tokenfleet.producer.core.lanes import (
    LaneDirectory,
    lane_failed,
    lane_refusals,
)
from tokenfleet.producer.core.models import ModelInfo, model_infos
from tokenfleet.producer.core.outage import OutageClock
from tokenfleet.producer.core.request import Prepared, prepare, prepare_many
from tokenfleet.producer.core.route_tokenizer import (
    RouteTokenizer,
    RouteTokenizers,
    compute_chains,
)
from tokenfleet.producer.core.slot_clients import SlotClients
from tokenfleet.shared.errors import TokenfleetError, UnknownRequest
from tokenfleet.shared.keys import CONSUMER_GROUP, DEFAULT_MODEL, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.queue_config import QueueConfig, QueueStats
from tokenfleet.shared.record import RequestRecord, as_str
from tokenfleet.shared.replica_wait import ReplicationLagged
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.cancel import CANCEL, EXPIRE_OVERDUE, withdraw_keys_args
from tokenfleet.shared.scripts.enqueue import (
    ENQUEUE,
    EXPIRED_MESSAGE,
    RouteTargets,
    enqueue_keys_args,
)
from tokenfleet.shared.scripts.queue_stats import QUEUE_STATS
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.tenants import DEFAULT_TENANT, TenantSettings

CANCELLED_MESSAGE = "cancelled by the client before it started"
# Routing: the candidates of a model (Keys.routers) are read at most this often per client, and
# only workers whose heartbeat was alive in the last ROUTERS_RECENT_S count (their routed
# streams' waiting entries count in the bound; the script routes only to live ones).
ROUTERS_TTL_S = 1.0
ROUTERS_RECENT_S = 60.0
# Tenants (docs/fairness.md): a tenant's settings in the fleet's hash are read at most this
# often per client, for the enqueue script to store in a model's book that lacks them.
TENANTS_TTL_S = 1.0

H = TypeVar("H")  # the handle class a face hands out


def _nth_call(call: Callable[[int], RunScript], numbers: list[int], j: int) -> RunScript:
    return call(numbers[j])


class SubscriberState(Protocol):
    """What the core asks of a face's subscriber: whether it was closed."""

    @property
    def closed(self) -> bool: ...


class ClientCore(ABC, Generic[H]):
    """State and plans shared by both faces (arguments: see ``Client``).

    Invariants: nothing here performs I/O; a refused submit (invalid input, closed client,
    full queue, a model the fleet neither serves nor declares) leaves nothing in Redis; a face's
    public method runs exactly one plan.
    """

    def __init__(
        self,
        redis_client: Any,
        *,
        settings: Settings | None,
        recheck_s: float,
        subscribe_timeout_s: float,
        resubmit_lost: bool | None = None,
    ) -> None:
        self.settings = settings if settings is not None else Settings.from_env()
        self.resubmit_lost = (
            self.settings.resubmit_lost if resubmit_lost is None else bool(resubmit_lost)
        )
        self._keys = Keys.for_settings(self.settings)
        self.recheck_s = recheck_s
        self.subscribe_timeout_s = subscribe_timeout_s
        self._redis = redis_client
        self._subscriber: SubscriberState = self._subscriber_of(redis_client)
        self._slots = SlotClients(
            redis_client,
            self._subscriber,
            first_root=self._keys.root,
            cluster=self._keys.laned,  # a cluster: one more client per lane used (core.lanes)
            make=lambda root: self._redis_for(self.settings, root=root),
            subscriber_of=self._subscriber_of,
        )
        self._owns_redis = False
        self._routers: dict[str, tuple[float, tuple[str, ...]]] = {}  # model -> (read at, names)
        self._tenants: dict[str, tuple[float, TenantSettings | None]] = {}  # name -> (read at, it)
        self._route_tokenizers = RouteTokenizers(self._keys, ROUTERS_TTL_S)
        self._lanes = LaneDirectory(self._keys)  # (a cluster: each model's lane, the registry)

    @classmethod
    def from_url(cls, url: str | None = None, **kwargs: Any) -> Self:
        """A client with its own connection pool, built in the settings' Redis mode
        (``shared.redis_connect``); ``url`` defaults to the settings' one."""
        settings = kwargs.pop("settings", None) or Settings.from_env()
        settings = settings.with_url(url)
        redis_client = cls._redis_for(settings)
        client = cls(redis_client, settings=settings, **kwargs)
        client._owns_redis = True
        return client

    @staticmethod
    @abstractmethod
    def _redis_for(settings: Settings, *, root: str | None = None) -> Any:
        """A redis client of the face's kind with its own pool, in the settings' Redis mode
        (``shared.redis_connect``; ``root``: on a cluster, the slot it serves)."""

    @staticmethod
    @abstractmethod
    def _subscriber_of(redis_client: Any) -> Any:
        """The face's pub/sub subscriber, on connections built like ``redis_client``'s."""

    @abstractmethod
    def _new_handle(
        self,
        request_id: str,
        subscription: Mailbox | None,
        deadline: float | None,
        keys: Keys | None = None,
        prepared: Prepared | None = None,
    ) -> H:
        """The face's handle on ``request_id`` (``keys``: its lane's names, when known;
        ``prepared``: the request as submitted, which the handle submits again if Redis loses
        it)."""

    def handle(self, request_id: str) -> H:
        """A handle on an existing request (e.g. one submitted by another process)."""
        return self._new_handle(request_id, None, None)

    # -- submitting -----------------------------------------------------------------------------
    def _submit(
        self, prompt: Any, params: dict[str, Any], *, timeout: float | None, try_only: bool
    ) -> Plan[H]:
        prepared = prepare(self.settings, now=time.time(), prompt=prompt, **params)
        return (yield from self._submit_prepared(prepared, timeout=timeout, try_only=try_only))

    def _submit_prepared(
        self, prepared: Prepared, *, timeout: float | None, try_only: bool
    ) -> Plan[H]:
        """Enqueue one prepared request (``_submit``'s, or a requeued dead letter's)."""
        if self._subscriber.closed:  # before the enqueue: a refused submit leaves no request
            raise redis.ConnectionError("the client is closed")
        keys = self._keys.for_model(prepared.model)
        if keys.laned:  # the checks a cluster's enqueue script cannot make (core.lanes)
            for refusal in (yield from lane_refusals(self._lanes, [prepared])).values():
                raise refusal
        if prepared.route_input is not None:
            tok = yield from self._route_tokenizers.get(prepared.model)
            if tok is not None:
                prepared.chain = (yield from compute_chains([(prepared, tok)]))[0]
        until = None if timeout is None else time.monotonic() + timeout
        delay, growth, ceiling = ops.BLOCK_POLL
        lagged = OutageClock(self.settings.redis_retry_s)
        while True:
            route = yield from self._route_targets(prepared.model)
            held = yield from self._tenant_settings([prepared])
            try:
                code, value = ops.enqueue_pair(
                    (yield self._enqueue(prepared, try_only, route, held))
                )
            except ReplicationLagged as exc:  # not known to survive a failover: send it again
                pause = lagged.next_wait(exc, until)  # (the same id: at most once in Redis)
                if pause is None:
                    raise
                yield Sleep(pause)
                continue
            if code in ("new", "exists"):
                # SUBSCRIBE only now, unconfirmed: the request reaches Redis sooner, and the
                # handle's first read waits for the confirmation and then reads the record and
                # token list, so what was published before it is not lost (docs/protocol.md)
                self._lanes.remember(prepared.request_id, prepared.model)
                channel = keys.channel(prepared.request_id)
                sub: Mailbox | None
                try:
                    sub = yield Subscribe(channel, self.subscribe_timeout_s, confirm=False)
                except redis.ConnectionError:  # closed meanwhile: the request exists anyway
                    sub = None  # the handle subscribes on its first read (and says why not)
                deadline = prepared.deadline if code == "new" else None
                return self._new_handle(prepared.request_id, sub, deadline, keys, prepared)
            if code != "full" or (until is not None and time.monotonic() + delay > until):
                raise ops.refusal(code, value, prepared.request_id, prepared.model)
            yield Sleep(delay)
            delay = min(delay * growth, ceiling)

    def _route_targets(self, model: str) -> Plan[RouteTargets | None]:
        """The routing candidates for ``model`` (cached ``ROUTERS_TTL_S``); None: routing off."""
        if self.settings.routing == "off":
            return None
        now = time.monotonic()
        cached = self._routers.get(model)
        if cached is None or now - cached[0] >= ROUTERS_TTL_S:
            since = time.time() - ROUTERS_RECENT_S
            names = yield Command(
                SortedSetCommands.zrangebyscore,
                (self._keys.for_model(model).routers(model), since, "+inf"),
            )
            cached = (now, tuple(sorted(n.decode() if isinstance(n, bytes) else n for n in names)))
            self._routers[model] = cached
        return RouteTargets(cached[1], self.settings.session_ttl_s)

    def _tenant_settings(self, prepared: Sequence[Prepared]) -> Plan[dict[str, TenantSettings]]:
        """The stored settings (``tokenfleet tenants set``) of the requests' tenants and of the
        default tenant, for the enqueue script to store in a model's book that lacks them
        (cached ``TENANTS_TTL_S``; a tenant without settings: left out). None are read when
        every request is the default tenant's: its settings matter only beside another tenant's
        requests, whose enqueue stores them too."""
        names = {p.tenant for p in prepared}
        if names <= {DEFAULT_TENANT}:
            return {}
        names.add(DEFAULT_TENANT)
        now = time.monotonic()
        stale = sorted(
            n for n in names if n not in self._tenants or now - self._tenants[n][0] >= TENANTS_TTL_S
        )
        if stale:
            raw = yield Command(HashCommands.hmget, (self._keys.fleet.tenants, stale))
            for name, value in zip(stale, raw, strict=True):
                self._tenants[name] = (now, TenantSettings.decode(value) if value else None)
        return {n: held for n in sorted(names) if (held := self._tenants[n][1]) is not None}

    def _resubmit(self, prepared: Prepared) -> Plan[None]:
        """Enqueue ``prepared`` again (same id and parameters) after Redis lost it: its queue's
        policy applies as to any submit (``full`` waits, with ``BLOCK_POLL``'s pauses); a refusal
        raises (``Overloaded``, ...). ``exists``: it is back already (a worker's repair)."""
        delay, growth, ceiling = ops.BLOCK_POLL
        while True:
            route = yield from self._route_targets(prepared.model)
            held = yield from self._tenant_settings([prepared])
            code, value = ops.enqueue_pair((yield self._enqueue(prepared, False, route, held)))
            if code in ("new", "exists"):
                self._lanes.remember(prepared.request_id, prepared.model)
                return
            if code != "full":
                raise ops.refusal(code, value, prepared.request_id, prepared.model)
            yield Sleep(delay)
            delay = min(delay * growth, ceiling)

    def _try_submit(self, prompt: Any, params: dict[str, Any]) -> Plan[H]:
        params.pop("timeout", None)
        return self._submit(prompt, params, timeout=0.0, try_only=True)

    def _enqueue(
        self,
        prepared: Prepared,
        try_only: bool,
        route: RouteTargets | None = None,
        tenant_settings: Mapping[str, TenantSettings] | None = None,
    ) -> RunScript:
        k, a = enqueue_keys_args(
            self._keys.for_model(prepared.model),
            prepared.model,
            prepared.priority,
            [prepared],
            now=time.time(),
            ttl_s=self.settings.record_ttl_s,
            try_only=try_only,
            route=route,
            tenant_settings=tenant_settings,
        )
        return RunScript(ENQUEUE, k, a, confirm=True)

    def _submit_many(
        self, requests: Sequence[str | Mapping[str, Any]]
    ) -> Plan[list[H | TokenfleetError]]:
        now = time.time()
        prepared = prepare_many(self.settings, requests, now=now)
        refused = yield from lane_refusals(self._lanes, prepared)
        keep = [i for i in range(len(prepared)) if i not in refused]
        batches = [
            (queue, [keep[j] for j in indices])
            for queue, indices in ops.plan_batches([prepared[i] for i in keep])
        ]
        routes: dict[str, RouteTargets | None] = {}
        for (model, _), _ in batches:
            if model not in routes:
                routes[model] = yield from self._route_targets(model)
        yield from self._attach_chains([prepared[i] for i in keep])
        held = yield from self._tenant_settings([prepared[i] for i in keep])

        def call(b: int) -> RunScript:  # made as the driver sends them (LazyCalls)
            (model, priority), indices = batches[b]
            items = [prepared[i] for i in indices]
            names = {p.tenant for p in items} | {DEFAULT_TENANT}
            k, a = enqueue_keys_args(
                self._keys.for_model(model),
                model,
                priority,
                items,
                now=now,
                ttl_s=self.settings.record_ttl_s,
                route=routes[model],
                tenant_settings={n: s for n, s in held.items() if n in names},
            )
            return RunScript(ENQUEUE, k, a)

        results: list[H | TokenfleetError] = []

        def make_handles() -> None:  # while Redis runs the calls: a handle has no I/O
            if not results:  # (once: a round trip sent again calls it again)
                new_handle = self._new_handle
                lane = {m: self._keys.for_model(m) for m in {p.model for p in prepared}}
                results.extend(
                    [new_handle(p.request_id, None, p.deadline, lane[p.model], p) for p in prepared]
                )

        # one round trip per slot (a cluster: per model's lane; else one for every batch)
        slots: dict[str, list[int]] = {}
        for b, ((model, _), _) in enumerate(batches):
            slots.setdefault(self._keys.for_model(model).root, []).append(b)
        replies: list[Any] = [None] * len(batches)
        for n, numbers in enumerate(slots.values()):
            calls = functools.partial(_nth_call, call, numbers)
            got = yield from self._run_slot(calls, len(numbers), make_handles, first=n == 0)
            for b, reply in zip(numbers, got, strict=True):
                replies[b] = reply
        make_handles()  # (when every request was refused before any round trip)
        for i, error in refused.items():
            results[i] = error
        for ((model, _), indices), reply in zip(batches, replies, strict=True):
            self._settle_batch(
                results, [(i, prepared[i].request_id) for i in indices], model, reply
            )
        return results

    def _settle_batch(
        self,
        results: list[H | TokenfleetError],
        members: list[tuple[int, str]],
        model: str,
        reply: Any,
    ) -> None:
        """Put one batch's outcome into ``results``: each member (its index there, its id)
        keeps its handle, or gets the refusal or the lane's error in its place."""
        if isinstance(reply, redis.RedisError):
            for i, _ in members:
                results[i] = lane_failed(model, reply)
            return
        refusals = ops.enqueue_refusals(
            registry.check_reply(ENQUEUE, reply), [rid for _, rid in members], model
        )
        for (i, rid), refusal in zip(members, refusals, strict=True):
            if refusal is not None:
                results[i] = refusal  # its handle, made meanwhile, is dropped
            elif self._keys.laned:
                self._lanes.remember(rid, model)

    def _attach_chains(self, prepared: Sequence[Prepared]) -> Plan[None]:
        """Give each routed request its prefix chain (one tokenizer load per model)."""
        tokenizers: dict[str, RouteTokenizer | None] = {}
        work: list[tuple[Prepared, RouteTokenizer]] = []
        for p in prepared:
            if p.route_input is not None:
                if p.model not in tokenizers:
                    tokenizers[p.model] = yield from self._route_tokenizers.get(p.model)
                tok = tokenizers[p.model]
                if tok is not None:
                    work.append((p, tok))
        if work:
            for (p, _), chain in zip(work, (yield from compute_chains(work)), strict=True):
                p.chain = chain

    def _run_slot(
        self,
        call: Callable[[int], RunScript],
        count: int,
        meanwhile: Callable[[], None],
        *,
        first: bool,
    ) -> Plan[list[Any]]:
        """One slot's enqueue calls in one round trip: their replies, or its error per call.

        The ``first`` slot's failure fails the whole submit (nothing is enqueued yet); a later
        slot's failure is reported per request, since other lanes' requests are already in.
        """
        lagged = OutageClock(self.settings.redis_retry_s)
        while True:
            try:
                got: list[Any] = yield RunScripts(
                    LazyCalls(count, call), meanwhile=meanwhile, confirm=True
                )
                return got
            except ReplicationLagged as exc:  # every request again (same ids: at most once)
                pause = lagged.next_wait(exc, None)
                if pause is None and first:
                    raise
                if pause is None:
                    return [exc] * count
                yield Sleep(pause)
            except redis.RedisError as exc:
                if first:
                    raise
                return [exc] * count

    # -- following requests ---------------------------------------------------------------------
    def _status(self, request_id: str) -> Plan[RequestRecord]:
        keys = yield from self._lanes.keys_of(request_id)
        fresh = False
        while True:
            raw = yield Command(HashCommands.hgetall, (keys.record(request_id),))
            record = RequestRecord.from_hash(request_id, raw)
            if record is None and keys.laned and not fresh:  # the id may be in another lane now
                keys = yield from self._lanes.keys_of(request_id, fresh=True)
                fresh = True
                continue
            if record is None:
                raise UnknownRequest(
                    f"no request {request_id} (never submitted, or its record expired)"
                )
            if not ops.is_overdue(record):
                return record
            yield from self._expire_overdue(record)  # then read it again: now expired

    def _cancel(self, request_id: str) -> Plan[bool]:
        record = yield from self._status(request_id)
        k, a = self._withdraw_args(record, TerminalStatus.CANCELLED, CANCELLED_MESSAGE)
        code = (yield RunScript(CANCEL, k, a, confirm=True))[0]
        return code in ("ok", "requested")

    def _expire_overdue(self, record: RequestRecord) -> Plan[None]:
        k, a = self._withdraw_args(record, TerminalStatus.EXPIRED, EXPIRED_MESSAGE)
        with contextlib.suppress(UnknownRequest):
            yield RunScript(EXPIRE_OVERDUE, k, a)

    def _withdraw_args(
        self, record: RequestRecord, status: TerminalStatus, message: str
    ) -> tuple[list[str], list[str]]:
        event = TerminalEvent(record.request_id, status, num_tokens=0, message=message)
        return withdraw_keys_args(
            self._keys.for_model(record.model or DEFAULT_MODEL),
            event,
            model=record.model or DEFAULT_MODEL,
            priority=Priority.parse(record.priority or "normal"),
            now=time.time(),
            ttl_s=self.settings.record_ttl_s,
            routed_to=record.routed_to,
            tenant=record.tenant,
        )

    # -- the fleet's models and queues (on a cluster: lane by lane, core.lanes) --------------------
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
            + tuple(
                Command(SortedSetCommands.zrange, (keys.tenants_active(m, p), 0, -1))
                for m, p in queues
            )
        )
        routers = {m: [as_str(w) or "" for w in ws] for m, ws in zip(models, names, strict=False)}
        active = {  # the tenants waiting in each queue (docs/fairness.md)
            q: [as_str(t) or "" for t in ts]
            for q, ts in zip(queues, names[len(models) :], strict=True)
        }
        k, a = ops.stats_keys_args(keys, queues, routers, CONSUMER_GROUP, active)
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
