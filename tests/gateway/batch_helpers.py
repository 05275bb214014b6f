"""Helpers for the Batch API core tests: an asyncio environment (Redis, client, stores), input
lines, and checks of a finished batch's files against its input, line by line."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import redis.asyncio
from waiting import wait_for_async

from tokenfleet.producer.async_client import AsyncClient
from tokenfleet.producer.gateway.batches import BatchObject, BatchRunner, BatchStore, FileStore
from tokenfleet.shared.settings import Settings

T = TypeVar("T")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass
class Env:
    """What a batch test talks to (one event loop)."""

    settings: Settings
    r: redis.asyncio.Redis
    client: AsyncClient
    files: FileStore
    batches: BatchStore

    def runner(self, **kw: Any) -> BatchRunner:
        return BatchRunner(self.client, self.r, self.settings, **kw)


def with_env(settings: Settings, body: Callable[[Env], Awaitable[T]]) -> T:
    """Run ``body(env)`` in a fresh event loop, closing everything after."""

    async def main() -> T:
        r = redis.asyncio.Redis.from_url(settings.redis_url)
        client = AsyncClient(r, settings=settings)
        try:
            env = Env(settings, r, client, FileStore(r, settings), BatchStore(r, settings))
            return await body(env)
        finally:
            await client.aclose()
            await r.aclose()

    return asyncio.run(main())


def chat_line(i: int, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": f"line {i}: say something"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }
    return {"custom_id": f"req-{i}", "method": "POST", "url": CHAT, "body": body}


def jsonl(objs: list[Any]) -> bytes:
    return b"".join(orjson.dumps(o) + b"\n" for o in objs)


async def upload_and_create(env: Env, objs: list[Any], endpoint: str = CHAT) -> BatchObject:
    f = await env.files.create("batch", "in.jsonl", jsonl(objs))
    return await env.batches.create(f.id, endpoint, "24h", {"test": "yes"})


async def wait_batch(
    env: Env, batch_id: str, done: Callable[[BatchObject], bool], timeout_s: float = 120.0
) -> BatchObject:
    """Poll the batch until ``done(batch)``; AssertionError with its state after ``timeout_s``."""
    last: list[BatchObject] = []

    async def reached() -> BatchObject | None:
        last[:] = [await env.batches.get(batch_id)]
        return last[0] if done(last[0]) else None

    try:
        got: BatchObject = await wait_for_async(reached, f"batch {batch_id}", timeout_s, 0.05)
    except AssertionError as stuck:
        raise AssertionError(f"{stuck}: stuck at {last[0].to_dict()}") from None
    return got


def final(b: BatchObject) -> bool:
    return b.final


async def file_lines(env: Env, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [orjson.loads(x) for x in (await env.files.content(file_id)).splitlines()]


async def check_exactly_once(
    env: Env, b: BatchObject, custom_ids: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every custom_id in exactly one line of the two files; the counts agree; the output
    bodies are OpenAI objects. Returns (output lines, error lines)."""
    out = await file_lines(env, b.output_file_id)
    err = await file_lines(env, b.error_file_id)
    seen = [x["custom_id"] for x in out + err]
    assert sorted(seen) == sorted(custom_ids), "a line lost or written twice"
    assert b.completed == len(out) and b.failed == len(err) and b.total == len(custom_ids)
    ledger = await env.r.hgetall(env.batches._keys.batch_done(b.id))
    assert len(ledger) == len(custom_ids)
    for x in out:
        assert x["id"].startswith("batch_req_") and x["error"] is None
        resp = x["response"]
        assert resp["status_code"] == 200
        assert resp["request_id"].startswith(b.id + "-")
        body = resp["body"]
        assert body["object"] in ("chat.completion", "text_completion")
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        assert body["usage"]["completion_tokens"] >= 1
    for x in err:
        assert x["error"]["code"] and x["error"]["message"]
    return out, err
