"""``SyncDriver``: runs a ``core`` plan with blocking calls (see ``core/effects.py``).

It makes no decision: each effect type maps to one method below, which makes the one redis-py
or subscriber call it names; the reply is sent back into the plan and an exception thrown in at
the plan's ``yield``. No event loop, no thread: ``Client.submit`` costs what its calls cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import redis

from tokenfleet.producer.core.effects import (
    AwaitConfirmation,
    Command,
    Plan,
    Receive,
    RunScript,
    RunScripts,
    Sleep,
    Subscribe,
    Transaction,
)
from tokenfleet.producer.sync_io.subscriber import Subscriber, Subscription
from tokenfleet.shared.scripts import registry

T = TypeVar("T")


class SyncDriver:
    """Performs effects on one ``redis.Redis`` and one ``Subscriber``.

    Invariant: ``_perform`` has one entry per effect type of ``core.effects``.
    """

    __slots__ = ("_perform", "_redis", "_subscriber")

    def __init__(self, redis_client: redis.Redis, subscriber: Subscriber) -> None:
        self._redis = redis_client
        self._subscriber = subscriber
        self._perform: dict[type, Callable[[Any], Any]] = {
            RunScript: self._run_script,
            Command: self._command,
            Receive: self._receive,
            Subscribe: self._subscribe,
            Transaction: self._transaction,
            RunScripts: self._run_scripts,
            AwaitConfirmation: self._await_confirmation,
            Sleep: self._sleep,
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
        return registry.call(self._redis, effect.script, effect.keys, effect.args)

    def _command(self, effect: Command) -> Any:
        return effect.command(self._redis, *effect.args)

    def _receive(self, effect: Receive) -> object | None:
        return cast(Subscription, effect.mailbox).get(effect.timeout)

    def _subscribe(self, effect: Subscribe) -> Subscription:
        return self._subscriber.subscribe(effect.channel, effect.timeout, confirm=effect.confirm)

    def _transaction(self, effect: Transaction) -> list[Any]:
        pipe = self._redis.pipeline(transaction=True)
        for c in effect.commands:
            c.command(pipe, *c.args)
        return pipe.execute()

    def _run_scripts(self, effect: RunScripts) -> list[Any]:
        r = self._redis
        pipe = r.pipeline(transaction=False)
        for call in effect.calls:
            registry.queue(r, pipe, call.script, call.keys, call.args)
        return pipe.execute()

    def _await_confirmation(self, effect: AwaitConfirmation) -> bool:
        sub = cast(Subscription, effect.mailbox)
        if effect.strict:
            sub.wait_confirmed(effect.timeout)
            return True
        return sub.confirmed_within(effect.timeout)

    def _sleep(self, effect: Sleep) -> None:
        time.sleep(effect.seconds)
