"""``SyncDriver``: runs a ``core`` plan with blocking calls (see ``core/effects.py``).

It makes no decision: each effect maps to the one redis-py or subscriber call below, its reply
is sent back into the plan and its exception thrown in at the plan's ``yield``. No event loop,
no thread: ``Client.submit`` costs what the calls themselves cost.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar, cast

import redis

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
from tokenfleet.producer.sync_io.subscriber import Subscriber, Subscription
from tokenfleet.shared.scripts import registry

T = TypeVar("T")


class SyncDriver:
    """Performs effects on one ``redis.Redis`` and one ``Subscriber``."""

    __slots__ = ("_redis", "_subscriber")

    def __init__(self, redis_client: redis.Redis, subscriber: Subscriber) -> None:
        self._redis = redis_client
        self._subscriber = subscriber

    def run(self, plan: Plan[T]) -> T:
        """Drive ``plan`` to its end and return its value (or raise what it raises)."""
        perform = self._perform
        try:
            effect = next(plan)
            while True:
                try:
                    reply = perform(effect)
                except Exception as exc:  # the plan decides: it may catch it at its yield
                    effect = plan.throw(exc)
                else:
                    effect = plan.send(reply)
        except StopIteration as stop:
            return cast(T, stop.value)

    def _perform(self, effect: Effect) -> Any:
        r = self._redis
        match effect:
            case RunScript(script, keys, args):
                return registry.call(r, script, keys, args)
            case Command(command, args):
                return command(r, *args)
            case Receive(mailbox, timeout):
                return cast(Subscription, mailbox).get(timeout)
            case Subscribe(channel, timeout, confirm):
                return self._subscriber.subscribe(channel, timeout, confirm=confirm)
            case Transaction(commands):
                pipe = r.pipeline(transaction=True)
                for c in commands:
                    c.command(pipe, *c.args)
                return pipe.execute()
            case RunScripts(calls):
                pipe = r.pipeline(transaction=False)
                for call in calls:
                    registry.queue(r, pipe, call.script, call.keys, call.args)
                return pipe.execute()
            case AwaitConfirmation(mailbox, timeout, strict):
                sub = cast(Subscription, mailbox)
                if strict:
                    sub.wait_confirmed(timeout)
                    return True
                return sub.confirmed_within(timeout)
            case Sleep(seconds):
                time.sleep(seconds)
                return None
        raise TypeError(f"not an effect: {effect!r}")
