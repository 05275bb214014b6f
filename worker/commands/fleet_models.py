"""``tokenfleet models fleet | declare | undeclare``: the models a fleet serves and declares.

``fleet`` lists every model that a live worker serves or the fleet declares (``Client.models()``)
with its count of live workers; ``declare NAME...`` / ``undeclare NAME...`` edit the declared set
(``Keys.declared``). A request for a model that is neither served nor declared is refused at
submit once the fleet declares anything or has a live worker; a declared one with no live worker
is accepted and waits (docs/models.md). These actions talk to Redis; the local ones
beside them (``list``, ``prepare``, ``clear``) do not.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tokenfleet.shared.redis_flags import add_redis_flags, settings_from_flags


def register_actions(sub: Any) -> None:
    """Add ``fleet``, ``declare`` and ``undeclare`` to the ``models`` subparsers."""
    fleet = sub.add_parser(
        "fleet",
        help="models the fleet serves (live workers) and declares",
        description="Every model a live worker serves or the fleet declares, with its number "
        "of live workers and when its last server's heartbeat lapses.",
    )
    fleet.add_argument("--json", action="store_true", help="print JSON")
    fleet.set_defaults(func=_fleet)
    declare = sub.add_parser(
        "declare",
        help="declare models: requests for them are accepted while no worker serves them",
        description="Add model names to the fleet's declared models. Once a fleet declares a "
        "model or has a live worker, submit refuses models that are neither served nor declared.",
    )
    undeclare = sub.add_parser("undeclare", help="remove models from the declared ones")
    for p, func in ((declare, _declare), (undeclare, _undeclare)):
        p.add_argument("names", nargs="+", metavar="NAME", help="served-model name")
        p.set_defaults(func=func)
    for p in (fleet, declare, undeclare):
        add_redis_flags(p)


def _fleet(args: argparse.Namespace) -> int:
    import orjson

    from tokenfleet.producer import Client
    from tokenfleet.shared.redis_connect import redis_client

    settings = settings_from_flags(args)
    client = redis_client(settings)
    try:
        with Client(client, settings=settings) as producer:
            models = producer.models()
    finally:
        client.close()
    rows = [{**m.to_dict(), "workers": len(m.workers)} for m in models]
    if args.json:
        print(orjson.dumps(rows).decode())
        return 0
    if not rows:
        print("no model is served or declared: submit accepts any model (an empty fleet)")
        return 0
    now = time.time()
    print(f"{'model':<32} {'served':<7} {'declared':<9} {'workers':>7}  heartbeat")
    for row in rows:
        expires = row["expires_at"]
        if expires is None:
            beat = "-"
        elif expires > now:
            beat = f"lapses in {expires - now:.0f}s"
        else:
            beat = f"lapsed {now - expires:.0f}s ago"
        print(
            f"{row['name'][:32]:<32} {'yes' if row['served'] else 'no':<7} "
            f"{'yes' if row['declared'] else 'no':<9} {row['workers']:>7}  {beat}"
        )
    return 0


def _edit(args: argparse.Namespace, add: bool) -> int:
    from tokenfleet.shared.keys import Keys, check_model_name
    from tokenfleet.shared.record import as_str
    from tokenfleet.shared.redis_connect import redis_client

    names = [check_model_name(n) for n in args.names]  # InvalidRequest names a bad one
    settings = settings_from_flags(args)
    client = redis_client(settings)
    key = Keys.for_settings(settings).declared
    try:
        changed = client.sadd(key, *names) if add else client.srem(key, *names)
        declared = sorted(as_str(n) or "" for n in client.smembers(key))
    finally:
        client.close()
    verb = "declared" if add else "undeclared"
    print(f"{verb} {changed} of {len(names)}; declared now: {', '.join(declared) or 'none'}")
    return 0


def _declare(args: argparse.Namespace) -> int:
    return _edit(args, add=True)


def _undeclare(args: argparse.Namespace) -> int:
    return _edit(args, add=False)
