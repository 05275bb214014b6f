"""Streams that outlive their connection: resume with ``Last-Event-ID`` after the connection is
cut and after the gateway process is SIGKILLed (a second gateway serves the resume); what a
client's disconnect does (``X-On-Disconnect: cancel | continue``), streaming or not."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator

import httpx
import pytest
from gateway_helpers import Fleet, Gateway, wait_for

pytestmark = pytest.mark.slow

LONG = {"model": "default", "max_tokens": 60, "ignore_eos": True, "stream": True}


def record(fleet: Fleet, rid: str, base: str | None = None) -> dict:
    return httpx.get(f"{base or fleet.base_url}/requests/{rid}", timeout=10).json()


def text_of(chunk: dict) -> str:
    """The text of a completion or chat chunk."""
    choice = chunk["choices"][0]
    return choice["text"] if "text" in choice else choice["delta"].get("content", "")


def read_until(lines: Iterator[str], last_index: int) -> tuple[list[tuple[int, str]], int | None]:
    """(index, text) of each token chunk up to and including ``last_index``; stops there (the
    event's data has been read: its id is the client's position). ``lines`` is the caller's
    ``resp.iter_lines()``, kept alive by the caller: an iterator dropped here would be
    collected at once, and closing it closes the connection (a disconnect, to the gateway)."""
    got: list[tuple[int, str]] = []
    event_id = None
    for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: {") and event_id is not None:
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                got.append((event_id, text_of(chunk)))
            if event_id >= last_index:
                return got, event_id
            event_id = None
    return got, event_id


def read_rest(base: str, rid: str, last_event_id: int) -> tuple[list[tuple[int, str]], list[str]]:
    """Resume at ``base``: the token chunks after ``last_event_id``, and every data line."""
    got, datas = [], []
    headers = {"Last-Event-ID": str(last_event_id)}
    with httpx.stream("GET", f"{base}/requests/{rid}/events", headers=headers, timeout=60) as resp:
        assert resp.status_code == 200
        event_id = None
        for line in resp.iter_lines():
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: "):
                datas.append(line[6:])
                if event_id is not None:
                    got.append((event_id, text_of(json.loads(line[6:]))))
                event_id = None
    return got, datas


def uninterrupted(base: str, rid: str) -> list[tuple[int, str]]:
    """A reader that follows the request from index 0 without interruption."""
    return read_rest(base, rid, -1)[0]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_resume_after_the_connection_is_cut(fleet: Fleet, endpoint: str) -> None:
    body = (
        {**LONG, "prompt": "resume me"}
        if endpoint == "completions"
        else {
            **LONG,
            "messages": [{"role": "user", "content": "resume me"}],
        }
    )
    reference: list[list[tuple[int, str]]] = []
    headers = {"X-On-Disconnect": "continue"}
    with httpx.stream(
        "POST", f"{fleet.base_url}/{endpoint}", json=body, headers=headers, timeout=60
    ) as resp:
        rid = resp.headers["x-request-id"]
        follower = threading.Thread(
            target=lambda: reference.append(uninterrupted(fleet.base_url, rid))
        )
        follower.start()
        first, last = read_until(resp.iter_lines(), 9)
    # the connection is closed here, mid-stream: the request goes on (continue)
    assert last is not None
    rest, datas = read_rest(fleet.base_url, rid, last)
    follower.join(60)
    tokens = first + rest
    assert [i for i, _ in tokens] == list(range(60))  # gap-free, duplicate-free
    assert datas[-1] == "[DONE]"
    text = "".join(t for _, t in tokens)
    assert text == "".join(t for _, t in reference[0])
    assert text == record(fleet, rid)["text"]


def test_resume_through_a_second_gateway_after_sigkill(fleet: Fleet) -> None:
    doomed = Gateway(fleet.redis_url, fleet.prefix, fleet.log_dir, name="doomed").wait_ready()
    try:
        body = {**LONG, "max_tokens": 200, "prompt": "survive the gateway"}
        with httpx.stream("POST", doomed.url + "/v1/completions", json=body, timeout=60) as resp:
            rid = resp.headers["x-request-id"]
            lines = resp.iter_lines()  # held open until the gateway is dead: no disconnect
            first, last = read_until(lines, 4)
            doomed.signal(signal.SIGKILL)  # mid-stream, default X-On-Disconnect (cancel)
            doomed.wait(10)
            del lines
        assert last == 4
        rest, datas = read_rest(fleet.base_url, rid, last)  # the module's gateway resumes
    finally:
        doomed.close()
    tokens = first + rest
    assert [i for i, _ in tokens] == list(range(200)), (datas[-2:], record(fleet, rid))
    assert datas[-1] == "[DONE]"
    final = record(fleet, rid)
    assert final["status"] == "done"
    assert "".join(t for _, t in tokens) == final["text"]
    assert "".join(t for _, t in tokens) == "".join(
        t for _, t in uninterrupted(fleet.base_url, rid)
    )


def test_a_browser_style_reconnect_replays_nothing(fleet: Fleet) -> None:
    body = {**LONG, "prompt": "twice", "max_tokens": 8, "stream": False}
    rid = httpx.post(f"{fleet.base_url}/completions", json=body, timeout=60).json()["id"]
    tokens, datas = read_rest(fleet.base_url, rid, 7)  # had everything: only the end comes
    assert tokens == []
    assert datas[-1] == "[DONE]"
    assert json.loads(datas[0])["choices"][0]["finish_reason"] == "length"


def test_disconnect_cancels_a_stream_by_default(fleet: Fleet) -> None:
    body = {**LONG, "max_tokens": 3000, "prompt": "leave early"}
    with httpx.stream("POST", f"{fleet.base_url}/completions", json=body, timeout=60) as resp:
        rid = resp.headers["x-request-id"]
        read_until(resp.iter_lines(), 2)
    final = wait_for(
        lambda: (rec := record(fleet, rid))["status"] in ("cancelled", "done") and rec,
        "the request to end",
    )
    assert final["status"] == "cancelled"
    assert final["num_tokens"] < 3000


def test_disconnect_with_continue_leaves_it_running(fleet: Fleet) -> None:
    body = {**LONG, "max_tokens": 150, "prompt": "keep going"}
    headers = {"X-On-Disconnect": "continue"}
    with httpx.stream(
        "POST", f"{fleet.base_url}/completions", json=body, headers=headers, timeout=60
    ) as resp:
        rid = resp.headers["x-request-id"]
        read_until(resp.iter_lines(), 2)
    final = wait_for(
        lambda: (rec := record(fleet, rid))["status"] not in ("queued", "running") and rec,
        "the request to end",
    )
    assert final["status"] == "done"
    assert final["num_tokens"] == 150


@pytest.mark.parametrize("mode", ["cancel", "continue"])
def test_non_streaming_disconnect(fleet: Fleet, mode: str) -> None:
    # long enough to outlive the client's timeout (and, to be cancelled, the gateway's noticing
    # the disconnect) on a fast idle host (about 1 ms a step); run to its end when it continues:
    # shorter there (1,200 tokens: 5.8 s through this fleet on the 2-core machine, idle)
    max_tokens = 2000 if mode == "cancel" else 1200
    body = {"model": "default", "prompt": "wait for me", "max_tokens": max_tokens}
    body["ignore_eos"] = True
    key = f"nonstream-{mode}-{fleet.prefix}"
    headers = {"X-On-Disconnect": mode, "Idempotency-Key": key}
    rid = f"cmpl-k-{key}"
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{fleet.base_url}/completions", json=body, headers=headers, timeout=0.5)
    final = wait_for(
        lambda: (
            (rec := record(fleet, rid)).get("status") not in (None, "queued", "running") and rec
        ),
        "the request to end",
    )
    assert final["status"] == ("cancelled" if mode == "cancel" else "done")
    assert (final["num_tokens"] < max_tokens) if mode == "cancel" else final["num_tokens"] == 1200
