"""Argparse flags generated from settings declarations (``tokenfleet.shared.declared_settings``).

``add_flags(parser, cls)`` adds one flag per declared field that names one; every flag defaults
to None, so ``flag_values(args, cls)`` holds only what was given and ``from_env(**flag_values)``
lets a flag win over its environment variable and the variable over the default. A flag's type
follows its field's: ``int`` and ``float`` fields take ``type=int``/``float`` (argparse refuses
other text, naming the flag); a boolean field whose default is on gets a flag that turns it off
(``--no-batch-yield``), one whose default is off a flag that turns it on; a field with a
``parse`` takes text that ``from_env`` parses (its errors name the flag).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from tokenfleet.shared.declared_settings import Declared, by_key, declared


def shown_default(d: Declared) -> str:
    """The default as ``--help`` and the docs say it."""
    if d.spec.shown_default is not None:
        return d.spec.shown_default
    if not d.has_default:
        return "required"
    if d.kind is bool:
        return "1" if d.default else "0"
    if d.default is None or d.default == "":
        return "none"
    return str(d.default)


def flag_help(d: Declared) -> str:
    """The flag's ``--help`` line: the declared help, then its variable and default."""
    default = f"default {shown_default(d)}" if d.has_default else "required"
    where = [f"${d.spec.env}" if d.spec.env else "", default]
    text = f"{d.spec.help} ({', '.join(w for w in where if w)})"
    return text.replace("%", "%%")  # argparse formats help with %


def add_flags(
    parser: Any,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    title: str | None = None,
) -> None:
    """Add to ``parser`` the flags of the settings class ``cls`` (``only`` those keys, if given;
    never those in ``exclude``), in a titled argument group when ``title`` is given."""
    chosen = set(only) if only is not None else None
    skipped = set(exclude)
    target = parser.add_argument_group(title) if title else parser
    groups: dict[str, Any] = {}
    for d in declared(cls):
        if not d.spec.flags or d.key in skipped or (chosen is not None and d.key not in chosen):
            continue
        where = target
        if d.spec.group:
            if d.spec.group not in groups:
                groups[d.spec.group] = target.add_mutually_exclusive_group()
            where = groups[d.spec.group]
        where.add_argument(*d.spec.flags, **_argument(d))


def _argument(d: Declared) -> dict[str, Any]:
    """``add_argument`` keywords for the declared field ``d``."""
    kwargs: dict[str, Any] = {"dest": d.key, "default": None, "help": flag_help(d)}
    if d.kind is bool and d.spec.parse is None:
        return {**kwargs, "action": "store_const", "const": not d.default}
    if d.spec.parse is None and d.kind in (int, float):
        kwargs["type"] = d.kind
    if d.spec.choices:
        kwargs["choices"] = d.spec.choices
    if d.spec.metavar:
        kwargs["metavar"] = d.spec.metavar
    return kwargs


def flag_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """Key -> value of every flag of ``cls`` given in ``args``: flags left out are absent, and so
    is one given as empty text (as an empty variable counts as unset)."""
    return {
        key: getattr(args, key)
        for key, d in by_key(cls).items()
        if d.spec.flags and getattr(args, key, None) not in (None, "")
    }
