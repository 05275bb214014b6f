"""The statuses a request goes through: the five terminal ones, and every one a record shows."""

from __future__ import annotations

from enum import StrEnum


class TerminalStatus(StrEnum):
    """The five ways a request ends; exactly one is reached per accepted request."""

    DONE = "done"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    DROPPED = "dropped"
    ERROR = "error"


class RequestStatus(StrEnum):
    """Every status a durable record can show: two live ones, then the terminal ones."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    DROPPED = "dropped"
    ERROR = "error"

    @property
    def is_terminal(self) -> bool:
        """True for the five end states."""
        return self not in (RequestStatus.QUEUED, RequestStatus.RUNNING)
