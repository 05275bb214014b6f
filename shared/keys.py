"""Every Redis key, stream, consumer group and channel name tokenfleet uses, built in one place.

All names start with the fleet's key prefix so several fleets can share one Redis. Lua scripts
never build names themselves: they receive them through ``KEYS[]``.

Layout (``P`` = prefix, ``M`` = model name, ``L`` = priority label, ``ID`` = request id)::

    P:q:M:L            stream of waiting/in-flight requests for one (model, priority) queue
    P:qcfg:M:L         hash: max_waiting, policy (the queue's bound and overflow policy)
    P:queues           set of "M|L" queue names that have ever been used
    P:req:ID           hash: the request's durable record
    P:req:ID:tok       list: token events, element i is the event with index i
    P:ch:ID            pub/sub channel of the request's events
    P:cancel           set of request ids whose cancellation was asked for while running
    P:worker:NAME      hash: a worker's heartbeat (expires with its TTL)
    P:workers          sorted set: worker name -> last heartbeat (seconds)
    P:dead             stream: dead-letter entries (undecodable or invalid requests)
    P:served           sorted set: model -> expiry (seconds) of its longest-lived live server
    P:models           set of the model names the fleet's configuration declares
    P:pool:NAME        hash: a shared KV pool's settings and counters
    P:pool:NAME:members  hash: member -> JSON state (weight, held, active, lease expiry, ...)
    P:pool:NAME:preempt  hash: donor member -> JSON pending preemption order
    P:pools            set of pool names
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.priority import Priority

CONSUMER_GROUP = "workers"
DEFAULT_MODEL = "default"
_MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# The names that depend on the prefix alone: attribute of ``Keys`` -> suffix after "P:".
_FIXED_NAMES = (
    ("queues", "queues"),
    ("cancel_set", "cancel"),
    ("workers", "workers"),
    ("served", "served"),
    ("declared", "models"),
    ("dead_letter", "dead"),
    ("pools", "pools"),
)


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
    """Validate a worker or pool name (1-64 of ``[A-Za-z0-9._-]``)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidRequest(
            f"{kind} name {name!r} must be 1-64 characters of letters, digits, '.', '_' or '-'"
        )
    return name


@dataclass(frozen=True, slots=True)
class Keys:
    """Builds names under one prefix. Cheap to construct; holds no connection.

    Names that depend on the prefix alone are attributes, set once; names of one queue,
    request, worker or pool are methods.
    """

    prefix: str = "tokenfleet"
    queues: str = field(init=False)  # set: "model|label" names of every queue used so far
    cancel_set: str = field(init=False)  # set: running request ids whose cancel was asked for
    workers: str = field(init=False)  # sorted set: worker name -> its last heartbeat (epoch s)
    # sorted set: model -> epoch seconds until which a live worker's heartbeat says it serves
    # that model (ZADD GT: the latest expiry of its servers); served while in the future
    served: str = field(init=False)
    # set: model names the fleet declares (`tokenfleet models declare`): accepted at submit
    # even while no live worker serves them
    declared: str = field(init=False)
    dead_letter: str = field(init=False)  # stream: entries no worker could decode or validate
    pools: str = field(init=False)  # set: shared KV pool names

    def __post_init__(self) -> None:
        for name, suffix in _FIXED_NAMES:
            object.__setattr__(self, name, f"{self.prefix}:{suffix}")  # frozen: set once here

    # -- queues -------------------------------------------------------------------------------
    def stream(self, model: str, priority: Priority) -> str:
        """The stream holding one (model, priority) queue."""
        return f"{self.prefix}:q:{model}:{priority.label}"

    def queue_config(self, model: str, priority: Priority) -> str:
        """Hash with the queue's ``max_waiting`` and ``policy``."""
        return f"{self.prefix}:qcfg:{model}:{priority.label}"

    @staticmethod
    def queue_member(model: str, priority: Priority) -> str:
        """The member naming a queue in :attr:`queues`."""
        return f"{model}|{priority.label}"

    # -- requests -----------------------------------------------------------------------------
    def record(self, request_id: str) -> str:
        """Hash: the request's durable record."""
        return f"{self.prefix}:req:{request_id}"

    def tokens(self, request_id: str) -> str:
        """List of encoded token events; element ``i`` has index ``i``."""
        return f"{self.prefix}:req:{request_id}:tok"

    def channel(self, request_id: str) -> str:
        """Pub/sub channel carrying the request's token and terminal events."""
        return f"{self.prefix}:ch:{request_id}"

    # -- workers ------------------------------------------------------------------------------
    def worker(self, name: str) -> str:
        """Hash: one worker's heartbeat and stats; expires when the worker stops beating."""
        return f"{self.prefix}:worker:{name}"

    # -- shared KV pools ----------------------------------------------------------------------
    def pool(self, name: str) -> str:
        """Hash: a shared KV pool's settings."""
        return f"{self.prefix}:pool:{name}"

    def pool_members(self, name: str) -> str:
        """Hash: member -> encoded member state of a shared KV pool."""
        return f"{self.prefix}:pool:{name}:members"

    def pool_preemptions(self, name: str) -> str:
        """Hash: donor member -> encoded pending preemption request."""
        return f"{self.prefix}:pool:{name}:preempt"
