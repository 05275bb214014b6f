"""The console over plain HTTP, against a real gateway (API keys on) and a real worker: who may
look and who may act, request text escaped in every page, a dead letter requeued, the numbers
the JSON feed shows equal to ``tokenfleet status --json``'s, and every metric the Grafana
dashboard names exported by the worker or the gateway."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from console_helpers import (
    IDLE_MODEL,
    ConsoleKeys,
    client,
    console_fleet,
    make_keys,
    status_json,
)
from gateway_helpers import Fleet, Proc, wait_for
from grafana_queries import DASHBOARDS, metric_names, queries
from pretend_worker import fail_waiting
from prometheus_client.parser import text_string_to_metric_families

from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer, free_port

pytestmark = pytest.mark.slow
SCRIPT = "<script>window.__pwned = 1</script><img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def fleet(
    redis_server: RedisServer,
    plain_redis: redis.Redis,
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    metrics_port: int,
) -> Iterator[Fleet]:
    yield from console_fleet(
        redis_server,
        plain_redis,
        tiny_llama_dir,
        tmp_path_factory.mktemp("console-http"),
        worker_args=("--metrics-port", str(metrics_port)),
        threaded=True,  # no test signals the worker
    )


@pytest.fixture(scope="module")
def keys(fleet: Fleet) -> ConsoleKeys:
    return make_keys(fleet.r, Settings(redis_url=fleet.redis_url, key_prefix=fleet.prefix))


def test_pages_need_a_viewer_key_and_actions_an_admin_key(fleet: Fleet, keys: ConsoleKeys) -> None:
    with httpx.Client(base_url=fleet.gateway.url, timeout=30) as http:
        nobody = http.get("/console")
        assert nobody.status_code == 401 and 'action="/console/login"' in nobody.text
        assert http.get("/console/status.json").status_code == 401
        user = http.get("/console", headers=keys.bearer("user"))
        assert user.status_code == 403 and "needs viewer or admin" in user.text
        viewer = http.get("/console", headers=keys.bearer("viewer"))
        assert (
            viewer.status_code == 200
            and "script-src 'self'" in (viewer.headers["content-security-policy"])
        )
        form = {"lane": "", "entry": "1-1"}
        refused = http.post("/console/dead/discard", data=form, headers=keys.bearer("viewer"))
        assert refused.status_code == 403 and "may look, not act" in refused.text
        allowed = http.post("/console/dead/discard", data=form, headers=keys.bearer("admin"))
        assert allowed.status_code == 200 and "already gone" in allowed.text

        assert http.post("/console/login", data={"key": keys.user}).status_code == 403
        assert http.post("/console/login", data={"key": "tf-bogus"}).status_code == 401
        login = http.post("/console/login", data={"key": keys.admin})
        assert login.status_code == 303 and login.headers["location"] == "/console"
        cookie = login.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
        # the cookie alone does not act: a form on another site could send it
        assert http.post("/console/dead/discard", data=form).status_code == 403
        sent = http.post("/console/dead/discard", data=form, headers={"HX-Request": "true"})
        assert sent.status_code == 200
        assert http.get("/console").status_code == 200  # the cookie opens the page
        http.post("/console/logout")
        assert http.get("/console").status_code == 401


def test_request_text_is_escaped_and_a_dead_letter_requeues(
    fleet: Fleet, keys: ConsoleKeys
) -> None:
    with client(fleet.redis_url, fleet.prefix) as producer:
        waiting = producer.submit(SCRIPT, model=IDLE_MODEL, max_tokens=4, request_id="xss-wait")
        producer.submit(SCRIPT + " failing", model=IDLE_MODEL, max_tokens=4, request_id="xss-dead")
    wait_for(lambda: fleet.r.xlen(fleet.keys.stream(IDLE_MODEL, Priority.NORMAL)) == 2, "2 queued")
    failed = fail_waiting(fleet.r, fleet.keys, IDLE_MODEL)  # xss-wait: the oldest
    assert failed == waiting.request_id
    admin = keys.bearer("admin")
    with httpx.Client(base_url=fleet.gateway.url, timeout=30, headers=admin) as http:
        page = http.get("/console/requests/xss-dead").text  # still waiting: its prompt shows
        console = http.get("/console").text  # the dead letter's prompt, the requests' ids
        for html in (page, console):
            assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in html
            assert "<script>window" not in html and "<img src=x" not in html
        snap = http.get("/console/status.json").json()
        [letter] = [d for d in snap["dead"] if d["request_id"] == failed]
        assert letter["reason"] == "engine_error: failed on purpose" and letter["requeueable"]
        form = {"lane": letter["lane"], "entry": letter["entry"]}
        done = http.post("/console/dead/requeue", data=form)
        assert done.status_code == 200 and f'requeued as <a href="/console/requests/{failed}.r' in (
            done.text
        )
        again = http.post("/console/dead/requeue", data=form)  # gone: nothing runs twice
        assert again.status_code == 409 and "no dead letter" in again.text
    with client(fleet.redis_url, fleet.prefix) as producer:
        [new] = [r for r in producer.queue_stats() if r.model == IDLE_MODEL]
        assert new.waiting == 2  # xss-dead and the requeued one


def test_the_json_feed_shows_what_status_json_prints(fleet: Fleet, keys: ConsoleKeys) -> None:
    """With nothing moving (the idle model's queue, no submit meanwhile), the console's reading
    and ``tokenfleet status --json`` agree on every queue and on the workers' counts."""
    with httpx.Client(base_url=fleet.gateway.url, timeout=30) as http:
        console = http.get("/console/status.json", headers=keys.bearer("viewer")).json()["status"]
    printed = status_json(fleet.redis_url, fleet.prefix)
    assert set(console) == set(printed)
    steady = ("model", "priority", "waiting", "running", "max_waiting", "policy", "lag")
    idle = [{k: q[k] for k in steady} for q in console["queues"] if q["model"] == IDLE_MODEL]
    assert idle == [
        {k: q[k] for k in steady} for q in printed["queues"] if q["model"] == IDLE_MODEL
    ]
    assert [w["name"] for w in console["workers"]] == [w["name"] for w in printed["workers"]]
    assert console["dead_letters"] == printed["dead_letters"]


def test_every_metric_the_dashboard_names_is_exported(
    fleet: Fleet, keys: ConsoleKeys, metrics_port: int
) -> None:
    """Each metric a deploy/grafana dashboard query names is declared by the real worker's or
    the real gateway's ``/metrics`` (after a few requests through the gateway)."""
    with httpx.Client(base_url=fleet.base_url, headers=keys.bearer("user"), timeout=60) as api:
        answers = [
            api.post("/completions", json={"model": "default", "prompt": "hi", "max_tokens": 3})
            for _ in range(2)
        ]
    for answer in answers:
        assert answer.status_code == 200, answer.text
    exported: set[str] = set()
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as got:
        texts = [got.read().decode(), httpx.get(fleet.gateway.url + "/metrics").text]
    for text in texts:
        for family in text_string_to_metric_families(text):
            exported.add(family.name)
            exported |= {s.name for s in family.samples}
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
            exported |= {family.name + s for s in suffixes.get(family.type, ())}
    named = set().union(
        *(metric_names(q) for p in DASHBOARDS for q in queries(json.loads(p.read_text())))
    )
    assert len(named) > 20
    assert named - exported == set()


def test_tokenfleet_console_serves_the_page_without_a_gateway(
    fleet: Fleet, keys: ConsoleKeys, tmp_path: Path
) -> None:
    port = free_port()
    args = [sys.executable, "-m", "tokenfleet.worker.cli", "console", "--port", str(port)]
    env = {"REDIS_URL": fleet.redis_url, "TOKENFLEET_KEY_PREFIX": fleet.prefix}
    proc = Proc([*args, "--auth", "required", "--log-level", "warning"], env, tmp_path / "c.log")
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert proc.alive(), proc.output()
            try:
                return httpx.get(url + "/console/login", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, "tokenfleet console")
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/console", headers=keys.bearer("user")).status_code == 403
            page = http.get("/console", headers=keys.bearer("viewer"))
            assert page.status_code == 200 and "<h2>Queues</h2>" in page.text
            status = http.get("/console/status.json", headers=keys.bearer("viewer")).json()
            assert status["status"]["prefix"] == fleet.prefix
            assert fleet.worker.name in [w["name"] for w in status["status"]["workers"]]
            script = http.get("/console/static/vendor/htmx.min.js")  # served by itself
            assert script.status_code == 200 and "htmx" in script.text[:2000]
    finally:
        proc.close()


def test_api_keys_show_their_use_and_refusals(fleet: Fleet, keys: ConsoleKeys) -> None:
    from tokenfleet.producer.gateway.auth import ApiKeyAdmin

    settings = Settings(redis_url=fleet.redis_url, key_prefix=fleet.prefix)
    limited, key = ApiKeyAdmin(fleet.r, settings).create("one-a-minute", rpm=1, tpm=10_000)
    body = {"model": "default", "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=fleet.base_url, timeout=60) as api:
        auth = {"Authorization": f"Bearer {limited}"}
        assert api.post("/completions", json=body, headers=auth).status_code == 200
        assert api.post("/completions", json=body, headers=auth).status_code == 429
    with httpx.Client(base_url=fleet.gateway.url, timeout=30) as http:
        snap = http.get("/console/status.json", headers=keys.bearer("viewer")).json()
        page = http.get("/console", headers=keys.bearer("viewer")).text
    [row] = [k for k in snap["keys"] if k["key_id"] == key.key_id]
    assert (row["rpm"], row["requests_used"], row["refused"]) == (1, 1, 1)
    # (its tokens bucket refills 10,000 a minute: what it shows used is gone within a second)
    assert 0 <= row["tokens_used"] <= 10_000 and row["tpm"] == 10_000
    assert f'<tr data-key="{key.key_id}">' in page and "1/1" in page


def test_a_kv_pool_shows_its_members_as_status_json_does(fleet: Fleet, keys: ConsoleKeys) -> None:
    """A pool with two members (scripted through the real pool scripts, weights 2 and 1, both
    active): the console shows its total, what is held, and each member's weight and holding,
    equal to ``tokenfleet status --json``'s."""
    from tokenfleet.worker.pool.admin import create_pool
    from tokenfleet.worker.pool.config import PoolConfig
    from tokenfleet.worker.pool.member import KVPoolMember

    config = PoolConfig(total_blocks=96, block_size=16, cap_permille=750, lease_ms=600_000)
    create_pool(fleet.r, fleet.keys, "console-gpu", config)
    members = [
        KVPoolMember(client=fleet.r, keys=fleet.keys, pool="console-gpu", member=n, weight=w)
        for n, w in (("m-a", 2.0), ("m-b", 1.0))
    ]
    try:
        for m in members:
            m.join()
        for m, want in zip(members, (80, 16), strict=True):
            m.step(active=True, want_blocks=want)
        with httpx.Client(base_url=fleet.gateway.url, timeout=30) as http:
            page = http.get("/console", headers=keys.bearer("viewer")).text
            snap = http.get("/console/status.json", headers=keys.bearer("viewer")).json()
        printed = status_json(fleet.redis_url, fleet.prefix)
        [pool] = [p for p in printed["pools"] if p["name"] == "console-gpu"]
        [shown] = [p for p in snap["status"]["pools"] if p["name"] == "console-gpu"]
        steady = ("name", "total", "held", "cap")
        assert {k: shown[k] for k in steady} == {k: pool[k] for k in steady}
        assert pool["total"] == 96 and pool["held"] > 0  # (the entitlements' split: pool tests)
        block = page.split('<div class="pool" data-pool="console-gpu">', 1)[1].split("</div>")[0]
        assert f'<span data-k="held">{pool["held"]}</span> of <span data-k="total">96</span>' in (
            block
        )
        for member in pool["members"]:
            row = block.split(f'<tr data-member="{member["name"]}">', 1)[1].split("</tr>")[0]
            assert f'data-k="weight">{member["weight"]}</td>' in row
            assert f'data-k="held">{member["held"]}</td>' in row
        assert [m["name"] for m in pool["members"]] == ["m-a", "m-b"]
        assert [m["weight"] for m in pool["members"]] == [2.0, 1.0]
    finally:
        for m in members:
            m.leave()


def test_cancel_needs_an_admin_key_and_ends_a_waiting_request(
    fleet: Fleet, keys: ConsoleKeys
) -> None:
    with (
        client(fleet.redis_url, fleet.prefix) as producer,
        httpx.Client(base_url=fleet.gateway.url, timeout=30) as http,
    ):
        waiting = producer.submit("wait to be cancelled", model=IDLE_MODEL, max_tokens=4)
        path = f"/console/requests/{waiting.request_id}/cancel"
        refused = http.post(path, headers=keys.bearer("viewer"))
        assert refused.status_code == 403 and "may look, not act" in refused.text
        assert producer.status(waiting.request_id).status.value == "queued"  # nothing changed
        done = http.post(path, headers=keys.bearer("admin"))
        assert done.status_code == 200 and "cancelled" in done.text
        assert producer.status(waiting.request_id).status.value == "cancelled"
        again = http.post(path, headers=keys.bearer("admin"))
        assert again.status_code == 200 and "it had already ended" in again.text
        unknown = http.post("/console/requests/no-such-id/cancel", headers=keys.bearer("admin"))
        assert unknown.status_code == 404


def test_the_search_box_opens_a_requests_page(fleet: Fleet, keys: ConsoleKeys) -> None:
    with client(fleet.redis_url, fleet.prefix) as producer:
        handle = producer.submit("find me", max_tokens=2)
        handle.result(timeout=60)
    rid = handle.request_id
    with httpx.Client(base_url=fleet.gateway.url, timeout=30, headers=keys.bearer("viewer")) as h:
        found = h.get("/console/requests", params={"id": f"  {rid} "})
        assert found.status_code == 303 and found.headers["location"] == f"/console/requests/{rid}"
        page = h.get(found.headers["location"])
        assert page.status_code == 200 and rid in page.text
        assert '<span class="status done">done</span>' in page.text
        bad = h.get("/console/requests", params={"id": "not an id!"})
        assert bad.status_code == 400 and "id" in bad.json()["error"]["param"]
        missing = h.get("/console/requests/never-submitted")
        assert missing.status_code == 404 and "never-submitted" in missing.text
