"""The console's HTML: Jinja2 templates shipped in the package (``templates/``), rendered on
the server, whole pages and the fragments the live feed swaps into them.

Every value is escaped (autoescape on for every template: a prompt, an output or an error
message holding markup shows as text); templates never mark request data safe. Undefined names
fail loudly (``StrictUndefined``): a template that drifts from the snapshot's fields fails its
test instead of showing blanks.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any

import jinja2
from markupsafe import Markup

# The fragments the live feed sends, each named as its event and its template (``_NAME.html``).
FRAGMENTS = ("queues", "workers", "routed", "pools", "requests", "batches", "keys", "dead", "meta")


def environment() -> jinja2.Environment:
    """The templates' environment (one per app)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("tokenfleet.producer.gateway.console", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(age=age, clock=clock, num=num, pct=pct, seconds=seconds, slug=slug)
    return env


def age(value: float | None) -> str:
    """Seconds as a short age: ``0.4 s``, ``12 s``, ``3 m``, ``2 h``; ``-`` for none."""
    if value is None or not math.isfinite(value) or value < 0:
        return "-"
    if value < 10:
        return f"{value:.1f} s"
    if value < 120:
        return f"{value:.0f} s"
    if value < 7200:
        return f"{value / 60:.0f} m"
    return f"{value / 3600:.0f} h"


def seconds(value: float | None) -> str:
    """A duration in seconds with milliseconds below 10 s (``0.123 s``); ``-`` for none."""
    if value is None or not math.isfinite(value) or value < 0:
        return "-"
    return f"{value:.3f} s" if value < 10 else age(value)


def clock(epoch: float | None) -> str:
    """Epoch seconds as local ``HH:MM:SS``; ``-`` for none."""
    if not epoch:
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(epoch))


def num(value: float | int | None, digits: int = 0) -> str:
    """A number for a table cell (``-`` for none)."""
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if digits else str(round(value))


def pct(part: float, whole: float) -> str:
    """``part`` of ``whole`` as a whole percentage (``-`` when ``whole`` is 0)."""
    return f"{100 * part / whole:.0f}%" if whole else "-"


def slug(text: str) -> str:
    """A stable, id-safe name for ``text`` (a queue's ``model|priority``): 12 hex digits."""
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def fragment(env: jinja2.Environment, name: str, context: dict[str, Any]) -> Markup:
    """One fragment of the page (``templates/_NAME.html``), already escaped: a page that
    includes it must not escape it again (it is the templates' output, not request data)."""
    return Markup(env.get_template(f"_{name}.html").render(context))
