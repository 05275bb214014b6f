"""What the batch HTTP tests share: building batch lines and files, reading batches back through
the official SDK, and the exactly-once check."""

from __future__ import annotations

import json
from typing import Any

import openai
from gateway_helpers import wait_for


def chat_line(i: int, max_tokens: int = 6) -> dict[str, Any]:
    return {
        "custom_id": f"c-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "default",
            "messages": [{"role": "user", "content": f"line {i}"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        },
    }


def jsonl(rows: list[Any]) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def sdk_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def final(sdk: openai.OpenAI, batch_id: str, timeout_s: float = 180) -> Any:
    return wait_for(
        lambda: (
            (b := sdk.batches.retrieve(batch_id)).status
            in ("completed", "failed", "expired", "cancelled")
            and b
        ),
        f"batch {batch_id} to end",
        timeout_s,
    )


def completed(sdk: openai.OpenAI, batch_id: str) -> int:
    counts = sdk.batches.retrieve(batch_id).request_counts
    return counts.completed if counts is not None else 0


def lines_of(sdk: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    return [json.loads(x) for x in sdk.files.content(file_id).text.splitlines() if x]


def check_exactly_once(out: list[dict], err: list[dict], custom_ids: list[str]) -> None:
    seen = [r["custom_id"] for r in out + err]
    assert sorted(seen) == sorted(custom_ids)  # every line once: none lost, none twice
    for row in out:
        assert row["response"]["status_code"] == 200
        body = row["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == 6
