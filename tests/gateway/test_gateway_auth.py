"""API keys at the gateway, as a client meets them: 401 for a missing, unknown or revoked key;
429 with Retry-After and ``x-ratelimit-*`` headers past a key's RPM; 403 above its priority
ceiling; and one key never sees, resumes or cancels another key's request (404), file or
batch."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from batch_http_helpers import chat_line, jsonl
from gateway_helpers import Fleet, module_fleet, wait_for

from tokenfleet.producer.gateway.auth import ApiKeyAdmin
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer

pytestmark = pytest.mark.slow

BODY = {"model": "default", "prompt": "hello", "max_tokens": 3}


@pytest.fixture(scope="module")
def keyed(
    redis_server: RedisServer,
    plain_redis: redis.Redis,
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("gateway-auth-logs")
    yield from module_fleet(
        redis_server,
        plain_redis,
        tiny_llama_dir,
        log_dir,
        gateway_args=("--auth", "required"),
        threaded=True,  # no test signals the worker
    )


def admin(fleet: Fleet) -> ApiKeyAdmin:
    settings = Settings(redis_url=fleet.redis_url, key_prefix=fleet.prefix)
    return ApiKeyAdmin(fleet.r, settings)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_missing_garbage_and_revoked_keys_are_401(keyed: Fleet) -> None:
    url = keyed.base_url + "/completions"
    for headers in ({}, bearer("nonsense"), bearer("tf-aaaaaaaaaa-wrong"), {"Authorization": "x"}):
        resp = httpx.post(url, json=BODY, headers=headers, timeout=30)
        assert resp.status_code == 401, headers
        assert resp.json()["error"]["code"] == "invalid_api_key"
    secret, key = admin(keyed).create("soon-revoked")
    assert httpx.post(url, json=BODY, headers=bearer(secret), timeout=60).status_code == 200
    admin(keyed).revoke(key.key_id)
    wait_for(  # each gateway re-reads a key within its cache bound (2 s)
        lambda: httpx.post(url, json=BODY, headers=bearer(secret), timeout=60).status_code == 401,
        "the revoked key to be refused",
        timeout_s=30,
    )
    sdk = openai.OpenAI(base_url=keyed.base_url, api_key=secret, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        sdk.models.list()


def test_rpm_limit_is_429_with_retry_after_and_headers(keyed: Fleet) -> None:
    secret, _ = admin(keyed).create("three-a-minute", rpm=3)
    url = keyed.base_url + "/completions"
    answers = [httpx.post(url, json=BODY, headers=bearer(secret), timeout=60) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
    assert answers[0].headers["x-ratelimit-remaining-requests"] == "2"
    refused = answers[3]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 20  # one request refills in 20 s
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


def test_a_request_over_the_tpm_itself_is_400(keyed: Fleet) -> None:
    secret, _ = admin(keyed).create("small-tpm", tpm=50)
    resp = httpx.post(
        keyed.base_url + "/completions",
        json={**BODY, "max_tokens": 500},
        headers=bearer(secret),
        timeout=30,
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "request_too_large"


def test_priority_ceiling(keyed: Fleet) -> None:
    secret, _ = admin(keyed).create("batchy", priority_ceiling="batch")
    url = keyed.base_url + "/completions"
    resp = httpx.post(url, json={**BODY, "priority": "critical"}, headers=bearer(secret))
    assert resp.status_code == 403
    assert resp.json()["error"]["code"] == "priority_above_ceiling"
    resp = httpx.post(url, json=BODY, headers=bearer(secret), timeout=60)  # defaults to batch
    assert resp.status_code == 200
    rid = resp.headers["x-request-id"]
    record = httpx.get(f"{keyed.base_url}/requests/{rid}", headers=bearer(secret), timeout=10)
    assert record.json()["priority"] == "batch"


def test_keys_are_isolated_from_each_other(keyed: Fleet) -> None:
    alice, alice_key = admin(keyed).create("alice")
    bob, _ = admin(keyed).create("bob")
    body = {**BODY, "max_tokens": 300, "ignore_eos": True, "stream": True}
    headers = {**bearer(alice), "X-On-Disconnect": "continue", "Idempotency-Key": "shared-key"}
    with httpx.stream(
        "POST", keyed.base_url + "/completions", json=body, headers=headers, timeout=60
    ) as resp:
        rid = resp.headers["x-request-id"]
    assert rid.startswith(alice_key.key_id + ".")
    for method, path in [
        ("GET", f"/requests/{rid}"),
        ("GET", f"/requests/{rid}/events"),
        ("POST", f"/requests/{rid}/cancel"),
    ]:
        resp = httpx.request(method, keyed.base_url + path, headers=bearer(bob), timeout=10)
        assert resp.status_code == 404, path
    # bob's own request under the same Idempotency-Key is another request
    mine = httpx.post(
        keyed.base_url + "/completions",
        json={**BODY, "prompt": "bob's"},
        headers={**bearer(bob), "Idempotency-Key": "shared-key"},
        timeout=60,
    )
    assert mine.status_code == 200
    assert mine.headers["x-request-id"] != rid
    final = wait_for(
        lambda: (
            (
                rec := httpx.get(
                    f"{keyed.base_url}/requests/{rid}", headers=bearer(alice), timeout=10
                ).json()
            )["status"]
            == "done"
            and rec
        ),
        "alice's request to finish untouched",
    )
    assert final["num_tokens"] == 300


def test_files_and_batches_belong_to_their_key_and_list_in_pages(keyed: Fleet) -> None:
    """Through the openai SDK: bob sees none of alice's files or batches (404 on every route,
    absent from his list); alice pages through her own batches with ``after``."""
    alice, _ = admin(keyed).create("alice-batches")
    bob, _ = admin(keyed).create("bob-batches")
    sdk_a = openai.OpenAI(base_url=keyed.base_url, api_key=alice, max_retries=0)
    sdk_b = openai.OpenAI(base_url=keyed.base_url, api_key=bob, max_retries=0)
    upload = sdk_a.files.create(
        file=("in.jsonl", io.BytesIO(jsonl([chat_line(i, max_tokens=2) for i in range(2)]))),
        purpose="batch",
    )
    made = [
        sdk_a.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    for call in (
        lambda: sdk_b.files.retrieve(upload.id),
        lambda: sdk_b.files.content(upload.id),
        lambda: sdk_b.files.delete(upload.id),
        lambda: sdk_b.batches.retrieve(made[0]),
        lambda: sdk_b.batches.cancel(made[0]),
        lambda: sdk_b.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert not set(made) & {b.id for b in sdk_b.batches.list(limit=100)}
    first = sdk_a.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    rest = sdk_a.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in rest.data] == made[:1] and not rest.has_more
    paged = [b.id for b in sdk_a.batches.list(limit=2)]  # the SDK follows ``after`` itself
    assert paged == made[::-1]
    for bid in made:
        sdk_a.batches.cancel(bid)
