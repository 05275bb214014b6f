"""Bad input is refused before anything touches Redis, with a message naming the fault."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from tokenfleet.producer import Client, InvalidRequest
from tokenfleet.shared.settings import Settings

CASES: list[tuple[dict[str, Any], str]] = [
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": []}, "prompt_token_ids is empty"),
    ({"prompt": None}, "exactly one of prompt"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "exactly one"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens must be a positive integer"),
    ({"prompt": "x", "max_tokens": 40_000}, "above the limit of 32768"),
    ({"prompt": "x", "temperature": -0.1}, "temperature must be >= 0"),
    ({"prompt": "x", "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"prompt": "x", "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"prompt": "x", "priority": "urgent"}, "unknown priority 'urgent'"),
    ({"prompt": "x" * 1_100_000}, "the limit is 1048576 bytes"),
    ({"prompt": b"caf\xe9"}, "prompt is not valid UTF-8"),
    ({"prompt": "lone \udc80"}, "prompt is not valid UTF-8"),
    ({"prompt": "x", "request_id": "bad id!"}, "request id 'bad id!'"),
    ({"prompt": "x", "deadline_s": 0}, "deadline_s must be a positive number"),
    ({"prompt": "x", "model": "../etc"}, "model name"),
    ({"prompt": [1, -2]}, "prompt_token_ids must be integers"),
    # structured outputs (docs/structured-outputs.md): each names its argument
    ({"prompt": "x", "regex": "a(b"}, "(?s)regex cannot be used: .*unclosed group"),
    ({"prompt": "x", "choice": []}, "choice is empty"),
    ({"prompt": "x", "choice": ["a", ""]}, r"choice\[1\] must be 1-4096 characters"),
    ({"prompt": "x", "grammar": "start: foo"}, "(?s)grammar cannot be used: .*unknown name"),
    ({"prompt": "x", "grammar": "root ::= ("}, "grammar"),
    ({"prompt": "x", "json_schema": {"type": "foo"}}, "json_schema cannot be used: .*foo"),
    ({"prompt": "x", "json_schema": {"required": "name"}}, "json_schema cannot be used"),
    (
        {"prompt": "x", "json_schema": {"type": "array", "uniqueItems": True}},
        r"unsupported JSON Schema keyword\(s\) \[\"uniqueItems\"\]",
    ),
    ({"prompt": "x", "json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"prompt": "x", "json_schema": 3}, "json_schema must be a JSON schema"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format must be"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format must be"),
    ({"prompt": "x", "regex": "a", "choice": ["a"]}, "give at most one of"),
    ({"prompt": "x", "logprobs": True, "top_logprobs": 21}, r"top_logprobs must be .*\[0, 20\]"),
    ({"prompt": "x", "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"prompt": "x", "logprobs": 1}, "logprobs must be a bool"),
]


@pytest.fixture
def offline_client() -> Client:
    """A client whose Redis does not exist: any Redis access would raise ConnectionError."""
    settings = Settings(redis_url="unix:///nonexistent/tokenfleet.sock", key_prefix="tft")
    return Client.from_url(settings=settings, subscribe_timeout_s=0.5)


@pytest.mark.parametrize(("params", "message"), CASES)
def test_invalid_input_is_refused_before_redis(
    offline_client: Client, params: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        offline_client.submit(**params)
    structured = {"regex", "choice", "grammar", "json_schema", "response_format", "top_logprobs"}
    named = structured & set(params)
    if named:  # the argument is named for the gateway's 400 too
        assert info.value.param in named
    with pytest.raises(InvalidRequest, match=message):
        offline_client.try_submit(**params)


def test_submit_many_validates_everything_first(client: Client, r: redis.Redis) -> None:
    with pytest.raises(InvalidRequest, match=r"requests\[1\]: temperature must be >= 0"):
        client.submit_many(["fine", {"prompt": "x", "temperature": -1}])
    with pytest.raises(InvalidRequest, match=r"requests\[0\]: unknown request field"):
        client.submit_many([{"prompt": "x", "colour": "blue"}])
    assert r.dbsize() == 0  # the valid first request was not enqueued either


def test_refused_input_leaves_no_trace(client: Client, r: redis.Redis) -> None:
    with pytest.raises(InvalidRequest):
        client.submit("x", top_p=2.0)
    assert r.dbsize() == 0
    assert client._subscriber.num_channels == 0
