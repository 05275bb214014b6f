"""``tokenfleet status``'s routing part: per model, its workers and its queue depths, routed
streams included (docs/routing.md).

A queue's depth is its shared stream's plus every routed stream's of that (model, priority),
one per worker in the model's routers set (``Keys.routers``), live or lapsed: a lapsed worker's
routed entries still wait there until another worker steals or claims them.
"""

from __future__ import annotations

from typing import Any

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.record import as_str


def routed_rows(client: Any, keys: Keys, queues: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, priority, routed worker): ``waiting`` (undelivered) and ``running``
    (pending) entries of that worker's routed stream; ``live``: a routing target now."""
    import time

    now = time.time()
    models = sorted({q["model"] for q in queues})
    pipe = client.pipeline(transaction=False)
    for model in models:
        pipe.zrange(keys.routers(model), 0, -1, withscores=True)
    routers = dict(zip(models, pipe.execute(), strict=True))
    wanted = []
    for q in queues:
        p = Priority.parse(q["priority"])
        for name, score in routers[q["model"]]:
            wanted.append((q["model"], p, as_str(name) or "", float(score) > now))
    pipe = client.pipeline(transaction=False)
    for model, p, name, _ in wanted:
        stream = keys.routed(model, p, name)
        pipe.xlen(stream)
        pipe.xpending(stream, CONSUMER_GROUP)
    replies = pipe.execute(raise_on_error=False)
    rows = []
    for i, (model, p, name, live) in enumerate(wanted):
        length, pending = replies[2 * i], replies[2 * i + 1]
        length = length if isinstance(length, int) else 0
        running = int(pending.get("pending", 0)) if isinstance(pending, dict) else 0
        rows.append(
            {
                "model": model,
                "priority": p.label,
                "worker": name,
                "live": live,
                "waiting": length - running,
                "running": running,
            }
        )
    return rows


def model_lines(snap: dict[str, Any]) -> list[str]:
    """Per model with a queue or a live worker: its live workers and its waiting requests,
    shared and routed. A queue's ``waiting`` (``queue_stats``) already counts its routed
    streams, so the shared part is that less the routed rows' (never below 0: the two reads are
    not one snapshot)."""
    lines = []
    models = {q["model"] for q in snap["queues"]}
    models |= {w["model"] for w in snap["workers"] if w["model"]}
    for model in sorted(models):
        names = [w["name"] for w in snap["workers"] if w["model"] == model]
        waiting = sum(q["waiting"] for q in snap["queues"] if q["model"] == model)
        routed = [r for r in snap.get("routed", []) if r["model"] == model]
        waiting_routed = sum(r["waiting"] for r in routed)
        shared = max(0, waiting - waiting_routed)
        per_worker = ", ".join(
            f"{w}: {sum(r['waiting'] for r in routed if r['worker'] == w)}"
            for w in sorted({r["worker"] for r in routed})
        )
        lines.append(
            f"model {model}: workers {', '.join(names) or 'none'}; waiting "
            f"{shared + waiting_routed} (shared {shared}, routed {waiting_routed}"
            + (f": {per_worker}" if per_worker else "")
            + ")"
        )
    return lines
