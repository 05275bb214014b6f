"""The OpenAI endpoints as a user meets them: the official ``openai`` SDK against a real
``tokenfleet serve`` process, a real worker and Redis."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from gateway_helpers import Fleet

from tokenfleet.producer import Client
from tokenfleet.shared.settings import Settings

pytestmark = pytest.mark.slow

CHAT: Any = [{"role": "user", "content": "Say something about Redis."}]


@pytest.fixture(scope="module")
def sdk(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.base_url, api_key="unused", max_retries=0)


def chat_text(sdk: openai.OpenAI, **kw: Any) -> tuple[str, str | None]:
    r = sdk.chat.completions.create(model="default", messages=CHAT, **kw)
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def test_models_lists_what_live_workers_serve(sdk: openai.OpenAI) -> None:
    assert [m.id for m in sdk.models.list()] == ["default"]


def test_models_name_their_workers_and_queue_depths(sdk: openai.OpenAI, fleet: Fleet) -> None:
    """Each model's ``tokenfleet`` extension: its live workers, whether it is declared, and per
    priority its waiting and running requests, routed streams included. Beside the real worker's
    "default", "side" is served by "ghost" (a live heartbeat and routing target, no process), so
    what is submitted for it stays waiting: one request in its shared stream, one routed."""
    r, keys, now = fleet.r, fleet.keys, time.time()
    r.hset(keys.worker("ghost"), mapping={"model": "side", "beat_at": now, "started_at": now})
    r.zadd(keys.workers, {"ghost": now})
    r.zadd(keys.served, {"side": now + 600})
    r.zadd(keys.routers("side"), {"ghost": now + 600})
    r.hset(keys.route_load("side"), "ghost", "0 8")
    r.sadd(keys.declared, "side")
    settings = Settings(redis_url=fleet.redis_url, key_prefix=fleet.prefix)
    client = Client.from_url(settings=settings)
    rids = []
    try:
        for meta in ({"session": "side-s"}, {}):
            kw: Any = {"model": "side", "max_tokens": 2, "priority": "batch", "metadata": meta}
            rids.append(client.submit(messages=CHAT, **kw).request_id)
        assert [client.status(rid).routed_to for rid in rids] == ["ghost", ""]
        listed = {m.id: m for m in sdk.models.list()}
        assert sorted(listed) == ["default", "side"]
        side = listed["side"].to_dict()
        assert (side["object"], side["owned_by"]) == ("model", "tokenfleet")
        idle = {"waiting": 0, "running": 0}
        assert side["tokenfleet"] == {
            "workers": ["ghost"],
            "declared": True,
            "queues": {"critical": idle, "normal": idle, "batch": {"waiting": 2, "running": 0}},
            "tenants": {},
        }
        # a tenant's request: the default tenant's waiting one moves to its tenant queue, the
        # tenants' figures appear (docs/fairness.md), and the queue still counts all three
        kw = {"model": "side", "max_tokens": 2, "priority": "batch", "tenant": "acme"}
        rids.append(client.submit(messages=CHAT, **kw).request_id)
        ext: Any = {m.id: m for m in sdk.models.list()}["side"].to_dict()["tokenfleet"]
        assert ext["queues"]["batch"] == {"waiting": 3, "running": 0}
        assert ext["tenants"] == {
            "acme": {"waiting": 0, "running": 0, "served_tokens": 0},  # admitted (a tie: A first)
            "default": {"waiting": 1, "running": 0, "served_tokens": 0},
        }
        extra = listed["default"].model_extra
        assert extra is not None
        default = extra["tokenfleet"]
        assert default["workers"] == [fleet.worker.name] and default["declared"] is False
        assert set(default["queues"]) == {"critical", "normal", "batch"}
    finally:
        for rid in rids:
            client.cancel(rid)
        client.close()
        r.delete(keys.worker("ghost"), keys.routers("side"), keys.route_load("side"))
        r.zrem(keys.workers, "ghost")
        r.zrem(keys.served, "side")
        r.srem(keys.declared, "side")
    assert [m.id for m in sdk.models.list()] == ["default"]


def test_chat_non_stream_usage_and_length(sdk: openai.OpenAI) -> None:
    r = sdk.chat.completions.create(
        model="default", messages=CHAT, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion"
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"
    assert r.usage is not None
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_equals_non_stream_greedy(sdk: openai.OpenAI, endpoint: str) -> None:
    kw: dict[str, Any] = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    if endpoint == "chat":
        whole = sdk.chat.completions.create(model="default", messages=CHAT, **kw)
        expected = whole.choices[0].message.content
        stream = sdk.chat.completions.create(
            model="default",
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
        parts, usage, finish, ids = [], None, None, set()
        for chunk in stream:
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                finish = c.finish_reason or finish
    else:
        whole_c = sdk.completions.create(model="default", prompt="Redis is", **kw)
        expected = whole_c.choices[0].text
        stream_c = sdk.completions.create(
            model="default",
            prompt="Redis is",
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
        parts, usage, finish, ids = [], None, None, set()
        for chunk_c in stream_c:
            ids.add(chunk_c.id)
            if chunk_c.usage is not None:
                usage = chunk_c.usage
            for cc in chunk_c.choices:
                parts.append(cc.text)
                finish = cc.finish_reason or finish
    assert "".join(parts) == expected
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12
    assert len(ids) == 1  # every chunk names the one request


def test_stop_string_ends_the_text(sdk: openai.OpenAI) -> None:
    base, _ = chat_text(sdk, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    stop = next(
        (base[i : i + 2] for i in range(3, len(base) - 2) if base[i : i + 2].isalnum()), None
    )
    if stop is None:
        pytest.skip(f"the tiny model's greedy text has no usable stop string: {base!r}")
    text, finish = chat_text(
        sdk, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert finish == "stop"
    assert text == base[: base.index(stop)]


def test_seed_makes_sampling_repeatable(sdk: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"max_tokens": 16, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    first = [chat_text(sdk, seed=s, **kw)[0] for s in (1, 2, 3)]
    again = [chat_text(sdk, seed=s, **kw)[0] for s in (1, 2, 3)]
    assert first == again
    assert len(set(first)) > 1  # the seeds are used, not ignored


def test_request_id_header_record_and_priority(fleet: Fleet) -> None:
    body = {"model": "default", "prompt": "hi", "max_tokens": 3, "priority": "critical"}
    resp = httpx.post(fleet.base_url + "/completions", json=body, timeout=60)
    assert resp.status_code == 200
    rid = resp.headers["x-request-id"]
    assert resp.json()["id"] == rid and rid.startswith("cmpl-")
    record = httpx.get(f"{fleet.base_url}/requests/{rid}", timeout=10).json()
    assert record["status"] == "done"
    assert record["priority"] == "critical"
    assert record["text"] == resp.json()["choices"][0]["text"]
    body.pop("priority")
    resp = httpx.post(
        fleet.base_url + "/completions", json=body, headers={"X-Priority": "batch"}, timeout=60
    )
    rid = resp.headers["x-request-id"]
    assert httpx.get(f"{fleet.base_url}/requests/{rid}", timeout=10).json()["priority"] == "batch"


def test_idempotency_key(fleet: Fleet) -> None:
    body = {"model": "default", "prompt": "same", "max_tokens": 5, "temperature": 0}
    headers = {"Idempotency-Key": "order-42/retry"}  # not id-safe: hashed into the id
    a = httpx.post(fleet.base_url + "/completions", json=body, headers=headers, timeout=60)
    b = httpx.post(fleet.base_url + "/completions", json=body, headers=headers, timeout=60)
    assert a.status_code == b.status_code == 200
    assert a.json()["id"] == b.json()["id"]
    assert a.json()["choices"] == b.json()["choices"]
    other = httpx.post(
        fleet.base_url + "/completions", json={**body, "prompt": "else"}, headers=headers
    )
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "idempotency_conflict"


def test_unknown_model_is_404(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(model="no-such-model", messages=CHAT)
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"n": 99}, "n"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"extra_body": {"bogus": 1}}, "bogus"),
    ],
)
def test_unsupported_parameters_are_named(sdk: openai.OpenAI, kw: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="default", messages=CHAT, **kw)
    assert info.value.param == param


def test_cancel_endpoint_ends_a_stream_with_an_error_chunk(fleet: Fleet) -> None:
    body = {
        "model": "default",
        "prompt": "long",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", fleet.base_url + "/completions", json=body, timeout=60) as resp:
        rid = resp.headers["x-request-id"]
        datas = []
        for line in resp.iter_lines():
            if line == "id: 2":  # once (tokens 20, 200, ... may stream before the cancel ends it)
                cancel = httpx.post(f"{fleet.base_url}/requests/{rid}/cancel", timeout=10)
                assert cancel.json()["cancelled"] is True
            if line.startswith("data: "):
                datas.append(line[6:])
    assert '"code":"cancelled"' in datas[-1]
    assert "[DONE]" not in datas
    record = httpx.get(f"{fleet.base_url}/requests/{rid}", timeout=10).json()
    assert record["status"] == "cancelled"
    assert record["num_tokens"] < 4000


def test_other_request_endpoints_404_for_unknown_ids(fleet: Fleet) -> None:
    for method, path in [
        ("GET", "/requests/nope"),
        ("POST", "/requests/nope/cancel"),
        ("GET", "/requests/nope/events"),
        ("GET", "/requests/bad%20id"),
    ]:
        resp = httpx.request(method, fleet.base_url + path, timeout=10)
        assert resp.status_code == 404, path
        assert resp.json()["error"]["code"] == "not_found"


def test_openapi_schema_documents_the_extensions(fleet: Fleet) -> None:
    schema = httpx.get(fleet.gateway.url + "/openapi.json", timeout=10).json()
    assert "/v1/requests/{request_id}/events" in schema["paths"]
    assert "X-Priority" in schema["info"]["description"]
    props = schema["components"]["schemas"]["ChatBody"]["properties"]
    assert {"priority", "deadline_s", "top_k"} <= set(props)


def test_a_declared_model_with_no_live_worker_is_503(fleet: Fleet) -> None:
    fleet.r.sadd(fleet.keys.declared, "ghost-model")
    try:
        resp = httpx.post(
            fleet.base_url + "/chat/completions",
            json={"model": "ghost-model", "messages": CHAT},
            timeout=30,
        )
    finally:
        fleet.r.srem(fleet.keys.declared, "ghost-model")
    assert resp.status_code == 503
    assert resp.json()["error"]["code"] == "model_unavailable"
    assert int(resp.headers["retry-after"]) >= 1
    assert not list(fleet.r.scan_iter(match=f"{fleet.prefix}:q:ghost-model:*"))
