"""Every setting is declared once, and everything else comes from the declaration.

Checked here: docs/configuration.md is what the declarations render (the failure prints the
command that regenerates it); every settings class in the packages is in the catalogue; every
``TOKENFLEET_*`` name the code, the deploy files and the docs use is declared; every flag and
variable of a setting give the same value, and a flag wins; booleans have one syntax; an
undeclared variable is refused by name, with the closest declared one.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path
from typing import Any

import pytest

from tokenfleet.shared.declared_settings import (
    BOOLEAN_SYNTAX,
    Declared,
    check_env_names,
    declared,
    from_env,
)
from tokenfleet.shared.errors import SettingsError
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.settings_catalog import PROCESS_KINDS, known_env_names
from tokenfleet.shared.settings_docs import COMMAND, render
from tokenfleet.shared.settings_flags import add_flags, flag_values

ROOT = Path(__file__).resolve().parent.parent
CLASSES = [kind.load() for kind in PROCESS_KINDS]
# Files whose TOKENFLEET_* names must all be declared (tests spell wrong names on purpose).
NAMED_IN = [
    *(
        p
        for d in ("shared", "producer", "worker", "examples", "benchmarks")
        for p in (ROOT / d).rglob("*.py")
    ),
    *(ROOT / "deploy").rglob("*.yaml"),
    *(ROOT / "docs").rglob("*.md"),
    ROOT / "compose.yaml",
    ROOT / "Dockerfile",
    ROOT / "README.md",
]
NAME_RE = re.compile(r"\bTOKENFLEET_[A-Z0-9_]+")
# A valid text for a setting, what it parses to, and another valid text: by type, then by key.
SAMPLES: dict[type, tuple[str, Any, str]] = {
    int: ("7", 7, "3"),
    float: ("2.5", 2.5, "1.5"),
    str: ("x-1", "x-1", "env-value"),
}
SPECIAL: dict[str, tuple[str, Any, str]] = {
    "redis_url": ("redis://h:1/0", "redis://h:1/0", "redis://e:2/0"),
    "kv_memory": ("2G", 2 * 2**30, "1G"),
    "priorities": ("batch,critical", (Priority.CRITICAL, Priority.BATCH), "normal"),
    "batch_lease_ms": ("700", 700, "300"),  # leases: at least MIN_BATCH_LEASE_MS
    "lease_ms": ("700", 700, "300"),
}


def test_the_configuration_page_is_what_the_declarations_render() -> None:
    page = ROOT / "docs" / "configuration.md"
    assert page.exists() and page.read_text() == render(), (
        f"docs/configuration.md is stale: run `.venv/bin/{COMMAND}` from the repository root"
    )


def test_every_settings_class_is_in_the_catalogue() -> None:
    found = set()
    for folder, package in (("shared", "shared"), ("producer", "producer"), ("worker", "worker")):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any(
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Name)
                    and call.func.id == "setting"
                    for call in ast.walk(node)
                ):
                    module = ".".join(path.relative_to(ROOT / folder).with_suffix("").parts)
                    found.add(f"tokenfleet.{package}.{module}:{node.name}")
    assert found == {kind.path for kind in PROCESS_KINDS}


def test_every_field_is_declared_with_a_help_and_names_are_unique() -> None:
    variables: list[str] = []
    for cls in CLASSES:
        decls = declared(cls)  # TypeError: a field without setting(...) or of an odd type
        assert decls and all(d.spec.help for d in decls), cls
        flags = [f for d in decls for f in d.spec.flags]
        assert len(flags) == len(set(flags)), cls
        variables += [d.spec.env for d in decls if d.spec.env]
    assert len(variables) == len(set(variables)), "a variable declared by two process kinds"
    assert set(variables) == known_env_names()


@pytest.mark.parametrize("path", NAMED_IN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_tokenfleet_name_in_use_is_declared(path: Path) -> None:
    names = {n for n in NAME_RE.findall(path.read_text()) if not n.endswith("_")}  # (a prefix)
    assert names - known_env_names() == set(), f"{path.relative_to(ROOT)} names undeclared ones"


def _sample(d: Declared) -> tuple[str, Any, str]:
    """A valid text for ``d``, the value it parses to, and another valid text."""
    if d.key in SPECIAL:
        return SPECIAL[d.key]
    if d.spec.choices:
        return d.spec.choices[-1], d.spec.choices[-1], d.spec.choices[0]
    if d.kind is bool:  # what its flag sets: the opposite of the default
        on, off = BOOLEAN_SYNTAX
        return (off, False, on) if d.default else (on, True, off)
    return SAMPLES[d.kind]


def _value(cls: type, d: Declared, env: dict[str, str], given: dict[str, Any]) -> Any:
    """``d``'s field of ``cls`` built from ``env`` and ``given`` (a required setting: "m")."""
    overrides = dict(given)
    for r in declared(cls):
        if not r.has_default and r.key not in given and (r.spec.env or "") not in env:
            overrides[r.key] = "m"
    return getattr(from_env(cls, env, overrides), d.name)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_variable_and_its_flag_set_the_same_value_and_the_flag_wins(cls: type) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, cls)
    checked = 0
    for d in declared(cls):
        text, value, other = _sample(d)
        if d.spec.env:
            assert _value(cls, d, {d.spec.env: text}, {}) == value, d.spec.env
            checked += 1
        if d.spec.flags:
            plain_bool = d.kind is bool and d.spec.parse is None
            args = [d.spec.flags[-1]] if plain_bool else [d.spec.flags[-1], text]
            given = flag_values(parser.parse_args(args), cls)
            assert given.keys() == {d.key}, args
            assert _value(cls, d, {}, given) == value, args
            if d.spec.env:  # both: the flag wins
                assert _value(cls, d, {d.spec.env: other}, given) == value, args
            checked += 1
    assert checked >= len(declared(cls)) - 1  # (Settings.lane is set by code only)


@pytest.mark.parametrize(
    ("cls", "var"),
    [
        (kind_cls, d.spec.env)
        for kind_cls in CLASSES
        for d in declared(kind_cls)
        if d.kind is bool and d.spec.env
    ],
)
def test_booleans_have_one_syntax(cls: type, var: str) -> None:
    on, off = BOOLEAN_SYNTAX
    (d,) = [d for d in declared(cls) if d.spec.env == var]
    assert _value(cls, d, {var: on}, {}) is True
    assert _value(cls, d, {var: off}, {}) is False
    for text in ("true", "false", "yes", "no", "on", "off", "2", "TRUE"):
        with pytest.raises(SettingsError, match=f"{var} must be 0 or 1"):
            _value(cls, d, {var: text}, {})
    assert _value(cls, d, {var: ""}, {}) is d.default  # empty: unset, the default


def test_an_undeclared_variable_is_refused_with_the_closest_name() -> None:
    closest = r"TOKENFLEET_MAX_NUM_SEQ \(did you mean TOKENFLEET_MAX_NUM_SEQS\?\)"
    with pytest.raises(SettingsError, match=closest):
        Settings.from_env({"TOKENFLEET_MAX_NUM_SEQ": "4"})
    # every kind accepts every kind's variables: one environment serves the whole fleet
    check_env_names(dict.fromkeys(known_env_names(), "1"))
    assert Settings.from_env({"TOKENFLEET_GATEWAY_PORT": "1", "TOKENFLEET_MODEL": "m"})


@pytest.mark.parametrize(
    "var", ["TOKENFLEET_REDIS_HEALTH_CHECK_S", "TOKENFLEET_GATEWAY_MODELS_TTL_S"]
)
def test_knobs_made_constants_are_no_longer_settings(var: str) -> None:
    with pytest.raises(SettingsError, match=f"unknown setting {var}"):
        Settings.from_env({var: "1"})


def test_a_bad_value_names_its_variable_or_flag() -> None:
    from tokenfleet.worker.worker_settings import WorkerSettings

    with pytest.raises(SettingsError, match="TOKENFLEET_MAX_NUM_SEQS must be an integer, got 'x'"):
        WorkerSettings.from_env({"TOKENFLEET_MODEL": "m", "TOKENFLEET_MAX_NUM_SEQS": "x"})
    with pytest.raises(SettingsError, match="TOKENFLEET_GRACE_S must be a number"):
        WorkerSettings.from_env({"TOKENFLEET_MODEL": "m", "TOKENFLEET_GRACE_S": "soon"})
    with pytest.raises(SettingsError, match="TOKENFLEET_KV_MEMORY: memory amount 'lots'"):
        WorkerSettings.from_env({"TOKENFLEET_MODEL": "m", "TOKENFLEET_KV_MEMORY": "lots"})
    with pytest.raises(SettingsError, match="--priorities: unknown priority"):
        WorkerSettings.from_env({}, model="m", priorities="urgent")
    with pytest.raises(SettingsError, match=r"no model given: pass --model PATH\|HUB_ID or set"):
        WorkerSettings.from_env({})


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_refused_value_names_its_flag_and_variable(cls: type) -> None:
    # Out of range (-1) or not a choice: the class's own check says which flag and variable.
    checked = 0
    for d in declared(cls):
        if d.spec.choices:
            bad = "bogus"
        elif d.kind in (int, float) and d.spec.parse is None:
            bad = "-1"
        else:
            continue
        env, given = ({d.spec.env: bad}, {}) if d.spec.env else ({}, {d.key: d.kind(bad)})
        with pytest.raises(SettingsError) as refused:
            _value(cls, d, env, given)
        for name in [*d.spec.flags[:1], *filter(None, [d.spec.env])]:
            assert name in str(refused.value), (name, str(refused.value))
        checked += 1
    assert checked or cls.__name__ in ("ModelCacheSettings", "CronSettings")
