"""Sentinel mode against a secured setup, as production runs it: data nodes that speak TLS only
and require a password (replication over TLS with ``masterauth``), sentinels that speak TLS only
and require a password of their own. A real worker process and the producer reach the primary
through the sentinels with the password and TLS options in ``REDIS_URL`` (``rediss://:PASSWORD@…
?ssl_ca_certs=…``, its host and port ignored), ``TOKENFLEET_SENTINEL_PASSWORD`` and
``TOKENFLEET_SENTINEL_TLS=1`` (the sentinels take the URL's ``ssl_*`` options); a request streams
to ``done``; ``tokenfleet status --json`` works with the same settings; and a wrong password or
plain TCP to either fails with the server's refusal instead of reaching the data."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from child_process import run_command, tokenfleet_args
from ha_helpers import HAWorker, ha_settings
from waiting import DEADLINE_S, wait_for

from tokenfleet.producer import Client
from tokenfleet.shared.redis_connect import redis_client
from tokenfleet.shared.schema import TerminalEvent, TokenEvent
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.testing.local_sentinel import LocalSentinel
from tokenfleet.worker.devtools.testing.local_tls import TlsFiles, make_certs

pytestmark = pytest.mark.slow
PREFIX = "hasec"
DATA_PASSWORD = "data-secret"
SENTINEL_PASSWORD = "sentinel-secret"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def secured(tls: TlsFiles) -> Iterator[LocalSentinel]:
    with LocalSentinel(
        service="tfsec",
        password=DATA_PASSWORD,
        sentinel_password=SENTINEL_PASSWORD,
        tls=tls,  # the data nodes and the sentinels: TLS only
    ) as setup:
        yield setup


def secured_url(tls: TlsFiles, password: str = DATA_PASSWORD) -> str:
    """What a user sets as ``REDIS_URL``: credentials and TLS; host and port are not used."""
    return f"rediss://:{password}@127.0.0.1:1/0?ssl_ca_certs={tls.ca_cert}"  # (port 1: unused)


def secured_settings(setup: LocalSentinel, tls: TlsFiles) -> Settings:
    return dataclasses.replace(
        ha_settings(setup, PREFIX),
        redis_url=secured_url(tls),
        sentinel_password=SENTINEL_PASSWORD,
        sentinel_tls=1,
    )


def test_a_fleet_runs_through_password_protected_sentinels_to_a_tls_primary(
    secured: LocalSentinel, tls: TlsFiles, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    settings = secured_settings(secured, tls)
    flags = ("--redis-url", secured_url(tls))  # after HAWorker's own --redis-url: it wins
    env = {"TOKENFLEET_SENTINEL_PASSWORD": SENTINEL_PASSWORD, "TOKENFLEET_SENTINEL_TLS": "1"}
    worker = HAWorker(tiny_llama_dir, secured, PREFIX, "sec-w", tmp_path, *flags, env=env)
    try:
        with redis_client(settings) as r:
            wait_for(lambda: worker.ready(r), "the worker's heartbeat")
            # the nodes really are secured: plain TCP and a missing password are refused
            primary = secured.primary_port()
            with pytest.raises(redis.ConnectionError):
                redis.Redis(host="127.0.0.1", port=primary, socket_timeout=2).ping()
            with (
                pytest.raises(redis.AuthenticationError),
                redis.Redis(
                    host="127.0.0.1", port=primary, ssl=True, ssl_ca_certs=str(tls.ca_cert)
                ) as anonymous,
            ):
                anonymous.get("x")
        with Client.from_url(settings=settings) as client:
            events = list(
                client.submit("Secured", max_tokens=24, ignore_eos=True).stream(timeout=DEADLINE_S)
            )
        assert [e.index for e in events if isinstance(e, TokenEvent)] == list(range(24))
        assert isinstance(events[-1], TerminalEvent) and events[-1].status == "done"
        status = run_cli(secured, tls, "status", "--json")
        assert "sec-w" in json.dumps(status), status
    finally:
        worker.close()


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"redis_url": "wrong-password"}, redis.AuthenticationError),
        ({"redis_url": "plain-tcp"}, redis.ConnectionError),
        ({"sentinel_password": "wrong"}, redis.ConnectionError),  # no sentinel answers
        ({"sentinel_tls": 0}, redis.ConnectionError),
    ],
    ids=["wrong-data-password", "plain-tcp-url", "wrong-sentinel-password", "plain-tcp-sentinels"],
)
def test_wrong_credentials_or_no_tls_fail_at_the_first_command(
    secured: LocalSentinel, tls: TlsFiles, change: dict[str, str], error: type[Exception]
) -> None:
    urls = {
        "wrong-password": secured_url(tls, "not-the-password"),
        "plain-tcp": f"redis://:{DATA_PASSWORD}@127.0.0.1:1/0",
    }
    settings = secured_settings(secured, tls)
    if "redis_url" in change:
        settings = dataclasses.replace(settings, redis_url=urls[str(change["redis_url"])])
    else:
        settings = dataclasses.replace(settings, **change)  # type: ignore[arg-type]
    settings = dataclasses.replace(
        settings, redis_retry_s=0, redis_socket_timeout_s=1, redis_connect_timeout_s=1
    )
    with Client.from_url(settings=settings) as client, pytest.raises(error):
        client.submit("never", max_tokens=2)


def run_cli(setup: LocalSentinel, tls: TlsFiles, *args: str) -> object:
    env = {
        **os.environ,
        "TOKENFLEET_KEY_PREFIX": PREFIX,
        "TOKENFLEET_SENTINEL_PASSWORD": SENTINEL_PASSWORD,
        "TOKENFLEET_SENTINEL_TLS": "1",
    }
    env.pop("REDIS_URL", None)
    cmd = tokenfleet_args(*args, "--redis-url", secured_url(tls), "--redis-mode", "sentinel",
                          "--sentinels", setup.sentinels,
                          "--sentinel-service", setup.service)  # fmt: skip
    done = run_command(cmd, env, inherit_env=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
