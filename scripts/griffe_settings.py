"""A griffe extension for the API pages: a settings field shows its default and its help.

A settings class declares each field as ``name: T = setting(default, env=..., flag=...,
help=...)`` (``tokenfleet.shared.declared_settings``). Read as source, the field's value is that
whole call, so the class's signature would print every declaration. This extension (listed under
mkdocstrings' ``extensions`` in mkdocs.yml) gives such a field the value its dataclass default
is — the first argument, ``default_factory()``, or none for a required setting — and a docstring
made of its help with its flag and variable, so the reference lists the fields like any other
documented attributes. It changes nothing but what the docs show.
"""

from __future__ import annotations

import ast
from typing import Any

import griffe


def _text(expr: Any) -> str:
    """A string literal's value (``help="..."`` as griffe keeps it: source text)."""
    value = ast.literal_eval(str(expr))
    return value if isinstance(value, str) else str(value)


def _flags(expr: Any) -> list[str]:
    """``flag="--x"`` or ``flag=("--x", "--y")`` as a list of flags."""
    value = ast.literal_eval(str(expr))
    return [value] if isinstance(value, str) else list(value)


class DeclaredSettings(griffe.Extension):
    """Rewrites ``setting(...)`` fields into a plain default and a docstring (see the module)."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        """Called by griffe for each attribute it reads."""
        call = attr.value
        if not isinstance(call, griffe.ExprCall) or str(call.function) != "setting":
            return
        keywords = {a.name: a.value for a in call.arguments if isinstance(a, griffe.ExprKeyword)}
        positional = [a for a in call.arguments if not isinstance(a, griffe.ExprKeyword)]
        if positional:
            attr.value = positional[0]
        elif "default_factory" in keywords:
            attr.value = f"{keywords['default_factory']}()"
        else:
            attr.value = None  # required
        ways = [f"`{f}`" for f in _flags(keywords["flag"])] if "flag" in keywords else []
        if "env" in keywords:
            ways.append(f"`${_text(keywords['env'])}`")
        text = _text(keywords["help"]) if "help" in keywords else ""
        if ways:
            text += f" ({', '.join(ways)})"
        attr.docstring = griffe.Docstring(text, parent=attr)
