"""How many requests of each queue ended in each terminal status: ``Keys.tally``, read.

``tf_finish`` (every terminal transition, in Lua) counts its request's queue and status in one
hash per lane, two ways::

    "M|L|STATUS"      total since the hash was created (a counter: Prometheus takes its rate)
    "M|L|STATUS|S"    "MINUTE COUNT": the ends in epoch minute MINUTE, in slot S = MINUTE mod 2

so each queue keeps at most 5 totals and 10 slots, whatever the traffic. ``per_min`` is the
sliding-window estimate of the ends in the last 60 s at ``now``: the current minute's count plus
the previous minute's, weighted by the part of that minute still inside the window. It is a
function of the hash and ``now`` only: two readers of one hash at one moment agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tokenfleet.shared.record import as_str
from tokenfleet.shared.schema import TerminalStatus

STATUSES = tuple(s.value for s in TerminalStatus)


def _slot(value: str | None) -> tuple[int, int] | None:
    minute, _, count = (value or "").partition(" ")
    if not minute.isdigit() or not count.isdigit():
        return None
    return int(minute), int(count)


def queue_ends(raw: Mapping[Any, Any], now: float) -> dict[tuple[str, str], dict[str, Any]]:
    """``HGETALL Keys.tally`` -> {(model, priority): {status: {"total", "per_min"}}} for every
    queue with an end, each terminal status present (0 when none)."""
    fields = {as_str(k) or "": as_str(v) for k, v in raw.items()}
    minute = math.floor(now / 60)
    weight = 1.0 - (now / 60 - minute)  # of the previous minute, still in the last 60 s
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for name, value in fields.items():
        parts = name.split("|")
        if len(parts) not in (3, 4) or parts[2] not in STATUSES:
            continue
        queue = out.setdefault(
            (parts[0], parts[1]), {s: {"total": 0, "per_min": 0.0} for s in STATUSES}
        )
        ends = queue[parts[2]]
        if len(parts) == 3:
            ends["total"] = int(value) if value and value.isdigit() else 0
            continue
        slot = _slot(value)
        if slot is None:
            continue
        at, count = slot
        if at == minute:
            ends["per_min"] = round(ends["per_min"] + count, 1)
        elif at == minute - 1:
            ends["per_min"] = round(ends["per_min"] + count * weight, 1)
    return out


def no_ends() -> dict[str, Any]:
    """The ends of a queue nothing ended in yet."""
    return {s: {"total": 0, "per_min": 0.0} for s in STATUSES}
