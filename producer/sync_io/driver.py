"""``SyncDriver``: runs a ``core`` plan with blocking calls (see ``core/effects.py``).

It makes no decision: each effect type maps to one method below, which makes the one redis-py
or subscriber call it names; the reply is sent back into the plan and an exception thrown in at
the plan's ``yield``. No event loop, no thread: ``Client.submit`` costs what its calls cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import redis

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
from tokenfleet.producer.sync_io.subscriber import Subscriber, Subscription
from tokenfleet.shared import replica_wait
from tokenfleet.shared.scripts import registry

T = TypeVar("T")


class SyncDriver:
    """Performs effects on the ``redis.Redis`` and ``Subscriber`` of each key's slot
    (``core.slot_clients``: one of each off a cluster; a plan keeps each effect in one slot).

    Invariant: ``_perform`` has one entry per effect type of ``core.effects``.
    """

    __slots__ = ("_perform", "_slots", "_wait")

    def __init__(self, slots: SlotClients[redis.Redis, Subscriber], first: redis.Redis) -> None:
        self._slots = slots  # the client and subscriber of each key's slot
        self._wait = replica_wait.wait_of(first)  # confirmed writes (effects' ``confirm``)
        self._perform: dict[type, Callable[[Any], Any]] = {
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

    def run(self, plan: Plan[T]) -> T:
        """Drive ``plan`` to its end and return its value (or raise what it raises)."""
        perform = self._perform
        try:
            effect = next(plan)
            while True:
                try:
                    reply = perform[type(effect)](effect)
                except Exception as exc:  # the plan decides: it may catch it at its yield
                    effect = plan.throw(exc)
                else:
                    effect = plan.send(reply)
        except StopIteration as stop:
            return cast(T, stop.value)

    def _run_script(self, effect: RunScript) -> list[Any]:
        wait = self._wait if effect.confirm else None
        client = self._slots.client(effect.keys[0])
        if wait is None:
            return registry.call(client, effect.script, effect.keys, effect.args)
        pipe = client.pipeline(transaction=False)  # the script and its WAIT: one connection
        registry.queue(client, pipe, effect.script, effect.keys, effect.args)
        pipe.wait(wait.num_replicas, wait.timeout_ms)
        reply, confirmed = pipe.execute(raise_on_error=False)
        return replica_wait.checked(wait, effect.script, reply, confirmed)

    def _command(self, effect: Command) -> Any:
        return effect.command(self._slots.client(effect.args[:1] and effect.args[0]), *effect.args)

    def _receive(self, effect: Receive) -> object | None:
        return cast(Subscription, effect.mailbox).get(effect.timeout)

    def _subscribe(self, effect: Subscribe) -> Subscription:
        return self._slots.subscriber(effect.channel).subscribe(
            effect.channel, effect.timeout, confirm=effect.confirm
        )

    def _transaction(self, effect: Transaction) -> list[Any]:
        pipe = self._slots.client(effect.commands[0].args[0]).pipeline(transaction=True)
        for c in effect.commands:
            c.command(pipe, *c.args)
        return pipe.execute(raise_on_error=effect.raise_on_error)

    def _run_scripts(self, effect: RunScripts) -> list[Any]:
        """One round trip of ``EVALSHA``s packed by hiredis (see ``core/script_wire.py``)."""
        wait = self._wait if effect.confirm else None
        client = self._slots.client(effect.calls[0].keys[0])  # (the calls share one slot)
        replies = self._exchange(client, effect.calls, effect.meanwhile, wait)
        retry = script_wire.missing_scripts(replies)
        if retry:  # the server lost its scripts: load them, run those calls again
            for source in {effect.calls[i].script.source for i in retry}:
                client.script_load(source)
            for i, reply in zip(
                retry, self._exchange(client, [effect.calls[i] for i in retry], None), strict=True
            ):
                replies[i] = reply
        return script_wire.raise_first_error(replies)

    def _exchange(
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
        conn = pool.get_connection()
        pending = [meanwhile] if meanwhile is not None else []

        def exchange() -> list[Any]:
            for packed in script_wire.packed_calls(conn, calls):
                conn.send_packed_command(packed, check_health=False)
            if wait is not None:  # confirmed by replicas, the calls' writes with it
                conn.send_command("WAIT", wait.num_replicas, wait.timeout_ms)
            while pending:
                pending.pop()()  # Redis works on the calls meanwhile
            replies: list[Any] = []
            for _ in calls:
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as exc:  # an error reply: the stream stays in sync
                    replies.append(exc)
            if wait is not None:
                replica_wait.check(wait, conn.read_response())
            return replies

        try:
            return conn.retry.call_with_retry(exchange, lambda _: conn.disconnect())
        except BaseException:
            conn.disconnect()  # replies may be left unread: never hand this socket out again
            raise
        finally:
            pool.release(conn)

    def _await_confirmation(self, effect: AwaitConfirmation) -> bool:
        sub = cast(Subscription, effect.mailbox)
        if effect.strict:
            sub.wait_confirmed(effect.timeout)
            return True
        return sub.confirmed_within(effect.timeout)

    def _sleep(self, effect: Sleep) -> None:
        time.sleep(effect.seconds)

    def _compute(self, effect: Compute) -> Any:
        return effect.fn()
