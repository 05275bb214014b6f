"""Redis ACL roles (docs/security.md, "Redis ACL roles"): a real worker process and a producer
run with exactly the users the page's block creates, and each role is refused what is not its
own."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from acl_roles_doc import documented_acl_commands
from child_process import ChildProcess, tokenfleet_args
from worker_helpers import WorkerProc, make_intake, wait_for

from tokenfleet.producer import Client
from tokenfleet.producer.gateway.auth import ApiKeyAdmin
from tokenfleet.shared.schema import RequestStatus
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.cli import main
from tokenfleet.worker.devtools.local_redis import RedisServer, free_port
from tokenfleet.worker.intake.reader import IntakeReader

PREFIX = "tfacl"
USERS = ("tf-producer", "tf-gateway", "tf-worker", "tf-admin")


def user_url(server_url: str, user: str, password: str) -> str:
    """``server_url`` (``unix:///path``) with a user and password in it."""
    assert server_url.startswith("unix://")
    return f"unix://{user}:{password}@{server_url[len('unix://') :]}"


def _acl_denials(rr: redis.Redis, users: Any) -> list[dict[str, Any]]:
    def text(v: Any) -> Any:
        return v.decode() if isinstance(v, bytes) else v

    entries = [{text(k): text(v) for k, v in e.items()} for e in rr.acl_log(count=1000)]
    return [e for e in entries if e.get("username") in users]


@pytest.fixture(scope="module")
def urls(redis_server: RedisServer, rr: redis.Redis) -> Iterator[dict[str, str]]:
    passwords = {user: os.urandom(12).hex() for user in USERS}
    commands = documented_acl_commands(PREFIX, passwords)
    assert [c[2] for c in commands] == list(USERS)
    version = tuple(int(x) for x in str(rr.info("server")["redis_version"]).split(".")[:2])
    setinfo = version >= (7, 2)  # docs/security.md: add +client|setinfo there
    for argv in commands:
        rr.execute_command(*argv, *(["+client|setinfo"] if setinfo else []))
    try:
        yield {u: user_url(redis_server.url, u, passwords[u]) for u in USERS}
    finally:
        for user in USERS:
            rr.acl_deluser(user)


def test_the_fleet_runs_with_exactly_the_documented_users(
    urls: dict[str, str],
    rr: redis.Redis,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rr.acl_log_reset()
    # the worker leaves batch alone, so a batch request stays queued for the producer to cancel
    w = WorkerProc(
        tiny_model_dir,
        urls["tf-worker"],
        PREFIX,
        "acl-w1",
        tmp_path,
        "--priorities",
        "critical,normal",
    )
    try:
        w.wait_ready(rr)
        settings = Settings(redis_url=urls["tf-producer"], key_prefix=PREFIX)
        with Client.from_url(settings=settings) as client:
            # ignore_eos and stop_token_ids reach the engine through the Python client
            full = client.submit("Hello", max_tokens=6, temperature=0, ignore_eos=True)
            first = full.result(timeout=120)
            assert (len(first.token_ids), first.finish_reason) == (6, "length")
            stop_id = first.token_ids[2]
            cut = first.token_ids.index(stop_id) + 1
            stopped = client.submit(
                "Hello", max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]
            )
            events = list(stopped.stream())
            second = stopped.result(timeout=120)
            assert second.token_ids == first.token_ids[:cut]
            assert second.finish_reason == "stop" and len(events) == cut + 1
            queued = client.submit("wait", priority="batch")
            assert client.cancel(queued.request_id) is True
            assert client.status(queued.request_id).status is RequestStatus.CANCELLED
            assert {q.priority for q in client.queue_stats()} >= {"normal", "batch"}
        # the CLI, as the producer
        monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", PREFIX)
        cli = ["--redis-url", urls["tf-producer"]]
        assert main(["submit", "Hi", "--max-tokens", "2", "--request-id", "acl-c1", *cli]) == 0
        assert main(["get", "acl-c1", *cli]) == 0
        assert main(["follow", "acl-c1", *cli]) == 0
        assert main(["queues", "--priority", "batch", "--max-waiting", "50", *cli]) == 0
        assert main(["status", "--redis-url", urls["tf-admin"]]) == 0
        capsys.readouterr()
        # every command the fleet sent was allowed: Redis logged no denial for these users
        assert _acl_denials(rr, USERS) == []
        w.signal(15)
        assert w.wait() == 0, w.output()
        assert _acl_denials(rr, USERS) == []
        for bad in ("Traceback", "NOPERM", "CLIENT UNBLOCK refused"):
            assert bad not in w.output(), w.output()
    finally:
        w.close()


def test_a_gateway_with_api_keys_runs_as_the_gateway_user(
    urls: dict[str, str],
    rr: redis.Redis,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    rr.acl_log_reset()
    w = WorkerProc(tiny_model_dir, urls["tf-worker"], PREFIX, "acl-gw-w", tmp_path)
    port = free_port()
    env = {"REDIS_URL": urls["tf-gateway"], "TOKENFLEET_KEY_PREFIX": PREFIX}
    args = ["serve", "--port", str(port), "--auth", "required", "--log-level", "warning"]
    gateway = ChildProcess(tokenfleet_args(*args), tmp_path / "gateway.log", env)
    try:
        w.wait_ready(rr)
        admin = ApiKeyAdmin(
            redis.Redis.from_url(urls["tf-admin"]),
            Settings(redis_url=urls["tf-admin"], key_prefix=PREFIX),
        )
        secret, _ = admin.create("acl-gateway-key", rpm=100, tpm=10_000)
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert gateway.alive(), gateway.output()
            try:
                return httpx.get(base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, "the gateway")
        resp = httpx.post(
            base + "/v1/completions",
            json={"model": "default", "prompt": "Hi", "max_tokens": 3},
            headers={"Authorization": f"Bearer {secret}"},
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-ratelimit-remaining-requests"] == "99"
        rid = resp.json()["id"]
        got = httpx.get(f"{base}/v1/requests/{rid}", headers={"Authorization": f"Bearer {secret}"})
        assert got.json()["status"] == "done"
        # a batch, uploaded, driven by the gateway's runner and read back, as tf-gateway
        auth = {"Authorization": f"Bearer {secret}"}
        line = {
            "custom_id": "acl-1",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "default", "prompt": "Hi", "max_tokens": 2},
        }
        upload = httpx.post(
            base + "/v1/files",
            headers=auth,
            files={"file": ("b.jsonl", orjson.dumps(line) + b"\n")},
            data={"purpose": "batch"},
        )
        assert upload.status_code == 200, upload.text
        made = httpx.post(
            base + "/v1/batches",
            headers=auth,
            json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions"},
        )
        assert made.status_code == 200, made.text
        bid = made.json()["id"]
        final = wait_for(
            lambda: (
                (b := httpx.get(f"{base}/v1/batches/{bid}", headers=auth).json())["status"]
                == "completed"
                and b
            ),
            "the batch to complete",
        )
        content = httpx.get(f"{base}/v1/files/{final['output_file_id']}/content", headers=auth)
        assert orjson.loads(content.content.splitlines()[0])["custom_id"] == "acl-1"
        assert _acl_denials(rr, USERS) == []
    finally:
        gateway.signal(signal.SIGTERM)
        gateway.wait(30)
        gateway.close()
        w.close()
    assert b"NOPERM" not in (tmp_path / "gateway.log").read_bytes()


def _refused(url: str, *command: Any) -> bool:
    client = redis.Redis.from_url(url)
    try:
        client.execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return True
    finally:
        client.close()
    return False


ADMIN_COMMANDS = [
    ("CONFIG", "GET", "maxmemory"),
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("KEYS", "*"),
    ("CLIENT", "KILL", "TYPE", "pubsub"),
    ("SAVE",),
    ("SWAPDB", "0", "1"),
    ("ACL", "LIST"),
    ("GET", "other-fleet:key"),  # outside the prefix
    ("PUBLISH", "other-fleet:ch:1", "x"),
]


def test_a_producer_cannot_run_worker_or_admin_commands(
    urls: dict[str, str],
    rr: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", PREFIX)
    stream = f"{PREFIX}:q:default:normal"
    if not rr.exists(stream):
        rr.xgroup_create(stream, "workers", id="0", mkstream=True)
    worker_only = [
        ("XREADGROUP", "GROUP", "workers", "thief", "STREAMS", stream, ">"),
        ("XCLAIM", stream, "workers", "thief", "0", "0-1"),
        ("XAUTOCLAIM", stream, "workers", "thief", "0", "0"),
        ("XPENDING", stream, "workers"),
        ("CLIENT", "UNBLOCK", "1"),
        ("HSET", f"{PREFIX}:worker:fake", "beat", "1"),  # a worker registration
        ("ZADD", f"{PREFIX}:workers", "1", "fake"),
        ("HSET", f"{PREFIX}:pool:p", "total", "1"),  # a pool
        ("XADD", f"{PREFIX}:dead", "*", "a", "1"),  # the dead-letter stream
    ]
    producer = urls["tf-producer"]
    for command in worker_only + ADMIN_COMMANDS:
        assert _refused(producer, *command), command
    # what the producer may do, it may do: read anything under the prefix
    assert not _refused(producer, "HGETALL", f"{PREFIX}:pool:p")
    # pool admin through the CLI: a clean refusal, no traceback
    assert main(["pool", "create", "p1", "--blocks", "64", "--redis-url", producer]) == 1
    assert "Redis refused" in capsys.readouterr().err
    for command in ADMIN_COMMANDS:
        assert _refused(urls["tf-worker"], *command), command
        assert _refused(urls["tf-admin"], *command), command
    assert main(["pool", "create", "p1", "--blocks", "64", "--redis-url", urls["tf-admin"]]) == 0
    rr.delete(f"{PREFIX}:pool:p1", f"{PREFIX}:pool:p1:members", f"{PREFIX}:pools", stream)


def test_a_worker_user_without_client_unblock_says_so_once(
    urls: dict[str, str],
    rr: redis.Redis,
    redis_server: RedisServer,
    tiny_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    password = os.urandom(12).hex()
    argv = next(
        c
        for c in documented_acl_commands(PREFIX, dict.fromkeys(USERS, password))
        if "tf-worker" in c
    )
    user = "tf-worker-nounblock"
    rr.execute_command(*[user if a == "tf-worker" else a for a in argv], "-client|unblock")
    url = user_url(redis_server.url, user, password)
    try:
        # in-process: the reader asks once, then leaves blocking reads to their timeout
        client = redis.Redis.from_url(url)
        reader = IntakeReader(
            make_intake(client, Settings(redis_url=url, key_prefix=PREFIX)), block_ms=50
        )
        reader._conn_id = client.client_id()

        class _Read:
            blocking = True

        rr.acl_log_reset()
        with caplog.at_level(logging.WARNING, logger="tokenfleet.worker.intake.reader"):
            for _ in range(3):
                reader._read = _Read()  # type: ignore[assignment]
                reader._unblock()
        assert [r.message.count("CLIENT UNBLOCK refused") for r in caplog.records] == [1]
        assert len(_acl_denials(rr, {user})) == 1  # sent once, never again
        client.close()

        # a real worker process with that user: idle (a blocking read armed), then SIGTERM
        w = WorkerProc(tiny_model_dir, url, PREFIX, "acl-nounblock", tmp_path)
        try:
            w.wait_ready(rr)

            def blocked() -> bool:
                return any(
                    c.get("user") == user and "b" in c.get("flags", "") for c in rr.client_list()
                )

            wait_for(blocked, "the worker's blocking read")
            w.signal(15)
            assert w.wait() == 0, w.output()
            out = w.output()
            assert out.count("CLIENT UNBLOCK refused") == 1, out
            assert "Traceback" not in out, out
        finally:
            w.close()
    finally:
        rr.acl_deluser(user)
        rr.delete(*(rr.keys(f"{PREFIX}:*") or ["-"]))


def test_every_role_may_wait_for_replicas_and_a_refused_wait_is_not_lag(
    urls: dict[str, str], rr: redis.Redis
) -> None:
    """``TOKENFLEET_REDIS_WAIT_REPLICAS`` ends round trips with ``WAIT``: the documented roles
    allow it; a user without it gets Redis's ``NOPERM`` at once, never an endless "replicas
    lag" outage."""
    from tokenfleet.shared.redis_connect import redis_client
    from tokenfleet.worker.pipelined import ScriptPipeline

    for user in USERS:
        assert not _refused(urls[user], "WAIT", 0, 0), user
    rr.acl_setuser(
        "tf-nowait",
        enabled=True,
        passwords=["+nowait-pw"],
        keys=[f"{PREFIX}:*"],
        commands=["+ping", "+hello", "+auth", "+select", "+client|setname"],
    )
    try:
        url = "unix://tf-nowait:nowait-pw@" + urls["tf-admin"].split("@", 1)[1]
        client = redis_client(Settings(redis_url=url, redis_wait_replicas=1))
        try:
            pipe = ScriptPipeline(client)
            pipe.command("PING")
            with pytest.raises(redis.exceptions.NoPermissionError):
                pipe.execute()
        finally:
            client.close()
    finally:
        rr.acl_deluser("tf-nowait")
