"""``tokenfleet worker``: run one inference worker against the fleet's Redis until SIGTERM/SIGINT.

The flags are generated from ``WorkerSettings``' declaration; most have a ``TOKENFLEET_*``
environment variable (for compose), and a flag wins over its variable (docs/configuration.md).
Exit status: 0 after a graceful stop, 3 when the engine failed several steps in a
row (see ``tokenfleet.worker.service.step_failure``), 4 when the model cannot be found or loaded
(nothing was read from the queue: queued work waits for a healthy worker), 1 on other bad
settings.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags
from tokenfleet.shared.settings_flags import add_flags, flag_values
from tokenfleet.worker.worker_settings import WorkerSettings


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "worker",
        help="run an inference worker",
        description="Run an inference worker: pull requests from the model's priority queues, "
        "run them through the continuous-batching engine and stream tokens back over Redis. "
        "Each flag defaults to its TOKENFLEET_* environment variable.",
    )
    add_flags(p, WorkerSettings, title="worker (a flag wins over its variable)")
    add_redis_flags(p)
    p.set_defaults(func=func)


def build_settings(args: argparse.Namespace) -> tuple[Any, WorkerSettings]:
    """(``Settings``, ``WorkerSettings``) from parsed flags and the environment."""
    return settings_from_flags(args), WorkerSettings.from_env(**flag_values(args, WorkerSettings))


def func(args: argparse.Namespace) -> int:
    settings, ws = build_settings(args)
    logging.basicConfig(
        level=getattr(logging, ws.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import torch

    from tokenfleet.worker.cpu_threads import usable_cpus

    torch.set_num_threads(ws.threads or usable_cpus())  # a container's CPU limit, not the node's
    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.engine.model_runner import UnsupportedModel
    from tokenfleet.worker.models.errors import EXIT_MODEL_UNAVAILABLE, ModelFileError
    from tokenfleet.worker.models.resolve import resolve_model
    from tokenfleet.worker.models.startup import context_warning, model_summary
    from tokenfleet.worker.service import WorkerService
    from tokenfleet.worker.service.engine_port import EnginePort
    from tokenfleet.worker.service.metrics import WorkerMetrics

    log = logging.getLogger("tokenfleet.worker")
    try:
        folder = resolve_model(ws.model)
        loaded = Engine(folder, **ws.engine_overrides())
    except (ModelFileError, UnsupportedModel) as exc:
        print(f"tokenfleet worker: model {ws.model!r} cannot be used: {exc}", file=sys.stderr)
        return EXIT_MODEL_UNAVAILABLE
    except ValueError as exc:  # a setting the model cannot honour (dtype, max_model_len, ...)
        print(f"tokenfleet worker: {exc}", file=sys.stderr)
        return 1
    log.info("%s", model_summary(ws.model, folder, loaded))
    warning = None if ws.max_model_len is not None else context_warning(loaded)
    if warning:
        log.warning("%s", warning)
    engine: EnginePort = loaded  # mypy: the engine fits the service's port
    metrics = WorkerMetrics(ws.model_name, tenant_labels=ws.metrics_tenants)
    if ws.metrics_port is not None:
        metrics.serve(ws.metrics_port)
    service = WorkerService(engine, settings, ws, metrics=metrics)
    service.install_signal_handlers()
    return service.run()
