"""``ApiKeyStore`` against the real server: authentication (and the revoke bound), the quota
script's check-and-charge, its headers, refills on a test clock, and settling."""

from __future__ import annotations

import time

import pytest
import redis
from auth_helpers import Clock, with_store
from waiting import wait_for_async

from tokenfleet.producer.gateway.auth import (
    ApiKey,
    ApiKeyAdmin,
    ApiKeyStore,
    AuthError,
    RateDecision,
)
from tokenfleet.producer.gateway.auth.quota import SCALE
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.settings import Settings


@pytest.fixture
def admin(r: redis.Redis, settings: Settings) -> ApiKeyAdmin:
    return ApiKeyAdmin(r, settings)


# -- authenticate -----------------------------------------------------------------------------


def test_authenticate_ok_missing_garbage_wrong(admin: ApiKeyAdmin, settings: Settings) -> None:
    presented, key = admin.create("web", rpm=5)
    other, _ = admin.create("other")
    unknown_id = "tf-zzzzzzzzzz-" + presented[14:]
    wrong_secret = presented[:14] + other[14:]

    async def body(store: ApiKeyStore) -> None:
        assert await store.authenticate(presented) == key
        assert await store.authenticate(f"  {presented}\n") == key
        for missing in (None, "", "   "):
            with pytest.raises(AuthError, match="missing API key") as info:
                await store.authenticate(missing)
            assert info.value.code == "invalid_api_key"
        messages = set()
        for bad in ("garbage", "Bearer " + presented, unknown_id, wrong_secret, presented + "x"):
            with pytest.raises(AuthError) as info:
                await store.authenticate(bad)
            messages.add(str(info.value))
        assert messages == {"invalid or revoked API key"}  # one message: nothing told apart

    with_store(settings, body)


def test_a_revoked_key_is_refused_exactly_at_the_cache_bound(
    admin: ApiKeyAdmin, settings: Settings
) -> None:
    presented, key = admin.create("web")
    clock = Clock()

    async def body(store: ApiKeyStore) -> None:
        assert store.cache_s == 2.0
        assert await store.authenticate(presented) == key  # read at s=1000, cached
        admin.revoke("web")
        clock.s += 1.999
        assert await store.authenticate(presented) == key  # still within the bound
        clock.s += 0.001
        with pytest.raises(AuthError, match="invalid or revoked"):
            await store.authenticate(presented)

    with_store(settings, body, monotonic=clock.monotonic)


def test_a_revoked_key_is_refused_within_the_bound_real_clock(
    admin: ApiKeyAdmin, settings: Settings
) -> None:
    presented, key = admin.create("web")
    cache_s = 0.3

    async def body(store: ApiKeyStore) -> tuple[float, float, list[tuple[float, float, bool]]]:
        before_read = time.monotonic()
        await store.authenticate(presented)  # the store reads and caches the record here
        after_read = time.monotonic()
        admin.revoke(key.key_id)
        polls: list[tuple[float, float, bool]] = []  # (monotonic before, after, accepted)

        async def refused() -> bool:
            t0 = time.monotonic()
            try:
                await store.authenticate(presented)
            except AuthError:
                polls.append((t0, time.monotonic(), False))
                return True
            polls.append((t0, time.monotonic(), True))
            return False

        await wait_for_async(refused, "the revoked key to be refused", cache_s + 30, 0.01)
        return before_read, after_read, polls

    before_read, after_read, polls = with_store(settings, body, cache_s=cache_s)
    assert polls and not polls[-1][2], "a revoked key was still accepted 30 s past the bound"
    # The store's own clock read lies between before_read and after_read, so: every poll it
    # accepted began before the bound ran out, and the refusal came only once it had.
    assert all(t0 < after_read + cache_s for t0, _, ok in polls if ok)
    assert polls[-1][1] >= before_read + cache_s


def test_admit_refuses_a_revoked_key_at_once(admin: ApiKeyAdmin, settings: Settings) -> None:
    presented, _ = admin.create("web", rpm=10)

    async def body(store: ApiKeyStore) -> None:
        key = await store.authenticate(presented)
        admin.revoke("web")
        with pytest.raises(AuthError):
            await store.admit(key, 1)  # the script reads the record itself: no cache delay
        with pytest.raises(AuthError):  # and the cache forgot it
            await store.authenticate(presented)
        await store.settle(key, 5, 1)  # a no-op on a revoked key

    with_store(settings, body)


def test_cache_is_bounded_and_caches_misses(
    admin: ApiKeyAdmin, settings: Settings, r: redis.Redis
) -> None:
    presented, key = admin.create("web")
    clock = Clock()

    async def body(store: ApiKeyStore) -> None:
        for i in range(5):
            with pytest.raises(AuthError):
                await store.authenticate(f"tf-{i:010d}-" + "a" * 32)
        assert len(store._cache) == 3  # oldest dropped first
        assert await store.authenticate(presented) == key
        assert list(store._cache)[-1] == key.key_id and len(store._cache) == 3
        r.delete(Keys(settings.key_prefix).api_key(key.key_id))
        assert await store.authenticate(presented) == key  # a cached hit reads no Redis
        clock.s += 2
        with pytest.raises(AuthError):
            await store.authenticate(presented)

    with_store(settings, body, max_cached=3, monotonic=clock.monotonic)


# -- admit ------------------------------------------------------------------------------------


def _admit_all(
    settings: Settings, key: ApiKey, asks: list[int], clock: Clock
) -> list[RateDecision]:
    async def body(store: ApiKeyStore) -> list[RateDecision]:
        return [await store.admit(key, n) for n in asks]

    return with_store(settings, body, clock_ms=clock.now_ms)


def test_admit_counts_requests_exactly_and_refill_is_exact(
    admin: ApiKeyAdmin, settings: Settings
) -> None:
    _, key = admin.create("web", rpm=40)
    clock = Clock()
    decisions = _admit_all(settings, key, [0] * 41, clock)
    assert [d.allowed for d in decisions] == [True] * 40 + [False]
    first, last_ok, refused = decisions[0], decisions[39], decisions[40]
    assert first.headers == {
        "x-ratelimit-limit-requests": "40",
        "x-ratelimit-remaining-requests": "39",
        "x-ratelimit-reset-requests": "1.5s",
    }
    assert last_ok.headers["x-ratelimit-remaining-requests"] == "0"
    assert last_ok.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert refused.limited_by == ("requests",) and refused.retry_after_s == 1.5
    # 40/min refills one request per 1500 ms: 1 ms early is refused, on time is admitted
    clock.ms += 1499
    assert [d.allowed for d in _admit_all(settings, key, [0], clock)] == [False]
    refused_late = _admit_all(settings, key, [0], clock)[0]
    assert refused_late.retry_after_s == 0.001
    clock.ms += 1
    assert [d.allowed for d in _admit_all(settings, key, [0, 0], clock)] == [True, False]
    clock.ms += 10 * 60_000  # idle for long: full again, never above the capacity
    assert sum(d.allowed for d in _admit_all(settings, key, [0] * 50, clock)) == 40


def test_admit_counts_tokens_and_refuses_charge_nothing(
    admin: ApiKeyAdmin, settings: Settings, r: redis.Redis, keys: Keys
) -> None:
    _, key = admin.create("web", rpm=10, tpm=1000)
    clock = Clock()
    ok = _admit_all(settings, key, [600], clock)[0]
    assert ok.allowed and ok.headers["x-ratelimit-remaining-tokens"] == "400"
    assert ok.headers["x-ratelimit-reset-tokens"] == "36s"
    before = r.hgetall(keys.api_key(key.key_id))
    refused = _admit_all(settings, key, [401], clock)[0]
    assert not refused.allowed and refused.limited_by == ("tokens",)
    assert refused.retry_after_s == 0.06  # 1 token at 1000/min
    assert refused.headers["x-ratelimit-remaining-requests"] == "9"
    too_large = _admit_all(settings, key, [1001], clock)[0]
    assert too_large.too_large and not too_large.allowed
    after = r.hgetall(keys.api_key(key.key_id))
    assert after.pop(b"refused") == b"2"  # refusals are counted (the console shows them) ...
    assert after == before  # ... and charge nothing
    assert _admit_all(settings, key, [400], clock)[0].allowed


def test_unlimited_key_has_no_headers_and_no_state(
    admin: ApiKeyAdmin, settings: Settings, r: redis.Redis, keys: Keys
) -> None:
    _, key = admin.create("web")
    before = r.hgetall(keys.api_key(key.key_id))
    decisions = _admit_all(settings, key, [10**6] * 3, Clock())
    assert all(d.allowed and d.headers == {} for d in decisions)
    assert r.hgetall(keys.api_key(key.key_id)) == before


def test_admit_on_redis_time(admin: ApiKeyAdmin, settings: Settings) -> None:
    _, key = admin.create("web", rpm=2)

    async def body(store: ApiKeyStore) -> list[RateDecision]:
        return [await store.admit(key, 0) for _ in range(3)]

    a, b, c = with_store(settings, body)
    assert a.allowed and b.allowed and not c.allowed
    # refill at 2/min: 30 s for one request, less what elapsed since the second admit
    assert 0 < c.retry_after_s <= 30.0


def test_admit_validates_tokens(admin: ApiKeyAdmin, settings: Settings) -> None:
    _, key = admin.create("web", tpm=10)

    async def body(store: ApiKeyStore) -> None:
        for bad in (-1, 2**31 + 1, 1.5, True):
            with pytest.raises(InvalidRequest):
                await store.admit(key, bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidRequest):
                await store.settle(key, 1, bad)  # type: ignore[arg-type]

    with_store(settings, body)


# -- settle -----------------------------------------------------------------------------------


def _tokens_level(r: redis.Redis, keys: Keys, key: ApiKey) -> int:
    return int(float(r.hget(keys.api_key(key.key_id), "tk") or 0))


def test_settle_refunds_and_charges_with_a_bounded_debt(
    admin: ApiKeyAdmin, settings: Settings, r: redis.Redis, keys: Keys
) -> None:
    _, key = admin.create("web", tpm=1000)
    clock = Clock()

    async def body(store: ApiKeyStore) -> list[bool]:
        out = []
        assert (await store.admit(key, 800)).allowed
        assert _tokens_level(r, keys, key) == 200 * SCALE
        await store.settle(key, 800, 300)  # 500 unused go back
        assert _tokens_level(r, keys, key) == 700 * SCALE
        await store.settle(key, 10, 10)  # nothing to correct
        await store.settle(key, 0, 5000)  # far more than charged: debt of one bucket, no more
        assert _tokens_level(r, keys, key) == -1000 * SCALE
        refused = await store.admit(key, 0)
        out.append(refused.allowed)
        assert refused.retry_after_s == 60.0  # the debt is repaid at 1000/min
        assert refused.headers["x-ratelimit-reset-tokens"] == "2m0s"
        clock.ms += 60_000
        out.append((await store.admit(key, 0)).allowed)
        await store.settle(key, 5000, 0)  # a refund never overfills the bucket
        assert _tokens_level(r, keys, key) == 1000 * SCALE
        return out

    assert with_store(settings, body, clock_ms=clock.now_ms) == [False, True]


def test_settle_without_a_token_limit_writes_nothing(
    admin: ApiKeyAdmin, settings: Settings, r: redis.Redis, keys: Keys
) -> None:
    _, key = admin.create("web", rpm=5)
    clock = Clock()

    async def body(store: ApiKeyStore) -> None:
        await store.admit(key, 100)
        before = r.hgetall(keys.api_key(key.key_id))
        await store.settle(key, 100, 7)
        assert r.hgetall(keys.api_key(key.key_id)) == before

    with_store(settings, body, clock_ms=clock.now_ms)
