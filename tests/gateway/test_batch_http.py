"""The Batch API as a user meets it: the official ``openai`` SDK (``files.create``,
``batches.create/retrieve/list/cancel``, ``files.content``) against real gateway processes,
workers and Redis; a gateway SIGKILLed mid-batch (another takes the batch over, no line lost
or written twice); cancel mid-batch; mixed valid and invalid lines; the same from Python and
the CLI."""

from __future__ import annotations

import io
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from batch_http_helpers import (
    chat_line,
    check_exactly_once,
    completed,
    final,
    jsonl,
    lines_of,
    sdk_for,
)
from gateway_helpers import Fleet, Gateway, module_fleet, start_fleet, wait_for

from tokenfleet.producer import Client
from tokenfleet.producer.jobs import run_batch
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.cli import main
from tokenfleet.worker.devtools.local_redis import RedisServer

pytestmark = pytest.mark.slow

LEASE = {"TOKENFLEET_GATEWAY_BATCH_LEASE_MS": "1500", "TOKENFLEET_GATEWAY_BATCH_WINDOW": "8"}


@pytest.fixture(scope="module")
def bfleet(
    redis_server: RedisServer,
    plain_redis: redis.Redis,
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("gateway-batch-logs")
    # no test signals this worker (the one a test kills is its own: start_fleet below)
    yield from module_fleet(redis_server, plain_redis, tiny_llama_dir, log_dir, threaded=True)


def test_a_batch_through_the_sdk_with_invalid_lines(bfleet: Fleet) -> None:
    sdk = sdk_for(bfleet.base_url)
    rows: list[Any] = [chat_line(i) for i in range(12)]
    rows += [
        "{not json",
        {**chat_line(0)},  # duplicate custom_id c-0
        {**chat_line(99), "url": "/v1/completions"},  # another endpoint
        {**chat_line(98), "body": {"model": "default", "messages": [], "max_tokens": 2}},
        {**chat_line(97), "body": {**chat_line(97)["body"], "model": "no-such-model"}},
        {**chat_line(96), "body": {**chat_line(96)["body"], "user": "x" * (1 << 20)}},  # > 1 MiB
    ]
    upload = sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes > 0
    assert sdk.files.retrieve(upload.id).id == upload.id
    batch = sdk.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status in ("validating", "in_progress")
    done = final(sdk, batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (18, 12)
    assert done.request_counts.failed == 6
    out, err = lines_of(sdk, done.output_file_id), lines_of(sdk, done.error_file_id)
    assert len(out) == 12 and len(err) == 6
    check_exactly_once(out, [], [f"c-{i}" for i in range(12)])
    assert all(e["error"]["code"] and e["error"]["message"] for e in err)
    codes = {e["custom_id"]: e["error"]["code"] for e in err}
    assert codes["c-97"] == "model_not_found" and codes["c-96"] == "line_too_large"
    assert codes["c-99"] == "invalid_url" and codes["c-0"] == "duplicate_custom_id"
    assert done.metadata == {"job": "nightly"}
    listed = [b.id for b in sdk.batches.list(limit=100)]
    assert batch.id in listed
    sdk.files.delete(upload.id)
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(upload.id)


N_CANCEL = 100  # more lines than the feeding window's cap (64): some are never fed


def test_cancel_mid_batch(bfleet: Fleet) -> None:
    sdk = sdk_for(bfleet.base_url)
    rows = [chat_line(i, max_tokens=300) for i in range(N_CANCEL)]
    upload = sdk.files.create(file=("c.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(
        lambda: completed(sdk, batch.id) >= 1,
        "a first line to finish",
    )
    assert sdk.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = final(sdk, batch.id)
    assert done.status == "cancelled"
    counts = done.request_counts
    assert counts is not None and counts.completed + counts.failed == N_CANCEL
    assert counts.completed < N_CANCEL
    out, err = lines_of(sdk, done.output_file_id), lines_of(sdk, done.error_file_id)
    assert sorted(r["custom_id"] for r in out + err) == sorted(f"c-{i}" for i in range(N_CANCEL))
    # feeding stopped: the lines never fed have no request in the fleet; the fed ones all ended
    codes = {e["custom_id"]: e["error"]["code"] for e in err}
    assert set(codes.values()) <= {"batch_cancelled", "cancelled"}
    unfed = 0
    for i in range(N_CANCEL):
        rec = RequestRecord.from_hash(
            f"{done.id}-{i}", bfleet.r.hgetall(bfleet.keys.record(f"{done.id}-{i}"))
        )
        if rec is None:  # never fed: it can only be a batch_cancelled line
            assert codes[f"c-{i}"] == "batch_cancelled", i
            unfed += 1
        else:
            assert rec.status.is_terminal, (i, rec)
    assert unfed >= 1, "every line was fed: nothing shows that feeding stopped"


def test_a_gateway_killed_mid_batch_loses_nothing(
    redis_server: RedisServer, plain_redis: redis.Redis, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """A fleet of its own whose one gateway drives the batch; SIGKILLed mid-batch, a second
    gateway takes the batch over when the lease lapses: every line once."""
    fleet = start_fleet(redis_server, plain_redis, tiny_llama_dir, tmp_path, gateway_env=LEASE)
    second = None
    try:
        sdk = sdk_for(fleet.base_url)
        rows = [chat_line(i) for i in range(40)]
        upload = sdk.files.create(file=("k.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
        batch = sdk.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_for(
            lambda: completed(sdk, batch.id) >= 3,
            "the batch to be under way",
        )
        assert plain_redis.exists(fleet.keys.batch_lease(batch.id))  # the gateway drives it
        fleet.gateway.signal(signal.SIGKILL)
        fleet.gateway.wait(10)
        second = Gateway(fleet.redis_url, fleet.prefix, tmp_path, name="b2", env=LEASE)
        second.wait_ready()
        sdk2 = sdk_for(second.url + "/v1")
        done = final(sdk2, batch.id)
        out, err = lines_of(sdk2, done.output_file_id), lines_of(sdk2, done.error_file_id)
    finally:
        fleet.gateway.close()
        fleet.worker.close()
        if second is not None:
            second.close()
    assert done.status == "completed"
    assert err == []
    check_exactly_once(out, err, [f"c-{i}" for i in range(40)])


def test_the_same_from_python_and_the_cli(
    bfleet: Fleet,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = Settings(redis_url=bfleet.redis_url, key_prefix=bfleet.prefix)
    with Client.from_url(settings=settings) as client:
        handle = client.submit_batch([chat_line(i) for i in range(6)])
        seen: list[int] = []
        batch = handle.wait(progress=lambda b: seen.append(b.completed), timeout=120)
        assert batch.status == "completed" and batch.completed == 6
        assert seen == sorted(seen) and seen[-1] == 6
        assert sorted(r["custom_id"] for r in handle.results()) == [f"c-{i}" for i in range(6)]
        assert handle.errors() == []
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(i) for i in range(5)]))
    out = tmp_path / "out.jsonl"
    cli = ["--redis-url", bfleet.redis_url]
    monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", bfleet.prefix)  # the CLI and the job read it
    assert main(["batch", "submit", str(path), "--wait", "-o", str(out), *cli]) == 0
    # what a cron config schedules as an rq job (here called directly)
    finished = run_batch(str(path), redis_url=bfleet.redis_url)
    assert finished["status"] == "completed"
    assert finished["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == [f"c-{i}" for i in range(5)]
    # status, results, list and cancel of the Python batch, from the CLI
    capsys.readouterr()
    bid = handle.batch_id
    assert main(["batch", "status", bid, "--json", *cli]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["id"] == bid and shown["status"] == "completed"
    assert shown["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert main(["batch", "results", bid, *cli]) == 0
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert sorted(r["custom_id"] for r in printed) == [f"c-{i}" for i in range(6)]
    assert main(["batch", "results", bid, "--errors", *cli]) == 0
    assert capsys.readouterr().out == ""
    assert main(["batch", "list", "--limit", "50", *cli]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"{bid}  completed   6/6 done, 0 failed") for line in listed)
    with Client.from_url(settings=settings) as client:  # a batch nobody drives yet
        later = client.submit_batch([chat_line(i, max_tokens=64) for i in range(3)]).batch_id
    assert main(["batch", "cancel", later, "--json", *cli]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "cancelling"
    with Client.from_url(settings=settings) as client:
        cancelled = client.batch(later).wait(timeout=120)
    assert cancelled.status == "cancelled"
    assert cancelled.completed + cancelled.failed == 3


def test_an_oversized_upload_is_413_and_stores_nothing(bfleet: Fleet) -> None:
    small = Gateway(
        bfleet.redis_url,
        bfleet.prefix,
        bfleet.log_dir,
        name="small-files",
        env={"TOKENFLEET_GATEWAY_MAX_FILE_BYTES": "4000"},
    )
    try:
        small.wait_ready()
        sdk = sdk_for(small.url + "/v1")
        before = set(bfleet.r.scan_iter(match=f"{bfleet.prefix}:file:*"))
        big = jsonl([chat_line(i) for i in range(100)])
        assert len(big) > 4000
        with pytest.raises(openai.APIStatusError) as info:
            sdk.files.create(file=("big.jsonl", io.BytesIO(big)), purpose="batch")
        assert info.value.status_code == 413
        assert set(bfleet.r.scan_iter(match=f"{bfleet.prefix}:file:*")) == before
        ok = sdk.files.create(file=("ok.jsonl", io.BytesIO(jsonl([chat_line(1)]))), purpose="batch")
        assert ok.bytes > 0
    finally:
        small.close()
