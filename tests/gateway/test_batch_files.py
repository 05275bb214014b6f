"""``FileStore`` and ``BatchStore`` (creation, validation, listing, cancel) against the real
server; no worker (nothing runs: only what creating a batch writes)."""

from __future__ import annotations

import orjson
import pytest
from batch_helpers import CHAT, COMPLETIONS, Env, chat_line, file_lines, jsonl, with_env

from tokenfleet.producer.gateway.batches import FileStore, FileTooLarge, NotFound
from tokenfleet.producer.gateway.batches.store import window_seconds
from tokenfleet.producer.gateway.errors import ApiError
from tokenfleet.shared.settings import Settings


def test_file_create_get_content_delete(settings: Settings) -> None:
    async def body(env: Env) -> None:
        data = b'{"a": 1}\r\n\n{"b": "\xc3\xa9"}'  # CRLF, a blank line, no final newline
        f = await env.files.create("batch", "x.jsonl", data)
        assert f.id.startswith("file-") and f.kind == "input"
        content = await env.files.content(f.id)
        assert content == '{"a": 1}\n{"b": "é"}\n'.encode()
        assert f.bytes == len(content)
        got = await env.files.get(f.id)
        assert got == f
        d = got.to_dict()
        assert d["object"] == "file" and d["purpose"] == "batch" and d["filename"] == "x.jsonl"
        assert (await env.files.delete(f.id)) == f
        for call in (env.files.get, env.files.content, env.files.delete):
            with pytest.raises(NotFound) as info:
                await call(f.id)
            assert info.value.status == 404

    with_env(settings, body)


def test_file_limits_purpose_and_encoding(settings: Settings) -> None:
    async def body(env: Env) -> None:
        small = FileStore(env.r, settings, max_bytes=10)
        with pytest.raises(FileTooLarge) as info:
            await small.create("batch", "x", b"x" * 11)
        assert info.value.status == 413 and info.value.code == "file_too_large"
        assert (await small.create("batch", "x", b"0123456789")).bytes == 11
        with pytest.raises(ApiError, match="purpose"):
            await env.files.create("fine-tune", "x", b"{}\n")
        with pytest.raises(ApiError, match="not UTF-8") as info2:
            await env.files.create("batch", "x", b'{"a": "\xff"}\n')
        assert info2.value.status == 400
        with pytest.raises(ApiError, match="no line"):
            await env.files.create("batch", "x", b"\n \n")

    with_env(settings, body)


def test_completion_window_forms() -> None:
    assert window_seconds("24h") == 86400 and window_seconds("5m") == 300
    for bad in ("24", "0h", "1d", "h", "-1h", "1.5h"):
        with pytest.raises(ApiError):
            window_seconds(bad)


def test_mixed_valid_and_invalid_lines_go_to_the_error_file_with_reasons(
    settings: Settings,
) -> None:
    good = [chat_line(i) for i in range(3)]
    bad_lines = [
        b"{not json",
        orjson.dumps({"method": "POST", "url": CHAT, "body": {}}),  # no custom_id
        orjson.dumps({**chat_line(10), "custom_id": "req-0"}),  # duplicate
        orjson.dumps({**chat_line(11), "method": "GET"}),
        orjson.dumps({**chat_line(12), "url": COMPLETIONS}),
        orjson.dumps(chat_line(13, n=2)),
        orjson.dumps(chat_line(14, max_tokens="4")),  # strict: a string is not an int
        orjson.dumps(chat_line(15, stream=True)),
        orjson.dumps(chat_line(16, priority="critical")),
        orjson.dumps({**chat_line(17), "body": {"model": "default", "messages": []}}),
        orjson.dumps(chat_line(18, max_tokens=4, extra_field=1)),
        orjson.dumps({**chat_line(19), "body": {**chat_line(19)["body"], "x": "y" * 300}}),
    ]
    expected_codes = [
        "invalid_json",
        "missing_custom_id",
        "duplicate_custom_id",
        "invalid_method",
        "invalid_url",
        "unsupported_parameter",
        "invalid_body",
        "invalid_body",
        "invalid_body",
        "invalid_body",
        "unknown_parameter",
        "line_too_large",
    ]

    async def body(env: Env) -> None:
        data = jsonl(good) + b"\n".join(bad_lines) + b"\n"
        f = await env.files.create("batch", "in.jsonl", data)
        store = type(env.batches)(env.r, settings, max_line_bytes=300)
        b = await store.create(f.id, CHAT, "24h", {"k": "v"})
        assert b.status == "in_progress" and b.total == 15
        assert b.failed == len(bad_lines) and b.completed == 0
        assert b.to_dict()["request_counts"] == {"total": 15, "completed": 0, "failed": 12}
        assert b.to_dict()["metadata"] == {"k": "v"}
        assert await env.r.sismember(store._keys.batches_active, b.id)
        # the error file is written as the lines are rejected (exposed when the batch is final)
        raw = await env.r.lrange(store._keys.file_lines(b.err_id), 0, -1)
        errors = [orjson.loads(x) for x in raw]
        assert [e["error"]["code"] for e in errors] == expected_codes
        assert [e["custom_id"] for e in errors][:3] == [None, None, "req-0"]
        assert all(e["response"] is None for e in errors)
        ledger = await env.r.hgetall(store._keys.batch_done(b.id))
        assert {int(k) for k in ledger} == set(range(3, 15))
        assert set(ledger.values()) == {b"err"}

    with_env(settings, body)


def test_a_batch_with_no_valid_line_fails_with_errors(settings: Settings) -> None:
    async def body(env: Env) -> None:
        f = await env.files.create("batch", "in.jsonl", b'{"x": 1}\n[]\n')
        b = await env.batches.create(f.id, CHAT)
        assert b.status == "failed" and b.failed == 2 and "failed_at" in b.times
        errs = b.to_dict()["errors"]["data"]
        assert [e["line"] for e in errs] == [1, 2]
        assert not await env.r.sismember(env.batches._keys.batches_active, b.id)

    with_env(settings, body)


def test_create_refusals_get_list_and_cancel(settings: Settings) -> None:
    async def body(env: Env) -> None:
        f = await env.files.create("batch", "in.jsonl", jsonl([chat_line(0)]))
        with pytest.raises(NotFound):
            await env.batches.create("file-nope", CHAT)
        with pytest.raises(ApiError, match="endpoint"):
            await env.batches.create(f.id, "/v1/embeddings")
        with pytest.raises(ApiError, match="completion_window"):
            await env.batches.create(f.id, CHAT, "1d")
        ids = []
        for _ in range(5):
            ids.append((await env.batches.create(f.id, CHAT)).id)
        page, more = await env.batches.list(limit=2)
        assert [b.id for b in page] == ids[::-1][:2] and more
        page2, more2 = await env.batches.list(after=page[-1].id, limit=10)
        assert [b.id for b in page2] == ids[::-1][2:] and not more2
        with pytest.raises(NotFound):
            await env.batches.get("batch_nope")
        cancelled = await env.batches.cancel(ids[0])
        assert cancelled.status == "cancelling" and "cancelling_at" in cancelled.times
        with pytest.raises(NotFound):
            await env.batches.cancel("batch_nope")
        d = (await env.batches.get(ids[1])).to_dict()
        assert d["object"] == "batch" and d["endpoint"] == CHAT and d["output_file_id"] is None
        assert await file_lines(env, None) == []

    with_env(settings, body)
