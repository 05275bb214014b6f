"""SmolLM2 behind the HTTP gateway, as a user meets it: a real ``tokenfleet serve`` (uvicorn)
and a real worker on the bundled model, driven by the official ``openai`` SDK. Text matters
here, so the checks are about the text: a factual answer, streaming equal to non-streaming,
a stop string, and a batch whose output lines hold real answers."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from conftest import MODEL_CACHE

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
PREFIX = "tfgw-real"
QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


def _poll(check: Any, what: str, timeout_s: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return value


@pytest.fixture(scope="module")
def base_url(
    redis_server: Any, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("real-gateway-logs")
    env = {
        **os.environ,
        "REDIS_URL": redis_server.url,
        "TOKENFLEET_KEY_PREFIX": PREFIX,
        "TOKENFLEET_MODEL_CACHE": str(MODEL_CACHE),
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = [sys.executable, "-m", "tokenfleet.worker.cli"]
    procs = []
    for name, args in (
        ("worker", ["worker", "--model", "smollm2", "--name", "real-gw", "--threads", "1"]),
        ("gateway", ["serve", "--port", str(port), "--log-level", "warning"]),
    ):
        with open(logs / f"{name}.log", "wb") as log:
            procs.append(
                subprocess.Popen([*cli, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
            )
    url = f"http://127.0.0.1:{port}/v1"
    r = redis.Redis.from_url(redis_server.url)
    try:

        def ready() -> bool:
            for p in procs:
                assert p.poll() is None, (logs / "worker.log").read_text()[-3000:]
            try:
                models = httpx.get(url + "/models", timeout=2).json()["data"]
            except httpx.HTTPError:
                return False
            return [m["id"] for m in models] == ["default"]

        _poll(ready, "the worker and the gateway")
        yield url
    finally:
        for p in procs:
            p.terminate()
            p.wait(60)
        r.close()


@pytest.fixture(scope="module")
def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)


def test_a_factual_answer(sdk: openai.OpenAI) -> None:
    r = sdk.chat.completions.create(
        model="default", messages=QUESTION, max_tokens=24, temperature=0
    )
    text = r.choices[0].message.content or ""
    assert "Paris" in text, text
    assert r.usage is not None and r.usage.prompt_tokens > 10
    assert r.usage.completion_tokens <= 24


def test_streaming_equals_the_whole_answer_and_stop_cuts_it(sdk: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "default", "messages": QUESTION, "max_tokens": 24}
    whole = sdk.chat.completions.create(temperature=0, **kw).choices[0].message.content or ""
    parts = [
        c.choices[0].delta.content or ""
        for c in sdk.chat.completions.create(temperature=0, stream=True, **kw)
        if c.choices
    ]
    assert "".join(parts) == whole
    cut = sdk.chat.completions.create(temperature=0, stop=["Paris"], **kw).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == whole[: whole.index("Paris")]


def test_a_batch_of_real_questions(sdk: openai.OpenAI) -> None:
    questions = ["What is the capital of France?", "Which city is the capital of France?"]
    rows = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "default",
                "messages": [{"role": "user", "content": q}],
                "max_tokens": 24,
                "temperature": 0,
            },
        }
        for i, q in enumerate(questions)
    ]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    upload = sdk.files.create(file=("q.jsonl", io.BytesIO(data)), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = _poll(
        lambda: (b := sdk.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
        "the batch to end",
    )
    assert done.status == "completed" and done.output_file_id
    out = {
        (row := json.loads(line))["custom_id"]: row["response"]["body"]["choices"][0]["message"][
            "content"
        ]
        for line in sdk.files.content(done.output_file_id).text.splitlines()
    }
    assert "Paris" in out["q0"] and "Paris" in out["q1"], out
