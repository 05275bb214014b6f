"""``tokenfleet status``'s routing part: per model, its workers and its queue depths, routed
streams included (docs/routing.md), from the snapshot's ``routed`` rows
(``producer.core.fleet_status``).

A queue's depth is its shared stream's plus every routed stream's of that (model, priority),
one per worker in the model's routers set (``Keys.routers``), live or lapsed: a lapsed worker's
routed entries still wait there until another worker steals or claims them.
"""

from __future__ import annotations

from typing import Any


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
