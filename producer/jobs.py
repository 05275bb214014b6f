"""rq job functions: run a generation inside rq's job status / result / retry machinery.

A web app enqueues ``generate`` with rq's JSON serializer (never pickle: nothing read from
Redis is unpickled)::

    from rq import Queue
    from rq.serializers import JSONSerializer
    from tokenfleet.producer.jobs import generate

    queue = Queue("tokenfleet", connection=redis_conn, serializer=JSONSerializer)
    job = queue.enqueue(generate, prompt="Summarise ...", max_tokens=128, on_overload="skip")

and runs ``rq worker -S json tokenfleet``. Arguments and the return value are JSON.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any
from urllib.parse import quote

import redis
from rq import get_current_job

from tokenfleet.producer.client import Client
from tokenfleet.shared.declared_settings import env_value
from tokenfleet.shared.errors import InvalidRequest, Overloaded
from tokenfleet.shared.settings import Settings

ON_OVERLOAD = ("skip", "fail")


def _client(redis_url: str | None) -> Client:
    """tokenfleet's Redis: ``redis_url``, else ``REDIS_URL`` (or the sentinel-mode settings),
    else the rq worker's Redis."""
    settings = Settings.from_env()
    if redis_url or env_value(Settings, "redis_url") or settings.redis_mode != "standalone":
        return Client.from_url(redis_url or settings.redis_url, settings=settings)
    job = get_current_job()
    if job is not None and isinstance(job.connection, redis.Redis):
        # the settings name the same server: a batch's handle opens connections from them
        url = url_of(job.connection)
        return Client(job.connection, settings=replace(settings, redis_url=url))
    return Client.from_url(settings.redis_url, settings=settings)


def url_of(connection: redis.Redis) -> str:
    """A ``redis://`` / ``rediss://`` / ``unix://`` URL naming the server (and database,
    credentials) of a standalone ``redis.Redis``."""
    kw = connection.connection_pool.connection_kwargs
    db = int(kw.get("db") or 0)
    user, password = kw.get("username"), kw.get("password")
    auth = ""
    if user or password:
        auth = f"{quote(str(user or ''), safe='')}:{quote(str(password or ''), safe='')}@"
    if kw.get("path"):
        return f"unix://{auth}{kw['path']}?db={db}"
    scheme = "rediss" if "SSL" in connection.connection_pool.connection_class.__name__ else "redis"
    return f"{scheme}://{auth}{kw['host']}:{kw['port']}/{db}"  # redis-py always sets both


def _request_id() -> str | None:
    """``rq-<job id>-<retries left>``: a worker that dies and restarts the same attempt
    re-attaches to the same request (idempotent ids); an rq retry gets a fresh one."""
    job = get_current_job()
    if job is None:
        return None
    return f"rq-{job.id}-{job.retries_left if job.retries_left is not None else 0}"


def generate(
    prompt: Any = None,
    *,
    on_overload: str = "fail",
    result_timeout: float | None = None,
    redis_url: str | None = None,
    **params: Any,
) -> dict[str, Any]:
    """Submit one generation, wait for it, return ``Result.to_dict()``.

    ``on_overload="skip"`` uses ``try_submit`` semantics: a full queue (any policy) makes the
    job return ``{"status": "skipped", "reason": ...}`` at once, so a cron firing is skipped
    rather than piled up. ``on_overload="fail"`` uses ``submit`` (a ``block`` queue waits up to
    ``timeout``) and raises ``Overloaded``, so rq marks the job failed and may retry it.
    A request that ends other than ``done`` raises ``RequestFailed`` (the job fails).
    ``params`` are ``Client.submit``'s keyword arguments.
    """
    if on_overload not in ON_OVERLOAD:
        raise InvalidRequest(f"on_overload must be 'skip' or 'fail', got {on_overload!r}")
    if params.get("request_id") is None:
        params["request_id"] = _request_id()
    with _client(redis_url) as client:
        if on_overload == "skip":
            try:
                handle = client.try_submit(prompt, **params)
            except Overloaded as exc:
                return {"status": "skipped", "reason": str(exc), "request_id": None}
        else:
            handle = client.submit(prompt, **params)
        with handle:
            return handle.result(timeout=result_timeout).to_dict()


def run_batch(
    path: str,
    *,
    endpoint: str = "/v1/chat/completions",
    completion_window: str = "24h",
    redis_url: str | None = None,
) -> dict[str, Any]:
    """Run the OpenAI-style batch in the JSONL file ``path`` (docs/batches.md) and wait for
    it, driving it meanwhile; returns the final batch object (status, ``request_counts``,
    ``output_file_id``, ``error_file_id``). A cron config schedules it like ``generate``; a
    batch that ends other than ``completed`` fails the job. Needs the ``gateway`` extra."""
    with _client(redis_url) as client:
        handle = client.submit_batch(path, endpoint=endpoint, completion_window=completion_window)
    batch = handle.wait()
    out: dict[str, Any] = batch.to_dict()
    if batch.status != "completed":
        raise RuntimeError(f"batch {batch.id} ended {batch.status}: {out.get('errors')}")
    return out
