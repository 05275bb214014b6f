"""The three priority levels, most urgent first."""

from __future__ import annotations

from enum import IntEnum

from tokenfleet.shared.errors import InvalidRequest


class Priority(IntEnum):
    """Priority levels; a smaller value is more urgent (``min()`` picks the most urgent)."""

    CRITICAL = 0
    NORMAL = 1
    BATCH = 2

    @property
    def label(self) -> str:
        """Lower-case wire name: ``critical``, ``normal`` or ``batch``."""
        return self.name.lower()

    @classmethod
    def parse(cls, value: str | int | Priority) -> Priority:
        """Accept a ``Priority``, its wire name or its integer value; else ``InvalidRequest``."""
        if isinstance(value, Priority):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        names = ", ".join(p.label for p in cls)
        raise InvalidRequest(f"unknown priority {value!r}; expected one of: {names}")


PRIORITIES: tuple[Priority, ...] = tuple(Priority)

BACKGROUND: Priority = Priority.BATCH
"""The level that yields to every other: its steps may be cut short and it sits out steps that
prefill more urgent work (the engine); it never fills a worker's last free slots (the worker)."""
