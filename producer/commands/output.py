"""What the request commands (``submit``, ``get``, ``follow``, ``cancel``) print, and their exit
statuses, in one place.

Exit statuses (docs/client.md, "The command line"):

    0  the request ended ``done`` (``get``: a record was shown; ``cancel``: cancelled or asked)
    1  it ended otherwise (``cancelled``, ``expired``, ``dropped``, ``error``), or an error: bad
       input, unknown request id, Redis refused (``cancel``: it had already ended)
    2  usage error (argparse)
    3  ``--timeout`` passed first: the request's state is printed (on stderr, or as JSON with
       ``"timed_out": true``); it goes on unless ``--cancel-on-timeout`` cancelled it
    130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import orjson

from tokenfleet.producer.client import Client
from tokenfleet.producer.handle import Handle
from tokenfleet.shared.errors import UnknownRequest
from tokenfleet.shared.record import RequestRecord
from tokenfleet.shared.schema import Event, TerminalEvent, TerminalStatus, TokenEvent

EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_TIMEOUT = 3


def print_json(data: Any) -> None:
    """One JSON document on its own line, flushed."""
    sys.stdout.write(orjson.dumps(data).decode() + "\n")
    sys.stdout.flush()


def show_text(text: str, usage: dict[str, Any], finish_reason: str | None) -> None:
    """The result's text, or a note on stderr when the model generated nothing at all (an empty
    line would look like a fault)."""
    if usage.get("completion_tokens", len(text)) == 0 and not text:
        print(f"(no tokens generated: finish_reason {finish_reason})", file=sys.stderr)
    else:
        print(text)


def events_until(handle: Handle, from_index: int, until: float | None) -> Iterator[Event]:
    """``handle.stream(from_index)`` with one bound on the whole wait (monotonic ``until``):
    builtin ``TimeoutError`` once it passes. Reconnects are the handle's (it re-reads the
    durable record and token list and goes on from the index it has)."""
    if until is None:
        yield from handle.stream(from_index)
        return
    index = from_index
    while True:
        remaining = until - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"request {handle.request_id}: the timeout passed")
        # a fresh iterator per event, each bounded by what is left; the handle's cache keeps
        # what it has read, so nothing is read twice
        event = next(iter(handle.stream(index, timeout=remaining)))
        yield event
        if isinstance(event, TerminalEvent):
            return
        index += 1


def print_events(events: Iterator[Event], *, as_json: bool) -> TerminalEvent | None:
    """Print token texts as they arrive (or each event as a JSON line); returns the terminal
    event. The text ends with a newline; a failure is said on stderr."""
    terminal: TerminalEvent | None = None
    try:
        for event in events:
            if isinstance(event, TerminalEvent):
                terminal = event
            if as_json:
                print_json(event.to_dict())
            elif isinstance(event, TokenEvent):
                sys.stdout.write(event.text)
                sys.stdout.flush()
    finally:
        if not as_json:
            sys.stdout.write("\n")
            sys.stdout.flush()
    if terminal is not None and not as_json and terminal.status is not TerminalStatus.DONE:
        detail = f"[{terminal.code}] " if terminal.code else ""
        print(
            f"request {terminal.request_id} {terminal.status.value}: {detail}"
            f"{terminal.message or ''}".rstrip(),
            file=sys.stderr,
        )
    return terminal


def exit_status(terminal: TerminalEvent | None) -> int:
    """0 for ``done``, else 1."""
    done = terminal is not None and terminal.status is TerminalStatus.DONE
    return EXIT_DONE if done else EXIT_FAILED


def describe(record: RequestRecord) -> list[str]:
    """A record as ``name  value`` lines for people (``get``, and a timeout's report)."""
    status = record.status.value
    if record.finish_reason:
        status += f" (finish_reason {record.finish_reason})"
    rows = [
        ("request", record.request_id),
        ("status", status),
        ("model", f"{record.model or '?'} ({record.priority or '?'})"),
        ("tokens", str(record.num_tokens)),
    ]
    if record.worker:
        rows.append(("worker", record.worker))
    elif record.ran_on:  # ended: who ran it last
        rows.append(("ran on", record.ran_on))
    route = record.route + (f" -> {record.routed_to}" if record.routed_to else "")
    if record.taken:  # another worker took it after it waited
        route += f", taken: {record.taken}"
    rows.append(("route", route))
    if record.waiting_on and not record.status.is_terminal:
        # set at submit while no live worker served its model; a worker's start clears it
        rows.append(
            ("waiting", f"on model {record.waiting_on} (no live worker served it at submit)")
        )
    if record.code or record.message:
        rows.append(("error", f"[{record.code or record.status.value}] {record.message or ''}"))
    return [f"{name:<8} {value}".rstrip() for name, value in rows]


def report_timeout(
    client: Client, handle: Handle, timeout: float, *, cancel: bool, as_json: bool
) -> int:
    """Say where the request stands when ``--timeout`` passed (cancelling it first with
    ``cancel``); returns :data:`EXIT_TIMEOUT`."""
    rid = handle.request_id
    cancelled = client.cancel(rid) if cancel else False
    try:
        record: RequestRecord | None = client.status(rid)
    except UnknownRequest:
        record = None
    if as_json:
        data = record.to_dict() if record is not None else {"request_id": rid, "status": None}
        print_json({**data, "timed_out": True, "cancel_requested": cancelled})
        return EXIT_TIMEOUT
    if not cancel:
        what = "it goes on"
    elif not cancelled:
        what = "it had already ended"
    elif record is not None and not record.status.is_terminal:
        what = "cancel asked for: its worker stops it at its next step"
    else:
        what = "cancelled"
    print(f"tokenfleet: timed out after {timeout:g}s ({what}):", file=sys.stderr)
    for line in describe(record) if record is not None else [f"request  {rid} (no record)"]:
        print("  " + line, file=sys.stderr)
    if not cancel:
        print(f"  follow it with: tokenfleet follow {rid}", file=sys.stderr)
    return EXIT_TIMEOUT
