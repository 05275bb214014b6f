"""``tokenfleet batch``: OpenAI-style batches from the command line.

``submit FILE`` uploads a JSONL file of batch lines and creates its batch (``--wait`` drives
it here and shows a progress bar until it is final, then writes the results); ``status``,
``cancel``, ``results`` and ``list`` follow batches made here, by Python, or through the
gateway's ``/v1/batches``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import orjson

from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags
from tokenfleet.shared.settings import Settings


def register(subparsers: Any) -> None:
    """Add the ``batch`` parser and its actions."""
    p = subparsers.add_parser(
        "batch",
        help="run an OpenAI-style batch (JSONL in, JSONL out)",
        description="Batches run at priority batch, fed to the fleet a window at a time.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = actions.add_parser("submit", help="upload FILE and create its batch")
    s.add_argument("file", metavar="FILE", help="JSONL: one {custom_id, method, url, body} a line")
    s.add_argument("--endpoint", default="/v1/chat/completions", help="the lines' url")
    s.add_argument("--window", default="24h", help="completion window (e.g. 24h, 90m)")
    s.add_argument("--wait", action="store_true", help="drive it here with a progress bar")
    s.add_argument("--output", "-o", default=None, help="with --wait: write the results here")
    for name, text in (
        ("status", "show a batch"),
        ("cancel", "cancel a batch"),
        ("results", "print a batch's output file (--errors: its error file)"),
    ):
        a = actions.add_parser(name, help=text)
        a.add_argument("batch_id", metavar="ID")
        if name == "results":
            a.add_argument("--errors", action="store_true", help="the error file instead")
    lst = actions.add_parser("list", help="the newest batches")
    lst.add_argument("--limit", type=int, default=20)
    for a in actions.choices.values():
        a.add_argument("--json", action="store_true", help="print JSON")
        add_redis_flags(a)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the chosen action."""
    settings = settings_from_flags(args)
    return asyncio.run(_run(args, settings))


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    from tokenfleet.producer.async_client import AsyncClient
    from tokenfleet.producer.gateway.batches.handle import AsyncBatchHandle, submit_batch
    from tokenfleet.producer.gateway.batches.store import BatchStore
    from tokenfleet.shared.redis_connect import async_redis_client

    r = async_redis_client(settings)
    client = AsyncClient(r, settings=settings)
    try:
        if args.action == "list":
            page, _ = await BatchStore(r, settings).list(limit=args.limit)
            for batch in page:
                _show(batch.to_dict(), args.json)
            return 0
        if args.action == "submit":
            handle = await submit_batch(
                client, r, args.file, endpoint=args.endpoint, completion_window=args.window
            )
            batch = await handle.status()
            if not args.wait:
                _show(batch.to_dict(), args.json)
                return 0
            batch = await _wait(handle)
            _show(batch.to_dict(), args.json)
            if args.output:
                rows = await handle.results()
                with open(args.output, "wb") as out:
                    out.writelines(orjson.dumps(row) + b"\n" for row in rows)
            return 0 if batch.status == "completed" else 1
        handle = AsyncBatchHandle(client, r, args.batch_id)
        if args.action == "status":
            _show((await handle.status()).to_dict(), args.json)
        elif args.action == "cancel":
            _show((await handle.cancel()).to_dict(), args.json)
        else:
            rows = await (handle.errors() if args.errors else handle.results())
            for row in rows:
                sys.stdout.write(orjson.dumps(row).decode() + "\n")
        return 0
    finally:
        await client.aclose()
        await r.aclose()


async def _wait(handle: Any) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=False,
    ) as bar:
        task = bar.add_task(handle.batch_id, total=None)

        def show(batch: Any) -> None:
            bar.update(
                task,
                total=batch.total or None,
                completed=batch.completed + batch.failed,
                description=f"{handle.batch_id} {batch.status} ({batch.failed} failed)",
            )

        return await handle.wait(progress=show)


def _show(obj: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(orjson.dumps(obj).decode())
        return
    counts = obj["request_counts"]
    print(
        f"{obj['id']}  {obj['status']:<11} {counts['completed']}/{counts['total']} done, "
        f"{counts['failed']} failed  output={obj['output_file_id'] or '-'} "
        f"errors={obj['error_file_id'] or '-'}"
    )
