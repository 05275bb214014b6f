"""Structured-output constraints and logprobs on the wire: shapes, limits, round trips."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import BaseModel

from tokenfleet.producer.core.request import prepare
from tokenfleet.shared.errors import InvalidRequest, ProtocolError
from tokenfleet.shared.schema import (
    MAX_CONSTRAINT_BYTES,
    Constraint,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    decode_event,
)
from tokenfleet.shared.settings import Settings


class Person(BaseModel):
    name: str
    age: int


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("xml", None, "kind must be one of"),
        ("json_schema", [1], "must be a JSON object"),
        ("json_schema", "{", "not valid JSON"),
        ("json_object", {"type": "object"}, "takes no spec"),
        ("choice", "a", "must be a list of strings"),
        ("choice", [], "is empty"),
        ("choice", ["a", 3], r"choice\[1\] must be a string"),
        ("regex", "", "is empty"),
        ("grammar", 5, "must be a string"),
        ("json_schema", {"x": "y" * MAX_CONSTRAINT_BYTES}, "the limit is 65536"),
    ],
)
def test_malformed_constraints_name_their_field(kind: str, spec: Any, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        Constraint(kind, spec)
    assert (info.value.param or "").startswith("structured")


def test_sampling_round_trips_constraints_and_logprobs_and_omits_them_when_unset() -> None:
    plain = SamplingParams()
    assert set(plain.to_dict()) >= {"max_tokens"} and "structured" not in plain.to_dict()
    assert "logprobs" not in plain.to_dict()
    for c in (
        Constraint("json_schema", {"type": "object"}, "thing"),
        Constraint("json_object"),
        Constraint("regex", "[0-9]+"),
        Constraint("choice", ["a", "b"]),
        Constraint("grammar", 'start: "x"'),
    ):
        s = SamplingParams(structured=c, logprobs=True, top_logprobs=5)
        again = SamplingParams.from_dict(orjson.loads(orjson.dumps(s.to_dict())))
        assert again == s and again.structured == c


def test_a_request_with_a_schema_decodes_on_the_worker_side() -> None:
    p = prepare(Settings(), now=1.0, prompt="x", response_format=Person, logprobs=True)
    req = GenerationRequest.decode(p.payload, 1 << 20)
    assert req.sampling.structured is not None
    assert req.sampling.structured.name == "Person"
    assert req.sampling.structured.spec["required"] == ["name", "age"]
    assert req.sampling.logprobs and req.sampling.top_logprobs == 0


def test_a_malformed_constraint_on_the_stream_is_a_protocol_error() -> None:
    p = prepare(Settings(), now=1.0, prompt="x", regex="[0-9]")
    bad = p.payload.replace(b'"type":"regex"', b'"type":"nope"')
    with pytest.raises(ProtocolError, match="kind must be one of") as info:
        GenerationRequest.decode(bad, 1 << 20)
    assert info.value.request_id == p.request_id


LOGPROBS: dict[str, Any] = {
    "token": "Hi",
    "logprob": -0.25,
    "bytes": [72, 105],
    "top_logprobs": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105]}],
}


def test_token_events_carry_logprobs_only_when_set() -> None:
    assert "logprobs" not in TokenEvent("r", 0, 5, "x").to_dict()
    event = TokenEvent("r", 0, 5, "Hi", LOGPROBS)
    assert decode_event(event.encode()) == event
    for bad in (
        {**LOGPROBS, "logprob": "x"},
        {**LOGPROBS, "top_logprobs": [{"token": 1}]},
        {**LOGPROBS, "top_logprobs": [LOGPROBS["top_logprobs"][0]] * 21},
        [1],
    ):
        raw = orjson.dumps({**event.to_dict(), "logprobs": bad})
        with pytest.raises(ProtocolError, match="malformed logprobs"):
            decode_event(raw)
