"""Tenants' settings and figures, read and written for ``tokenfleet tenants`` (docs/fairness.md).

A tenant's settings live in the fleet's hash (``Keys.tenants``) and are copied into the tenant
book of every model the fleet knows (``Keys.tenant_book``: where the scripts read the weight and
the tenant's own bound, in the model's lane). A model first used after a ``set`` gets them from
its producers: a client reads a tenant's settings from the fleet's hash (cached a second) and its
enqueue script stores them in the book, unless the book holds settings set later (``at|T``).

The figures per (model, tenant): waiting (in its tenant queues), admitted, served tokens and
virtual time, from the books and queues (bounded: one read per model and tenant).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.priority import PRIORITIES
from tokenfleet.shared.record import as_str
from tokenfleet.shared.tenants import TenantSettings, check_tenant, check_weight


def known_models(client: redis.Redis, keys: Keys) -> list[str]:
    """Every model the fleet has a queue, a declaration or a lane for."""
    models = {as_str(m) or "" for m in client.smembers(keys.declared)}
    models |= {(as_str(m) or "").partition("|")[0] for m in client.smembers(keys.queues)}
    if keys.laned:
        models |= {as_str(m) or "" for m in client.smembers(keys.lanes)}
    return sorted(m for m in models if m)


def set_tenant(
    client: redis.Redis,
    keys: Keys,
    tenant: str,
    *,
    weight: float | None = None,
    max_waiting: int | None = None,
    clear_bound: bool = False,
) -> TenantSettings:
    """Store ``tenant``'s settings (what is not given stays as it was, stamped with the time
    now) and copy them into every known model's tenant book. ``InvalidRequest`` for a bad name,
    weight or bound."""
    check_tenant(tenant)
    held = TenantSettings.decode(client.hget(keys.tenants, tenant))
    if max_waiting is not None and max_waiting < 0:
        raise InvalidRequest(f"max_waiting must be 0 or more, got {max_waiting}")
    new = TenantSettings(
        check_weight(weight) if weight is not None else held.weight,
        None if clear_bound else (max_waiting if max_waiting is not None else held.max_waiting),
        time.time(),
    )
    client.hset(keys.tenants, tenant, new.encode())
    sync(client, keys, {tenant: new})
    return new


def sync(client: redis.Redis, keys: Keys, tenants: dict[str, TenantSettings] | None = None) -> None:
    """Copy ``tenants`` (default: every stored tenant) into each known model's book."""
    if tenants is None:
        tenants = {
            as_str(k) or "": TenantSettings.decode(v)
            for k, v in client.hgetall(keys.tenants).items()
        }
    for model in known_models(client, keys):
        book = keys.for_model(model).tenant_book(model)
        pipe = client.pipeline(transaction=False)
        for name, s in tenants.items():
            pipe.hset(book, mapping={f"w|{name}": repr(s.weight), f"at|{name}": repr(s.at)})
            if s.max_waiting is None:
                pipe.hdel(book, f"max|{name}")
            else:
                pipe.hset(book, f"max|{name}", s.max_waiting)
        pipe.execute()


@dataclass(frozen=True, slots=True)
class TenantRow:
    """One tenant of one model: its settings and figures (``tokenfleet tenants list``)."""

    model: str
    tenant: str
    weight: float
    max_waiting: int | None
    waiting: int  # in its tenant queues (requests not admitted yet)
    admitted: int  # admitted from its tenant queues so far
    served_tokens: int  # prompt + output tokens of its ended requests
    virtual_time: float  # tokens served / weight (admission's order: least first)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "model": self.model,
            "tenant": self.tenant,
            "weight": self.weight,
            "max_waiting": self.max_waiting,
            "waiting": self.waiting,
            "admitted": self.admitted,
            "served_tokens": self.served_tokens,
            "virtual_time": self.virtual_time,
        }


def book_rows(client: redis.Redis, keys: Keys, model: str) -> list[TenantRow]:
    """The tenants of ``model``'s book, with their waiting counts (one XLEN per queue)."""
    lane = keys.for_model(model)
    raw = {
        as_str(k) or "": as_str(v) or "" for k, v in client.hgetall(lane.tenant_book(model)).items()
    }
    names = sorted({k.partition("|")[2] for k in raw if "|" in k})
    pipe = client.pipeline(transaction=False)
    for name in names:
        for p in PRIORITIES:
            pipe.xlen(lane.tenant_queue(model, p, name))
    lengths = pipe.execute() if names else []
    rows = []
    for i, name in enumerate(names):
        bound = raw.get(f"max|{name}")
        rows.append(
            TenantRow(
                model,
                name,
                float(raw.get(f"w|{name}") or 1),
                int(bound) if bound else None,
                sum(lengths[i * len(PRIORITIES) : (i + 1) * len(PRIORITIES)]),
                int(raw.get(f"admitted|{name}") or 0),
                int(raw.get(f"served|{name}") or 0),
                float(raw.get(f"vt|{name}") or 0),
            )
        )
    return rows


def list_tenants(
    client: redis.Redis, keys: Keys
) -> tuple[dict[str, TenantSettings], list[TenantRow]]:
    """Every stored tenant's settings, and the per-model rows of every known model."""
    stored = {
        as_str(k) or "": TenantSettings.decode(v) for k, v in client.hgetall(keys.tenants).items()
    }
    rows = [row for model in known_models(client, keys) for row in book_rows(client, keys, model)]
    return stored, rows
