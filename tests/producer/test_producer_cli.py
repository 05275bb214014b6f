"""``tokenfleet submit`` and ``tokenfleet queues``, in-process and once as a real subprocess."""

from __future__ import annotations

import io
import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from child_process import run_command
from producer_helpers import FakeWorker

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.schema import GenerationRequest
from tokenfleet.worker.cli import main

TOKENFLEET = Path(sys.executable).parent / "tokenfleet"


@pytest.fixture(autouse=True)
def _prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", "tft")


def _serve_in_thread(worker: FakeWorker, texts: list[str]) -> threading.Thread:
    thread = threading.Thread(target=worker.serve, args=(texts,))
    thread.start()
    return thread


def test_submit_prints_text_streamed_and_json(
    redis_url: str, worker: FakeWorker, capsys: pytest.CaptureFixture[str]
) -> None:
    thread = _serve_in_thread(worker, ["Hi", " there"])
    assert main(["submit", "hello", "--stream", "--redis-url", redis_url]) == 0
    thread.join(30)
    assert capsys.readouterr().out == "Hi there\n"

    thread = _serve_in_thread(worker, ["ok"])
    code = main(["submit", "hello", "--json", "--request-id", "cli-1", "--redis-url", redis_url])
    thread.join(30)
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["request_id"], out["text"], out["status"]) == ("cli-1", "ok", "done")


def test_submit_reports_failures(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--redis-url", redis_url]
    assert main(["queues", "--max-waiting", "0", "--priority", "batch", *args]) == 0
    capsys.readouterr()
    assert main(["submit", "x", "--priority", "batch", *args]) == 1
    assert "is full" in capsys.readouterr().err
    assert main(["submit", "x", "--top-p", "2", *args]) == 1
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    code = main(["submit", "x", "--json", "--deadline", "0.1", "--priority", "critical", *args])
    assert code == 1
    assert json.loads(capsys.readouterr().out)["status"] == "expired"
    assert main(["submit", "x", "--detach", *args]) == 0
    assert len(capsys.readouterr().out.strip()) == 32


def test_queues_shows_and_sets(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--redis-url", redis_url]
    assert main(["queues", *args]) == 0
    assert "no queues yet" in capsys.readouterr().out
    assert main(["queues", "--max-waiting", "7", "--policy", "drop_oldest", *args]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["MODEL", "PRIORITY", "WAITING", "RUNNING", "MAX_WAITING", "POLICY"]
    assert [line.split() for line in table[1:]] == [
        ["default", p, "0", "0", "7", "drop_oldest"] for p in ("critical", "normal", "batch")
    ]
    assert main(["queues", "--priority", "batch", "--policy", "block", "--json", *args]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["priority"], r["max_waiting"], r["policy"]) for r in rows][-1] == (
        "batch",
        7,
        "block",
    )


def test_installed_entry_point(redis_url: str) -> None:
    out = run_command(
        [str(TOKENFLEET), "queues", "--json", "--redis-url", redis_url],
        {"TOKENFLEET_KEY_PREFIX": "tft"},
        timeout_s=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def _queued_requests(redis_url: str) -> dict[str, GenerationRequest]:
    """The decoded requests waiting in the normal queue, by id."""
    client = redis.Redis.from_url(redis_url)
    try:
        entries: Any = client.xrange(Keys("tft").stream("default", Priority.NORMAL))
    finally:
        client.close()
    out = {}
    for _, fields in entries:
        request = GenerationRequest.decode(fields[b"d"], 1 << 20)
        out[request.request_id] = request
    return out


def test_submit_chat_system_and_messages(
    redis_url: str,
    worker: FakeWorker,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = ["--redis-url", redis_url, "--detach"]
    assert (
        main(["submit", "--chat", "Hi?", "--system", "Be brief.", "--request-id", "c1", *args]) == 0
    )
    assert main(["submit", "Once", "--request-id", "c2", *args]) == 0
    turns = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]
    turns.append({"role": "user", "content": "C"})
    (tmp_path / "chat.json").write_text(json.dumps(turns))
    assert (
        main(["submit", "--messages", str(tmp_path / "chat.json"), "--request-id", "c3", *args])
        == 0
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(turns)))
    assert main(["submit", "--messages", "-", "--request-id", "c4", *args]) == 0
    capsys.readouterr()
    queued = _queued_requests(redis_url)
    assert [dict(m) for m in queued["c1"].messages or ()] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
    ]
    assert queued["c2"].prompt == "Once" and queued["c2"].messages is None
    assert [dict(m) for m in queued["c3"].messages or ()] == turns
    assert [dict(m) for m in queued["c4"].messages or ()] == turns
    for bad, why in [
        (["--messages", "-", "x"], "give no PROMPT"),
        (["--system", "s", "x"], "--system needs --chat"),
        ([], "give a PROMPT"),
        (["--messages", str(tmp_path / "absent.json")], "absent.json"),
    ]:
        assert main(["submit", *bad, "--redis-url", redis_url]) == 1
        assert why in capsys.readouterr().err


def test_a_result_with_no_tokens_is_said_so(
    redis_url: str, worker: FakeWorker, capsys: pytest.CaptureFixture[str]
) -> None:
    thread = _serve_in_thread(worker, [])
    assert main(["submit", "hello", "--redis-url", redis_url]) == 0
    thread.join(30)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "(no tokens generated: finish_reason stop)" in captured.err
