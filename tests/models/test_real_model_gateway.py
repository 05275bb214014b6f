"""SmolLM2 behind the HTTP gateway, as a user meets it: a real ``tokenfleet serve`` (uvicorn)
and real workers on the bundled model (the session's fleet, tests/models/real_fleet.py), driven
by the official ``openai`` SDK. Text matters
here, so the checks are about the text: a factual answer, streaming equal to non-streaming,
a stop string, and a batch whose output lines hold real answers."""

from __future__ import annotations

import io
import json
from typing import Any

import openai
import pytest
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


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
    done = wait_for(
        lambda: (b := sdk.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
        "the batch to end",
        timeout_s=300,
        poll_s=0.1,
    )
    assert done.status == "completed" and done.output_file_id
    out = {
        (row := json.loads(line))["custom_id"]: row["response"]["body"]["choices"][0]["message"][
            "content"
        ]
        for line in sdk.files.content(done.output_file_id).text.splitlines()
    }
    assert "Paris" in out["q0"] and "Paris" in out["q1"], out
