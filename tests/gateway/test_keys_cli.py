"""``tokenfleet keys create|list|revoke`` end to end through the CLI entry point."""

from __future__ import annotations

import re

import orjson
import pytest
import redis
from auth_helpers import dump_redis, with_store

from tokenfleet.producer.gateway.auth import ApiKey, ApiKeyStore, AuthError
from tokenfleet.producer.gateway.auth.model import digest_of
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.cli import main


@pytest.fixture(autouse=True)
def _prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", "tft")  # the `settings` fixture's prefix


def _created_key(out: str) -> str:
    (presented,) = re.findall(r"^    (tf-\S+)$", out, flags=re.MULTILINE)
    return presented


def test_create_list_revoke(
    redis_url: str, settings: Settings, r: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ["--redis-url", redis_url]
    assert main(["keys", "list", *url]) == 0
    assert "no API keys" in capsys.readouterr().out

    create = ["keys", "create", "--name", "web", "--rpm", "60", "--tpm", "5000"]
    assert main([*create, "--priority-ceiling", "batch", *url]) == 0
    out = capsys.readouterr().out
    presented = _created_key(out)
    assert f"Authorization: Bearer {presented}" in out
    assert "only time it is shown" in out
    assert "priority ceiling batch, 60 requests/min, 5000 tokens/min" in out

    async def auth(store: ApiKeyStore) -> ApiKey:
        return await store.authenticate(presented)

    key = with_store(settings, auth)
    assert (key.name, key.priority_ceiling, key.rpm, key.tpm) == ("web", Priority.BATCH, 60, 5000)

    assert main(["keys", "create", "--name", "web", *url]) == 1
    assert "an API key named web already exists" in capsys.readouterr().err

    assert main(["keys", "create", "--name", "cron", "--role", "viewer", "--json", *url]) == 0
    created = orjson.loads(capsys.readouterr().out)
    assert (created["tenant"], created["weight"]) == ("default", None)
    assert created["api_key"].startswith(f"tf-{created['key_id']}-")
    assert (created["name"], created["priority_ceiling"], created["rpm"]) == ("cron", "normal", 0)
    assert created["role"] == "viewer"

    assert main(["keys", "list", *url]) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    header = ["ID", "NAME", "ROLE", "CEILING", "RPM", "TPM", "CREATED", "REVOKED"]
    assert lines[0].split() == header
    assert lines[1].split()[:6] == [key.key_id, "web", "user", "batch", "60", "5000"]
    assert lines[2].split()[1:6] == ["cron", "viewer", "normal", "unlimited", "unlimited"]
    assert lines[2].endswith("-")  # not revoked

    assert main(["keys", "revoke", "web", *url]) == 0
    assert f"revoked API key web (id {key.key_id})" in capsys.readouterr().out
    assert main(["keys", "list", "--json", *url]) == 0
    listed = orjson.loads(capsys.readouterr().out)
    assert [(k["name"], k["revoked_at"] is not None) for k in listed] == [
        ("web", True),
        ("cron", False),
    ]
    assert set(listed[0]) == {
        "key_id",
        "name",
        "priority_ceiling",
        "rpm",
        "tpm",
        "created_at",
        "revoked_at",
        "role",
        "tenant",
        "weight",
    }

    async def refused(store: ApiKeyStore) -> None:
        with pytest.raises(AuthError):
            await store.authenticate(presented)

    with_store(settings, refused)

    # nothing printed after create, and nothing in Redis, holds a secret or its digest
    blob = dump_redis(r).decode()
    for secret in (presented, created["api_key"]):
        assert secret not in table and secret not in str(listed) and secret not in blob
        assert digest_of(secret) not in table and digest_of(secret) not in str(listed)


def test_errors_exit_1(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = ["--redis-url", redis_url]
    assert main(["keys", "revoke", "nobody", *url]) == 1
    assert "no live API key with id or name 'nobody'" in capsys.readouterr().err
    assert main(["keys", "create", "--name", "x", "--rpm", "-3", *url]) == 1
    assert "rpm must be an integer" in capsys.readouterr().err
    assert main(["keys", "create", "--name", "bad name", *url]) == 1
    assert "API key name" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["keys", "create", "--name", "x", "--priority-ceiling", "urgent", *url])
    with pytest.raises(SystemExit):
        main(["keys", *url])  # an action is required


def test_a_key_of_a_tenant_with_a_weight_sets_the_tenants_weight(
    redis_url: str, r: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--tenant`` / ``--weight`` go into the key's record, and the weight becomes the
    tenant's (what ``tokenfleet tenants list`` shows; docs/fairness.md)."""
    url = ["--redis-url", redis_url]
    argv = ["keys", "create", "--name", "acme-app", "--tenant", "acme", "--weight", "3"]
    assert main([*argv, "--json", *url]) == 0
    created = orjson.loads(capsys.readouterr().out)
    assert (created["tenant"], created["weight"]) == ("acme", 3.0)
    assert main(["tenants", "list", "--json", *url]) == 0
    listed = orjson.loads(capsys.readouterr().out)
    assert listed["tenants"]["acme"] == {"weight": 3.0, "max_waiting": None}
    assert main(["keys", "create", "--name", "bad", "--tenant", "a b", *url]) == 1
    assert "tenant name" in capsys.readouterr().err
