"""``tokenfleet keys``: create, list and revoke the gateway's API keys.

``tokenfleet keys create --name N [--priority-ceiling normal] [--rpm N] [--tpm N] [--json]``
``tokenfleet keys list [--json]``
``tokenfleet keys revoke ID|NAME``

The key is printed once, at create; Redis keeps only its SHA-256 digest, and nothing here ever
prints a secret or a digest again.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import orjson

from tokenfleet.shared.priority import PRIORITIES, Priority
from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags


def register(subparsers: Any) -> None:
    """Add the ``keys`` parser and its actions."""
    p = subparsers.add_parser(
        "keys",
        help="create, list and revoke the HTTP gateway's API keys",
        description="API keys for `tokenfleet serve`: each has a name, a priority ceiling and "
        "requests/tokens per minute limits, enforced in Redis across every gateway process. "
        "Redis stores only a hash of each key.",
    )
    sub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)

    c = sub.add_parser("create", help="create a key and print it (shown only this once)")
    c.add_argument("--name", required=True, help="a unique name for the key (e.g. the app)")
    c.add_argument(
        "--priority-ceiling",
        choices=[x.label for x in PRIORITIES],
        default=Priority.NORMAL.label,
        help="the most urgent priority the key may submit at (default: normal)",
    )
    c.add_argument("--rpm", type=int, default=0, help="requests per minute (default 0: no limit)")
    c.add_argument("--tpm", type=int, default=0, help="tokens per minute (default 0: no limit)")
    c.add_argument(
        "--role",
        choices=["user", "viewer", "admin"],
        default="user",
        help="user: the OpenAI API only (default); viewer: also read the fleet console; "
        "admin: also cancel, requeue and discard there",
    )
    c.add_argument(
        "--tenant",
        default="default",
        help="whose requests the key's are: fair shares between tenants (docs/fairness.md)",
    )
    c.add_argument(
        "--weight",
        type=float,
        default=None,
        help="the tenant's share weight, recorded with each request (default: as stored by "
        "tokenfleet tenants set, else 1)",
    )
    c.add_argument("--json", action="store_true", help="print JSON (the key included)")
    add_redis_flags(c)
    c.set_defaults(func=create_func)

    ls = sub.add_parser("list", help="list keys, live and revoked (never their secrets)")
    ls.add_argument("--json", action="store_true", help="print JSON")
    add_redis_flags(ls)
    ls.set_defaults(func=list_func)

    r = sub.add_parser("revoke", help="revoke a key by id or name")
    r.add_argument("key", metavar="ID|NAME", help="the key's id or its (live) name")
    add_redis_flags(r)
    r.set_defaults(func=revoke_func)


def _admin(args: argparse.Namespace) -> tuple[Any, Any]:
    from tokenfleet.producer.gateway.auth import ApiKeyAdmin
    from tokenfleet.shared.redis_connect import redis_client

    settings = settings_from_flags(args)
    client = redis_client(settings)
    return client, ApiKeyAdmin(client, settings)


def _limit(value: int) -> str:
    return "unlimited" if value == 0 else str(value)


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def create_func(args: argparse.Namespace) -> int:
    """Create the key; print it once, with how to use it."""
    client, admin = _admin(args)
    try:
        presented, key = admin.create(
            args.name,
            priority_ceiling=args.priority_ceiling,
            rpm=args.rpm,
            tpm=args.tpm,
            role=args.role,
            tenant=args.tenant,
            weight=args.weight,
        )
    finally:
        client.close()
    if args.json:
        sys.stdout.write(orjson.dumps({"api_key": presented, **key.to_dict()}).decode() + "\n")
        return 0
    print(
        f"created API key {key.name} (id {key.key_id}): priority ceiling "
        f"{key.priority_ceiling.label}, {_limit(key.rpm)} requests/min, "
        f"{_limit(key.tpm)} tokens/min, role {key.role.value}, tenant {key.tenant}\n\n"
        f"    {presented}\n\n"
        "This is the only time it is shown (Redis keeps only its hash): store it now.\n"
        f"Send it with each request:  Authorization: Bearer {presented}\n"
        f"(OpenAI SDKs: api_key=...).  Revoke it with:  tokenfleet keys revoke {key.key_id}"
    )
    return 0


def list_func(args: argparse.Namespace) -> int:
    """Print every key: id, name, ceiling, limits, created, revoked."""
    client, admin = _admin(args)
    try:
        keys = admin.list()
    finally:
        client.close()
    if args.json:
        sys.stdout.write(orjson.dumps([k.to_dict() for k in keys]).decode() + "\n")
        return 0
    if not keys:
        print("no API keys (create one with: tokenfleet keys create --name NAME)")
        return 0
    header = ("ID", "NAME", "ROLE", "CEILING", "RPM", "TPM", "CREATED", "REVOKED")
    table = [header] + [
        (
            k.key_id,
            k.name,
            k.role.value,
            k.priority_ceiling.label,
            _limit(k.rpm),
            _limit(k.tpm),
            _when(k.created_at),
            _when(k.revoked_at),
        )
        for k in keys
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def revoke_func(args: argparse.Namespace) -> int:
    """Revoke the key; say when gateways stop accepting it."""
    from tokenfleet.producer.gateway.auth.store import DEFAULT_CACHE_S

    client, admin = _admin(args)
    try:
        key = admin.revoke(args.key)
    finally:
        client.close()
    print(
        f"revoked API key {key.name} (id {key.key_id}) at {_when(key.revoked_at)}; gateways "
        f"refuse it within {DEFAULT_CACHE_S:g} s"
    )
    return 0
