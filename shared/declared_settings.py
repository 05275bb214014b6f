"""Settings declared once: each field of a settings dataclass states, in one ``setting(...)``, its
environment variable, its command-line flag and its help, beside its type and its default.

Everything else comes from that declaration: reading the environment (``from_env``), the argparse
flags (``tokenfleet.shared.settings_flags``), the refusal of a ``TOKENFLEET_*`` variable that no
process declares (``check_env_names``, over ``tokenfleet.shared.settings_catalog``) and
docs/configuration.md (``tokenfleet.shared.settings_docs``).

Values in the environment have one syntax per type: an integer as Python writes it, a number
(``float``) likewise, a boolean as ``1`` (on) or ``0`` (off) and nothing else; a field declared
with ``parse`` (memory amounts, priority lists) takes that parser's syntax. An empty variable counts
as unset. A value that does not parse is a ``SettingsError`` naming the variable; whether a parsed
value is acceptable (ranges, choices) is the settings class's own ``__post_init__``'s to say.

Why not pydantic-settings: its settings classes read ``os.environ`` whenever one is constructed,
and this project builds settings by keyword in code and tests and from explicit mappings (a child
process's environment); std dataclasses with declared metadata keep those plain (and
``dataclasses.replace`` working) and add nothing to a process's start-up.
"""

from __future__ import annotations

import difflib
import functools
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from tokenfleet.shared.errors import SettingsError

ENV_PREFIX = "TOKENFLEET_"  # variables with this prefix must be declared by some process
BOOLEAN_SYNTAX = ("1", "0")  # the one way to write a boolean: 1 = on, 0 = off
_METADATA_KEY = "tokenfleet.setting"
_KINDS = (str, int, float, bool)  # the value types an environment variable can carry

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Setting:
    """What a settings field declares besides its name, type and default.

    Attributes:
        help: what the setting does, for ``--help`` and the docs (one sentence or two).
        env: the environment variable that carries it; None: not read from the environment.
        flags: the command-line flags that set it (first is the main one); empty: none.
        key: the name its flag's value and ``from_env``'s keyword take, where it differs from the
            field's (``kv_memory`` sets ``kv_memory_bytes``); empty: the field's name.
        parse: turns the text of the variable or flag into the field's value (raises
            ``SettingsError``/``ValueError``); None: the field's type says how.
        metavar: the flag's placeholder in ``--help``.
        choices: the values the flag accepts (argparse refuses others) and the docs list.
        group: flags of one group are mutually exclusive, and a flag of the group replaces
            every environment value of the group.
        shown_default: the default as the docs and ``--help`` say it, where the value is computed
            (``HOST-PID``) or None means something (``the engine's``).
        syntax: the value's syntax for the docs, where ``parse`` defines one.
        see: a docs page that says more, as (title, "page.md#anchor"); the docs link it.
    """

    help: str
    env: str | None = None
    flags: tuple[str, ...] = ()
    key: str = ""
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    group: str | None = None
    shown_default: str | None = None
    syntax: str | None = None
    see: tuple[str, str] | None = None


def setting(
    default: Any = MISSING,
    *,
    help: str,
    env: str | None = None,
    flag: str | tuple[str, ...] = (),
    key: str = "",
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    choices: Iterable[str] = (),
    group: str | None = None,
    shown_default: str | None = None,
    syntax: str | None = None,
    see: tuple[str, str] | None = None,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field declared as a setting (``x: int = setting(3, help=..., env=...)``).

    No ``default`` and no ``default_factory``: the setting is required (``from_env`` names its
    flag and variable when it is missing).
    """
    spec = Setting(
        help=help,
        env=env,
        flags=(flag,) if isinstance(flag, str) else tuple(flag),
        key=key,
        parse=parse,
        metavar=metavar,
        choices=tuple(choices),
        group=group,
        shown_default=shown_default,
        syntax=syntax,
        see=see,
    )
    metadata = {_METADATA_KEY: spec}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, slots=True)
class Declared:
    """One declared field of a settings class, resolved: its name, value type and declaration.

    Invariant: ``kind`` is one of str, int, float, bool, or the field has a ``parse``.
    """

    name: str  # the dataclass field's name
    kind: type  # the value's type with ``| None`` removed
    optional: bool  # ``| None``: None is a value it may hold
    spec: Setting
    default: Any  # MISSING: required, or computed by a factory (see ``has_default``)
    has_default: bool

    @property
    def key(self) -> str:
        """The name its flag's value and ``from_env``'s keyword take."""
        return self.spec.key or self.name

    @property
    def source(self) -> str:
        """How a person sets it, for messages: its flag, else its variable, else its key."""
        return (self.spec.flags or (self.spec.env or self.key,))[0]


@functools.cache
def declared(cls: type) -> tuple[Declared, ...]:
    """Every declared field of the dataclass ``cls``, in declaration order.

    Raises:
        TypeError: a field without ``setting(...)``, or whose type the environment cannot carry.
    """
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        spec = f.metadata.get(_METADATA_KEY)
        if not isinstance(spec, Setting):
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting(...)")
        kind, optional = _unwrap(hints[f.name])
        if spec.parse is None and kind not in _KINDS:
            raise TypeError(f"{cls.__name__}.{f.name}: type {kind} needs a parse function")
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        out.append(Declared(f.name, kind, optional, spec, f.default, has_default))
    return tuple(out)


def by_key(cls: type) -> dict[str, Declared]:
    """``declared(cls)`` by key (what flags and ``from_env``'s keywords are called)."""
    return {d.key: d for d in declared(cls)}


def env_names(cls: type) -> dict[str, str]:
    """Environment variable -> key, for every field of ``cls`` that the environment sets."""
    return {d.spec.env: d.key for d in declared(cls) if d.spec.env}


def label(cls: type, name: str) -> str:
    """The field ``name`` of ``cls`` as a message names it: with the flag and the variable that
    set it (``max_num_seqs (--max-num-seqs, TOKENFLEET_MAX_NUM_SEQS)``), so a value a settings
    class refuses in ``__post_init__`` is traced to what a person wrote; the bare name where
    neither sets it."""
    d = next(d for d in declared(cls) if d.name == name)
    ways = [*d.spec.flags[:1], *filter(None, [d.spec.env])]
    return f"{name} ({', '.join(ways)})" if ways else name


def _unwrap(hint: Any) -> tuple[type, bool]:
    """(type without ``None``, whether ``None`` was allowed) of a field's annotation."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])[0], True
    return (typing.get_origin(hint) or hint), False


def parse_text(d: Declared, raw: str, source: str) -> Any:
    """The value of ``d`` written as ``raw`` in ``source`` (a variable or flag name).

    Raises:
        SettingsError: naming ``source``, when ``raw`` does not parse.
    """
    if d.spec.parse is not None:
        try:
            return d.spec.parse(raw)
        except ValueError as exc:  # SettingsError is one
            raise SettingsError(f"{source}: {exc}") from None
    if d.kind is bool:
        if raw.strip() not in BOOLEAN_SYNTAX:
            raise SettingsError(
                f"{source} must be 0 or 1 (every boolean setting is written 1 for on, 0 for off), "
                f"got {raw!r}"
            )
        return raw.strip() == "1"
    try:
        if d.kind is int:
            return int(raw)
        if d.kind is float:
            return float(raw)
    except ValueError:
        what = "an integer" if d.kind is int else "a number"
        raise SettingsError(f"{source} must be {what}, got {raw!r}") from None
    return raw


def read_env(cls: type, env: Mapping[str, str]) -> dict[str, Any]:
    """Key -> parsed value of every field of ``cls`` that ``env`` sets (empty = unset)."""
    values: dict[str, Any] = {}
    for d in declared(cls):
        raw = env.get(d.spec.env) if d.spec.env else None
        if raw:
            values[d.key] = parse_text(d, raw, d.spec.env or d.key)
    return values


def env_value(cls: type, key: str, env: Mapping[str, str] | None = None) -> Any:
    """The parsed value of one setting of ``cls`` in ``env`` (default ``os.environ``), or None
    when it is unset (the other variables are not read)."""
    d = by_key(cls)[key]
    raw = (os.environ if env is None else env).get(d.spec.env) if d.spec.env else None
    return parse_text(d, raw, d.spec.env or key) if raw else None


def from_env(cls: type[T], env: Mapping[str, str] | None, overrides: Mapping[str, Any]) -> T:
    """An instance of the settings class ``cls``: its variables in ``env`` (default
    ``os.environ``), then ``overrides`` (flags or keywords, by key; None skips one) on top.

    A text override of a field with a ``parse`` is parsed; any other override is taken as it is
    (the class checks it). An override of a field in a ``group`` drops the environment's values of
    the whole group (one KV size given two ways: the flag's).

    Raises:
        SettingsError: an undeclared ``TOKENFLEET_*`` variable, a value that does not parse, an
            unknown override, a required setting missing, or what ``cls`` refuses.
    """
    env = os.environ if env is None else env
    check_env_names(env, cls)
    decls = by_key(cls)
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(given) - set(decls)
    if unknown:
        raise SettingsError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    values = read_env(cls, env)
    for key in given:
        if decls[key].spec.group:
            group = decls[key].spec.group
            values = {k: v for k, v in values.items() if decls[k].spec.group != group}
    for key, value in given.items():
        d = decls[key]
        values[key] = (
            parse_text(d, value, d.source) if d.spec.parse and isinstance(value, str) else value
        )
    for d in decls.values():
        if not d.has_default and d.key not in values:
            ways = []
            if d.spec.flags:
                ways.append(" ".join(["pass", d.spec.flags[0], *filter(None, [d.spec.metavar])]))
            if d.spec.env:
                ways.append(f"set {d.spec.env}")
            raise SettingsError(f"no {d.key} given: {' or '.join(ways)}")
    return cls(**{decls[k].name: v for k, v in values.items()})


def env_of(settings: Any, keys: Iterable[str]) -> dict[str, str]:
    """The environment variables that carry the settings ``keys`` of ``settings`` to a child
    process (empty values left out; booleans as 1/0). A key without a variable is skipped."""
    decls = by_key(type(settings))
    out = {}
    for key in keys:
        d = decls[key]
        value = getattr(settings, d.name)
        if d.spec.env and value is not None and value != "":
            out[d.spec.env] = ("1" if value else "0") if d.kind is bool else str(value)
    return out


def check_env_names(env: Mapping[str, str], first: type | None = None) -> None:
    """Refuse a ``TOKENFLEET_*`` variable in ``env`` that no process declares (a misspelt
    setting fails loudly rather than being ignored). ``first``'s names are tried before the
    whole catalogue is loaded (the common case imports nothing more).

    Raises:
        SettingsError: naming the variable, the closest declared name and every declared one.
    """
    ours = set(env_names(first)) if first is not None else set()
    strangers = [v for v in env if v.startswith(ENV_PREFIX) and v not in ours]
    if not strangers:
        return
    from tokenfleet.shared.settings_catalog import known_env_names

    known = sorted(v for v in known_env_names() if v.startswith(ENV_PREFIX))
    for var in sorted(strangers):
        if var not in known:
            close = difflib.get_close_matches(var, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise SettingsError(
                f"unknown setting {var}{hint}; known: {', '.join(known)} (docs/configuration.md)"
            )
