"""Checks both HA path suites run (tests/ha/test_sentinel_path.py, test_cluster_path.py): the
same promises through Sentinel and on a Cluster, written once."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from child_process import ChildProcess, free_port, run_command, tokenfleet_args
from ha_helpers import HAWorker
from waiting import DEADLINE_S, wait_for

from tokenfleet.producer import Client
from tokenfleet.shared.errors import Overloaded
from tokenfleet.shared.schema import TerminalEvent, TokenEvent


def indices(events: list[Any]) -> list[int]:
    return [e.index for e in events if isinstance(e, TokenEvent)]


def terminal(events: list[Any]) -> str:
    last = events[-1]
    assert isinstance(last, TerminalEvent), last
    return str(last.status.value)


def _cli(prefix: str, redis_flags: list[str], *args: str) -> str:
    """A ``tokenfleet`` command with ``redis_flags`` (no REDIS_URL in its environment)."""
    env = {**os.environ, "TOKENFLEET_KEY_PREFIX": prefix}
    env.pop("REDIS_URL", None)
    done = run_command(tokenfleet_args(*args, *redis_flags), env, inherit_env=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def check_gateway_serves(
    fleet: Any, prefix: str, redis_flags: list[str], log_dir: Path, model_dir: Path
) -> None:
    """``tokenfleet serve --auth required`` with ``redis_flags``: API keys made by ``tokenfleet
    keys``; a completion through the openai SDK, whole and streamed, agree; a key's request
    rate is enforced (429); a Batch API batch runs to ``completed`` with every line once (on a
    worker that serves the batch level, started for it: the fleet's leave it unserved).
    ``fleet``: ``setup`` and ``r``."""
    batch_worker = HAWorker(
        model_dir, fleet.setup, prefix, "batch-only", log_dir, "--priorities", "batch"
    )
    try:
        wait_for(lambda: batch_worker.ready(fleet.r), "the batch worker's heartbeat")
        _check_gateway(prefix, redis_flags, log_dir, "A gateway in HA mode")
    finally:
        batch_worker.close()


@contextlib.contextmanager
def gateway_process(
    prefix: str, redis_flags: list[str], log_dir: Path, *extra: str
) -> Iterator[str]:
    """A real ``tokenfleet serve`` (uvicorn) with ``redis_flags`` and ``extra`` flags, healthy;
    yields its base URL; SIGTERM after."""
    port = free_port()
    env = {**os.environ, "TOKENFLEET_KEY_PREFIX": prefix}
    env.pop("REDIS_URL", None)
    args = tokenfleet_args("serve", "--port", str(port), "--log-level", "warning", *extra,
                           *redis_flags)  # fmt: skip
    proc = ChildProcess(args, log_dir / f"gateway-{port}.log", env, inherit_env=False)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        proc.check_alive("the gateway")
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, "the gateway's /health")
        yield url
    finally:
        proc.signal(signal.SIGTERM)
        proc.wait(30)
        proc.close()


def _check_gateway(prefix: str, redis_flags: list[str], log_dir: Path, prompt: str) -> None:
    name = prefix.strip("{}")
    free = json.loads(_cli(prefix, redis_flags, "keys", "create", "--name", f"{name}-free",
                           "--json"))["api_key"]  # fmt: skip
    limited = json.loads(_cli(prefix, redis_flags, "keys", "create", "--name", f"{name}-rpm1",
                              "--rpm", "1", "--json"))["api_key"]  # fmt: skip
    with gateway_process(prefix, redis_flags, log_dir, "--auth", "required") as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=free, max_retries=0)
        whole = sdk.completions.create(model="default", prompt=prompt, max_tokens=6, seed=1)
        parts = [
            c.choices[0].text
            for c in sdk.completions.create(
                model="default", prompt=prompt, max_tokens=6, seed=1, stream=True
            )
            if c.choices
        ]
        assert whole.choices[0].finish_reason == "length"
        assert "".join(parts) == whole.choices[0].text
        # a rate limit: one request a minute
        capped = openai.OpenAI(base_url=url + "/v1", api_key=limited, max_retries=0)
        capped.completions.create(model="default", prompt=prompt, max_tokens=2)
        with pytest.raises(openai.RateLimitError):
            capped.completions.create(model="default", prompt=prompt, max_tokens=2)
        _check_batch(sdk, prompt)


def _check_batch(sdk: openai.OpenAI, prompt: str) -> None:
    """A 5-line batch through the gateway (which drives it): completed, every line once."""
    rows = [
        {
            "custom_id": f"b-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "default", "prompt": f"{prompt} {i}", "max_tokens": 3},
        }
        for i in range(5)
    ]
    data = "".join(json.dumps(row) + "\n" for row in rows).encode()
    upload = sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    final = ("completed", "failed", "expired", "cancelled")

    def ended() -> Any:
        b = sdk.batches.retrieve(batch.id)
        return b if b.status in final else None

    done = wait_for(ended, "the batch to end", poll_s=0.2)  # (an HTTP call per poll)
    assert done.status == "completed", done
    assert done.output_file_id is not None
    lines = sdk.files.content(done.output_file_id).text.splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in lines) == [f"b-{i}" for i in range(5)]


def check_crash_recovery(fleet: Any) -> None:
    """A worker SIGKILLed holding a request: the other resumes it, 150 tokens once, gap-free.
    ``fleet``: ``settings``, ``workers`` (HAWorker: ``name``, ``kill()``, ``output()``) and
    ``record(rid)``."""
    with Client.from_url(settings=fleet.settings) as client:
        handle = client.submit("Crash recovery", max_tokens=150, ignore_eos=True)
        rid = handle.request_id

        def holder() -> Any:
            rec = fleet.record(rid)
            if rec is None or rec.status != "running" or rec.num_tokens < 5:
                return None
            return next((w for w in fleet.workers if w.name == rec.worker), None)

        victim = wait_for(holder, "the request to run and stream a few tokens")
        victim.kill()
        survivor = next(w for w in fleet.workers if w is not victim)
        events = list(handle.stream(timeout=DEADLINE_S))
        assert indices(events) == list(range(150)), "gap-free, duplicate-free"
        assert terminal(events) == "done"
        rec = fleet.record(rid)
        assert rec is not None and rec.status == "done" and rec.attempts == 2
        assert f"resumed {rid} at index" in survivor.output()
        print(
            f"[counts] crash recovery: {victim.name} killed, {survivor.name} resumed, "
            "150 tokens once"
        )


def check_cancel(fleet: Any) -> None:
    """A streaming request cancelled after its first token ends ``cancelled``, gap-free."""
    with Client.from_url(settings=fleet.settings) as client:
        handle = client.submit("Cancel me", max_tokens=2000, ignore_eos=True)
        stream = handle.stream(timeout=DEADLINE_S)
        first = next(stream)
        assert isinstance(first, TokenEvent)
        assert handle.cancel()
        rest = list(stream)
        assert terminal(rest) == "cancelled"
        assert indices([first, *rest]) == list(range(len(indices([first, *rest]))))
        assert client.status(handle.request_id).status == "cancelled"


def check_overflow_policies(fleet: Any) -> None:
    """drop_newest refuses, drop_oldest evicts (on the batch queue, which no worker drains while
    the test runs: the fleet's workers serve other levels); leaves the queue empty."""
    with Client.from_url(settings=fleet.settings) as client:
        client.set_queue_config("batch", max_waiting=2, policy="drop_newest")
        kept = [client.submit("q", priority="batch", max_tokens=4) for _ in range(2)]
        with pytest.raises(Overloaded):
            client.submit("refused", priority="batch", max_tokens=4)
        client.set_queue_config("batch", policy="drop_oldest")
        newest = client.submit("newest", priority="batch", max_tokens=4)
        assert client.status(kept[0].request_id).status == "dropped"
        assert client.status(newest.request_id).status == "queued"
        for h in (kept[1], newest):  # leave the queue empty for the next test
            assert h.cancel()
        wait_for(
            lambda: (
                all(client.status(h.request_id).status == "cancelled" for h in (kept[1], newest))
                or None
            ),
            "the queued requests to be cancelled",
        )
