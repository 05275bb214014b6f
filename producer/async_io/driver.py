"""``AsyncDriver``: runs a ``core`` plan with awaits (see ``core/effects.py``).

The asyncio twin of ``sync_io/driver.py``, effect for effect: no decision of its own; replies
are sent back into the plan, exceptions thrown in at its ``yield`` (cancellation is not: it
propagates, as from any await). A cancel that an await lost on its way in (see
``shared.cancellation``) is raised at the next effect: a plan that retries forever (``_pull``
through an outage) still ends when its task is cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import redis
import redis.asyncio

from tokenfleet.producer.async_io.subscriber import AsyncSubscriber, AsyncSubscription
from tokenfleet.producer.core import script_wire
from tokenfleet.producer.core.effects import (
    AwaitConfirmation,
    Command,
    Compute,
    Plan,
    Receive,
    RunScript,
    RunScripts,
    Sleep,
    Subscribe,
    Transaction,
)
from tokenfleet.producer.core.slot_clients import SlotClients
from tokenfleet.shared import replica_wait
from tokenfleet.shared.cancellation import cancel_checkpoint, raise_if_cancelling
from tokenfleet.shared.scripts import registry

T = TypeVar("T")


class AsyncDriver:
    """Performs effects on the ``redis.asyncio.Redis`` and ``AsyncSubscriber`` of each key's
    slot (``core.slot_clients``: one of each off a cluster; a plan keeps each effect in one slot).

    Invariant: ``_perform`` has one entry per effect type of ``core.effects``.
    """

    __slots__ = ("_perform", "_slots", "_wait")

    def __init__(
        self, slots: SlotClients[redis.asyncio.Redis, AsyncSubscriber], first: redis.asyncio.Redis
    ) -> None:
        self._slots = slots  # the client and subscriber of each key's slot
        self._wait = replica_wait.wait_of(first)  # confirmed writes (effects' ``confirm``)
        self._perform: dict[type, Callable[[Any], Awaitable[Any]]] = {
            RunScript: self._run_script,
            Command: self._command,
            Receive: self._receive,
            Subscribe: self._subscribe,
            Transaction: self._transaction,
            RunScripts: self._run_scripts,
            AwaitConfirmation: self._await_confirmation,
            Sleep: self._sleep,
            Compute: self._compute,
        }

    async def run(self, plan: Plan[T]) -> T:
        """Drive ``plan`` to its end and return its value (or raise what it raises)."""
        perform = self._perform
        try:
            effect = next(plan)
            while True:
                cancel_checkpoint()
                try:
                    reply = await perform[type(effect)](effect)
                except Exception as exc:  # the plan decides: it may catch it at its yield
                    raise_if_cancelling(exc)
                    effect = plan.throw(exc)
                else:
                    effect = plan.send(reply)
        except StopIteration as stop:
            return cast(T, stop.value)

    async def _run_script(self, effect: RunScript) -> list[Any]:
        wait = self._wait if effect.confirm else None
        client = self._slots.client(effect.keys[0])
        if wait is None:
            return await registry.acall(client, effect.script, effect.keys, effect.args)
        pipe = client.pipeline(transaction=False)  # the script and its WAIT: one connection
        await registry.aqueue(client, pipe, effect.script, effect.keys, effect.args)
        pipe.wait(wait.num_replicas, wait.timeout_ms)
        reply, confirmed = await pipe.execute(raise_on_error=False)
        return replica_wait.checked(wait, effect.script, reply, confirmed)

    async def _command(self, effect: Command) -> Any:
        return await effect.command(
            self._slots.client(effect.args[:1] and effect.args[0]), *effect.args
        )

    async def _receive(self, effect: Receive) -> object | None:
        return await cast(AsyncSubscription, effect.mailbox).get(effect.timeout)

    async def _subscribe(self, effect: Subscribe) -> AsyncSubscription:
        return await self._slots.subscriber(effect.channel).subscribe(
            effect.channel, effect.timeout, confirm=effect.confirm
        )

    async def _transaction(self, effect: Transaction) -> list[Any]:
        pipe = self._slots.client(effect.commands[0].args[0]).pipeline(transaction=True)
        for c in effect.commands:
            c.command(pipe, *c.args)  # queued: an asyncio pipeline buffers commands
        return await pipe.execute(raise_on_error=effect.raise_on_error)

    async def _run_scripts(self, effect: RunScripts) -> list[Any]:
        """One round trip of ``EVALSHA``s packed by hiredis (see ``core/script_wire.py``)."""
        wait = self._wait if effect.confirm else None
        client = self._slots.client(effect.calls[0].keys[0])  # (the calls share one slot)
        replies = await self._exchange(client, effect.calls, effect.meanwhile, wait)
        retry = script_wire.missing_scripts(replies)
        if retry:  # the server lost its scripts: load them, run those calls again
            for source in {effect.calls[i].script.source for i in retry}:
                await client.script_load(source)
            again = await self._exchange(client, [effect.calls[i] for i in retry], None)
            for i, reply in zip(retry, again, strict=True):
                replies[i] = reply
        return script_wire.raise_first_error(replies)

    async def _exchange(
        self,
        client: Any,
        calls: Sequence[RunScript],
        meanwhile: Callable[[], None] | None,
        wait: replica_wait.ReplicaWait | None = None,
    ) -> list[Any]:
        """Send ``calls`` on one pooled connection, run ``meanwhile`` (once, even if retried),
        then read one reply each (error replies returned in place), retried on a lost
        connection as redis-py retries a pipeline."""
        pool = client.connection_pool
        conn = await pool.get_connection()
        pending = [meanwhile] if meanwhile is not None else []

        async def exchange() -> list[Any]:
            for packed in script_wire.packed_calls(conn, calls):
                await conn.send_packed_command(packed, check_health=False)
            if wait is not None:  # confirmed by replicas, the calls' writes with it
                await conn.send_command("WAIT", wait.num_replicas, wait.timeout_ms)
            while pending:
                pending.pop()()  # Redis works on the calls meanwhile
            replies: list[Any] = []
            for _ in calls:
                try:
                    replies.append(await conn.read_response())
                except redis.ResponseError as exc:  # an error reply: the stream stays in sync
                    replies.append(exc)
            if wait is not None:
                replica_wait.check(wait, await conn.read_response())
            return replies

        async def fail(_: Exception) -> None:
            await conn.disconnect()

        try:
            return cast(list[Any], await conn.retry.call_with_retry(exchange, fail))
        except BaseException:
            await conn.disconnect(nowait=True)  # replies may be unread: never reuse this socket
            raise
        finally:
            await pool.release(conn)

    async def _await_confirmation(self, effect: AwaitConfirmation) -> bool:
        sub = cast(AsyncSubscription, effect.mailbox)
        if effect.strict:
            await sub.wait_confirmed(effect.timeout)
            return True
        return await sub.confirmed_within(effect.timeout)

    async def _sleep(self, effect: Sleep) -> None:
        await asyncio.sleep(effect.seconds)

    async def _compute(self, effect: Compute) -> Any:
        return await asyncio.to_thread(effect.fn)
