"""Keep-alives that no client mis-reads (issue 27), tested with the clients people use.

The module's gateway sends a keep-alive every 0.1 s, so every stream here outlives many
keep-alive intervals. Streams also stall mid-generation: once the client has read a token event
(an ``id:`` line), the worker is SIGSTOPped until the client's own parser has gone through
several keep-alives, then SIGCONTed. Before the fix (a comment *and* a blank line), the
official SDK raised ``JSONDecodeError`` on the first keep-alive after an id, and httpx-sse
yielded an event with empty data.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
import redis
from browser_helpers import headless_chromium
from gateway_helpers import Fleet, Gateway, module_fleet, wait_for
from httpx_sse import connect_sse
from sse_helpers import (
    ReadBytes,
    RecordingTransport,
    SdkAsyncRecordingTransport,
    SdkRecordingTransport,
    Staller,
    keepalives_after_first_id,
)

from tokenfleet.producer.gateway.keepalive import KEEPALIVE_LINE
from tokenfleet.worker.devtools.local_redis import RedisServer

pytestmark = pytest.mark.slow

KEEPALIVE_S = "0.1"
NUM_TOKENS = 300  # the tiny model needs seconds for these: the staller stops it long before
BROWSER_TOKENS = 1500  # the browser test: more than an idle machine makes before its stall
CHAT: Any = [{"role": "user", "content": "Tell a long story about queues."}]


@pytest.fixture(scope="module")
def fleet(
    redis_server: RedisServer,
    plain_redis: redis.Redis,
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    """This module's own fleet: keep-alives every 0.1 s; the worker's heartbeat outlives a
    stall (10 s TTL), so no stall reads as a dead worker."""
    yield from module_fleet(
        redis_server,
        plain_redis,
        tiny_llama_dir,
        tmp_path_factory.mktemp("keepalive-logs"),
        gateway_args=("--keepalive-s", KEEPALIVE_S),
        worker_args=("--heartbeat-ttl-s", "10"),
    )


def record(fleet: Fleet, rid: str) -> dict[str, Any]:
    return httpx.get(f"{fleet.base_url}/requests/{rid}", timeout=10).json()


def submitted_in_background(fleet: Fleet, prompt: str, max_tokens: int = NUM_TOKENS) -> str:
    """A streaming request whose submitter leaves at once (``continue``): its id."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body["ignore_eos"] = True
    headers = {"X-On-Disconnect": "continue"}
    url = f"{fleet.base_url}/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as resp:
        assert resp.status_code == 200
        return str(resp.headers["x-request-id"])


def test_keepalive_is_a_lone_comment_line_between_events(fleet: Fleet) -> None:
    """The wire itself: while the worker is stopped mid-stream the gateway keeps sending
    ``: keep-alive`` lines, never followed by a blank line, and the token events around them
    are whole and gap-free."""
    read = ReadBytes()
    body = {"model": "default", "prompt": "wire", "max_tokens": NUM_TOKENS, "stream": True}
    body["ignore_eos"] = True
    with (
        httpx.Client(transport=RecordingTransport(read), timeout=120) as http,
        Staller(read, fleet.worker, keepalives=5),
        http.stream("POST", f"{fleet.base_url}/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        for _ in resp.iter_raw():
            pass
    (wire,) = read.bodies()
    assert keepalives_after_first_id(wire) >= 5
    assert KEEPALIVE_LINE + b"\r\n" not in wire  # a blank line after it would dispatch
    ids, datas = [], []
    for event in wire.split(b"\r\n\r\n"):
        lines = [x for x in event.split(b"\r\n") if x and x != KEEPALIVE_LINE.rstrip()]
        if not lines:
            continue
        fields = dict(line.decode().split(": ", 1) for line in lines)
        assert set(fields) <= {"id", "data"}, fields
        datas.append(fields["data"])
        if "id" in fields:
            ids.append(int(fields["id"]))
    assert ids == list(range(NUM_TOKENS))
    assert datas[-1] == "[DONE]"


def token_piece(chunk: Any, endpoint: str) -> str | None:
    """The text of a token chunk; None for the chat role chunk and the finish chunk."""
    choice = chunk.choices[0]
    if choice.finish_reason is not None:
        return None
    if endpoint == "chat":
        return None if choice.delta.role is not None else choice.delta.content or ""
    return str(choice.text)


def _sdk_stream_text(sdk: openai.OpenAI, endpoint: str) -> tuple[str, str | None, int]:
    """Text, finish reason and number of token chunks of one streamed request."""
    extra = {"ignore_eos": True}
    if endpoint == "chat":
        chunks: Any = sdk.chat.completions.create(
            model="default", messages=CHAT, max_tokens=NUM_TOKENS, stream=True, extra_body=extra
        )
    else:
        chunks = sdk.completions.create(
            model="default", prompt="once", max_tokens=NUM_TOKENS, stream=True, extra_body=extra
        )
    parts, finish = [], None
    for chunk in chunks:
        piece = token_piece(chunk, endpoint)
        if piece is not None:
            parts.append(piece)
        finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish, len(parts)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_sync_sdk_stream_outlives_keepalives_and_a_stall(fleet: Fleet, endpoint: str) -> None:
    read = ReadBytes()
    http = httpx2.Client(transport=SdkRecordingTransport(read), timeout=120)
    sdk = openai.OpenAI(base_url=fleet.base_url, api_key="unused", max_retries=0, http_client=http)
    with Staller(read, fleet.worker, keepalives=5):
        text, finish, count = _sdk_stream_text(sdk, endpoint)
    http.close()
    assert finish == "length"
    assert read.keepalives_after_an_id() >= 5
    _assert_matches_record(fleet, read, text, count)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_async_sdk_stream_outlives_keepalives_and_a_stall(fleet: Fleet, endpoint: str) -> None:
    read = ReadBytes()

    async def run() -> tuple[str, str | None, int]:
        http = httpx2.AsyncClient(transport=SdkAsyncRecordingTransport(read), timeout=120)
        sdk = openai.AsyncOpenAI(
            base_url=fleet.base_url, api_key="unused", max_retries=0, http_client=http
        )
        extra = {"ignore_eos": True}
        if endpoint == "chat":
            chunks: Any = await sdk.chat.completions.create(
                model="default",
                messages=CHAT,
                max_tokens=NUM_TOKENS,
                stream=True,
                extra_body=extra,
            )
        else:
            chunks = await sdk.completions.create(
                model="default", prompt="once", max_tokens=NUM_TOKENS, stream=True, extra_body=extra
            )
        parts, finish = [], None
        async for chunk in chunks:
            piece = token_piece(chunk, endpoint)
            if piece is not None:
                parts.append(piece)
            finish = chunk.choices[0].finish_reason or finish
        await http.aclose()
        return "".join(parts), finish, len(parts)

    with Staller(read, fleet.worker, keepalives=5):
        text, finish, count = asyncio.run(run())
    assert finish == "length"
    assert read.keepalives_after_an_id() >= 5
    _assert_matches_record(fleet, read, text, count)


def _assert_matches_record(fleet: Fleet, read: ReadBytes, text: str, count: int) -> None:
    """Every token reached the SDK once: as many token chunks as tokens, the record's text."""
    (wire,) = read.bodies()
    rid = next(
        json.loads(line[6:])["id"] for line in wire.split(b"\r\n") if line.startswith(b"data: {")
    )
    final = wait_for(lambda: (rec := record(fleet, rid))["status"] == "done" and rec, "the end")
    assert count == final["num_tokens"] == NUM_TOKENS
    assert text == final["text"]


def test_sixteen_concurrent_sdk_streams_longer_than_the_keepalive(fleet: Fleet) -> None:
    """The load that broke every stream: 16 streams at once through AsyncOpenAI, each running
    for many keep-alive intervals while the worker batches them. Zero errors."""
    read = ReadBytes()
    n, max_tokens = 16, 120

    async def one(sdk: openai.AsyncOpenAI, i: int) -> tuple[int, str | None]:
        chunks: Any = await sdk.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": f"story number {i}"}],
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        count, finish = 0, None
        async for chunk in chunks:
            count += token_piece(chunk, "chat") is not None
            finish = chunk.choices[0].finish_reason or finish
        return count, finish

    async def run() -> list[Any]:
        limits = httpx2.Limits(max_connections=n)
        transport = SdkAsyncRecordingTransport(read, limits=limits)
        async with httpx2.AsyncClient(transport=transport, timeout=300) as http:
            sdk = openai.AsyncOpenAI(
                base_url=fleet.base_url, api_key="unused", max_retries=0, http_client=http
            )
            return await asyncio.gather(*(one(sdk, i) for i in range(n)), return_exceptions=True)

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == []
    assert results == [(max_tokens, "length")] * n
    bodies = read.bodies()
    assert len(bodies) == n
    assert all(keepalives_after_first_id(body) >= 1 for body in bodies)  # each crossed one


def test_httpx_sse_reads_events_across_keepalives_and_a_reconnect(fleet: Fleet) -> None:
    """An SSE client library on ``/v1/requests/{id}/events``: every event it yields has data
    (none dispatched by a keep-alive), and a reconnect with ``Last-Event-ID`` continues at the
    next index, gap-free and duplicate-free."""
    rid = submitted_in_background(fleet, "an sse library")
    url = f"{fleet.base_url}/requests/{rid}/events"
    read = ReadBytes()
    tokens: list[tuple[int, str]] = []
    with (
        httpx.Client(transport=RecordingTransport(read), timeout=120) as http,
        Staller(read, fleet.worker, keepalives=5) as staller,
    ):
        with connect_sse(http, "GET", url) as source:
            for sse in source.iter_sse():
                assert sse.data, "an event with no data: a keep-alive was dispatched"
                if sse.data == "[DONE]":
                    break
                choice = json.loads(sse.data)["choices"][0]
                if choice["finish_reason"] is None:
                    tokens.append((int(sse.id), choice["text"]))
                if read.keepalives_after_an_id() >= 5 and len(tokens) >= 3:
                    break  # leave mid-stream after the stall: the connection is closed
        staller.join()
        headers = {"Last-Event-ID": str(tokens[-1][0])}
        datas = []
        with connect_sse(http, "GET", url, headers=headers) as source:
            for sse in source.iter_sse():
                assert sse.data, "an event with no data: a keep-alive was dispatched"
                datas.append(sse.data)
                if sse.data != "[DONE]":
                    choice = json.loads(sse.data)["choices"][0]
                    if choice["finish_reason"] is None:
                        tokens.append((int(sse.id), choice["text"]))
    assert datas[-1] == "[DONE]"
    assert [i for i, _ in tokens] == list(range(NUM_TOKENS))
    assert "".join(t for _, t in tokens) == record(fleet, rid)["text"]


PAGE = """<!doctype html><html><body><script>
window.seen = {tokens: [], opens: 0, errors: 0, bad: [], done: false};
const es = new EventSource("/v1/requests/RID/events");
es.onopen = () => { window.seen.opens += 1; };
es.onerror = () => { window.seen.errors += 1; };
es.onmessage = (e) => {
  if (e.data === "[DONE]") { window.seen.done = true; es.close(); return; }
  let chunk;
  try { chunk = JSON.parse(e.data); } catch (err) { window.seen.bad.push(e.data); return; }
  const choice = chunk.choices[0];
  if (choice.finish_reason === null) {
    window.seen.tokens.push([Number(e.lastEventId), choice.text]);
  }
};
</script></body></html>"""


def test_browser_eventsource_across_keepalives_and_a_gateway_restart(fleet: Fleet) -> None:
    """A browser's own EventSource (headless Chromium) follows a request while the worker
    stalls (keep-alives only) and while the gateway is SIGKILLed and started again on the same
    port: the browser reconnects by itself with ``Last-Event-ID`` and the tokens it shows are
    every index once, in order. Runs last in the module: it replaces the module's gateway."""
    # long enough that an idle machine cannot finish it between the browser's 3rd token and
    # the SIGSTOP (with 300 tokens it once did: the stall and the restart then tested nothing)
    rid = submitted_in_background(fleet, "a browser follows", max_tokens=BROWSER_TOKENS)
    origin = fleet.gateway.url
    with headless_chromium() as browser:
        page = browser.new_page()
        page.route(  # the test page is served as if from the gateway's origin (same-origin SSE)
            f"{origin}/test-page.html",
            lambda route: route.fulfill(body=PAGE.replace("RID", rid), content_type="text/html"),
        )
        page.goto(f"{origin}/test-page.html")
        page.wait_for_function("window.seen.tokens.length >= 3", timeout=60_000)
        fleet.worker.signal(signal.SIGSTOP)  # the stream now carries keep-alives only
        try:
            page.wait_for_timeout(1_000)  # ten keep-alive intervals in the browser
            assert not page.evaluate("window.seen.done"), "the request ended before the stall"
            fleet.gateway.signal(signal.SIGKILL)
            fleet.gateway.wait(10)
            fleet.gateway.close()
            fleet.gateway = Gateway(
                fleet.redis_url,
                fleet.prefix,
                fleet.log_dir,
                "--keepalive-s",
                KEEPALIVE_S,
                name="gateway-restarted",
                port=fleet.gateway.port,
            ).wait_ready()
        finally:
            fleet.worker.signal(signal.SIGCONT)
        page.wait_for_function("window.seen.done", timeout=120_000)
        seen = page.evaluate("window.seen")
    assert seen["bad"] == []
    assert seen["opens"] == 2  # the first connection and the browser's own reconnect
    assert [i for i, _ in seen["tokens"]] == list(range(BROWSER_TOKENS))
    assert "".join(t for _, t in seen["tokens"]) == record(fleet, rid)["text"]
