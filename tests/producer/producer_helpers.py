"""A scripted stand-in for the worker side of docs/protocol.md, for producer tests.

``FakeWorker`` takes entries with XREADGROUP, moves records to ``running``, appends token
events (RPUSH then PUBLISH, as the protocol requires) and ends requests through the real
``finish`` script.
"""

from __future__ import annotations

from typing import Any

import redis

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import TerminalEvent, TerminalStatus, TokenEvent
from tokenfleet.shared.scripts import registry
from tokenfleet.shared.scripts.finish import FINISH, finish_keys_args


class FakeWorker:
    """Serve requests by script: ``take`` one, ``emit`` tokens, ``finish`` it."""

    def __init__(self, r: redis.Redis, keys: Keys, name: str = "fake-worker") -> None:
        self.r = r
        self.keys = keys
        self.name = name

    def take(
        self, priority: Priority = Priority.NORMAL, model: str = "default", block_ms: int = 5000
    ) -> str:
        """Read one entry (blocking) and mark its request running; returns its id."""
        stream = self.keys.stream(model, priority)
        try:  # whoever touches a stream first creates it and its group (docs/protocol.md)
            self.r.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        reply: Any = self.r.xreadgroup(
            CONSUMER_GROUP, self.name, {stream: ">"}, count=1, block=block_ms
        )
        if not reply:
            raise TimeoutError(f"no entry in {stream} within {block_ms} ms")
        _, entries = reply[0]
        _, fields = entries[0]
        rid = fields[b"id"].decode()
        self.r.hset(
            self.keys.record(rid),
            mapping={"status": "running", "worker": self.name, "started_at": "1"},
        )
        return rid

    def emit(self, rid: str, start: int, texts: list[str], *, publish: bool = True) -> None:
        """Append token events ``start, start + 1, ...`` (RPUSH, then PUBLISH)."""
        for offset, text in enumerate(texts):
            data = TokenEvent(rid, start + offset, 100 + start + offset, text).encode()
            pipe = self.r.pipeline(transaction=True)
            pipe.rpush(self.keys.tokens(rid), data)
            if publish:
                pipe.publish(self.keys.channel(rid), data)
            pipe.hset(self.keys.record(rid), "num_tokens", start + offset + 1)
            pipe.execute()

    def republish(self, rid: str, index: int) -> None:
        """Publish an already stored token event again (a resumed worker's duplicate)."""
        data = self.r.lindex(self.keys.tokens(rid), index)
        assert data is not None
        self.r.publish(self.keys.channel(rid), data)

    def finish(
        self,
        rid: str,
        status: TerminalStatus = TerminalStatus.DONE,
        *,
        num_tokens: int,
        priority: Priority = Priority.NORMAL,
        text: str = "",
    ) -> str:
        """End the request through the real finish script; returns its code."""
        stream_id: Any = self.r.hget(self.keys.record(rid), "stream_id") or b""
        event = TerminalEvent(
            rid,
            status,
            num_tokens=num_tokens,
            finish_reason="stop" if status is TerminalStatus.DONE else None,
            code="worker_lost" if status is TerminalStatus.ERROR else None,
            message=None if status is TerminalStatus.DONE else f"{status} by the fake worker",
            usage={"prompt_tokens": 3, "completion_tokens": num_tokens},
        )
        k, a = finish_keys_args(
            self.keys,
            event,
            model="default",
            priority=priority,
            now=2.0,
            ttl_s=600,
            stream_id=stream_id.decode(),
            extra_fields={"text": text},
        )
        return str(registry.call(self.r, FINISH, k, a)[0])

    def serve(
        self, texts: list[str], priority: Priority = Priority.NORMAL, block_ms: int = 5000
    ) -> str:
        """Take one request and complete it with ``texts``; returns its id."""
        rid = self.take(priority, block_ms=block_ms)
        self.emit(rid, 0, texts)
        self.finish(rid, num_tokens=len(texts), priority=priority, text="".join(texts))
        return rid
