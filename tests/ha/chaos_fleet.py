"""A fleet for failover chaos tests with the default settings (no WAIT): two real worker processes,
a real gateway, streaming clients of both kinds (``Handle.stream()`` threads on one ``Client``,
and SSE through the gateway read with httpx), and the checks every scenario makes: each request
ends exactly once, ``done``, its tokens gap-free, duplicate-free and equal to the undisturbed
in-process greedy run, and no client sees an index twice. The scenario (what it does to Redis)
is the test's; the counts (requests, tokens the workers repaired, requests re-enqueued) are
printed with the ``[counts]`` tag."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis
from child_process import ChildProcess, tokenfleet_args
from ha_checks import gateway_process
from ha_helpers import DEADLINE_S, wait_for

from tokenfleet.producer import Client
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import TerminalEvent, TokenEvent
from tokenfleet.shared.settings import Settings

# prompts with no near-tie along their greedy tokens (test_worker_recovery's): a request resumed
# in another batch recomputes its context, and a near-tie could flip on rounding
PROMPTS = ["Morning light", "Under the bridge", "Far across the valley", "The night train"]
MAX_TOKENS = 160
READ_TIMEOUT_S = 240.0  # a reader still reading after this hangs (a failure)
_REPAIRED = re.compile(r"repaired \S+ after a Redis rollback: (\d+) tokens put back")
_RESUBMITTED = re.compile(r"resubmitted \S+ after Redis lost it")


def reference_runs(engine: Any, max_tokens: int = MAX_TOKENS) -> dict[str, list[int]]:
    """Per prompt, the undisturbed in-process greedy run's token ids."""
    from tokenfleet.worker.engine.request import SamplingParams as EngineParams

    params = EngineParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.block_manager.reset_prefix_cache()
    runs = engine.generate(PROMPTS, params)
    return {p: list(run.token_ids) for p, run in zip(PROMPTS, runs, strict=True)}


class ChaosWorker(ChildProcess):
    """A real ``tokenfleet worker`` reaching Redis through ``flags`` (standalone, sentinel or
    cluster), with the default settings but for quick heartbeats and claims; killed (SIGKILL)
    at :meth:`close`."""

    def __init__(
        self, model_dir: Path, flags: list[str], prefix: str, name: str, log_dir: Path
    ) -> None:
        self.name = name
        env = {**os.environ, "TOKENFLEET_KEY_PREFIX": prefix}
        for var in ("REDIS_URL", "TOKENFLEET_MODEL", "TOKENFLEET_REDIS_MODE"):
            env.pop(var, None)
        args = tokenfleet_args("worker", "--model", str(model_dir), "--name", name,
                               "--threads", "1", "--heartbeat-ttl-s", "2", "--claim-idle-s",
                               "0.5", "--claim-interval-s", "0.5", "--max-num-seqs", "4",
                               *flags)  # fmt: skip
        super().__init__(args, log_dir / f"{name}.log", env, inherit_env=False)


@dataclass
class HandleReader:
    """One request streamed with ``Handle.stream()`` on a thread."""

    prompt: str
    handle: Any
    max_tokens: int
    events: list[Any] = field(default_factory=list)
    error: BaseException | None = None

    def run(self) -> None:
        try:
            for event in self.handle.stream(timeout=READ_TIMEOUT_S):
                self.events.append(event)
        except BaseException as exc:  # checked by the test, with the request id
            self.error = exc


@dataclass
class SSEReader:
    """One request streamed as SSE through the gateway (``/v1/completions``, ``stream``)."""

    prompt: str
    max_tokens: int
    ids: list[int] = field(default_factory=list)  # each token chunk's SSE id (its index)
    texts: list[str] = field(default_factory=list)
    finish: str | None = None
    errors: list[str] = field(default_factory=list)  # an error chunk, or the exception
    done_marks: int = 0  # [DONE] lines
    refusals: list[int] = field(default_factory=list)  # statuses of POSTs refused before a byte

    def run(self, base_url: str) -> None:
        """POST and read the stream; a refusal before any byte (503 or 429: the request was not
        accepted, e.g. during the switch) is sent again after a pause, as the OpenAI SDKs do."""
        body = {"model": "default", "prompt": self.prompt, "max_tokens": self.max_tokens,
                "stream": True, "temperature": 0, "ignore_eos": True}  # fmt: skip
        deadline = time.monotonic() + READ_TIMEOUT_S
        try:
            while True:
                with httpx.stream(
                    "POST", base_url + "/v1/completions", json=body, timeout=READ_TIMEOUT_S
                ) as resp:
                    if resp.status_code in (429, 503) and time.monotonic() < deadline:
                        self.refusals.append(resp.status_code)
                        time.sleep(0.5)
                        continue
                    if resp.status_code != 200:
                        resp.read()
                        self.errors.append(f"HTTP {resp.status_code}: {resp.text}")
                        return
                    self._read(resp)
                    return
        except BaseException as exc:  # checked by the test
            self.errors.append(repr(exc))

    def _read(self, resp: httpx.Response) -> None:
        event_id: str | None = None
        for line in resp.iter_lines():
            if line.startswith("id:"):
                event_id = line[3:].strip()
            elif line.startswith("data:"):
                self._data(line[5:].strip(), event_id)
                event_id = None

    def _data(self, data: str, event_id: str | None) -> None:
        if data == "[DONE]":
            self.done_marks += 1
            return
        chunk = orjson.loads(data)
        if "error" in chunk:
            self.errors.append(str(chunk["error"]))
            return
        for choice in chunk.get("choices", []):
            if event_id is not None:
                self.ids.append(int(event_id))
                self.texts.append(choice.get("text") or "")
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]


@dataclass
class ChaosFleet:
    """The fleet under test and its clients (see the module docstring)."""

    settings: Settings
    flags: list[str]
    workers: list[ChaosWorker]
    client: Client
    gateway_url: str
    inspect: Callable[[], redis.Redis]  # a fresh client of the primary that holds the lane
    handles: list[HandleReader] = field(default_factory=list)
    sse: list[SSEReader] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def keys(self) -> Keys:
        return Keys.for_settings(self.settings).for_model("default")

    def submit(self, count: int, *, sse: int = 0, max_tokens: int = MAX_TOKENS) -> None:
        """``count`` requests through ``Client.submit`` and ``sse`` through the gateway, each
        followed by a streaming reader thread."""
        for i in range(count):
            prompt = PROMPTS[(len(self.handles) + i) % len(PROMPTS)]
            handle = self.client.submit(
                prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
            )
            reader = HandleReader(prompt, handle, max_tokens)
            self._start(threading.Thread(target=reader.run))
            self.handles.append(reader)
        for i in range(sse):
            sreader = SSEReader(PROMPTS[(len(self.sse) + i) % len(PROMPTS)], max_tokens)
            self._start(threading.Thread(target=sreader.run, args=(self.gateway_url,)))
            self.sse.append(sreader)

    def _start(self, thread: threading.Thread) -> None:
        thread.start()
        self.threads.append(thread)

    def records(self) -> list[RequestRecord | None]:
        with self.inspect() as r:
            return [
                RequestRecord.from_hash(
                    h.handle.request_id, r.hgetall(self.keys.record(h.handle.request_id))
                )
                for h in self.handles
            ]

    def wait_some_done_some_running(self) -> None:
        """Until at least one request is done and one is running with tokens out."""

        def mixed() -> bool:
            try:
                recs = self.records()
            except redis.RedisError:
                return False
            return any(x and x.status == "done" for x in recs) and any(
                x and x.status == "running" and x.num_tokens >= 4 for x in recs
            )

        wait_for(mixed, "some requests done and some running")

    def wait_running(self, min_tokens: int = 8) -> None:
        """Until some request runs with ``min_tokens`` out."""

        def running() -> bool:
            try:
                recs = self.records()
            except redis.RedisError:
                return False
            return any(x and x.status == "running" and x.num_tokens >= min_tokens for x in recs)

        wait_for(running, "a request running mid-stream")

    def check(self, reference: dict[str, list[int]], how: str) -> None:
        """Every reader ends; each request exactly once, done, equal to the reference; no index
        seen twice; workers alive, none ended a request error. Prints the counts."""
        deadline = time.monotonic() + READ_TIMEOUT_S
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
            assert not t.is_alive(), "a reader hangs"
        text_of: dict[tuple[str, int], str] = {}
        resubmitted = 0
        refused = sum(len(s.refusals) for s in self.sse)
        for h in self.handles:
            rid = h.handle.request_id
            assert h.error is None, f"{rid}: {h.error!r}"
            tokens = [e for e in h.events if isinstance(e, TokenEvent)]
            ends = [e for e in h.events if isinstance(e, TerminalEvent)]
            want = reference[h.prompt][: h.max_tokens]
            assert [e.index for e in tokens] == list(range(len(want))), rid  # no gap, no repeat
            assert [e.token_id for e in tokens] == want, rid
            assert len(ends) == 1 and h.events[-1] is ends[0], (rid, ends)
            assert ends[0].status == "done", (rid, ends[0])
            text_of[h.prompt, h.max_tokens] = "".join(e.text for e in tokens)
            resubmitted += getattr(h.handle, "resubmits", 0)
        for s in self.sse:
            assert not s.errors, (s.prompt, s.errors)
            assert s.ids == list(range(s.max_tokens)), (s.prompt, s.ids)  # no gap, no repeat
            assert s.finish == "length" and s.done_marks == 1, (s.finish, s.done_marks)
            if (s.prompt, s.max_tokens) in text_of:
                assert "".join(s.texts) == text_of[s.prompt, s.max_tokens], s.prompt
        with self.inspect() as r:
            for h in self.handles:
                rid = h.handle.request_id
                rec = RequestRecord.from_hash(rid, r.hgetall(self.keys.record(rid)))
                assert rec is not None and rec.status == "done", (rid, rec)
                assert rec.num_tokens == h.max_tokens, (rid, rec.num_tokens)
                assert r.llen(self.keys.tokens(rid)) == rec.num_tokens, rid
                streamed = "".join(e.text for e in h.events if isinstance(e, TokenEvent))
                assert rec.text == streamed == text_of[h.prompt, h.max_tokens], (
                    rid,
                    rec,
                    streamed,
                    text_of[h.prompt, h.max_tokens],
                    [e.text for e in h.events if isinstance(e, TokenEvent)],
                    r.lrange(self.keys.tokens(rid), 0, -1),
                )
        logs = "".join(w.output(tail=None) for w in self.workers)
        for w in self.workers:
            assert w.alive(), f"worker {w.name} exited:\n{w.output(tail=4000)}"
        assert "inconsistent state" not in logs and "Traceback" not in logs, logs[-6000:]
        repaired = sum(int(m.group(1)) for m in _REPAIRED.finditer(logs))
        repairs = len(_REPAIRED.findall(logs))
        print(
            f"[counts] {how}: {len(self.handles)} handle streams and {len(self.sse)} SSE streams "
            f"ended once, done, gap- and duplicate-free, equal to the greedy reference; "
            f"{repairs} request repairs putting back {repaired} tokens; {resubmitted} requests "
            f"re-enqueued by their handles; {refused} SSE POSTs refused (503/429) and sent again"
        )


@contextmanager
def chaos_fleet(
    model_dir: Path,
    log_dir: Path,
    *,
    settings: Settings,
    flags: list[str],
    inspect: Callable[[], redis.Redis],
    ready: Callable[[ChaosWorker], bool],
) -> Iterator[ChaosFleet]:
    """Two workers (``chaos-a``, ``chaos-b``), a gateway and a ``Client``, all reaching Redis
    in the mode ``flags`` and ``settings`` give, with every other setting at its default."""
    prefix = settings.key_prefix
    with ExitStack() as stack:
        workers = [ChaosWorker(model_dir, flags, prefix, f"chaos-{n}", log_dir) for n in "ab"]
        for w in workers:
            stack.callback(w.close)
        for w in workers:
            wait_for(lambda: ready(w), f"{w.name}'s heartbeat")  # noqa: B023
        url = stack.enter_context(gateway_process(prefix, flags, log_dir))
        client = stack.enter_context(Client.from_url(settings=settings))
        yield ChaosFleet(settings, flags, workers, client, url, inspect)


def heartbeat_of(inspect: Callable[[], redis.Redis], keys: Keys) -> Callable[[ChaosWorker], bool]:
    """``ready`` for :func:`chaos_fleet`: the worker's heartbeat is in Redis."""

    def ready(w: ChaosWorker) -> bool:
        w.check_alive(f"worker {w.name}")
        try:
            with inspect() as r:
                return bool(r.exists(keys.worker(w.name)))
        except redis.RedisError:
            return False

    return ready


__all__ = ["DEADLINE_S", "ChaosFleet", "chaos_fleet", "heartbeat_of", "reference_runs"]
