"""``tokenfleet demo``: start a small fleet, submit a mix of requests, watch them stream.

With no arguments: a Redis (REDIS_URL, else localhost:6379, else a private one), the bundled
SmolLM2-135M-Instruct (its GGUF file converted once into the model cache; ``--model tiny`` runs
the tiny random model instead), two worker processes with one thread each, and twelve chat
requests at the three priorities, greedy and sampled, some with a system turn or a stop string.
Tokens are shown as they arrive, one line per request and burst (readable in a terminal and in
CI logs); a summary table and each answer end the run. ``--workers 0`` uses the fleet already
running (compose's demo producer). Every run uses its own key prefix unless ``--workers 0``, so
a shared Redis is not disturbed.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.shared.declared_settings import env_value
from tokenfleet.shared.keys import DEFAULT_MODEL
from tokenfleet.worker.worker_settings import WorkerSettings

PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Give me three tips for learning a new language.",
    "Write a short poem about the sea.",
    "Why do cats purr?",
    "Describe a rainy morning in the city.",
    "Explain what a message queue is in two sentences.",
)
SYSTEM = "You are a helpful assistant. Answer briefly."
TINY = "tiny"  # --model tiny: the tiny random model built into ./.tiny-model/
PRIORITY_CYCLE: tuple[str, ...] = ("critical", "normal", "batch")


@dataclass
class Row:
    """One demo request and what was seen of it."""

    request_id: str
    priority: str
    kind: str
    question: str = ""
    text: str = ""
    num_tokens: int = 0
    status: str = ""
    finish_reason: str = ""
    queue_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run a local fleet and stream a mix of requests (what `make demo` runs)",
        description="Start worker processes on SmolLM2-135M-Instruct (or --model), submit chat "
        "requests at "
        "the three priorities, stream their text live and print a summary table.",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="worker processes to start (0: use the fleet already running)",
    )
    p.add_argument("--requests", type=int, default=12, help="requests to submit (12)")
    p.add_argument(
        "--model",
        default="smollm2",
        help="what the workers load: a bundled name, .gguf file, folder or cached hub id, or "
        "'tiny' for the tiny random model (default: smollm2)",
    )
    p.add_argument(
        "--model-name",
        default=env_value(WorkerSettings, "model_name") or DEFAULT_MODEL,
        help="served model name: the workers serve it and the requests ask for it "
        "($TOKENFLEET_MODEL_NAME, else default)",
    )
    p.add_argument("--max-tokens", type=int, default=48, help="max tokens per request (48)")
    p.add_argument(
        "--redis-url",
        default=None,
        help="default: $REDIS_URL, else localhost:6379, else a private server",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="give up on the requests after this many seconds (300)",
    )
    p.set_defaults(func=func)


def func(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.workers < 0:
        raise SystemExit("tokenfleet demo: --requests must be >= 1 and --workers >= 0")
    from tokenfleet.shared.settings import Settings
    from tokenfleet.worker.devtools.local_redis import ensure_redis

    with ensure_redis(args.redis_url) as url:
        base = Settings.from_env().with_url(url)
        if args.workers == 0:
            return _run(args, base)
        prefix = f"demo-{uuid.uuid4().hex[:8]}"
        settings = Settings(redis_url=url, key_prefix=prefix, record_ttl_s=3600)
        return _with_fleet(args, settings)


def _with_fleet(args: argparse.Namespace, settings: Any) -> int:
    from tokenfleet.worker.devtools.local_fleet import LocalFleet, delete_prefix
    from tokenfleet.worker.devtools.tiny_model import cached_tiny_model
    from tokenfleet.worker.models.resolve import resolve_model

    if args.model == TINY:
        model = str(cached_tiny_model())
    else:  # converted here, once, rather than by every worker at the same time
        print(f"preparing model {args.model} ...", flush=True)
        model = str(resolve_model(args.model))
    print(f"model: {model}   key prefix: {settings.key_prefix}")
    print(f"starting {args.workers} worker process(es), 1 thread each ...", flush=True)
    fleet = LocalFleet(
        model,
        settings.redis_url,
        key_prefix=settings.key_prefix,
        num_workers=args.workers,
        name_prefix=settings.key_prefix,
        extra_args=["--model-name", args.model_name, "--max-num-seqs", "8", "--grace-s", "5"],
    )
    fleet.start()
    try:
        code = _run(args, settings)
    finally:
        codes = fleet.stop()
        print(f"workers stopped (exit codes {codes})")
        if any(codes):
            for name in fleet.names:
                print(f"--- log of {name} ---\n{fleet.log_tail(name)}", file=sys.stderr)
        delete_prefix(settings.redis_url, settings.key_prefix)
        fleet.cleanup()
    return code or (1 if any(codes) else 0)


def _requests(n: int, max_tokens: int, model_name: str) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)]
        spec: dict[str, Any] = {
            "priority": PRIORITY_CYCLE[i % 3],
            "max_tokens": max_tokens if i % 4 else max_tokens // 2,
            "temperature": 0.7 if i % 2 else 0.0,  # greedy and seeded sampling
            "seed": i,
            "request_id": f"demo-{i:02d}-{uuid.uuid4().hex[:6]}",
            "model": model_name,
            "messages": [{"role": "user", "content": prompt}],
        }
        if i % 3 == 1:
            spec["messages"].insert(0, {"role": "system", "content": SYSTEM})
        if i % 5 == 2:
            spec["stop"] = ["\n"]
        out.append(spec)
    return out


def _run(args: argparse.Namespace, settings: Any) -> int:
    from tokenfleet.producer import Client

    specs = _requests(args.requests, args.max_tokens, args.model_name)
    events: queue.Queue[tuple[str, Any]] = queue.Queue()
    rows: dict[str, Row] = {}
    with Client.from_url(settings.redis_url, settings=settings) as client:
        start = time.monotonic()
        handles = []
        for spec in specs:
            kind = "chat" + (" +system" if len(spec["messages"]) > 1 else "")
            rid = spec["request_id"]
            rows[rid] = Row(
                rid,
                spec["priority"],
                kind + (" +stop" if "stop" in spec else ""),
                question=spec["messages"][-1]["content"],
            )
            handles.append(client.submit(**spec))
        print(
            f"submitted {len(handles)} requests; streaming (one line per request and burst):",
            flush=True,
        )
        threads = [
            threading.Thread(target=_pump, args=(h, events, args.timeout), daemon=True)
            for h in handles
        ]
        for t in threads:
            t.start()
        _show(events, rows, len(handles), args.timeout)
        elapsed = time.monotonic() - start
    _summary(list(rows.values()), elapsed)
    return 0 if all(r.status for r in rows.values()) else 1


def _pump(handle: Any, events: queue.Queue[tuple[str, Any]], timeout: float) -> None:
    try:
        for ev in handle.stream(timeout=timeout):
            events.put((handle.request_id, ev))
    except Exception as exc:  # shown in the table as the request's status
        events.put((handle.request_id, exc))


def _show(
    events: queue.Queue[tuple[str, Any]], rows: dict[str, Row], total: int, timeout: float
) -> None:
    from tokenfleet.producer import TokenEvent

    done = 0
    deadline = time.monotonic() + timeout
    while done < total and time.monotonic() < deadline:
        burst: dict[str, list[str]] = {}
        ended: list[str] = []
        try:
            item = events.get(timeout=0.5)
        except queue.Empty:
            continue
        pending = [item]
        flush_at = time.monotonic() + 0.2
        while time.monotonic() < flush_at:
            try:
                pending.append(events.get(timeout=max(0.0, flush_at - time.monotonic())))
            except queue.Empty:
                break
        for rid, ev in pending:
            row = rows[rid]
            if isinstance(ev, TokenEvent):
                row.text += ev.text
                row.num_tokens += 1
                burst.setdefault(rid, []).append(ev.text)
            elif isinstance(ev, Exception):
                row.status, row.finish_reason = "error", type(ev).__name__
                ended.append(rid)
            else:
                row.status = ev.status.value
                row.finish_reason = ev.finish_reason or ev.code or ""
                row.queue_s, row.ttft_s = ev.timings.get("queue_s"), ev.timings.get("ttft_s")
                row.e2e_s = ev.timings.get("e2e_s")
                ended.append(rid)
        for rid, pieces in burst.items():
            row = rows[rid]
            print(
                f"  {rid[:7]} {row.priority:<8} +{len(pieces):<3} {''.join(pieces)!r}", flush=True
            )
        for rid in ended:
            row = rows[rid]
            done += 1
            print(
                f"  {rid[:7]} {row.priority:<8} == {row.status} ({row.finish_reason}), "
                f"{row.num_tokens} tokens",
                flush=True,
            )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _summary(rows: list[Row], elapsed_s: float) -> None:
    order = {"critical": 0, "normal": 1, "batch": 2}
    rows = sorted(rows, key=lambda r: (order.get(r.priority, 9), r.request_id))
    header = (
        f"{'request':<9} {'priority':<9} {'kind':<19} {'queue ms':>9} {'TTFT ms':>8} "
        f"{'e2e ms':>8} {'tokens':>6}  finish"
    )
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.request_id[:7]:<9} {r.priority:<9} {r.kind:<19} {_ms(r.queue_s):>9} "
            f"{_ms(r.ttft_s):>8} {_ms(r.e2e_s):>8} {r.num_tokens:>6}  "
            f"{r.status or 'unfinished'} {r.finish_reason}"
        )
    total = sum(r.num_tokens for r in rows)
    rate = total / elapsed_s if elapsed_s > 0 else 0.0
    print("-" * len(header))
    print(f"{len(rows)} requests, {total} tokens in {elapsed_s:.1f} s: {rate:.1f} tokens/s overall")
    print()
    for r in rows:
        answer = " ".join(r.text.split()) if r.num_tokens else "(no tokens)"
        print(f"{r.request_id[:7]} Q: {r.question}\n        A: {answer}")
