"""Fast checks of the gateway's pure parts: ids and ownership, body parsing, settings, the
drain meter's arithmetic, error shapes. No processes, no Redis."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from tokenfleet.producer.gateway.drain import MAX_RETRY_AFTER_S, DrainMeter
from tokenfleet.producer.gateway.errors import ApiError
from tokenfleet.producer.gateway.identity import kind_of, make_request_id, owns
from tokenfleet.producer.gateway.openai_api import (
    ChatBody,
    CompletionBody,
    chat_submission,
    completion_submission,
)
from tokenfleet.producer.gateway.settings import GatewaySettings
from tokenfleet.producer.gateway.streams import parse_last_event_id
from tokenfleet.shared.errors import SettingsError
from tokenfleet.shared.keys import Keys, check_request_id
from tokenfleet.shared.priority import Priority


def chat(**fields: Any) -> ChatBody:
    """A chat body from plain JSON-like values (as the app receives them)."""
    return ChatBody.model_validate(fields)


def test_ids_are_valid_and_scoped_per_owner_and_kind() -> None:
    for owner in (None, "k1a2b3c4d5"):
        for kind in ("chat", "completion"):
            for idem in (None, "order-42", "order 42/ü", "x" * 300):
                rid = make_request_id(kind, owner, idem)
                check_request_id(rid)
                assert kind_of(rid) == kind
                assert owns(owner, rid)
    assert make_request_id("chat", "a1", "k") == make_request_id("chat", "a1", "k")
    assert make_request_id("chat", "a1", "k") != make_request_id("chat", "b2", "k")
    assert make_request_id("chat", None, "k") != make_request_id("completion", None, "k")
    assert make_request_id("chat", None) != make_request_id("chat", None)
    assert not owns("a1", make_request_id("chat", "b2"))
    assert not owns("a1", "chatcmpl-123")  # an id made without a key belongs to no key
    assert kind_of("0123abcd") == "completion"  # made by the Python client


def test_last_event_id() -> None:
    assert parse_last_event_id(None) == 0
    assert parse_last_event_id("7") == 8
    assert parse_last_event_id(" 0 ") == 1
    assert parse_last_event_id("-3") == 0
    assert parse_last_event_id("abc") == 0


def test_completion_body_to_submit_arguments() -> None:
    sub = completion_submission(
        CompletionBody(model="m", prompt=["one"], max_tokens=5, stop="x", seed=3, user="u", top_k=4)
    )
    assert sub.kind == "completion"
    assert sub.params == {
        "prompt": "one",
        "max_tokens": 5,
        "stop": "x",
        "seed": 3,
        "top_k": 4,
        "metadata": {"user": "u"},
    }
    assert completion_submission(CompletionBody(model="m", prompt="p")).params["max_tokens"] == 16
    ids = completion_submission(CompletionBody(model="m", prompt=[1, 2, 3]))
    assert ids.params["prompt"] == [1, 2, 3]
    with pytest.raises(ApiError) as info:
        completion_submission(CompletionBody(model="m", prompt=["a", "b"]))
    assert info.value.param == "prompt"


def test_chat_body_roles_parts_and_token_limits() -> None:
    body = chat(
        model="m",
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        max_completion_tokens=7,
    )
    sub = chat_submission(body, default_max_tokens=256)
    assert sub.params["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    assert sub.params["max_tokens"] == 7
    assert (
        chat_submission(chat(model="m", messages=[{"role": "user", "content": "x"}]), 99).params[
            "max_tokens"
        ]
        == 99
    )
    with pytest.raises(ApiError, match="disagree"):
        chat_submission(
            chat(
                model="m",
                messages=[{"role": "user", "content": "x"}],
                max_tokens=1,
                max_completion_tokens=2,
            ),
            9,
        )
    image = chat(
        model="m",
        messages=[{"role": "user", "content": [{"type": "image_url"}]}],
    )
    with pytest.raises(ApiError) as info:
        chat_submission(image, 9)
    assert info.value.param == "messages[0].content[0]"


@pytest.mark.parametrize(
    ("field", "off", "on"),
    [
        ("service_tier", "auto", "flex"),
        ("presence_penalty", 0, 0.2),
        ("frequency_penalty", 0.0, 1),
        ("logit_bias", {}, {"1": 5}),
        ("function_call", "none", "auto"),
        ("store", False, True),
    ],
)
def test_unsupported_fields_pass_only_when_off(field: str, off: object, on: object) -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    chat_submission(chat(**base, **{field: off}), 9)
    with pytest.raises(ApiError) as info:
        chat_submission(chat(**base, **{field: on}), 9)
    assert info.value.param == field
    assert info.value.status == 400


def test_settings_from_env() -> None:
    s = GatewaySettings.from_env(
        {"TOKENFLEET_GATEWAY_PORT": "9001", "TOKENFLEET_GATEWAY_AUTH": "required"}, host="0.0.0.0"
    )
    assert (s.port, s.auth_required, s.host) == (9001, True, "0.0.0.0")
    with pytest.raises(SettingsError, match="TOKENFLEET_GATEWAY_PORTT"):
        GatewaySettings.from_env({"TOKENFLEET_GATEWAY_PORTT": "1"})
    with pytest.raises(SettingsError, match="TOKENFLEET_GATEWAY_PORT must be an integer"):
        GatewaySettings.from_env({"TOKENFLEET_GATEWAY_PORT": "x"})
    with pytest.raises(SettingsError):
        GatewaySettings(auth="maybe")
    with pytest.raises(SettingsError):
        GatewaySettings(on_disconnect="ignore")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--window", "0"], "window (--window) must be positive"),
        (["--lease-ms", "50"], "lease_ms (--lease-ms) must be at least 100 ms"),
        (["--redis-url", "http://h"], "must start with redis://"),
    ],
)
def test_a_lone_batch_runner_refuses_bad_settings_in_one_line(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenfleet.producer.gateway.batches import runner

    with pytest.raises(SystemExit) as exited:
        runner.main(argv)
    assert exited.value.code == 1
    assert said in capsys.readouterr().err


def test_a_batch_lease_the_runner_refuses_is_refused_by_the_gateway_settings() -> None:
    with pytest.raises(SettingsError, match="TOKENFLEET_GATEWAY_BATCH_LEASE_MS"):
        GatewaySettings.from_env({"TOKENFLEET_GATEWAY_BATCH_LEASE_MS": "50"})


def test_keepalive_setting_default_env_and_bounds() -> None:
    assert GatewaySettings().keepalive_s == 15.0
    env = {"TOKENFLEET_GATEWAY_KEEPALIVE_S": "2.5"}
    assert GatewaySettings.from_env(env).keepalive_s == 2.5
    assert GatewaySettings.from_env(env, keepalive_s=0.1).keepalive_s == 0.1  # the flag wins
    for bad in (0.0, -1.0, 3601.0):  # 0 would make the ping task spin
        with pytest.raises(SettingsError, match="keepalive_s"):
            GatewaySettings(keepalive_s=bad)


def test_keepalive_comment_has_no_blank_line() -> None:
    """The keep-alive is one comment line: with a blank line after it, SDKs that keep the last
    event id dispatch an empty event (issue 27)."""
    from tokenfleet.producer.gateway.keepalive import KEEPALIVE_LINE, KeepAliveComment

    wire = KeepAliveComment().encode()
    assert wire == KEEPALIVE_LINE == b": keep-alive\r\n"
    assert wire.count(b"\r\n") == 1 and wire.startswith(b":")


def test_drain_meter_rate_and_retry_after() -> None:
    meter = DrainMeter(None, Keys("t"), window_s=30)  # type: ignore[arg-type]
    member = Keys.queue_member("m", Priority.NORMAL)
    meter._samples[member] = deque([(100.0, 10), (110.0, 30)])  # 2 starts a second
    assert meter.rate("m", Priority.NORMAL) == pytest.approx(2.0)
    assert meter.retry_after_s("m", Priority.NORMAL) == 1
    assert meter.retry_after_s("m", Priority.NORMAL, slots=9) == 5
    meter._samples[member] = deque([(100.0, 10), (200.0, 11)])  # one start in 100 s
    assert meter.retry_after_s("m", Priority.NORMAL) == 100
    assert meter.retry_after_s("m", Priority.NORMAL, slots=50) == MAX_RETRY_AFTER_S
    # nothing drained: the time observed so far, at least 1 s
    assert 1 <= meter.retry_after_s("m", Priority.BATCH) <= 30


def test_drain_meter_samples_the_fleet_counters(redis_url: str) -> None:
    import asyncio

    import redis.asyncio

    keys = Keys("tdrain")

    async def run() -> float:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            meter = DrainMeter(client, keys)
            await client.hset(keys.drained, "m|normal", 5)
            await meter.sample()
            await client.hincrby(keys.drained, "m|normal", 7)
            await meter.sample()
            (t0, c0), (t1, c1) = meter._samples["m|normal"]
            assert (c0, c1) == (5, 12)
            return meter.rate("m", Priority.NORMAL) * (t1 - t0)
        finally:
            await client.aclose()

    assert asyncio.run(run()) == pytest.approx(7)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_structured_outputs_and_logprobs_become_submit_arguments() -> None:
    base: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    sub = chat_submission(chat(**base, response_format=fmt, logprobs=True, top_logprobs=4), 9)
    assert sub.params["response_format"] == fmt
    assert (sub.params["logprobs"], sub.params["top_logprobs"]) == (True, 4)
    assert (
        "response_format"
        not in chat_submission(chat(**base, response_format={"type": "text"}), 9).params
    )
    for so, keyword in (
        ({"json": SCHEMA}, "json_schema"),
        ({"regex": "[0-9]+"}, "regex"),
        ({"choice": ["a", "b"]}, "choice"),
        ({"grammar": 'start: "x"'}, "grammar"),
        ({"json_object": True}, "response_format"),
    ):
        sub = chat_submission(chat(**base, structured_outputs=so), 9)
        assert keyword in sub.params
        comp = completion_submission(
            CompletionBody.model_validate({"model": "m", "prompt": "x", "structured_outputs": so})
        )
        assert keyword in comp.params
    comp = completion_submission(
        CompletionBody.model_validate({"model": "m", "prompt": "x", "logprobs": 3})
    )
    assert (comp.params["logprobs"], comp.params["top_logprobs"]) == (True, 3)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
        ),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),
    ],
)
def test_bad_structured_outputs_and_logprobs_are_400s_naming_the_field(
    fields: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ApiError) as info:
        chat_submission(chat(**base, **fields), 9)
    assert (info.value.status, info.value.param) == (400, param), info.value.message
