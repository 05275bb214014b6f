"""``tokenfleet worker``: run one inference worker against the fleet's Redis until SIGTERM/SIGINT.

Every flag has a ``TOKENFLEET_*`` environment variable (for compose); a flag wins over the
environment. Exit status: 0 after a graceful stop, 3 when the engine failed several steps in a
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


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "worker",
        help="run an inference worker",
        description="Run an inference worker: pull requests from the model's priority queues, "
        "run them through the continuous-batching engine and stream tokens back over Redis. "
        "Each flag defaults to its TOKENFLEET_* environment variable.",
    )
    p.add_argument(
        "--model",
        help="bundled name (smollm2), .gguf file, model folder, or a hub id already in the local "
        "cache (TOKENFLEET_MODEL)",
    )
    p.add_argument(
        "--model-name",
        help="served model name, the queues' MODEL (TOKENFLEET_MODEL_NAME, default 'default')",
    )
    add_redis_flags(p)
    p.add_argument("--device", help="torch device, e.g. cpu, cuda, cuda:1 (TOKENFLEET_DEVICE)")
    p.add_argument("--dtype", help="auto, float32, bfloat16 or float16 (TOKENFLEET_DTYPE)")
    p.add_argument("--max-num-seqs", type=int, help="sequences per step (TOKENFLEET_MAX_NUM_SEQS)")
    p.add_argument(
        "--max-batched-tokens", type=int, help="tokens per step (TOKENFLEET_MAX_BATCHED_TOKENS)"
    )
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-blocks", type=int, help="KV cache blocks (TOKENFLEET_KV_BLOCKS)")
    kv.add_argument("--kv-memory", help="KV cache memory, e.g. 512M or 4GiB (TOKENFLEET_KV_MEMORY)")
    p.add_argument(
        "--max-model-len",
        type=int,
        help="prompt + output tokens per request at most (TOKENFLEET_MAX_MODEL_LEN; default: the "
        "model's context, capped by the KV cache with a warning)",
    )
    p.add_argument("--block-size", type=int, help="tokens per KV block (TOKENFLEET_BLOCK_SIZE)")
    p.add_argument(
        "--priorities",
        help="levels served, e.g. critical,normal (TOKENFLEET_PRIORITIES, default all)",
    )
    p.add_argument("--name", help="unique worker name (TOKENFLEET_NAME, default HOST-PID)")
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port (TOKENFLEET_METRICS_PORT)",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (TOKENFLEET_THREADS)")
    p.add_argument(
        "--grace-s",
        type=float,
        help="on SIGTERM, seconds to finish running requests (TOKENFLEET_GRACE_S, 30)",
    )
    p.add_argument(
        "--heartbeat-ttl-s",
        type=float,
        help="heartbeat lifetime; a worker is dead once it lapses (10)",
    )
    p.add_argument(
        "--claim-idle-s",
        type=float,
        help="idle time before a dead worker's entry may be claimed (5)",
    )
    p.add_argument("--claim-interval-s", type=float, help="how often to look for them (2)")
    p.add_argument(
        "--poison-limit",
        type=int,
        help="workers a request may outlive before it ends worker_lost (3)",
    )
    p.add_argument("--kv-pool", help="shared KV pool to join (TOKENFLEET_KV_POOL)")
    p.add_argument(
        "--share-weight", type=float, help="weight in the KV pool (TOKENFLEET_SHARE_WEIGHT, 1)"
    )
    p.add_argument(
        "--urgent-slots",
        type=int,
        help="more urgent requests a read may take beyond the free slots, each preempting a "
        "running batch request (TOKENFLEET_URGENT_SLOTS; default max-num-seqs/8, 0 = none)",
    )
    p.add_argument(
        "--no-batch-yield",
        dest="batch_yields",
        action="store_const",
        const=False,
        help="run batch work like any other: no sitting out urgent prefills, no cut steps, no "
        "slots taken from it (TOKENFLEET_BATCH_YIELDS=0)",
    )
    p.add_argument(
        "--steal-after-s",
        type=float,
        help="take other workers' routed work once it has waited this long "
        "(TOKENFLEET_STEAL_AFTER_S, 0.5)",
    )
    p.add_argument(
        "--overflow-for",
        metavar="MODEL",
        help="serve MODEL as an overflow worker: take only its work that waited "
        "--overflow-after-s (TOKENFLEET_OVERFLOW_FOR)",
    )
    p.add_argument(
        "--overflow-after-s",
        type=float,
        help="the overflow threshold in seconds (TOKENFLEET_OVERFLOW_AFTER_S, 5)",
    )
    p.add_argument("--log-level", default="INFO", help="logging level (INFO)")
    p.set_defaults(func=func)


def build_settings(args: argparse.Namespace) -> tuple[Any, Any]:
    """(``Settings``, ``WorkerSettings``) from parsed flags and the environment."""
    from tokenfleet.worker.worker_settings import WorkerSettings

    settings = settings_from_flags(args)
    ws = WorkerSettings.from_env(
        model=args.model,
        model_name=args.model_name,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens,
        kv_blocks=args.kv_blocks,
        kv_memory=args.kv_memory,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        priorities=args.priorities,
        name=args.name,
        metrics_port=args.metrics_port,
        threads=args.threads,
        grace_s=args.grace_s,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        claim_idle_s=args.claim_idle_s,
        claim_interval_s=args.claim_interval_s,
        poison_limit=args.poison_limit,
        kv_pool=args.kv_pool,
        share_weight=args.share_weight,
        urgent_slots=args.urgent_slots,
        batch_yields=args.batch_yields,
        steal_after_s=args.steal_after_s,
        overflow_for=args.overflow_for,
        overflow_after_s=args.overflow_after_s,
    )
    return settings, ws


def func(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    settings, ws = build_settings(args)
    if ws.threads:
        import torch

        torch.set_num_threads(ws.threads)
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
    metrics = WorkerMetrics(ws.model_name)
    if ws.metrics_port is not None:
        metrics.serve(ws.metrics_port)
    service = WorkerService(engine, settings, ws, metrics=metrics)
    service.install_signal_handlers()
    return service.run()
