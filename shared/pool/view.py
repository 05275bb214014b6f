"""A pool as ``pool_inspect`` sees it: the parse of its reply, shared by every reader.

``tokenfleet pool show`` and ``tokenfleet status`` (the worker's ``pool.admin.pool_snapshot``)
and the producer's fleet status (``producer.core.fleet_status``, behind the console) read a pool
through this one function, so a pool reads the same wherever it is shown.
"""

from __future__ import annotations

from typing import Any

import orjson


def pool_view(name: str, reply: list[Any]) -> dict[str, Any]:
    """A checked ``POOL_INSPECT`` reply (status code first) as a dict: the pool's settings,
    ``members`` (weight, held, entitlement, active, loan, token share, lease left; sorted by
    name), ``preemptions`` (sorted by id), ``free`` (total less held) and ``name``. No I/O."""
    view: dict[str, Any] = orjson.loads(reply[1])
    view["name"] = name
    # cjson writes an empty Lua table as {}: normalise the lists.
    for field in ("members", "preemptions"):
        if not isinstance(view.get(field), list):
            view[field] = []
    for member in view["members"]:
        member["weight"] = member.pop("weight_milli") / 1000
        member["active"] = bool(member["active"])
        if not isinstance(member["blocks_by_priority"], list):
            member["blocks_by_priority"] = []
    for order in view["preemptions"]:
        order["delivered"] = bool(order["delivered"])
    view["members"].sort(key=lambda m: m["name"])
    view["preemptions"].sort(key=lambda o: o["id"])
    view["free"] = view["total"] - view["held"]
    return view
