"""Lua scripts in a pipeline with exactly one round trip.

redis-py's pipeline runs ``SCRIPT EXISTS`` (a round trip of its own) before every ``execute`` that
contains a registered script. The worker publishes once per engine step, so it queues raw
``EVALSHA`` commands instead and handles ``NOSCRIPT`` (a restarted or flushed server) itself:
the scripts are loaded and only the commands that failed are run again. An ``EVALSHA`` that
fails with ``NOSCRIPT`` did nothing, so running it again is safe.

Invariant: ``ScriptPipeline.execute`` returns one reply per queued command, in order, each
checked with ``registry.check_reply`` for scripts; any other error is raised.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import redis

from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.registry import KeyOrArg, LuaScript

_SHAS: dict[str, str] = {}


def sha_of(script: LuaScript) -> str:
    """The SHA1 Redis knows ``script`` by."""
    sha = _SHAS.get(script.source)
    if sha is None:
        sha = _SHAS[script.source] = hashlib.sha1(script.source.encode()).hexdigest()
    return sha


class ScriptPipeline:
    """A non-transactional pipeline of scripts and plain commands, sent in one round trip."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.pipe = client.pipeline(transaction=False)
        self._calls: list[tuple[LuaScript, list[KeyOrArg], list[KeyOrArg]] | None] = []

    def script(self, script: LuaScript, keys: Sequence[KeyOrArg], args: Sequence[KeyOrArg]) -> None:
        """Queue ``script`` (its reply is checked and returned by :meth:`execute`)."""
        keys, args = list(keys), list(args)
        self.pipe.execute_command("EVALSHA", sha_of(script), len(keys), *keys, *args)
        self._calls.append((script, keys, args))

    def command(self, name: str, *args: Any) -> None:
        """Queue a plain command."""
        self.pipe.execute_command(name, *args)
        self._calls.append(None)

    def __len__(self) -> int:
        return len(self._calls)

    def execute(self) -> list[Any]:
        """Send everything, then return the replies (scripts' checked); see the module doc."""
        if not self._calls:
            return []
        replies = self.pipe.execute(raise_on_error=False)
        retry = [
            i
            for i, reply in enumerate(replies)
            if isinstance(reply, redis.exceptions.NoScriptError)
            or (isinstance(reply, redis.ResponseError) and str(reply).startswith("NOSCRIPT"))
        ]
        if retry:
            for i in retry:
                call = self._calls[i]
                if call is not None:
                    replies[i] = registry.call(self.client, call[0], call[1], call[2])
        out = []
        for i, (reply, call) in enumerate(zip(replies, self._calls, strict=True)):
            if isinstance(reply, Exception):
                raise reply
            out.append(
                reply if call is None or i in retry else registry.check_reply(call[0], reply)
            )
        return out
