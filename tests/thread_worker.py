"""A worker in a thread of the test process, for tests where no signal and no crash is under
test: the same ``WorkerService`` that ``tokenfleet worker`` runs, built from the same flags by
the same parser, but with no interpreter, torch import and model load to pay per worker.

Tests that send a worker a signal, kill it or watch it exit keep a real process
(``worker_helpers.WorkerProc``).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from waiting import DEADLINE_S, wait_for

from tokenfleet.shared.keys import Keys

# What worker_helpers.WorkerProc passes too: short heartbeats and claims (tests wait less).
WORKER_FLAGS = ("--threads", "1", "--heartbeat-ttl-s", "2", "--claim-idle-s", "0.5",
                "--claim-interval-s", "0.5")  # fmt: skip


class ThreadWorker:
    """``tokenfleet worker --model MODEL_DIR --name NAME FLAGS EXTRA`` as a ``WorkerService``
    running in a daemon thread, on ``redis_url`` under key prefix ``prefix``; its log lines are
    kept (:meth:`output`). :meth:`close` stops it as SIGTERM would (graceful, then at once)."""

    def __init__(
        self,
        model_dir: Path,
        redis_url: str,
        prefix: str,
        name: str,
        *extra: str,
        flags: Sequence[str] = WORKER_FLAGS,
    ) -> None:
        from tokenfleet.worker.cli import build_parser
        from tokenfleet.worker.commands.worker import build_settings
        from tokenfleet.worker.engine.engine import Engine
        from tokenfleet.worker.service import WorkerService
        from tokenfleet.worker.service.metrics import WorkerMetrics

        self.name = name
        self.keys = Keys(prefix)
        argv = ["worker", "--model", str(model_dir), "--name", name, *flags]
        argv += ["--redis-url", redis_url, *extra]
        settings, ws = build_settings(build_parser().parse_args(argv))
        settings = dataclasses.replace(settings, key_prefix=prefix)  # (the environment's, else)
        self._log = io.StringIO()
        self._handler = logging.StreamHandler(self._log)
        self._handler.addFilter(lambda record: name in record.getMessage())
        logging.getLogger("tokenfleet").addHandler(self._handler)
        engine = Engine(model_dir, **ws.engine_overrides())
        metrics = WorkerMetrics(ws.model_name)  # as the command does (worker/commands/worker.py)
        self._http: Any = None
        if ws.metrics_port is not None:
            self._http = metrics.serve(ws.metrics_port)  # (server, thread): shut down at close
        self.service = WorkerService(engine, settings, ws, metrics=metrics)
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name=f"worker-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.exit_code = self.service.run()

    def wait_ready(self, r: redis.Redis, timeout_s: float = DEADLINE_S) -> None:
        def ready() -> bool:
            if not self._thread.is_alive():
                raise AssertionError(f"worker {self.name} stopped early:\n{self.output()}")
            return bool(r.exists(self.keys.worker(self.name)))

        wait_for(ready, f"worker {self.name}'s heartbeat", timeout_s, 0.05)

    def output(self) -> str:
        return self._log.getvalue()[-6000:]

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 60) -> None:
        """Stop it (graceful, then at once) and wait for its thread."""
        if self._thread.is_alive():
            self.service.request_stop()
            self._thread.join(timeout_s / 2)
        if self._thread.is_alive():
            self.service.request_stop()  # a second request: hand back at once
            self._thread.join(timeout_s / 2)
        logging.getLogger("tokenfleet").removeHandler(self._handler)
        if self._http is not None:
            server = self._http[0] if isinstance(self._http, tuple) else self._http
            server.shutdown()
            server.server_close()
        if self._thread.is_alive():
            raise AssertionError(f"worker {self.name} did not stop:\n{self.output()}")
