"""An independent Python statement of the pool's accounting rules, for the tests to check the Lua
scripts against (exact arithmetic with fractions)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any


def weighted_split(
    total: int, weights: Mapping[str, int], caps: Mapping[str, int]
) -> dict[str, int]:
    """Water-filled weighted split: whoever's exact share reaches its cap gets the cap, the rest
    is split again; floors, then the remainder one each by largest fraction, then by name."""
    share: dict[str, int] = {}
    open_ = sorted(weights)
    remaining = total
    while open_:
        wsum = sum(weights[n] for n in open_)
        exact = {n: Fraction(remaining * weights[n], wsum) for n in open_}
        capped = [n for n in open_ if exact[n] >= caps[n]]
        if not capped:
            floors = {n: math.floor(exact[n]) for n in open_}
            left = remaining - sum(floors.values())
            for n in sorted(open_, key=lambda n: (-(exact[n] - floors[n]), n))[:left]:
                floors[n] += 1
            share.update(floors)
            break
        for n in capped:
            share[n] = caps[n]
            remaining -= caps[n]
        open_ = [n for n in open_ if n not in capped]
    return share


def expected_entitlements(view: Mapping[str, Any]) -> dict[str, int]:
    active = {m["name"]: round(m["weight"] * 1000) for m in view["members"] if m["active"]}
    share = weighted_split(view["total"], active, dict.fromkeys(active, view["cap"]))
    return {m["name"]: share.get(m["name"], 0) for m in view["members"]}


def least_urgent(use: Sequence[int]) -> int:
    return max((i for i, u in enumerate(use) if u > 0), default=-1)


def freeable(member: Mapping[str, Any], priority: int) -> int:
    use = member["blocks_by_priority"]
    spare = max(0, member["held"] - sum(use))
    return min(member["held"], spare + sum(u for i, u in enumerate(use) if i > priority))


def expected_donor(
    view: Mapping[str, Any], requester: str, priority: int, short: int, busy: set[str]
) -> str | None:
    """The donor rule: least urgent work strictly below ``priority`` that can free ``short``
    blocks; ties to the member furthest above its entitlement, then by name."""
    best: str | None = None
    best_key: tuple[int, int] = (-1, 0)
    for m in sorted(view["members"], key=lambda m: m["name"]):
        if m["name"] == requester or m["name"] in busy:
            continue
        lu = least_urgent(m["blocks_by_priority"])
        if lu <= priority or freeable(m, priority) < short:
            continue
        key = (lu, m["held"] - m["entitlement"])
        if best is None or key > best_key:
            best, best_key = m["name"], key
    return best
