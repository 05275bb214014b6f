"""Bad input and rough clients: each gets a clear OpenAI-shaped error, the gateway survives,
and nothing is enqueued for a refused request."""

from __future__ import annotations

import socket

import httpx
import pytest
from gateway_helpers import Fleet, wait_for

pytestmark = pytest.mark.slow


def request_keys(fleet: Fleet) -> set[bytes]:
    return set(fleet.r.scan_iter(match=f"{fleet.prefix}:req:*", count=1000))


def queue_lengths(fleet: Fleet) -> int:
    return sum(
        int(fleet.r.xlen(k)) for k in fleet.r.scan_iter(match=f"{fleet.prefix}:q:*", count=100)
    )


@pytest.fixture
def nothing_enqueued(fleet: Fleet):
    before = (request_keys(fleet), queue_lengths(fleet))
    yield
    assert (request_keys(fleet), queue_lengths(fleet)) == before


def post(fleet: Fleet, path: str, content: bytes, **headers: str) -> httpx.Response:
    headers.setdefault("content-type", "application/json")
    return httpx.post(fleet.base_url + path, content=content, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("content", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b"", 400, "invalid_json", None),
        (b"[1, 2]", 400, "invalid_type", None),
        (b'{"model": "default"}', 400, "invalid_type", "messages"),
        (b'{"model": "default", "messages": "hi"}', 400, "invalid_type", "messages"),
        (b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', 400, None, "model"),
        (
            b'{"model": "default", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": "5"}',
            400,
            "invalid_type",
            "max_tokens",
        ),
        (
            b'{"model": "default", "messages": [{"role": "user", "content": "x"}], '
            b'"temperature": -1}',
            400,
            "invalid_request",
            None,
        ),
        (  # a tool result must say which call it answers
            b'{"model": "default", "messages": [{"role": "tool", "content": "x"}]}',
            400,
            None,
            "messages[0].tool_call_id",
        ),
        (
            b'{"model": "default", "messages": [{"role": "robot", "content": "x"}]}',
            400,
            None,
            "messages[0].role",
        ),
        (
            b'{"model": "default", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": 99999999}',
            400,
            "invalid_request",
            None,
        ),
    ],
)
def test_bad_bodies_are_400_naming_the_field(
    fleet: Fleet, nothing_enqueued: None, content: bytes, status: int, code: str, param: str
) -> None:
    resp = post(fleet, "/chat/completions", content)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


def test_oversized_bodies_are_413_before_parsing(fleet: Fleet, nothing_enqueued: None) -> None:
    big = b'{"model": "default", "prompt": "' + b"a" * 3_000_000 + b'"}'
    resp = post(fleet, "/completions", big)
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "body_too_large"

    def chunks():
        for _ in range(40):
            yield b"a" * 100_000

    resp = httpx.post(
        fleet.base_url + "/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 413


def test_a_lying_content_length_does_not_hang_the_gateway(fleet: Fleet) -> None:
    host, port = "127.0.0.1", fleet.gateway.port
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model"'
        )
        s.shutdown(socket.SHUT_WR)  # the client leaves with 92 bytes unsent
        s.recv(100)
    assert httpx.get(fleet.gateway.url + "/health", timeout=10).status_code == 200


def test_a_slow_reader_does_not_stall_others(fleet: Fleet) -> None:
    body = {"model": "default", "prompt": "slow", "max_tokens": 300, "ignore_eos": True}
    with httpx.stream(
        "POST",
        fleet.base_url + "/completions",
        json={**body, "stream": True},
        headers={"X-On-Disconnect": "continue"},
        timeout=60,
    ) as slow:
        rid = slow.headers["x-request-id"]
        lines = slow.iter_lines()
        next(lines)
        # while that client reads nothing, another request is served in full
        other = httpx.post(fleet.base_url + "/completions", json={**body, "max_tokens": 20})
        assert other.status_code == 200
        assert other.json()["usage"]["completion_tokens"] == 20
        # and the unread request itself runs to its end in the fleet: the reader holds up
        # nothing but its own connection
        wait_for(
            lambda: (
                httpx.get(f"{fleet.base_url}/requests/{rid}", timeout=10).json()["status"] == "done"
            ),
            "the unread request to finish",
        )
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert sum(1 for line in rest if '"text"' in line) >= 299  # every token, read late
    assert httpx.get(fleet.gateway.url + "/health", timeout=10).status_code == 200


def test_unknown_route_and_method_are_openai_shaped(fleet: Fleet) -> None:
    resp = httpx.get(fleet.base_url + "/embeddings", timeout=10)
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "not_found_error"
    resp = httpx.get(fleet.base_url + "/completions", timeout=10)
    assert resp.status_code == 405
    assert resp.json()["error"]["code"] == "method_not_allowed"


def test_metrics_count_answers_and_streams(fleet: Fleet) -> None:
    httpx.get(fleet.base_url + "/requests/nope", timeout=10)
    text = httpx.get(fleet.gateway.url + "/metrics", timeout=10).text
    assert 'tokenfleet_gateway_requests_total{code="404",route="/v1/requests/{request_id}"}' in text
    assert "tokenfleet_gateway_sse_streams_open" in text
    assert "tokenfleet_gateway_resumes_total" in text
