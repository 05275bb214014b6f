"""``ApiKeyAdmin`` against the real server: create, list, revoke, unique live names, and no
plaintext key anywhere in Redis."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from auth_helpers import dump_redis, with_store

from tokenfleet.producer.gateway.auth import ApiKeyAdmin, ApiKeyStore
from tokenfleet.producer.gateway.auth.model import digest_of
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings


@pytest.fixture
def admin(r: redis.Redis, settings: Settings) -> ApiKeyAdmin:
    ticks = iter(range(1, 1000))
    return ApiKeyAdmin(r, settings, clock=lambda: 1_700_000_000.0 + next(ticks))


def test_create_stores_a_digest_and_lists(admin: ApiKeyAdmin, r: redis.Redis, keys: Keys) -> None:
    presented, key = admin.create("web", priority_ceiling="critical", rpm=60, tpm=10_000)
    assert presented.startswith(f"tf-{key.key_id}-")
    assert (key.name, key.priority_ceiling, key.rpm, key.tpm) == (
        "web",
        Priority.CRITICAL,
        60,
        10_000,
    )
    assert r.smembers(keys.api_keys) == {key.key_id.encode()}
    assert r.hget(keys.api_key_names, "web") == key.key_id.encode()
    assert r.hget(keys.api_key(key.key_id), "digest") == digest_of(presented).encode()
    _, batch = admin.create("cron")  # defaults: normal ceiling, unlimited
    assert (batch.priority_ceiling, batch.rpm, batch.tpm) == (Priority.NORMAL, 0, 0)
    assert admin.list() == [key, batch]  # oldest first
    assert admin.get("web") == key and admin.get(key.key_id) == key


def test_names_are_unique_among_live_keys(admin: ApiKeyAdmin) -> None:
    _, first = admin.create("web")
    with pytest.raises(InvalidRequest, match=rf"named web already exists \(id {first.key_id}\)"):
        admin.create("web", rpm=5)
    assert [k.name for k in admin.list()] == ["web"]  # the refused create left nothing
    revoked = admin.revoke("web")
    assert revoked.revoked and revoked.key_id == first.key_id
    _, second = admin.create("web")  # a revoked key's name is free again
    assert second.key_id != first.key_id
    assert [(k.name, k.revoked) for k in admin.list()] == [("web", True), ("web", False)]
    assert admin.get("web") == second  # a name resolves to the live key


def test_revoke_by_id_or_name(admin: ApiKeyAdmin, r: redis.Redis, keys: Keys) -> None:
    _, a = admin.create("a", rpm=10)
    _, b = admin.create("b")
    assert admin.revoke(a.key_id).revoked_at is not None
    gone = admin.revoke(a.key_id)  # twice: a no-op returning the first revoke
    assert gone == admin.get(a.key_id) and gone.revoked_at == admin.list()[0].revoked_at
    assert r.hget(keys.api_key(a.key_id), "digest") is None
    assert r.hget(keys.api_key_names, "a") is None
    assert admin.revoke("b").key_id == b.key_id
    with pytest.raises(InvalidRequest, match="no live API key with id or name 'b'"):
        admin.revoke("b")  # a revoked key's name names nothing
    for unknown in ("nobody", "zzzzzzzzzz", ""):
        with pytest.raises(InvalidRequest, match="no live API key"):
            admin.revoke(unknown)


def test_create_validates_before_touching_redis(admin: ApiKeyAdmin, r: redis.Redis) -> None:
    for kwargs in ({"rpm": -1}, {"tpm": 10**10}, {"priority_ceiling": "urgent"}):
        with pytest.raises(InvalidRequest):
            admin.create("x", **kwargs)
    with pytest.raises(InvalidRequest, match="API key name"):
        admin.create("has space")
    assert r.dbsize() == 0


def test_the_plaintext_key_is_nowhere_in_redis(
    admin: ApiKeyAdmin, r: redis.Redis, settings: Settings
) -> None:
    created = [admin.create(f"app{i}", rpm=100, tpm=10_000)[0] for i in range(3)]

    async def use(store: ApiKeyStore) -> None:
        for presented in created:
            key = await store.authenticate(presented)
            assert (await store.admit(key, 500)).allowed
            await store.settle(key, 500, 123)

    with_store(settings, use)
    admin.revoke("app0")
    blob = dump_redis(r)
    assert b"apikey" in blob  # the dump does see the records
    for presented in created:
        secret = presented[len("tf-0123456789-") :]  # the secret may itself hold '-'
        assert len(secret) == 32
        assert presented.encode() not in blob and secret.encode() not in blob


def test_concurrent_creates_of_one_name_leave_one_key(redis_url: str, settings: Settings) -> None:
    def attempt(_: int) -> str:
        client = redis.Redis.from_url(redis_url)
        try:
            ApiKeyAdmin(client, settings).create("web")
            return "created"
        except InvalidRequest:
            return "refused"
        finally:
            client.close()

    with ThreadPoolExecutor(8) as pool:
        outcomes = sorted(pool.map(attempt, range(8)))
    assert outcomes == ["created"] + ["refused"] * 7
    client = redis.Redis.from_url(redis_url)
    assert [k.name for k in ApiKeyAdmin(client, settings).list()] == ["web"]
    client.close()


def test_a_keys_role_says_what_it_may_do_in_the_console(
    admin: ApiKeyAdmin, r: redis.Redis, keys: Keys
) -> None:
    from tokenfleet.producer.gateway.auth import Role

    _, user = admin.create("app")
    _, viewer = admin.create("ops", role="viewer")
    _, boss = admin.create("oncall", role=Role.ADMIN)
    assert (user.role, viewer.role, boss.role) == (Role.USER, Role.VIEWER, Role.ADMIN)
    assert r.hget(keys.api_key(user.key_id), "role") is None  # the default is not written
    assert admin.get("ops").role is Role.VIEWER  # (read back from the record)
    allowed = {role: [needed for needed in Role if role.allows(needed)] for role in Role}
    assert allowed == {
        Role.USER: [Role.USER],
        Role.VIEWER: [Role.USER, Role.VIEWER],
        Role.ADMIN: [Role.USER, Role.VIEWER, Role.ADMIN],
    }
    with pytest.raises(InvalidRequest, match="unknown role 'root'"):
        admin.create("x", role="root")
    assert r.hget(keys.api_key_names, "x") is None  # refused before anything is stored
