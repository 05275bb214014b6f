"""``RunScripts`` on the wire: ``EVALSHA`` commands packed by hiredis, replies sorted out.

Both drivers send a ``RunScripts`` effect this way, on one connection from the client's pool, in
one round trip: redis-py's pipeline would first walk every argument in Python to pack it (the
bulk of ``submit_many``'s client time beside validation, measured) and run ``SCRIPT EXISTS``,
a round trip of its own, before every pipeline that holds a script. Each call is packed on its
own, so a driver can write the first call while it packs the next and Redis starts at once.

A call that fails with ``NOSCRIPT`` (a restarted or flushed server) did nothing: the driver
loads its script and runs only those calls again. Any other error reply is raised, the first
in order, as redis-py's pipeline does. No I/O here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis

from tokenfleet.producer.core.effects import RunScript

_hiredis_pack: Callable[[Any], bytes] | None
try:  # hiredis comes with redis[hiredis], a dependency; the fallback is redis-py's packer
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover
    _hiredis_pack = None

_SHAS: dict[str, str] = {}


def sha_of(source: str) -> str:
    """The SHA1 Redis knows a script's ``source`` by."""
    sha = _SHAS.get(source)
    if sha is None:
        sha = _SHAS[source] = hashlib.sha1(source.encode()).hexdigest()
    return sha


def packed_calls(conn: Any, calls: Sequence[RunScript]) -> Iterator[list[bytes]]:
    """The wire bytes of each call's ``EVALSHA``, one call at a time (for
    ``send_packed_command``); ``conn`` packs only when hiredis is missing."""
    for call in calls:
        command = ("EVALSHA", sha_of(call.script.source), len(call.keys), *call.keys, *call.args)
        if _hiredis_pack is None:  # pragma: no cover
            yield list(conn.pack_command(*command))
        else:
            yield [_hiredis_pack(command)]


def is_noscript(reply: Any) -> bool:
    return isinstance(reply, redis.exceptions.NoScriptError) or (
        isinstance(reply, redis.ResponseError) and str(reply).startswith("NOSCRIPT")
    )


def missing_scripts(replies: Sequence[Any]) -> list[int]:
    """Indices of the calls that failed with ``NOSCRIPT`` (to run again once loaded)."""
    return [i for i, reply in enumerate(replies) if is_noscript(reply)]


def raise_first_error(replies: Sequence[Any]) -> list[Any]:
    """``replies`` as they are, unless one is an error reply: then the first is raised."""
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            raise reply
    return list(replies)
