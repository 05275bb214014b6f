"""Every Redis key, stream, consumer group and channel name tokenfleet uses, built in one place.

All names start with the fleet's key prefix so several fleets can share one Redis. Lua scripts
never build names themselves: they receive them through ``KEYS[]``. In Redis Cluster mode ``P``
below is a hash tag: ``{P|M}`` for a model's lane (queues, requests, workers, routing),
``{P}`` for the rest: the registry, pools, API keys, files, batches (see :class:`Keys`).

Layout (``P`` = prefix, ``M`` = model name, ``L`` = priority label, ``ID`` = request id)::

    P:q:M:L            stream of waiting/in-flight requests for one (model, priority) queue
    P:qcfg:M:L         hash: max_waiting, policy (the queue's bound and overflow policy)
    P:queues           set of "M|L" queue names that have ever been used
    P:drained          hash: "M|L" -> requests started from that queue so far (its drain rate)
    P:tally            hash: "M|L|STATUS" -> ends so far, "M|L|STATUS|S" -> "MINUTE N" (tally.py)
    P:recent           list: the newest request ids, newest first (trimmed by the enqueue script)
    P:tq:M:L:T         stream: tenant T's requests waiting to be admitted into P:q:M:L (fairness)
    P:tact:M:L         sorted set: tenants with requests waiting in queue (M, L) -> virtual time
    P:tlen:M:L         list: one element per request waiting in queue (M, L)'s tenant queues
                       (its LLEN is what KEDA adds to P:q:M:L's lag: deploy/k8s/keda.yaml)
    P:tbook:M          hash: per tenant of model M: virtual time, weight, own bound, served tokens
    P:tenants          hash: tenant -> JSON settings (weight, max_waiting) (the fleet's)
    P:req:ID           hash: the request's durable record
    P:req:ID:tok       list: token events, element i is the event with index i
    P:ch:ID            pub/sub channel of the request's events
    P:cancel           set of request ids whose cancellation was asked for while running
    P:worker:NAME      hash: a worker's heartbeat (expires with its TTL)
    P:workers          sorted set: worker name -> last heartbeat (seconds)
    P:probe:NAME       string: written (1 s TTL) by worker NAME to test that writes go through
                       and replicate while it waits out an outage (worker/service/outage.py)
    P:dead             stream: dead letters: entries that cannot run, failed requests
    P:rq:M:L:NAME      stream: the requests of queue (M, L) routed to worker NAME (same
                       consumer group as P:q:M:L; any worker may steal entries that waited)
    P:routers:M        sorted set: worker -> expiry (seconds) of the heartbeat of each worker
                       that takes routed work for model M (live while in the future)
    P:rload:M          hash: worker -> "RUNNING MAX_NUM_SEQS STEP_MS LEVELS": load, pace, levels
                       (written with each heartbeat; what the enqueue script weighs)
    P:pfx:NAME         set: the prefix-chain hashes worker NAME holds in its cache (expires
                       with its heartbeat)
    P:session:H        string: the worker a session is pinned to (H = hash of "MODEL|KEY"; TTL)
    P:served           sorted set: model -> expiry (seconds) of its longest-lived live server
    P:models           set of the model names the fleet's configuration declares
    P:lanes            set of the models whose lane was ever written (cluster: the registry)
    P:pool:NAME        hash: a shared KV pool's settings and counters
    P:pool:NAME:members  hash: member -> JSON state (weight, held, active, lease expiry, ...)
    P:pool:NAME:preempt  hash: donor member -> JSON pending preemption order
    P:pools            set of pool names
    P:owners           hash: file or batch id -> owning API key id (gateway with keys on)
    P:apikey:KID       hash: one gateway API key's record (never the key) and its quota buckets
                       (tokenfleet.producer.gateway.auth.model lists the fields)
    P:apikeys          set of API key ids (live and revoked)
    P:apikeys:names    hash: name -> key id of every live (unrevoked) API key
    P:file:ID          hash: one Batch API file (id, purpose, filename, bytes, created_at, kind
                       input|output|error, batch_id for outputs)
    P:file:ID:lines    list: the file's JSONL lines, one per element, without the newline
    P:batch:ID         hash: one batch (status, endpoint, input file, counts, next_line, times)
    P:batch:ID:done    hash: line index -> "ok" | "err": the batch's exactly-once ledger
    P:batch:ID:lease   string: the token of the runner driving the batch (expires: PX)
    P:batches          sorted set: batch id -> creation time (listing, newest first)
    P:batches:active   set of the batch ids runners must drive (until they are final)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings

CONSUMER_GROUP = "workers"
DEFAULT_MODEL = "default"
_MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_model_name(model: str) -> str:
    """Return ``model`` if it is a valid served-model name, else raise ``InvalidRequest``."""
    if not isinstance(model, str) or not _MODEL_RE.match(model):
        raise InvalidRequest(
            f"model name {model!r} must be 1-128 characters of letters, digits, '.', '_', '/' "
            "or '-', starting with a letter or digit"
        )
    return model


def check_request_id(request_id: str) -> str:
    """Return ``request_id`` if valid (1-128 of ``[A-Za-z0-9._-]``), else ``InvalidRequest``."""
    if not isinstance(request_id, str) or not _REQUEST_ID_RE.match(request_id):
        raise InvalidRequest(
            f"request id {request_id!r} must be 1-128 characters of letters, digits, '.', '_' "
            "or '-', starting with a letter or digit"
        )
    return request_id


def check_name(kind: str, name: str) -> str:
    """Validate a worker, pool or tenant name (1-64 of ``[A-Za-z0-9._-]``)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidRequest(
            f"{kind} name {name!r} must be 1-64 characters of letters, digits, '.', '_' or '-'"
        )
    return name


@dataclass(frozen=True, slots=True)
class Keys:
    """Builds names under one prefix. Cheap to construct; holds no connection. Its names come
    in groups, one per room of the layout above.

    ``cluster`` (Redis Cluster mode, built by :meth:`for_settings`): every name starts with a
    hash tag, so that every script, MULTI and pipeline stays inside one slot while one fleet
    spreads over the cluster's primaries (docs/protocol.md, "Redis Cluster"):

    * a *lane* per model, ``{prefix|model}``: its queues, requests, channels, routing, and its
      workers' heartbeats (everything a request's life touches: ``lane`` names the model);
    * the *fleet*, ``{prefix}``: the registry (:attr:`lanes`, the fleet's copies of
      :attr:`served` and :attr:`declared`), API keys, files, batches, pools (:meth:`pool_root`).

    Channels are then sharded pub/sub ones (:attr:`publish_command`). Invariant: with
    ``cluster`` False the lane changes nothing (every name as before cluster mode existed).
    """

    prefix: str = "tokenfleet"
    cluster: bool = False
    lane: str = ""

    @classmethod
    def for_settings(cls, settings: Settings) -> Keys:
        """The fleet's names for ``settings``: its key prefix, hash-tagged in cluster mode, in
        the lane ``settings.lane`` names (none: the fleet's own names)."""
        return cls(
            settings.key_prefix, cluster=settings.redis_mode == "cluster", lane=settings.lane
        )

    def for_model(self, model: str) -> Keys:
        """The names in ``model``'s lane (the same names off a cluster)."""
        if not self.cluster or model == self.lane:
            return self
        return Keys(self.prefix, cluster=True, lane=model)

    @property
    def fleet(self) -> Keys:
        """The names with no lane (the fleet's slot on a cluster)."""
        return self.for_model("")

    @property
    def laned(self) -> bool:
        """Whether lanes have names of their own (cluster mode; readers use :attr:`lanes`)."""
        return self.cluster

    # -- where names start -------------------------------------------------------------------------
    @property
    def root(self) -> str:
        """A lane room's first segment: ``prefix``, or on a cluster ``{prefix|lane}``."""
        return f"{{{self.prefix}|{self.lane}}}" if self.cluster and self.lane else self.fleet_root

    @property
    def fleet_root(self) -> str:
        """A fleet room's first segment: ``prefix``, or on a cluster ``{prefix}``."""
        return f"{{{self.prefix}}}" if self.cluster else self.prefix

    def pool_root(self, name: str) -> str:
        """The first segment of pool ``name``'s names: the fleet's (every pool script also keeps
        the pool list, ``Keys.pools``; a pool's traffic is light; docs/protocol.md)."""
        del name  # (one place to change should a pool get a slot of its own)
        return self.fleet_root

    @property
    def publish_command(self) -> str:
        """The command that publishes on this fleet's channels (scripts get it in ARGV):
        ``PUBLISH``, or ``SPUBLISH`` on a cluster (sharded: it stays on the slot's shard)."""
        return "SPUBLISH" if self.cluster else "PUBLISH"

    # -- queues: streams, their settings, their counters -------------------------------------------
    def stream(self, model: str, priority: Priority) -> str:
        """The stream holding one (model, priority) queue."""
        return f"{self.root}:q:{model}:{priority.label}"

    def queue_config(self, model: str, priority: Priority) -> str:
        """Hash with the queue's ``max_waiting`` and ``policy``."""
        return f"{self.root}:qcfg:{model}:{priority.label}"

    @property
    def queues(self) -> str:
        """Set of ``model|label`` names of every queue used so far."""
        return f"{self.root}:queues"

    @property
    def drained(self) -> str:
        """Hash: ``model|label`` -> how many requests workers have started from that queue (a
        counter; its rate is the queue's drain rate, read by the gateway for Retry-After)."""
        return f"{self.root}:drained"

    @property
    def tally(self) -> str:
        """Hash: each queue's ends per terminal status, in all and per minute (``tally``)."""
        return f"{self.root}:tally"

    @staticmethod
    def queue_member(model: str, priority: Priority) -> str:
        """The member naming a queue in :attr:`queues`."""
        return f"{model}|{priority.label}"

    # -- tenants (docs/fairness.md; shared/scripts/tf_tenants.lua) ----------------------------
    def tenant_queue(self, model: str, priority: Priority, tenant: str) -> str:
        """Stream: tenant ``tenant``'s requests waiting to be admitted into queue (model,
        priority); no consumer group (admission moves its head into :meth:`stream`). With
        ``tenant`` "" the name's part before the tenant (what the scripts append it to)."""
        return f"{self.root}:tq:{model}:{priority.label}:{tenant}"

    def tenants_active(self, model: str, priority: Priority) -> str:
        """Sorted set: the tenants with requests waiting in queue (model, priority) -> their
        virtual time (the order of admission: least first)."""
        return f"{self.root}:tact:{model}:{priority.label}"

    def tenant_backlog(self, model: str, priority: Priority) -> str:
        """List: one element per request waiting in queue (model, priority)'s tenant queues,
        so that its length is their number: what KEDA's ``redis`` (list) trigger reads and adds
        to the shared stream's lag (docs/deployment.md). Kept by every script that puts a
        request into a tenant queue or takes one out (tf_tenants.lua); deleted when the queue's
        last active tenant goes."""
        return f"{self.root}:tlen:{model}:{priority.label}"

    def tenant_book(self, model: str) -> str:
        """Hash: per tenant T of model's queues, ``vt|T`` (virtual time: tokens served /
        weight), ``w|T`` (weight), ``max|T`` (own bound; "" or absent: none), ``at|T`` (when
        those two were set: ``TenantSettings.at``), ``served|T`` (prompt + output tokens of its
        ended requests), ``admitted|T`` (requests admitted from its tenant queues)."""
        return f"{self.root}:tbook:{model}"

    @property
    def tenants(self) -> str:
        """Hash (the fleet's): tenant -> JSON settings (``weight``, ``max_waiting``) set by
        ``tokenfleet tenants set``; copied into each known model's :meth:`tenant_book`, and
        into a later model's by its producers' enqueue (docs/fairness.md)."""
        return f"{self.fleet_root}:tenants"

    # -- one request's record, tokens and channel; the cancel set ----------------------------------
    def record(self, request_id: str) -> str:
        """Hash: the request's durable record."""
        return f"{self.root}:req:{request_id}"

    def tokens(self, request_id: str) -> str:
        """List of encoded token events; element ``i`` has index ``i``."""
        return f"{self.root}:req:{request_id}:tok"

    def channel(self, request_id: str) -> str:
        """Pub/sub channel carrying the request's token and terminal events."""
        return f"{self.root}:ch:{request_id}"

    @property
    def recent(self) -> str:
        """List: the newest requests' ids, newest first, trimmed to ``RECENT_REQUESTS``."""
        return f"{self.root}:recent"

    @property
    def cancel_set(self) -> str:
        """Set of running request ids whose cancellation was asked for."""
        return f"{self.root}:cancel"

    # -- workers' heartbeats, the fleet's registry, the dead-letter stream -------------------------
    def worker(self, name: str) -> str:
        """Hash: one worker's heartbeat and stats; expires when the worker stops beating."""
        return f"{self.root}:worker:{name}"

    def worker_probe(self, name: str) -> str:
        """String: what worker ``name`` writes (short TTL) while it waits out an outage."""
        return f"{self.root}:probe:{name}"

    @property
    def workers(self) -> str:
        """Sorted set: worker name -> time of its last heartbeat (epoch seconds)."""
        return f"{self.root}:workers"

    @property
    def dead_letter(self) -> str:
        """Stream of entries no worker could run, and of requests that ended ``error``."""
        return f"{self.root}:dead"

    @property
    def served(self) -> str:
        """Sorted set: model -> epoch seconds until which a live worker's heartbeat says it
        serves that model (``ZADD GT``: its servers' latest expiry); served while in the future."""
        return f"{self.root}:served"

    @property
    def declared(self) -> str:
        """Set: model names the fleet declares (``tokenfleet models declare``), accepted at
        submit even while no live worker serves them."""
        return f"{self.root}:models"

    @property
    def lanes(self) -> str:
        """Set (a fleet room): every model that has a lane, i.e. whose names were ever written
        (producers add a model before its first enqueue or queue setting, workers each beat):
        what lane-less readers (``tokenfleet status``, a lookup by id) go through on a cluster."""
        return f"{self.fleet_root}:lanes"

    # -- routing (docs/routing.md): routed streams, routers, caches held, sessions -----------------
    def routed(self, model: str, priority: Priority, worker: str) -> str:
        """Stream: the requests of queue (``model``, ``priority``) routed to ``worker``."""
        return f"{self.root}:rq:{model}:{priority.label}:{worker}"

    def routers(self, model: str) -> str:
        """Sorted set: worker -> heartbeat expiry (epoch s) of the workers taking routed work
        for ``model``; a worker is a routing target while its score is in the future."""
        return f"{self.root}:routers:{model}"

    def route_load(self, model: str) -> str:
        """Hash: worker -> "RUNNING MAX_NUM_SEQS" for ``model``'s routed workers (heartbeat)."""
        return f"{self.root}:rload:{model}"

    def route_tokenizer(self, model: str) -> str:
        """Hash: how ``model``'s workers turn a prompt into tokens (tokenizer JSON, chat template,
        special tokens, block size), so producers compute the engine's block hashes."""
        return f"{self.root}:rtok:{model}"

    def prefixes(self, worker: str) -> str:
        """Set: prefix-chain link hashes (hex) ``worker`` holds in its cache."""
        return f"{self.root}:pfx:{worker}"

    def session(self, session_hash: str) -> str:
        """String: the worker the session (``session_hash``: a hash of its key) is pinned to."""
        return f"{self.root}:session:{session_hash}"

    # -- shared KV pools ---------------------------------------------------------------------------
    def pool(self, name: str) -> str:
        """Hash: a shared KV pool's settings."""
        return f"{self.pool_root(name)}:pool:{name}"

    def pool_members(self, name: str) -> str:
        """Hash: member -> encoded member state of a shared KV pool."""
        return f"{self.pool_root(name)}:pool:{name}:members"

    def pool_preemptions(self, name: str) -> str:
        """Hash: donor member -> encoded pending preemption request."""
        return f"{self.pool_root(name)}:pool:{name}:preempt"

    @property
    def pools(self) -> str:
        """Set of pool names."""
        return f"{self.fleet_root}:pools"

    # -- gateway API keys --------------------------------------------------------------------------
    def api_key(self, key_id: str) -> str:
        """Hash: one API key's record (digest, never the key) and its quota buckets."""
        return f"{self.fleet_root}:apikey:{key_id}"

    @property
    def api_keys(self) -> str:
        """Set of the ids of every API key ever created (revoked ones stay listed)."""
        return f"{self.fleet_root}:apikeys"

    @property
    def api_key_names(self) -> str:
        """Hash: name -> id of each live API key (names are unique among live keys)."""
        return f"{self.fleet_root}:apikeys:names"

    # -- the Batch API (files, batches, ledgers, leases) -------------------------------------------
    def file(self, file_id: str) -> str:
        """Hash: one Batch API file's object."""
        return f"{self.fleet_root}:file:{file_id}"

    def file_lines(self, file_id: str) -> str:
        """List: the file's JSONL lines (no newlines)."""
        return f"{self.fleet_root}:file:{file_id}:lines"

    def batch(self, batch_id: str) -> str:
        """Hash: one batch's object, counts and cursor."""
        return f"{self.fleet_root}:batch:{batch_id}"

    def batch_done(self, batch_id: str) -> str:
        """Hash: line index -> "ok" | "err" (the exactly-once ledger)."""
        return f"{self.fleet_root}:batch:{batch_id}:done"

    def batch_lease(self, batch_id: str) -> str:
        """String: the driving runner's token, with a PX expiry."""
        return f"{self.fleet_root}:batch:{batch_id}:lease"

    @property
    def batches(self) -> str:
        """Sorted set: batch id -> created_at."""
        return f"{self.fleet_root}:batches"

    @property
    def batches_active(self) -> str:
        """Set: ids of the batches runners drive (not final yet)."""
        return f"{self.fleet_root}:batches:active"

    @property
    def owners(self) -> str:
        """Hash: file or batch id -> the id of the API key that owns it (keys on)."""
        return f"{self.fleet_root}:owners"
