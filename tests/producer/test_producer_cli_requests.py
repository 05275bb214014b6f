"""``tokenfleet get``, ``follow`` and ``cancel``; ``submit --timeout`` and every wire option;
unknown ``submit`` keywords (the CLI's request commands, against the real server)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from child_process import ChildProcess
from producer_helpers import FakeWorker
from waiting import wait_for

from tokenfleet.producer import AsyncClient, Client
from tokenfleet.producer.commands.output import describe
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import GenerationRequest
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.cli import main

TOKENFLEET = Path(sys.executable).parent / "tokenfleet"


@pytest.fixture(autouse=True)
def _prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENFLEET_KEY_PREFIX", "tft")


def _queued(r: redis.Redis) -> dict[str, GenerationRequest]:
    entries: Any = r.xrange(Keys("tft").stream("default", Priority.NORMAL))
    out = {}
    for _, fields in entries:
        request = GenerationRequest.decode(fields[b"d"], 1 << 20)
        out[request.request_id] = request
    return out


def test_get_shows_the_state_then_the_text(
    redis_url: str, worker: FakeWorker, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--redis-url", redis_url]
    assert main(["get", "nope", *args]) == 1
    assert "no request nope" in capsys.readouterr().err
    assert main(["submit", "hi", "--detach", "--request-id", "g1", *args]) == 0
    capsys.readouterr()
    assert main(["get", "g1", *args]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["request  g1", "status   queued"]
    rid = worker.take()
    worker.emit(rid, 0, ["Hel"])
    assert main(["get", "g1", *args]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "status   running" in out and "tokens   1" in out and "worker   fake-worker" in out
    assert "route    shared" in out  # no routing target: the shared stream
    worker.emit(rid, 1, ["lo"])
    worker.finish(rid, num_tokens=2, text="Hello")
    assert main(["get", "g1", *args]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "status   done (finish_reason stop)" and out[-1] == "Hello"
    assert main(["get", "g1", "--json", *args]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["status"], record["text"], record["num_tokens"]) == ("done", "Hello", 2)


def test_cancel_a_queued_then_a_running_request(
    redis_url: str, r: redis.Redis, worker: FakeWorker, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--redis-url", redis_url]
    assert main(["cancel", "nope", *args]) == 1
    assert main(["submit", "a", "--detach", "--request-id", "k1", *args]) == 0
    capsys.readouterr()
    assert main(["cancel", "k1", *args]) == 0
    assert capsys.readouterr().out.strip() == "request k1 cancelled"
    assert main(["cancel", "k1", *args]) == 1  # nothing left to cancel
    assert "had already ended: cancelled" in capsys.readouterr().out
    assert main(["submit", "b", "--detach", "--request-id", "k2", *args]) == 0
    assert worker.take() == "k2"
    capsys.readouterr()
    assert main(["cancel", "k2", "--json", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["status"], out["cancelled"]) == ("running", True)
    assert r.sismember(Keys("tft").cancel_set, "k2")  # its worker stops it at its next step


def _lines(proc: ChildProcess, count: int) -> list[str]:
    """Its first ``count`` stdout lines, once it has printed them."""

    def first() -> list[str]:
        lines = proc.lines()
        return lines[:count] if len(lines) >= count else []

    return list(wait_for(first, f"{count} lines from {proc.log_path.name}", timeout_s=60))


def _subscribed(r: redis.Redis, channel: str) -> bool:
    return dict(r.pubsub_numsub(channel)).get(channel.encode(), 0) >= 1


def test_follow_prints_from_where_it_is_and_rides_a_reconnect(
    redis_url: str,
    r: redis.Redis,
    worker: FakeWorker,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    assert main(["submit", "x", "--detach", "--request-id", "f1", "--redis-url", redis_url]) == 0
    capsys.readouterr()
    rid = worker.take()
    worker.emit(rid, 0, ["a", "b"])  # before anyone follows: read from the token list
    proc = ChildProcess(
        [str(TOKENFLEET), "follow", "f1", "--json", "--redis-url", redis_url],
        tmp_path / "follow.out",
        {"TOKENFLEET_KEY_PREFIX": "tft"},
        stderr_path=tmp_path / "follow.err",
    )
    try:
        events = [json.loads(line) for line in _lines(proc, 2)]
        channel = Keys("tft").channel("f1")
        wait_for(lambda: _subscribed(r, channel), f"a subscriber to {channel}", timeout_s=60)
        assert r.client_kill_filter(_type="pubsub") >= 1  # the follower's connection drops
        worker.emit(rid, 2, ["c"])  # published while it is down
        worker.emit(rid, 3, ["d"], publish=False)  # only in the list
        worker.finish(rid, num_tokens=4, text="abcd")
        assert proc.wait(60) == 0, proc.errors()
        events += [json.loads(line) for line in _lines(proc, 5)[2:]]
    finally:
        proc.close()
    tokens = [e for e in events if e["type"] == "token"]
    assert [e["index"] for e in tokens] == [0, 1, 2, 3]
    assert "".join(e["text"] for e in tokens) == "abcd"
    assert events[-1]["type"] == "done" and len(events) == 5
    # --from: the text from an index on, in plain text
    assert main(["follow", "f1", "--from", "2", "--redis-url", redis_url]) == 0
    assert capsys.readouterr().out == "cd\n"
    assert main(["follow", "nope", "--redis-url", redis_url]) == 1


def test_submit_timeout_shows_the_state_and_can_cancel(
    redis_url: str, r: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # no worker: every wait times out
    args = ["--redis-url", redis_url, "--timeout", "0.2"]
    assert main(["submit", "x", "--request-id", "t1", *args]) == 3
    err = capsys.readouterr().err
    assert "timed out after 0.2s (it goes on)" in err and "status   queued" in err
    assert "tokenfleet follow t1" in err and "Traceback" not in err
    assert "t1" in _queued(r)
    assert main(["submit", "x", "--request-id", "t2", "--stream", *args]) == 3
    assert "status   queued" in capsys.readouterr().err
    assert main(["submit", "x", "--request-id", "t3", "--json", "--cancel-on-timeout", *args]) == 3
    out = json.loads(capsys.readouterr().out)
    assert (out["request_id"], out["status"], out["timed_out"]) == ("t3", "cancelled", True)
    assert main(["submit", "x", "--request-id", "t4", "--cancel-on-timeout", *args]) == 3
    assert "(cancelled)" in capsys.readouterr().err
    assert set(_queued(r)) == {"t1", "t2"}  # t3 and t4 left the queue
    assert main(["follow", "t1", *args]) == 3
    assert main(["submit", "x", "--cancel-on-timeout", "--redis-url", redis_url]) == 1
    assert "--cancel-on-timeout needs --timeout" in capsys.readouterr().err


def test_submit_takes_every_wire_option(
    redis_url: str, r: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--redis-url", redis_url, "--detach"]
    options = ["--stop", "END", "--stop", "\n\n", "--top-k", "5", "--ignore-eos"]
    options += ["--stop-token-id", "7", "--stop-token-id", "9", "--metadata", '{"job": 3}']
    assert main(["submit", "x", "--request-id", "w1", *options, *args]) == 0
    assert main(["submit", "--token-ids", "1,2,3", "--request-id", "w2", *args]) == 0
    queued = _queued(r)
    s = queued["w1"].sampling
    assert (s.stop, s.top_k, s.ignore_eos, s.stop_token_ids) == (("END", "\n\n"), 5, True, (7, 9))
    assert queued["w1"].metadata == {"job": 3}
    assert queued["w2"].prompt_token_ids == (1, 2, 3)
    defaults = queued["w2"].sampling
    assert (defaults.stop, defaults.ignore_eos, defaults.stop_token_ids) == ((), False, ())
    capsys.readouterr()
    for bad, why in [
        (["--token-ids", "1,x"], "comma-separated integers"),
        (["x", "--token-ids", "1"], "give no PROMPT"),
        (["x", "--metadata", "{"], "--metadata is not JSON"),
        (["x", "--stop-token-id", "-1"], "stop_token_ids must be integers >= 0"),
    ]:
        assert main(["submit", *bad, "--redis-url", redis_url]) == 1
        assert why in capsys.readouterr().err


def test_unknown_submit_keywords_are_invalid_requests(
    client: Client, r: redis.Redis, settings: Settings
) -> None:
    with pytest.raises(InvalidRequest, match=r"unknown request parameter.*: max_token, topk"):
        client.submit("x", max_token=5, topk=2)
    with pytest.raises(InvalidRequest, match="unknown request parameter"):
        client.try_submit("x", ignore_eso=True)
    assert r.dbsize() == 0  # refused before anything touched Redis
    handle = client.submit("x", ignore_eos=True, stop_token_ids=[4, 5], request_id="ok1")
    handle.close()
    many = client.submit_many([{"prompt": "y", "ignore_eos": True, "stop_token_ids": [6]}])
    queued = _queued(r)
    assert (queued["ok1"].sampling.ignore_eos, queued["ok1"].sampling.stop_token_ids) == (
        True,
        (4, 5),
    )
    other = next(q for rid, q in queued.items() if rid != "ok1")
    assert (other.sampling.ignore_eos, other.sampling.stop_token_ids) == (True, (6,))
    for h in many:
        assert not isinstance(h, Exception)
        h.close()


def test_the_async_client_refuses_unknown_keywords_too(settings: Settings) -> None:
    async def submit() -> None:
        async with AsyncClient.from_url(settings=settings) as client:
            await client.submit("x", bogus=1)

    with pytest.raises(InvalidRequest, match=r"unknown request parameter.*: bogus"):
        asyncio.run(submit())


def test_get_says_where_routing_sent_a_request_and_who_took_it() -> None:
    raw: dict[bytes | str, bytes | str] = {
        "status": "done",
        "route": "session",
        "routed_to": "gpu-0",
        "taken": "stolen_by:gpu-1",
    }
    record = RequestRecord.from_hash("r1", raw)
    assert record is not None and record.taken == "stolen_by:gpu-1"
    assert "route    session -> gpu-0, taken: stolen_by:gpu-1" in describe(record)
    assert record.to_dict()["taken"] == "stolen_by:gpu-1"
    plain = RequestRecord.from_hash("r2", {"status": "queued"})
    assert plain is not None and "route    shared" in describe(plain)
