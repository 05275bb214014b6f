"""The schema package: one module per concept, every public name importable from the package."""

from __future__ import annotations

import pkgutil
from types import ModuleType

import tokenfleet.shared.schema as schema
from tokenfleet.shared.schema import (
    constraint,
    events,
    fields,
    request,
    sampling,
    status,
    tools,
    wire,
)

MODULES = (constraint, events, fields, request, sampling, status, tools, wire)
# Helpers the request and event modules share; they stay in their modules.
INTERNAL = frozenset({"is_int", "token_ids_ok", "loads"})


def _own_public_names(module: ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, ModuleType)
        and getattr(value, "__module__", module.__name__) == module.__name__
    }


def test_every_public_name_of_a_schema_module_is_re_exported() -> None:
    assert {m.__name__.rpartition(".")[2] for m in MODULES} == {
        info.name for info in pkgutil.iter_modules(schema.__path__)
    }
    for module in MODULES:
        assert _own_public_names(module) - set(schema.__all__) <= INTERNAL, module.__name__
    assert all(getattr(schema, name) is not None for name in schema.__all__)
