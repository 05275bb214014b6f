"""``AsyncDriver``: runs a ``core`` plan with awaits (see ``core/effects.py``).

The asyncio twin of ``sync_io/driver.py``, effect for effect: no decision of its own; replies
are sent back into the plan, exceptions thrown in at its ``yield`` (cancellation is not: it
propagates, as from any await).
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar, cast

import redis.asyncio

from tokenfleet.producer.async_io.subscriber import AsyncSubscriber, AsyncSubscription
from tokenfleet.producer.core.effects import (
    AwaitConfirmation,
    Command,
    Effect,
    Plan,
    Receive,
    RunScript,
    RunScripts,
    Sleep,
    Subscribe,
    Transaction,
)
from tokenfleet.shared.scripts import registry

T = TypeVar("T")


class AsyncDriver:
    """Performs effects on one ``redis.asyncio.Redis`` and one ``AsyncSubscriber``."""

    __slots__ = ("_redis", "_subscriber")

    def __init__(self, redis_client: redis.asyncio.Redis, subscriber: AsyncSubscriber) -> None:
        self._redis = redis_client
        self._subscriber = subscriber

    async def run(self, plan: Plan[T]) -> T:
        """Drive ``plan`` to its end and return its value (or raise what it raises)."""
        perform = self._perform
        try:
            effect = next(plan)
            while True:
                try:
                    reply = await perform(effect)
                except Exception as exc:  # the plan decides: it may catch it at its yield
                    effect = plan.throw(exc)
                else:
                    effect = plan.send(reply)
        except StopIteration as stop:
            return cast(T, stop.value)

    async def _perform(self, effect: Effect) -> Any:
        r = self._redis
        match effect:
            case RunScript(script, keys, args):
                return await registry.acall(r, script, keys, args)
            case Command(command, args):
                return await command(r, *args)
            case Receive(mailbox, timeout):
                return await cast(AsyncSubscription, mailbox).get(timeout)
            case Subscribe(channel, timeout, confirm):
                return await self._subscriber.subscribe(channel, timeout, confirm=confirm)
            case Transaction(commands):
                pipe = r.pipeline(transaction=True)
                for c in commands:
                    c.command(pipe, *c.args)  # queued: an asyncio pipeline buffers commands
                return await pipe.execute()
            case RunScripts(calls):
                pipe = r.pipeline(transaction=False)
                for call in calls:
                    await registry.aqueue(r, pipe, call.script, call.keys, call.args)
                return await pipe.execute()
            case AwaitConfirmation(mailbox, timeout, strict):
                sub = cast(AsyncSubscription, mailbox)
                if strict:
                    await sub.wait_confirmed(timeout)
                    return True
                return await sub.confirmed_within(timeout)
            case Sleep(seconds):
                await asyncio.sleep(seconds)
                return None
        raise TypeError(f"not an effect: {effect!r}")
