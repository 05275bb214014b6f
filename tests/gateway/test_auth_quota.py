"""The pure parts of API keys: the presented format, the record codec, the bucket arithmetic
and the headers a decision carries (no Redis)."""

from __future__ import annotations

import re

import pytest

from tokenfleet.producer.gateway.auth.model import (
    MAX_LIMIT,
    PRESENTED_LENGTH,
    ApiKey,
    decode_record,
    digest_matches,
    digest_of,
    encode_record,
    new_key_id,
    new_presented_key,
    parse_presented,
)
from tokenfleet.producer.gateway.auth.quota import (
    PERIOD_MS,
    SCALE,
    Bucket,
    decide,
    format_duration,
)
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.scripts.registry import read_lua

LUA = "tokenfleet.producer.gateway.auth.lua"


def _key(**kw: object) -> ApiKey:
    fields: dict[str, object] = dict(
        key_id="abc123def0",
        name="web",
        priority_ceiling=Priority.NORMAL,
        rpm=60,
        tpm=1000,
        created_at=1.5,
    )
    fields.update(kw)
    return ApiKey(**fields)  # type: ignore[arg-type]


def test_presented_key_format() -> None:
    key_id = new_key_id()
    assert re.fullmatch(r"[a-z0-9]{10}", key_id)
    presented = new_presented_key(key_id)
    assert presented.startswith(f"tf-{key_id}-") and len(presented) == PRESENTED_LENGTH
    secret = presented.split("-", 2)[2]
    assert len(secret) * 6 >= 128  # base64url: 6 bits a character
    assert parse_presented(presented) == key_id
    assert new_presented_key(key_id) != presented


@pytest.mark.parametrize(
    "text",
    [
        "",
        "tf-",
        "sk-abc123def0-" + "a" * 32,
        "tf-ABC123DEF0-" + "a" * 32,  # ids are lower case
        "tf-abc123def0-" + "a" * 31,
        "tf-abc123def0-" + "a" * 33,
        "tf-abc123def0-" + "a" * 31 + "!",
        "tf-abc123def0_" + "a" * 32,
        "tf-abc123def0-" + "a" * 32 + "\n",
        "x" * 10_000,
    ],
)
def test_malformed_presented_keys_name_no_key(text: str) -> None:
    assert parse_presented(text) is None


def test_digest_compare() -> None:
    presented = new_presented_key("abc123def0")
    stored = digest_of(presented)
    assert re.fullmatch(r"[0-9a-f]{64}", stored)
    assert digest_matches(presented, stored)
    assert not digest_matches(presented[:-1] + ("A" if presented[-1] != "A" else "B"), stored)
    assert not digest_matches(presented, None)


def test_record_round_trip_holds_no_secret() -> None:
    key = _key()
    presented = new_presented_key(key.key_id)
    fields = encode_record(key, digest_of(presented))
    assert presented not in "".join(fields.values())
    assert "revoked_at" not in fields
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    raw[b"rq"] = b"123"  # bucket fields are the scripts'; the codec ignores them
    assert decode_record(key.key_id, raw) == (key, digest_of(presented))
    revoked = _key(revoked_at=2.25)
    assert decode_record(key.key_id, encode_record(revoked, "d" * 64)) == (revoked, None)
    assert decode_record(key.key_id, {}) is None
    with pytest.raises(InvalidRequest, match="does not decode"):
        decode_record(key.key_id, {"name": "web"})


def test_api_key_validates_and_permits() -> None:
    key = _key()
    assert not key.revoked and _key(revoked_at=3.0).revoked
    assert key.permits(Priority.NORMAL) and key.permits(Priority.BATCH)
    assert not key.permits(Priority.CRITICAL)
    assert key.to_dict()["priority_ceiling"] == "normal"
    for bad in (
        {"key_id": "short"},
        {"name": "a b"},
        {"rpm": -1},
        {"tpm": MAX_LIMIT + 1},
        {"rpm": True},
    ):
        with pytest.raises(InvalidRequest):
            _key(**bad)


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0s"),
        (-5, "0s"),
        (1, "1ms"),
        (20, "20ms"),
        (999, "999ms"),
        (1000, "1s"),
        (1500, "1.5s"),
        (8640, "8.64s"),
        (59_999, "59.999s"),
        (60_000, "1m0s"),
        (360_000, "6m0s"),
        (61_250, "1m1.25s"),
        (3_723_000, "1h2m3s"),
    ],
)
def test_format_duration_like_openai(ms: int, text: str) -> None:
    assert format_duration(ms) == text


def test_the_scripts_mirror_the_units() -> None:
    source = read_lua(LUA, "api_key_admit.lua")
    assert f"local SCALE = {SCALE}\n" in source
    assert f"local PERIOD_MS = {PERIOD_MS}\n" in source
    assert PERIOD_MS == SCALE  # a limit L per minute refills exactly L units per millisecond


def test_bucket_arithmetic() -> None:
    full = Bucket("requests", 40, 40 * SCALE)
    assert (full.remaining(), full.reset_ms(), full.wait_ms(1)) == (40, 0, 0)
    empty = Bucket("requests", 40, 0)
    # 40 per minute: one request every 1.5 s; the whole bucket in a minute
    assert (empty.remaining(), empty.wait_ms(1), empty.reset_ms()) == (0, 1500, 60_000)
    debt = Bucket("tokens", 1000, -1000 * SCALE)
    assert (debt.remaining(), debt.wait_ms(0), debt.reset_ms()) == (0, 60_000, 120_000)
    partial = Bucket("tokens", 7, 1)  # a sliver: rounds the wait up, never down
    assert partial.wait_ms(1) == -(-(SCALE - 1) // 7)


def test_decide_allowed_headers() -> None:
    d = decide(True, 40, 1000, 39 * SCALE, 900 * SCALE + 5, tokens=100)
    assert d.allowed and d.retry_after_s == 0.0 and d.message == ""
    assert d.headers == {
        "x-ratelimit-limit-requests": "40",
        "x-ratelimit-remaining-requests": "39",
        "x-ratelimit-reset-requests": "1.5s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "900",
        "x-ratelimit-reset-tokens": "6s",
    }


def test_decide_omits_unlimited_dimensions() -> None:
    assert decide(True, 0, 0, 0, 0, tokens=5).headers == {}
    only_tokens = decide(True, 0, 600, 0, 500 * SCALE, tokens=5).headers
    assert set(only_tokens) == {
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    }


def test_decide_refused_waits_for_the_slowest_refused_part() -> None:
    # requests empty (1.5 s to one), tokens short by 50 of 100 at 1000/min (3 s)
    d = decide(False, 40, 1000, 0, 50 * SCALE, tokens=100)
    assert not d.allowed and d.limited_by == ("requests", "tokens")
    assert d.retry_after_s == 3.0
    assert "requests per minute (limit 40) and tokens per minute (limit 1000)" in d.message
    assert "try again in 3s" in d.message
    only_requests = decide(False, 40, 1000, SCALE // 2, 1000 * SCALE, tokens=100)
    assert only_requests.limited_by == ("requests",) and only_requests.retry_after_s == 0.75


def test_decide_too_large_is_not_a_wait() -> None:
    d = decide(False, 0, 1000, 0, 1000 * SCALE, tokens=1001)
    assert d.too_large and d.retry_after_s == 0.0 and d.limited_by == ("tokens",)
    assert "request too large" in d.message and "1000 tokens per minute" in d.message
