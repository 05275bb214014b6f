"""The console in a real browser: Debian's headless Chromium (``scripts/ensure_chromium.sh``
installs it; Playwright's Python package drives it through ``executable_path``: no browser of
Playwright's own is ever downloaded) against a real gateway (API keys on), a real worker (the
tiny Llama) and the suite's Redis.

What a person would check: the page loads with no console errors; while requests flow its
numbers change without a reload and, the fleet held still, equal ``tokenfleet status --json``'s;
a request found by the search box shows its tokens as they arrive on its page; a batch's
progress advances; a dead-lettered request (its record lapsed while the worker was stopped)
requeued from the page runs; a viewer key cannot act; a prompt holding ``<script>`` shows as
text and runs nothing. Screenshots go to test-artifacts/console/ (gitignored).
"""

from __future__ import annotations

import io
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
from gateway_helpers import Fleet, wait_for
from pretend_worker import fail_waiting

from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer

playwright = pytest.importorskip("playwright.sync_api")  # (the test extra installs it)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "console"
CHROMIUM = Path("/usr/bin/chromium")
# as root, headless Chromium needs these (Playwright adds --headless and its own fresh
# --user-data-dir for each launch)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
WAIT_S = 90.0
# The held-fleet test's work: 16 requests two at a time, long enough (1,600 steps) that an idle
# machine cannot finish them in the few page readings it takes to see the numbers move.
FLOW_REQUESTS, FLOW_TOKENS = 16, 200
SCRIPT = "<script>window.__pwned = 1</script><img src=x onerror=window.__pwned=2>"


@pytest.fixture(scope="module")
def fleet(
    redis_server: RedisServer,
    plain_redis: redis.Redis,
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    yield from console_fleet(
        redis_server,
        plain_redis,
        tiny_llama_dir,
        tmp_path_factory.mktemp("console-browser"),
        # two at a time, so that queues form; a heartbeat that outlives a held (SIGSTOP) worker
        worker_args=("--max-num-seqs", "2", "--heartbeat-ttl-s", "60"),
        gateway_env={"TOKENFLEET_GATEWAY_CONSOLE_REFRESH_S": "0.5"},
    )


@pytest.fixture(scope="module")
def keys(fleet: Fleet) -> ConsoleKeys:
    return make_keys(fleet.r, Settings(redis_url=fleet.redis_url, key_prefix=fleet.prefix))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing: run 'make chromium' (scripts/ensure_chromium.sh)")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Visit:
    """A browser context logged in with one key, collecting console errors."""

    def __init__(self, browser: Any, fleet: Fleet, key: str) -> None:
        self.fleet = fleet
        self.context = browser.new_context(viewport={"width": 1500, "height": 1000})
        self.context.set_default_timeout(WAIT_S * 1000)
        self.errors: list[str] = []
        self.page = self.open("/console/login")
        self.page.fill("input[name=key]", key)
        self.page.click("form[action='/console/login'] button")
        self.page.wait_for_url("**/console")

    def open(self, path: str) -> Any:
        page = self.context.new_page()
        page.on("console", self._console)
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.goto(self.fleet.gateway.url + path)
        return page

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def shot(self, page: Any, name: str) -> None:
        page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def admin(browser: Any, fleet: Fleet, keys: ConsoleKeys) -> Iterator[Visit]:
    visit = Visit(browser, fleet, keys.admin)
    yield visit
    visit.close()


def until(check: Callable[[], Any], what: str) -> Any:
    return wait_for(check, what, WAIT_S)


def cell(page: Any, row: str, key: str) -> str:
    text: str = page.locator(f"{row} [data-k='{key}']").first.inner_text()
    return text.strip()


def read_at(page: Any) -> float:
    return float(page.locator("#read-at").get_attribute("data-at"))


def test_the_page_loads_without_errors_and_keeps_itself_live(admin: Visit) -> None:
    page = admin.page
    for section in ("queues", "workers", "pools", "requests", "batches", "keys", "dead"):
        assert page.locator(f"section#{section}").count() == 1
    first = read_at(page)
    until(lambda: read_at(page) > first + 1, "two more readings of the live feed")
    assert page.locator(f"tr[data-worker='{admin.fleet.worker.name}']").count() == 1
    admin.shot(page, "console-idle")
    assert admin.errors == []


def test_numbers_change_live_and_equal_status_json_while_held(admin: Visit) -> None:
    fleet, page = admin.fleet, admin.page
    page.evaluate("window.__stayed = 1")  # gone if the page reloads
    worker_row = f"tr[data-worker='{fleet.worker.name}']"
    queue_row = "tr[data-queue='default|normal']"
    tokens_before = int(cell(page, worker_row, "tokens_total") or 0)
    with client(fleet.redis_url, fleet.prefix) as producer:
        producer.submit_many(
            [
                {"prompt": f"flow {i}", "max_tokens": FLOW_TOKENS, "ignore_eos": True}
                for i in range(FLOW_REQUESTS)
            ]
        )
    seen_waiting, seen_tokens = set(), set()

    def moving() -> bool:
        seen_waiting.add(int(cell(page, queue_row, "waiting")))
        seen_tokens.add(int(cell(page, worker_row, "tokens_total")))
        return len(seen_waiting) >= 3 and len(seen_tokens) >= 3

    until(moving, "the queue's and the worker's numbers to change on the page")
    fleet.worker.signal(signal.SIGSTOP)  # held: nothing moves until SIGCONT
    try:
        held_at = time.time()
        until(lambda: read_at(page) > held_at + 1.0, "a reading of the held fleet")
        printed = status_json(fleet.redis_url, fleet.prefix)
        [queue] = [
            q for q in printed["queues"] if (q["model"], q["priority"]) == ("default", "normal")
        ]
        [worker] = [w for w in printed["workers"] if w["name"] == fleet.worker.name]
        assert queue["waiting"] + queue["running"] > 0  # held mid-flow: non-trivial numbers
        admin.shot(page, "console-flowing")
        for key in ("waiting", "running", "max_waiting", "lag"):
            assert cell(page, queue_row, key) == str(queue[key]), key
        for key in ("running", "waiting", "tokens_total"):
            assert cell(page, worker_row, key) == str(worker[key]), key
        kv = f"{worker['kv_blocks_used']}/{worker['kv_blocks_total']}"
        assert cell(page, worker_row, "kv_blocks") == kv
    finally:
        fleet.worker.signal(signal.SIGCONT)
    until(
        lambda: (
            int(cell(page, worker_row, "tokens_total"))
            >= tokens_before + FLOW_REQUESTS * FLOW_TOKENS
        ),
        "every flowed token on the page",
    )
    assert page.evaluate("window.__stayed") == 1  # updated in place, never reloaded
    assert admin.errors == []


def test_a_requests_page_shows_its_tokens_as_they_arrive(admin: Visit) -> None:
    fleet = admin.fleet
    with client(fleet.redis_url, fleet.prefix) as producer:
        handle = producer.submit("tell a long story", max_tokens=300, ignore_eos=True)
    page = admin.page  # found through the search box, as a person would
    page.fill("form.search input[name=id]", handle.request_id)
    page.click("form.search button")
    page.wait_for_url(f"**/console/requests/{handle.request_id}")
    counts: list[int] = []

    def arriving() -> bool:
        n = page.locator("#tokens .tok").count()
        if not counts or n != counts[-1]:
            counts.append(n)
        return page.locator("#record [data-k='status']").inner_text().strip() == "done"

    until(arriving, "the request to end on its page")
    assert counts == sorted(counts) and len([c for c in counts if 0 < c < 300]) >= 3, counts
    assert page.locator("#tokens .tok").count() == 300
    assert page.locator("#record [data-k='num_tokens']").inner_text().strip() == "300"
    assert "ended" in page.locator("#token-state").inner_text()
    admin.shot(page, "console-request")
    assert admin.errors == []


LINES = 16


def test_a_batchs_progress_advances(admin: Visit, keys: ConsoleKeys) -> None:
    from openai import OpenAI

    fleet, page = admin.fleet, admin.page
    api = OpenAI(base_url=fleet.base_url, api_key=keys.user)
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            # long enough (2 run at a time) for the page's 0.5 s readings to catch it midway
            "body": {
                "model": "default",
                "prompt": f"line {i}",
                "max_tokens": 48,
                "ignore_eos": True,
            },
        }
        for i in range(LINES)
    ]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    upload = api.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch")
    batch = api.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    api.close()
    row = f"tr[data-batch='{batch.id}']"
    values: list[int] = []

    # the row's status and progress read in one script run: htmx cannot swap the row between
    # the two reads (read apart, a swap between them paired an old bar with a new status)
    read_row = """row => {
        const tr = document.querySelector(row);
        if (!tr) return null;
        return [tr.querySelector("[data-k='status']").innerText.trim(),
                Number(tr.querySelector("progress").getAttribute("value") || 0)];
    }"""

    def advancing() -> bool:
        got = page.evaluate(read_row, row)
        if got is None:
            return False
        status, done = got
        if not values or values[-1] != done:
            values.append(done)
        return status == "completed"

    until(advancing, "the batch to complete on the page")
    assert values == sorted(values) and values[-1] == LINES, values
    assert len([v for v in values if 0 < v < LINES]) >= 2, values  # seen advancing
    assert (cell(page, row, "completed"), cell(page, row, "failed")) == (str(LINES), "0")
    admin.shot(page, "console-batch")
    assert admin.errors == []


def test_requeue_runs_a_dead_lettered_request_and_its_prompt_stays_text(admin: Visit) -> None:
    """The worker held, a request's record lapses (its producer's record TTL is 1 s); let go,
    the worker finds no record and dead-letters it. Requeued from the page, it runs."""
    fleet, page = admin.fleet, admin.page
    fleet.worker.signal(signal.SIGSTOP)
    try:
        with client(fleet.redis_url, fleet.prefix, record_ttl_s=1) as producer:
            lapsed = producer.submit(SCRIPT, max_tokens=8, ignore_eos=True)
        until(lambda: not fleet.r.exists(fleet.keys.record(lapsed.request_id)), "record lapse")
    finally:
        fleet.worker.signal(signal.SIGCONT)
    row = f"#dead-body tr:has(a:text-is('{lapsed.request_id}'))"
    until(lambda: page.locator(row).count() == 1, "the dead letter on the page")
    assert "no durable record" in page.locator(f"{row} [data-k='reason']").inner_text()
    assert page.locator(f"{row} code.prompt").inner_text().startswith("<script>window.__pwned")
    assert page.locator(f"{row} code.prompt script").count() == 0
    assert page.evaluate("window.__pwned") is None  # shown as text: nothing ran
    admin.shot(page, "console-dead-letter")
    page.locator(f"{row} button:text-is('Requeue')").click()
    link = page.locator("#action-note a")
    link.wait_for()
    new_id = link.inner_text().strip()
    assert new_id.startswith(lapsed.request_id + ".r")
    with client(fleet.redis_url, fleet.prefix) as producer:
        result = producer.handle(new_id).result(timeout=WAIT_S)  # (raises unless done)
    assert result.usage["completion_tokens"] == 8
    until(lambda: page.locator(row).count() == 0, "the requeued letter to leave the table")
    assert page.evaluate("window.__pwned") is None
    assert admin.errors == []


def test_a_viewer_key_cannot_act_and_a_waiting_prompt_shows_as_text(
    browser: Any, fleet: Fleet, keys: ConsoleKeys
) -> None:
    with client(fleet.redis_url, fleet.prefix) as producer:
        producer.submit("to fail", model=IDLE_MODEL, max_tokens=4)
        waiting = producer.submit(SCRIPT, model=IDLE_MODEL, max_tokens=4)
    failed = fail_waiting(fleet.r, fleet.keys, IDLE_MODEL)  # the oldest: "to fail"
    viewer = Visit(browser, fleet, keys.viewer)
    try:
        page = viewer.page
        row = f"#dead-body tr:has(a:text-is('{failed}'))"
        until(lambda: page.locator(row).count() == 1, "the dead letter on the viewer's page")
        assert page.locator("button:text-is('Requeue'), button:text-is('Discard')").count() == 0
        assert page.locator("button:text-is('Cancel')").count() == 0
        entry = page.locator(row).get_attribute("data-dead")
        refused = viewer.context.request.post(
            fleet.gateway.url + "/console/dead/discard",
            form={"lane": "", "entry": entry},
            headers={"HX-Request": "true"},
        )
        assert refused.status == 403 and "may look, not act" in refused.text()
        assert fleet.r.xlen(fleet.keys.dead_letter) >= 1
        viewer.shot(page, "console-viewer")

        request_page = viewer.open(f"/console/requests/{waiting.request_id}")
        prompt = request_page.locator("#prompt")
        assert prompt.inner_text() == SCRIPT  # the waiting request's prompt, as text
        assert prompt.locator("script, img").count() == 0
        assert request_page.evaluate("window.__pwned") is None
        assert request_page.locator("button:text-is('Cancel')").count() == 0
        assert viewer.errors == []
    finally:
        viewer.close()
    with client(fleet.redis_url, fleet.prefix) as producer:
        assert producer.cancel(waiting.request_id)  # (the idle model's queue left empty)
