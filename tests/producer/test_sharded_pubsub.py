"""Sharded pub/sub (cluster mode): the subscription table routes ``smessage``/``ssubscribe``
like their plain twins and reports a server-side ``sunsubscribe`` of a listened channel (the
cluster moved its slot) as a lost connection; a ``Subscriber`` built with the sharded commands
receives what a script SPUBLISHes (Redis 7 has sharded pub/sub on a standalone server too)."""

from __future__ import annotations

import threading

import redis

from tokenfleet.producer.core.subscriptions import SubscriptionTable, pubsub_connection_factory
from tokenfleet.producer.sync_io.subscriber import Subscriber


def test_the_table_routes_sharded_replies_and_reports_a_dropped_channel() -> None:
    table = SubscriptionTable()
    got: list[object] = []
    confirmed = threading.Event()
    assert table.add("{f}:ch:r1", 1, got.append, confirmed)
    assert table.dispatch([b"ssubscribe", b"{f}:ch:r1", 1]) is False and confirmed.is_set()
    assert table.dispatch([b"smessage", b"{f}:ch:r1", b"event"]) is False
    assert got == [b"event"]
    assert table.dispatch([b"sunsubscribe", b"{f}:ch:other", 0]) is False  # not listened to
    assert table.dispatch([b"sunsubscribe", b"{f}:ch:r1", 0]) is True  # the slot moved


def test_a_sharded_subscriber_receives_spublish(r: redis.Redis) -> None:
    sub = Subscriber(pubsub_connection_factory(r), commands=("SSUBSCRIBE", "SUNSUBSCRIBE"))
    try:
        box = sub.subscribe("{f}:ch:r1", timeout=10)
        assert r.execute_command("SPUBLISH", "{f}:ch:r1", b"hello") == 1
        assert box.get(timeout=10) == b"hello"
        assert r.execute_command("PUBLISH", "{f}:ch:r1", b"plain") == 0  # not a shard channel's
        box.close()
    finally:
        sub.close()
