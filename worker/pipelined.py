"""Lua scripts in a pipeline with exactly one round trip, sent now and read later if need be.

redis-py's pipeline runs ``SCRIPT EXISTS`` (a round trip of its own) before every ``execute`` that
contains a registered script, and it always waits for the replies. The worker publishes once per
engine step, so it queues raw ``EVALSHA`` commands instead, writes them on one connection taken
from the client's pool (:meth:`ScriptPipeline.send`) and reads the replies whenever it wants them
(:meth:`ScriptPipeline.receive`): the step loop sends a step's tokens the moment the step ends and
reads the replies after the next step, when they have long arrived, with no thread in between.
``NOSCRIPT`` (a restarted or flushed server) is handled here: the scripts are loaded and only the
commands that failed are run again. An ``EVALSHA`` that fails with ``NOSCRIPT`` did nothing, so
running it again is safe.

Invariants: ``execute`` (= ``send`` then ``receive``) returns one reply per queued command, in
order, each checked with ``registry.check_reply`` for scripts; any other error is raised (a
script queued with ``raise_errors=False`` gets its error reply back instead). Between
``send`` and ``receive`` the pipeline holds its connection, which nothing else uses; ``receive``
gives it back to the pool (closed if the exchange failed half way, so that no reply is left on
it for the next user). With a replica confirmation asked for (``shared.replica_wait``), a
round trip ends with ``WAIT`` and ``receive`` raises ``ReplicationLagged`` (a lost connection)
when too few replicas confirmed it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import redis

from tokenfleet.shared import replica_wait
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.registry import KeyOrArg, LuaScript

_hiredis_pack: Callable[[Any], bytes] | None
try:  # hiredis comes with redis[hiredis], a dependency; the fallback is redis-py's packer
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover
    _hiredis_pack = None

_SHAS: dict[str, str] = {}


def pack(conn: Any, commands: Sequence[tuple[KeyOrArg, ...]]) -> list[bytes]:
    """The wire bytes of ``commands``. hiredis packs each command in one C call; redis-py's
    packer first walks every argument in Python (a third of a publish's CPU, measured)."""
    if _hiredis_pack is None:
        return list(conn.pack_commands(commands))
    return [b"".join([_hiredis_pack(command) for command in commands])]


def dedicated_connection(client: redis.Redis) -> Any:
    """A new connection with ``client``'s settings, outside its pool: the caller owns it, sends
    and reads on it directly and ends it with ``disconnect()``. A loop that makes a round trip
    every engine step keeps one: redis-py's pool checkout (a health-check ``select``) and
    release cost about 80 µs together per round trip (measured, redis-py 8)."""
    pool = client.connection_pool
    return pool.connection_class(**pool.connection_kwargs)


def sha_of(script: LuaScript) -> str:
    """The SHA1 Redis knows ``script`` by."""
    sha = _SHAS.get(script.source)
    if sha is None:
        sha = _SHAS[script.source] = hashlib.sha1(script.source.encode()).hexdigest()
    return sha


class ScriptPipeline:
    """A non-transactional pipeline of scripts and plain commands, sent in one round trip."""

    def __init__(self, client: redis.Redis, connection: Any = None) -> None:
        """``connection``: send on this connection (owned by the caller, never released to the
        pool) instead of one taken from ``client``'s pool for the round trip. The replica
        confirmation the settings ask for (``shared.replica_wait``) comes with ``client``."""
        self.client = client
        self._own = connection
        self._wait = replica_wait.wait_of(client)
        self._commands: list[tuple[KeyOrArg, ...]] = []
        self._calls: list[tuple[LuaScript, list[KeyOrArg], list[KeyOrArg]] | None] = []
        self._tolerant: set[int] = set()  # indices whose error replies are returned, not raised
        self._conn: Any = None  # the connection the commands were sent on, until received
        self._sent = False

    def script(
        self,
        script: LuaScript,
        keys: Sequence[KeyOrArg],
        args: Sequence[KeyOrArg],
        *,
        raise_errors: bool = True,
    ) -> None:
        """Queue ``script`` (its reply is checked and returned by :meth:`execute`).
        ``raise_errors=False``: an error reply is returned in its place, as the exception,
        instead of being raised (the other commands' replies stay usable)."""
        keys, args = list(keys), list(args)
        self._commands.append(("EVALSHA", sha_of(script), len(keys), *keys, *args))
        self._calls.append((script, keys, args))
        if not raise_errors:
            self._tolerant.add(len(self._calls) - 1)

    def command(self, name: str, *args: KeyOrArg, raise_errors: bool = True) -> None:
        """Queue a plain command (its reply is returned as Redis sent it); ``raise_errors``
        as for :meth:`script`."""
        self._commands.append((name, *args))
        self._calls.append(None)
        if not raise_errors:
            self._tolerant.add(len(self._calls) - 1)

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether a reply can be read without blocking (waiting up to ``timeout_s`` for one);
        True when nothing is in flight."""
        if self._conn is None:
            return True
        try:
            return bool(self._conn.can_read(timeout=timeout_s))
        except BaseException:
            self._conn.disconnect()
            raise

    def __len__(self) -> int:
        return len(self._calls)

    def execute(self) -> list[Any]:
        """Send everything, then return the replies (scripts' checked); see the module doc."""
        self.send()
        return self.receive()

    def send(self) -> None:
        """Write every queued command to Redis in one go, without waiting for the replies."""
        if self._sent:
            raise RuntimeError("this pipeline was already sent")
        self._sent = True
        if not self._commands:
            return
        pool = self.client.connection_pool
        conn = self._own if self._own is not None else pool.get_connection()
        commands = self._commands
        if self._wait is not None:  # last: its reply says whether the writes reached replicas
            commands = [*commands, ("WAIT", self._wait.num_replicas, self._wait.timeout_ms)]
        try:
            conn.send_packed_command(pack(conn, commands))
        except BaseException:
            conn.disconnect()  # a partial write leaves the protocol state unknown
            if self._own is None:
                pool.release(conn)
            raise
        self._conn = conn

    def receive(self) -> list[Any]:
        """The replies of what :meth:`send` wrote, in order (waits for them if need be)."""
        if not self._sent:
            raise RuntimeError("receive() before send()")
        conn, self._conn = self._conn, None
        if conn is None:
            return []
        replies: list[Any] = []
        try:
            for _ in range(len(self._commands) + (self._wait is not None)):
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as exc:  # an error reply: the stream stays in sync
                    replies.append(exc)
            if self._wait is not None:
                replica_wait.check(self._wait, replies.pop())
        except BaseException:
            conn.disconnect()  # replies may be left unread: never hand this socket out again
            raise
        finally:
            if self._own is None:
                self.client.connection_pool.release(conn)
        retry = [
            i
            for i, reply in enumerate(replies)
            if isinstance(reply, redis.exceptions.NoScriptError)
            or (isinstance(reply, redis.ResponseError) and str(reply).startswith("NOSCRIPT"))
        ]
        for i in retry:
            call = self._calls[i]
            if call is not None:
                try:
                    replies[i] = registry.call(self.client, call[0], call[1], call[2])
                except redis.ResponseError as exc:
                    if i not in self._tolerant:
                        raise
                    replies[i] = exc
        out: list[Any] = []
        for i, (reply, call) in enumerate(zip(replies, self._calls, strict=True)):
            if isinstance(reply, Exception):
                if i in self._tolerant:
                    out.append(reply)
                    continue
                raise reply
            out.append(
                reply if call is None or i in retry else registry.check_reply(call[0], reply)
            )
        return out
