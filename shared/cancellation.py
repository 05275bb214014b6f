"""Cancellation checkpoints for asyncio loops that must stop when their task is cancelled.

A task's ``cancel()`` can be lost on its way in: redis-py may answer a cancel that lands
mid-command with a ``ConnectionError`` (which a retry-on-error loop then swallows), and Python
3.11's ``asyncio.wait_for`` (used by redis-py to write a command under a socket timeout) returns
the inner result and drops the cancel when both happen at once. The task then still counts the
request (``Task.cancelling() > 0``) but nothing is raised, so a loop that runs forever never ends
and whoever awaits the task waits forever (seen: ``BatchHandle.wait`` hung after its batch
completed). Every forever-loop of ours calls ``cancel_checkpoint()`` once per round and
``raise_if_cancelling(exc)`` where it retries on an error.
"""

from __future__ import annotations

import asyncio


def cancel_checkpoint() -> None:
    """Raise ``CancelledError`` if the current task has been asked to cancel (and the request
    was lost on its way in); no-op outside a task."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def raise_if_cancelling(exc: BaseException) -> None:
    """``cancel_checkpoint()`` for an ``except`` clause: the cancel is raised from ``exc``."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from exc
