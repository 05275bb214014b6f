"""End to end through one real worker process: producer protocol → worker → stream and record.

One worker serves the whole module (prefix ``tfe``); each test uses its own request ids.
"""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from worker_helpers import (
    WorkerProc,
    enqueue,
    make_request,
    record,
    subscribe,
    token_events,
    wait_for,
    wait_terminal,
)

from tokenfleet.producer import Client
from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import SamplingParams, TerminalEvent
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer, free_port
from tokenfleet.worker.engine.request import SamplingParams as EngineParams

pytestmark = pytest.mark.slow
PREFIX = "tfe"
KEYS = Keys(PREFIX)


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(
    tiny_model_dir: Path,
    redis_server: RedisServer,
    rr: redis.Redis,
    tmp_path_factory: pytest.TempPathFactory,
    metrics_port: int,
) -> Iterator[WorkerProc]:
    w = WorkerProc(
        tiny_model_dir,
        redis_server.url,
        PREFIX,
        "e2e-1",
        tmp_path_factory.mktemp("logs"),
        "--max-num-seqs",
        "8",
        "--metrics-port",
        str(metrics_port),
    )
    try:
        w.wait_ready(rr)
        yield w
        w.signal(15)
        assert w.wait() == 0, w.output()
    finally:
        w.close()


def _engine_params(s: SamplingParams) -> EngineParams:
    return EngineParams(
        temperature=s.temperature,
        max_tokens=s.max_tokens,
        stop=s.stop,
        ignore_eos=s.ignore_eos,
        seed=s.seed,
    )


def test_greedy_output_equals_the_in_process_engine(
    worker: WorkerProc, rr: redis.Redis, cold_ref_engine: Any
) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    messages = ({"role": "user", "content": "Tell me about the sea."},)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("e2e-plain", {"prompt": "Once upon a time", "sampling": greedy}),
        ("e2e-ids", {"prompt_token_ids": (5, 17, 42, 99, 7), "sampling": greedy}),
        ("e2e-chat", {"messages": messages, "sampling": greedy}),
        (
            "e2e-stop",
            {
                "prompt": "The river ran",
                "sampling": SamplingParams(max_tokens=40, temperature=0.0, stop=(" the",)),
            },
        ),
        (
            "e2e-seeded",
            {
                "prompt": "In the morning",
                "priority": Priority.CRITICAL,
                "sampling": SamplingParams(max_tokens=16, temperature=0.9, seed=7),
            },
        ),
    ]
    log = subscribe(rr, KEYS, [rid for rid, _ in cases])
    for rid, kw in cases:
        enqueue(rr, KEYS, make_request(rid, **kw))
    tok = cold_ref_engine.tokenizer
    chat_ids = tok(
        tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    prompts = ["Once upon a time", [5, 17, 42, 99, 7], chat_ids, "The river ran", "In the morning"]
    refs = cold_ref_engine.generate(prompts, [_engine_params(kw["sampling"]) for _, kw in cases])
    for (rid, _), ref in zip(cases, refs, strict=True):
        term = log.wait_terminal(rid)
        rec = wait_terminal(rr, KEYS, rid)
        streamed = log.tokens(rid)
        stored = token_events(rr, KEYS, rid)
        assert [e.index for e in streamed] == list(range(len(ref.token_ids))), rid
        assert streamed == stored
        assert [e.token_id for e in streamed] == ref.token_ids, rid
        assert "".join(e.text for e in streamed) == ref.text == rec.text
        assert term.status == "done" and term.finish_reason == ref.finish_reason.value
        assert term.num_tokens == rec.num_tokens == len(ref.token_ids)
        assert rec.attempts == 1 and rec.first_token_at is not None
        assert {"queue_s", "ttft_s", "e2e_s"} <= set(term.timings)
    stream = KEYS.stream("default", Priority.NORMAL)
    assert rr.xlen(stream) == 0  # acked and deleted
    assert rr.xpending(stream, CONSUMER_GROUP)["pending"] == 0


def test_cancel_mid_stream(worker: WorkerProc, rr: redis.Redis) -> None:
    rid = "e2e-cancel"
    log = subscribe(rr, KEYS, [rid])
    enqueue(
        rr,
        KEYS,
        make_request(
            rid, sampling=SamplingParams(max_tokens=20000, temperature=0.0, ignore_eos=True)
        ),
    )
    wait_for(lambda: len(log.tokens(rid)) >= 3, "a few tokens")
    assert (record(rr, KEYS, rid) or pytest.fail("no record")).status == "running"
    client = Client(rr, settings=Settings(key_prefix=PREFIX))
    assert client.cancel(rid)  # running: asked for, the worker stops it at its next step
    term = log.wait_terminal(rid)
    rec = wait_terminal(rr, KEYS, rid)
    assert term.status == "cancelled" and rec.status == "cancelled"
    assert term.num_tokens == rec.num_tokens == rr.llen(KEYS.tokens(rid)) < 20000
    assert [e.index for e in log.tokens(rid)] == list(range(term.num_tokens))
    assert not rr.sismember(KEYS.cancel_set, rid)
    # the worker freed the request: its heartbeat reports nothing running
    wait_for(lambda: rr.hget(KEYS.worker(worker.name), "running") == b"0", "running == 0")


def test_expired_request_is_never_started(worker: WorkerProc, rr: redis.Redis) -> None:
    rid = "e2e-expired"
    log = subscribe(rr, KEYS, [rid])
    enqueue(rr, KEYS, make_request(rid, deadline=time.time() - 1))
    term = log.wait_terminal(rid)
    rec = wait_terminal(rr, KEYS, rid)
    assert term.status == "expired" and rec.status == "expired"
    assert rec.started_at is None and rec.num_tokens == 0 and rr.llen(KEYS.tokens(rid)) == 0


def test_poison_guard_ends_a_request_that_outlived_the_limit(
    worker: WorkerProc, rr: redis.Redis
) -> None:
    rid = "e2e-poison"
    log = subscribe(rr, KEYS, [rid])
    # the record says 3 workers already died holding it (the default poison limit)
    enqueue(rr, KEYS, make_request(rid), attempts=3)
    term = log.wait_terminal(rid)
    assert term.status == "error" and term.code == "worker_lost", term
    assert (record(rr, KEYS, rid) or pytest.fail("no record")).code == "worker_lost"
    assert rr.llen(KEYS.tokens(rid)) == 0


def _xadd(rr: redis.Redis, fields: dict[Any, Any]) -> str:
    stream = KEYS.stream("default", Priority.BATCH)
    with contextlib.suppress(redis.ResponseError):
        rr.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    entry: Any = rr.xadd(stream, fields)
    return str(entry.decode())


def test_malformed_and_oversized_entries_are_dead_lettered(
    worker: WorkerProc, rr: redis.Redis
) -> None:
    good = make_request("e2e-bad-valid", sampling=SamplingParams(max_tokens=2)).to_dict()
    bad_temp = {**good, "id": "e2e-bad-temp", "sampling": {**good["sampling"], "temperature": -1}}
    huge = {**good, "id": "e2e-bad-huge", "prompt": "x" * 1_100_000}
    cases = {
        "e2e-bad-json": {"id": "e2e-bad-json", "d": b"{not json", "dl": ""},
        "e2e-bad-temp": {"id": "e2e-bad-temp", "d": orjson.dumps(bad_temp), "dl": ""},
        "e2e-bad-huge": {"id": "e2e-bad-huge", "d": orjson.dumps(huge), "dl": ""},
    }
    log = subscribe(rr, KEYS, list(cases))
    dead_before = rr.xlen(KEYS.dead_letter)
    entry_ids = [_xadd(rr, fields) for fields in cases.values()]
    entry_ids.append(_xadd(rr, {"garbage": b"\xff\xfe"}))  # no id at all
    for rid in cases:
        term = log.wait_terminal(rid)
        assert isinstance(term, TerminalEvent)
        assert term.status == "error" and term.code == "invalid_request", term
        rec = wait_terminal(rr, KEYS, rid)
        assert rec.status == "error" and rec.message
    stream = KEYS.stream("default", Priority.BATCH)
    wait_for(lambda: rr.xlen(KEYS.dead_letter) >= dead_before + 4, "4 dead letters")
    all_dead: Any = rr.xrange(KEYS.dead_letter)
    dead = all_dead[-4:]
    assert {d[1][b"entry_id"].decode() for d in dead} == set(entry_ids)
    assert b"limit" in next(d for d in dead if d[1][b"id"] == b"e2e-bad-huge")[1][b"reason"]
    wait_for(lambda: rr.xlen(stream) == 0, "malformed entries deleted")
    assert rr.xpending(stream, CONSUMER_GROUP)["pending"] == 0
    # the worker survived: a good request still completes
    ok = "e2e-after-bad"
    enqueue(rr, KEYS, make_request(ok, sampling=SamplingParams(max_tokens=3, temperature=0)))
    assert wait_terminal(rr, KEYS, ok).status == "done"
    assert worker.alive()


def test_engine_refusal_is_an_error_event_not_a_crash(worker: WorkerProc, rr: redis.Redis) -> None:
    rid = "e2e-oov"
    log = subscribe(rr, KEYS, [rid])
    enqueue(rr, KEYS, make_request(rid, prompt_token_ids=(1, 2, 10**9)))
    term = log.wait_terminal(rid)
    assert term.status == "error" and "vocabulary" in (term.message or "")
    assert worker.alive()


def test_metrics_endpoint(worker: WorkerProc, rr: redis.Redis, metrics_port: int) -> None:
    rid = "e2e-metrics"
    enqueue(rr, KEYS, make_request(rid, sampling=SamplingParams(max_tokens=4, temperature=0)))
    wait_terminal(rr, KEYS, rid)

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as f:
            return f.read().decode()

    text = wait_for(lambda: "e2e_request_latency_seconds_count" in scrape() and scrape(), "metrics")
    for name in (
        "tokenfleet:time_to_first_token_seconds_bucket",
        "tokenfleet:request_queue_time_seconds_count",
        "tokenfleet:time_per_output_token_seconds_count",
        "tokenfleet:generation_tokens_total",
        "tokenfleet:num_requests_running",
        "tokenfleet:kv_cache_usage_perc",
        "tokenfleet:avg_generation_throughput_toks_per_s",
    ):
        assert name in text, name
    assert 'model_name="default",priority="normal"' in text


def test_client_submit_stream_and_result(
    worker: WorkerProc, redis_server: RedisServer, cold_ref_engine: Any
) -> None:
    from tokenfleet.producer import Client, TokenEvent
    from tokenfleet.shared.settings import Settings

    settings = Settings(redis_url=redis_server.url, key_prefix=PREFIX)
    with Client.from_url(redis_server.url, settings=settings) as client:
        handle = client.submit("A small boat", max_tokens=20, temperature=0.0, priority="critical")
        streamed = [e for e in handle.stream(timeout=60) if isinstance(e, TokenEvent)]
        result = handle.result(timeout=60)
    ref = cold_ref_engine.generate(["A small boat"], EngineParams(temperature=0.0, max_tokens=20))[
        0
    ]
    assert [e.index for e in streamed] == list(range(len(ref.token_ids)))
    assert result.token_ids == [e.token_id for e in streamed] == ref.token_ids
    assert result.text == ref.text
    assert result.finish_reason == ref.finish_reason.value
