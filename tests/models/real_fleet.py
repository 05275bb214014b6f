"""The real-model gateway fleet: two real ``tokenfleet worker --model smollm2`` processes and a
real ``tokenfleet serve`` (uvicorn) on a private ``redis-server`` of their own, as a user starts
them. One is started for the session, when a test first asks for it (``real_fleet`` in
tests/models/conftest.py), and stopped after the last test of tests/models: the tools, ``n``,
structured-output and plain gateway tests share it instead of paying three SmolLM2 loads each.

Its own Redis because the suite's ``redis_url`` fixture flushes the shared server before each
test that asks for it. The workers' heartbeats are short (3 s) so a takeover happens within a
test. A test that SIGKILLs a worker (the takeover tests) leaves it dead; the fixture starts it
again, under the same name as a restarted process would have, before the next test (``revive``).

Invariant: after ``revive()`` returns, every worker of ``WORKERS`` (and of ``FLOAT32_WORKERS``,
once started) and the gateway run, and the gateway's ``/v1/models`` lists exactly ``WORKERS`` for
model ``default`` (and exactly ``FLOAT32_WORKERS`` for model ``float32``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from child_process import ChildProcess, free_port, tokenfleet_args
from waiting import wait_for

from tokenfleet.worker.devtools.local_redis import RedisServer

PREFIX = "tfreal"
WORKERS = ("real-a", "real-b")  # model "default": the defaults (int4 weights, a 16-bit KV cache)
READY_S = 300.0  # failure guard: two SmolLM2 loads on a loaded 2-core machine
TIMERS = ("--heartbeat-ttl-s", "3", "--claim-idle-s", "1", "--claim-interval-s", "0.5")
# Model "float32", two workers started when a test first asks (``float32_model``): the file's
# weights dequantized to float32 and a float32 KV cache, for the tests that compare logprobs with
# Hugging Face's float32 forward (tests/models/test_structured_real.py) and that require a
# greedy answer resumed on the other worker after a SIGKILL to go on token for token as it
# would have (tests/models/test_contract_real.py). As int4, a resume recomputes the answer so far
# in one prefill, whose float32 rounding differs from the decode steps that first computed it,
# and int4's bfloat16 activations carry that into near-tie flips (measured 2026-11-28 on nine
# chats resumed after 5, 12 and 25 tokens: 8 of 27 diverged as int4, 0 of 27 in float32, the
# engine in-process, no prefix cache). The other tests run on
# the defaults, as a user's fleet does, and at a third of float32's compute per token.
FLOAT32_MODEL = "float32"
FLOAT32_WORKERS = ("real-f32-a", "real-f32-b")
FLOAT32 = ("--model-name", FLOAT32_MODEL, "--quantization", "none", "--kv-dtype", "float32")


class RealFleet:
    """See the module docstring. ``url``: the gateway's ``/v1`` base; ``redis_url``: its
    Redis; ``workers``: name -> the running process (replaced by ``revive``)."""

    def __init__(self, model_cache: Path, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.server = RedisServer(unix_socket=True, prefer="system").start()
        self.redis_url = self.server.url
        self.env = {
            "REDIS_URL": self.redis_url,
            "TOKENFLEET_KEY_PREFIX": PREFIX,
            "TOKENFLEET_MODEL_CACHE": str(model_cache),
        }
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v1"
        self.workers: dict[str, ChildProcess] = {}
        self.starts = 0  # worker processes started (each log file is its own)
        self.closed = False
        # model name -> its workers' names: what revive starts and _ready waits for
        self.models: dict[str, tuple[str, ...]] = {"default": WORKERS}
        self.gateway = ChildProcess(
            tokenfleet_args("serve", "--port", str(port), "--log-level", "warning"),
            log_dir / "gateway.log",
            self.env,
        )
        try:
            self.revive()
        except BaseException:
            self.close()
            raise

    def revive(self) -> None:
        """Start again every worker that is not running, and wait until all are ready."""
        if self.closed:
            raise RuntimeError("the real-model fleet was stopped after the last test of its folder")
        for name in (name for names in self.models.values() for name in names):
            if name not in self.workers or not self.workers[name].alive():
                if name in self.workers:
                    self.workers[name].close()
                self.starts += 1
                extra = FLOAT32 if name in FLOAT32_WORKERS else ()
                args = tokenfleet_args(
                    "worker", "--model", "smollm2", "--name", name, "--threads", "1",
                    *TIMERS, *extra,
                )  # fmt: skip
                log = self.log_dir / f"{name}-{self.starts}.log"
                self.workers[name] = ChildProcess(args, log, self.env)
        wait_for(self._ready, "the SmolLM2 workers and the gateway", READY_S, 0.1)

    def float32_model(self) -> str:
        """The name of the model served in float32 (weights and KV cache), its two workers
        started on the first call and kept, like the others, until ``close``."""
        self.models[FLOAT32_MODEL] = FLOAT32_WORKERS
        try:
            self.revive()
        except BaseException:
            del self.models[FLOAT32_MODEL]  # the next test's revive does not wait for it again
            raise
        return FLOAT32_MODEL

    def _ready(self) -> bool:
        assert self.gateway.alive(), f"the gateway exited early:\n{self.gateway.output()}"
        for names in self.models.values():
            for name in names:
                proc = self.workers[name]
                assert proc.alive(), f"worker {name} exited early:\n{proc.output()}"
        try:
            models: list[dict[str, Any]] = httpx.get(self.url + "/models", timeout=2).json()["data"]
        except httpx.HTTPError:
            return False
        listed = {m["id"]: tuple(sorted(m["tokenfleet"]["workers"])) for m in models}
        return listed == {model: tuple(sorted(names)) for model, names in self.models.items()}

    def close(self) -> None:
        """Stop the workers and the gateway (SIGTERM, then SIGKILL) and the Redis; once."""
        if self.closed:
            return
        self.closed = True
        for proc in [*self.workers.values(), self.gateway]:
            proc.close(grace_s=30)
        self.server.stop()
