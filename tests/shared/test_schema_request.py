"""Requests and sampling parameters: validation that names the fault, encode/decode round trips."""

from __future__ import annotations

from typing import Any

import pytest

from tokenfleet.shared.errors import InvalidRequest, ProtocolError
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import GenerationRequest, SamplingParams

LIMIT = 1 << 20


def make(**kw: Any) -> GenerationRequest:
    kw.setdefault("request_id", "r1")
    if not {"prompt", "prompt_token_ids", "messages"} & set(kw):
        kw["prompt"] = "hello"
    return GenerationRequest(**kw)


def test_request_round_trip_keeps_every_field() -> None:
    req = make(
        sampling=SamplingParams(
            max_tokens=7, temperature=0.5, top_p=0.9, top_k=4, seed=3, stop=("\n",), ignore_eos=True
        ),
        priority="critical",
        model="m/x",
        deadline=123.5,
        enqueued_at=100.0,
        metadata={"user": 1, "tags": ["a"]},
    )
    back = GenerationRequest.decode(req.encode(), LIMIT)
    assert back == req
    assert back.priority is Priority.CRITICAL
    assert back.sampling.stop == ("\n",)


def test_token_ids_and_messages_round_trip() -> None:
    ids = make(prompt_token_ids=[1, 2, 3])
    assert GenerationRequest.decode(ids.encode(), LIMIT).prompt_token_ids == (1, 2, 3)
    chat = make(messages=[{"role": "user", "content": "hi"}])
    assert GenerationRequest.decode(chat.encode(), LIMIT).messages == (
        {"role": "user", "content": "hi"},
    )


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of"),
        ({"prompt_token_ids": []}, "prompt_token_ids is empty"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids must be integers"),
        ({"prompt_token_ids": [1, 2**31]}, "prompt_token_ids must be integers"),
        ({"prompt_token_ids": [1, True]}, "prompt_token_ids must be integers"),
        ({"prompt_token_ids": [1, 2.0]}, "prompt_token_ids must be integers"),
        ({"prompt_token_ids": [1, "2"]}, "prompt_token_ids must be integers"),
        ({"prompt": "bad \udcff text"}, "not valid UTF-8"),
        ({"prompt": b"\xff\xfe"}, "not valid UTF-8"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, "messages have no content"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages\\[0\\]"),
        ({"priority": "urgent"}, "unknown priority"),
        ({"model": "bad model"}, "model name"),
        ({"request_id": "a b"}, "request id"),
        ({"deadline": float("nan")}, "deadline must be finite"),
        ({"metadata": {"x": "y" * 20_000}}, "metadata is .* bytes"),
        ({"metadata": {"x": object()}}, "not JSON-serialisable"),
    ],
)
def test_invalid_requests_name_the_fault(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        make(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"max_tokens": 1.5}, "max_tokens must be a positive integer"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("inf")}, "temperature must be finite"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"seed": -1}, "seed must be an integer"),
        ({"stop": [""]}, "stop strings must be"),
        ({"stop": ["x"] * 17}, "at most 16 stop strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_sampling_names_the_fault(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        SamplingParams(**kwargs)


def test_max_tokens_limit_and_payload_limit() -> None:
    with pytest.raises(InvalidRequest, match="max_tokens 100 is above the limit of 50"):
        SamplingParams(max_tokens=100).check_limit(50)
    req = make(prompt="x" * 1000)
    with pytest.raises(InvalidRequest, match="the limit is 500 bytes"):
        req.encode(max_bytes=500)


def test_decode_checks_size_before_parsing() -> None:
    with pytest.raises(ProtocolError, match="limit is 10"):
        GenerationRequest.decode(b"{" * 11, 10)


@pytest.mark.parametrize(
    ("payload", "fragment", "rid"),
    [
        (b"not json", "not valid JSON", None),
        (b"[1, 2]", "must be a JSON object", None),
        (b'{"v": 99, "id": "r9"}', "schema version 99", "r9"),
        (b'{"v": 1, "id": "r9", "prompt": "x", "evil": 1}', "unknown request field", "r9"),
        (b'{"v": 1, "id": "r9", "prompt": ""}', "prompt is empty", "r9"),
        (b'{"v": 1, "id": "r9", "prompt": "x", "sampling": {"top_p": 2}}', "top_p", "r9"),
        (b'{"v": 1, "id": "bad id", "prompt": "x"}', "request id", None),
    ],
)
def test_decode_errors_are_specific_and_carry_a_readable_id(
    payload: bytes, fragment: str, rid: str | None
) -> None:
    with pytest.raises(ProtocolError, match=fragment) as info:
        GenerationRequest.decode(payload, LIMIT)
    assert info.value.request_id == rid


def test_token_ids_accept_int_subclasses_but_not_bools() -> None:
    class TokenId(int):
        pass

    req = make(prompt_token_ids=[TokenId(5), 0, 2**31 - 1])
    assert req.prompt_token_ids == (5, 0, 2**31 - 1)
