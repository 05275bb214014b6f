"""What a plan asks of the outside world: the only vocabulary between the producer's logic and
its two drivers.

A *plan* is a generator written once in ``core``: it yields one effect at a time and receives
its reply (or has the effect's exception thrown in at the ``yield``, so ``try`` / ``except``
around a ``yield`` works as around a call); its return value is the operation's result. The sync
driver (``sync_io.driver``) performs effects with blocking calls, the asyncio driver
(``async_io.driver``) with awaits; neither makes a decision of its own, so both faces give the
same results for the same calls.

Invariant: an effect is plain data with no I/O of its own, never changed once yielded (not
frozen only because frozen dataclasses cost three times as much to build on the submit path);
each driver performs every effect type below and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeVar, overload

from tokenfleet.shared.scripts.registry import KeyOrArg, LuaScript

T = TypeVar("T")


class Confirmation(Protocol):
    """``threading.Event`` or ``asyncio.Event``: set once Redis confirmed a SUBSCRIBE."""

    def is_set(self) -> bool: ...


class Mailbox(Protocol):
    """A subscription of either subscriber (``sync_io`` / ``async_io``), as plans see it:
    plans test ``confirmation`` and ``close()`` it; only drivers wait on it."""

    channel: str

    @property
    def confirmation(self) -> Confirmation: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class RunScript:
    """Run one Lua script. Reply: its values, checked by ``registry.check_reply`` (a refusal
    code arrives in the plan as the mapped exception)."""

    script: LuaScript
    keys: Sequence[KeyOrArg]
    args: Sequence[KeyOrArg]
    # a write the caller is told of: with ``redis_wait_replicas`` set, the driver ends its
    # round trip with WAIT and raises ``ReplicationLagged`` when too few replicas confirm it
    confirm: bool = False


class LazyCalls(Sequence[RunScript]):
    """``n`` script calls, each made by ``build(i)`` when first asked for, in order: a driver
    that packs and sends each call as it takes it has Redis run the first while the next ones
    are being made. A call once made is kept (a retry makes nothing twice). Plain data in the
    effects' sense: making a call does no I/O."""

    __slots__ = ("_build", "_made", "_n")

    def __init__(self, n: int, build: Callable[[int], RunScript]) -> None:
        self._n = n
        self._build = build
        self._made: list[RunScript] = []

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> RunScript: ...
    @overload
    def __getitem__(self, i: slice) -> list[RunScript]: ...
    def __getitem__(self, i: int | slice) -> RunScript | list[RunScript]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        i %= self._n
        made = self._made
        while len(made) <= i:
            made.append(self._build(len(made)))
        return made[i]


@dataclass(slots=True)
class RunScripts:
    """Run several scripts in one pipeline without MULTI (one round trip). Reply: the raw
    replies in order, unchecked (each may carry its own refusal code).

    ``meanwhile``, if given, is called exactly once, after every call was sent and before any
    reply is read, so the plan's own work (``submit_many`` makes its handles there) overlaps
    Redis's; it does no I/O, and the plan keeps what it makes (a closure). If it raises, the
    effect raises that (the replies are never read, the connection is dropped)."""

    calls: Sequence[RunScript]  # a list, or ``LazyCalls``
    meanwhile: Callable[[], None] | None = None
    confirm: bool = False  # as ``RunScript.confirm``, for the whole round trip


@dataclass(slots=True)
class Command:
    """One plain command. ``command`` is a redis-py command function (``HashCommands.hgetall``
    and the like: the sync and asyncio clients share these functions), applied to the client
    with ``args``. Reply: the command's parsed reply."""

    command: Callable[..., Any]
    args: tuple[Any, ...]


@dataclass(slots=True)
class Transaction:
    """Plain commands in one MULTI/EXEC pipeline. Reply: their replies, in order; with
    ``raise_on_error`` False a command's error reply (``XINFO`` of a stream that does not exist)
    is a ``redis.ResponseError`` in its place instead of raised."""

    commands: tuple[Command, ...]
    raise_on_error: bool = True


@dataclass(slots=True)
class Sleep:
    """Wait ``seconds`` (the ``block`` policy's polling). Reply: None."""

    seconds: float


@dataclass(slots=True)
class Subscribe:
    """Listen to ``channel`` on the client's shared pub/sub connection. Reply: the ``Mailbox``,
    once Redis confirmed it if ``confirm``, else at once (SUBSCRIBE sent). Raises
    ``redis.ConnectionError`` if the client is closed, or not confirmed within ``timeout``."""

    channel: str
    timeout: float
    confirm: bool


@dataclass(slots=True)
class Receive:
    """The next item in ``mailbox`` within ``timeout`` seconds. Reply: the message bytes,
    ``RESYNC`` (reconnected: re-read the record), or None (nothing came)."""

    mailbox: Mailbox
    timeout: float


@dataclass(slots=True)
class AwaitConfirmation:
    """Wait up to ``timeout`` seconds for Redis to confirm ``mailbox``'s SUBSCRIBE. Reply: True
    once confirmed; False when the time passes first, unless ``strict``: then the mailbox is
    closed and ``redis.ConnectionError`` raised."""

    mailbox: Mailbox
    timeout: float
    strict: bool


@dataclass(slots=True)
class Compute:
    """Run ``fn()`` (CPU work that may take milliseconds: tokenizing a long prompt for routing).
    Reply: its return value. The asyncio driver runs it on a thread, so the event loop (a
    gateway's other streams, a batch runner) goes on meanwhile; the blocking driver calls it."""

    fn: Callable[[], Any]


Effect: TypeAlias = (
    RunScript
    | RunScripts
    | Command
    | Transaction
    | Sleep
    | Subscribe
    | Receive
    | AwaitConfirmation
    | Compute
)
# A plan: yields effects, is sent their replies, returns T (see the module docstring).
Plan: TypeAlias = Generator[Effect, Any, T]
