"""Helpers for worker tests: enqueue per docs/protocol.md, run worker processes, read results."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
from child_process import ChildProcess, tokenfleet_args
from waiting import DEADLINE_S, wait_for

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import (
    GenerationRequest,
    TerminalEvent,
    TokenEvent,
    decode_event,
)

if TYPE_CHECKING:
    from tokenfleet.worker.intake import Intake


def make_intake(
    r: redis.Redis,
    settings: Any,
    *,
    worker_name: str = "w1",
    priorities: Sequence[Any] | None = None,
    starvation_pulls: int = 8,
) -> Intake:
    """An ``Intake`` for model "default" (poison limit 3), its consumer groups created."""
    from tokenfleet.shared.priority import Priority
    from tokenfleet.worker.intake import Intake

    intake = Intake(
        r,
        settings,
        model_name="default",
        priorities=list(priorities) if priorities is not None else [Priority.NORMAL],
        worker_name=worker_name,
        poison_limit=3,
        starvation_pulls=starvation_pulls,
    )
    intake.streams.ensure_groups()
    return intake


_ENQUEUE_LUA = """
local id = redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'd', ARGV[2], 'dl', ARGV[3])
redis.call('HSET', KEYS[2], 'stream_id', id)
for i = 5, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[2], ARGV[4])
return id
"""


def enqueue(
    r: redis.Redis, keys: Keys, req: GenerationRequest, ttl_s: int = 3600, **record_fields: Any
) -> str:
    """What the producer's enqueue script does (protocol step 1), atomically, minus the bound
    checks; ``record_fields`` override the new record's fields."""
    stream = keys.stream(req.model, req.priority)
    try:
        r.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    data = req.encode()
    dl = "" if req.deadline is None else repr(req.deadline)
    fields: dict[str, Any] = {
        "status": "queued",
        "enqueued_at": repr(req.enqueued_at),
        "request": data,
        "model": req.model,
        "priority": req.priority.label,
        "num_tokens": 0,
        "attempts": 0,
        **record_fields,
    }
    args: list[Any] = [req.request_id, data, dl, ttl_s]
    for k, v in fields.items():
        args += [k, v]
    entry = r.eval(_ENQUEUE_LUA, 2, stream, keys.record(req.request_id), *args)
    r.sadd(keys.queues, Keys.queue_member(req.model, req.priority))
    return entry.decode() if isinstance(entry, bytes) else str(entry)


def make_request(rid: str, **kw: Any) -> GenerationRequest:
    if not {"prompt", "prompt_token_ids", "messages"} & set(kw):
        kw["prompt"] = "The quick brown fox"
    kw.setdefault("enqueued_at", time.time())
    return GenerationRequest(request_id=rid, **kw)


def record(r: redis.Redis, keys: Keys, rid: str) -> RequestRecord | None:
    return RequestRecord.from_hash(rid, r.hgetall(keys.record(rid)))


def wait_terminal(
    r: redis.Redis, keys: Keys, rid: str, timeout_s: float = DEADLINE_S
) -> RequestRecord:
    def done() -> RequestRecord | None:
        rec = record(r, keys, rid)
        return rec if rec is not None and rec.status.is_terminal else None

    return wait_for(done, f"{rid} to reach a terminal state", timeout_s)


def token_events(r: redis.Redis, keys: Keys, rid: str) -> list[TokenEvent]:
    out = []
    for raw in r.lrange(keys.tokens(rid), 0, -1):
        ev = decode_event(raw)
        assert isinstance(ev, TokenEvent)
        out.append(ev)
    return out


@dataclass
class ChannelLog:
    """Every event published on some requests' channels, in arrival order."""

    pubsub: Any
    events: dict[str, list[Any]] = field(default_factory=dict)

    def pump(self, max_s: float = 0.1) -> None:
        """Take in what has arrived. Returns after a quiet 10 ms or after ``max_s``, so that a
        steady stream (an event every few ms) cannot keep the caller from checking its
        condition until the stream ends."""
        until = time.monotonic() + max_s
        while time.monotonic() < until:
            msg = self.pubsub.get_message(ignore_subscribe_messages=True, timeout=0.01)
            if msg is None:
                return
            ev = decode_event(msg["data"])
            self.events.setdefault(ev.request_id, []).append(ev)

    def terminal(self, rid: str) -> TerminalEvent | None:
        self.pump()
        evs = self.events.get(rid, [])
        return evs[-1] if evs and isinstance(evs[-1], TerminalEvent) else None

    def wait_terminal(self, rid: str, timeout_s: float = DEADLINE_S) -> TerminalEvent:
        return wait_for(lambda: self.terminal(rid), f"terminal event of {rid}", timeout_s)

    def tokens(self, rid: str) -> list[TokenEvent]:
        self.pump()
        return [e for e in self.events.get(rid, []) if isinstance(e, TokenEvent)]


def subscribe(r: redis.Redis, keys: Keys, rids: Sequence[str]) -> ChannelLog:
    ps = r.pubsub()
    ps.subscribe(*[keys.channel(rid) for rid in rids])
    # wait for the subscribe confirmations so nothing published after this is missed
    confirmed = 0

    def all_confirmed() -> bool:
        nonlocal confirmed
        msg = ps.get_message(timeout=0.1)
        confirmed += bool(msg and msg["type"] == "subscribe")
        return confirmed >= len(set(rids))  # (redis-py subscribes a channel once)

    wait_for(all_confirmed, "the subscribe confirmations", timeout_s=10, poll_s=0)
    return ChannelLog(ps)


class WorkerProc(ChildProcess):
    """A real ``tokenfleet worker`` process (``python -m tokenfleet.worker.cli worker``), or
    ``script`` run with the same flags; killed (SIGKILL) at :meth:`close`."""

    def __init__(
        self,
        model_dir: Path,
        redis_url: str,
        prefix: str,
        name: str,
        log_dir: Path,
        *extra: str,
        script: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        full_env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "TOKENFLEET_KEY_PREFIX": prefix,
            **(env or {}),
        }
        full_env.pop("TOKENFLEET_MODEL", None)
        args = tokenfleet_args("worker") if script is None else [sys.executable, str(script)]
        args += [
            "--model",
            str(model_dir),
            "--name",
            name,
            "--threads",
            "1",
            "--heartbeat-ttl-s",
            "2",
            "--claim-idle-s",
            "0.5",
            "--claim-interval-s",
            "0.5",
            *extra,
        ]
        super().__init__(args, log_dir / f"{name}.log", full_env, inherit_env=False)
        self.keys = Keys(prefix)

    def wait_ready(self, r: redis.Redis, timeout_s: float = DEADLINE_S) -> None:
        def ready() -> bool:
            self.check_alive(f"worker {self.name}")
            return bool(r.exists(self.keys.worker(self.name)))

        wait_for(ready, f"worker {self.name}'s heartbeat", timeout_s, 0.05)


def worker_service(r: redis.Redis, settings: Any, model_dir: Path, name: str) -> Any:
    """An in-process ``WorkerService`` named ``name``, its consumer groups created."""
    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.service import WorkerService
    from tokenfleet.worker.worker_settings import WorkerSettings

    ws = WorkerSettings(model=str(model_dir), name=name)
    svc = WorkerService(Engine(model_dir, device="cpu"), settings, ws, client=r)
    svc.intake.streams.ensure_groups()
    return svc
