"""The layers depend one way (docs/architecture.md): ``shared`` <- ``producer``, ``shared`` <-
``worker``; the engine (``worker/engine/``) depends on nothing above it.

A web app installs the producer without the model stack, so nothing in ``producer/`` or
``shared/`` may import ``tokenfleet.worker`` — at module level or inside a function (a lazy import
is still an import). The check walks every import statement of the sources (relative ones
resolved), and ``importlib.import_module`` / ``__import__`` called with a literal name.

Not covered, on purpose: ``shared/settings_catalog.py`` names each process kind's settings class
by an import path held as data (``"tokenfleet.worker.worker_settings:WorkerSettings"``) and
imports it only to list every declared variable (docs/configuration.md, or refusing a misspelt
``TOKENFLEET_*`` variable); those settings modules import neither torch nor the service.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from child_process import run_command

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "shared": ("tokenfleet.producer", "tokenfleet.worker"),
    "producer": ("tokenfleet.worker",),
}
ENGINE_MAY_IMPORT = "tokenfleet.worker.engine"


def _module_name(path: Path) -> str:
    """``tokenfleet.<pkg>.<...>`` for a source file of one of the three folders."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["tokenfleet", *parts])


def imported_names(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """Every module ``source`` (the text of ``module``) imports, with its line: import
    statements anywhere (relative ones resolved against ``module``) and ``import_module`` /
    ``__import__`` calls whose first argument is a string literal."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                found.append((node.lineno, first.value))
    return found


def _within(name: str, package: str) -> bool:
    """``name`` is ``package`` or one of its submodules."""
    return name == package or name.startswith(package + ".")


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of ``module`` that break the layering (empty: none)."""
    layer = module.split(".")[1]
    forbidden = FORBIDDEN.get(layer, ())
    in_engine = _within(module, ENGINE_MAY_IMPORT)
    bad = []
    for line, name in imported_names(source, module, is_package):
        upward = in_engine and _within(name, "tokenfleet.worker")
        if any(_within(name, f) for f in forbidden) or (
            upward and not _within(name, ENGINE_MAY_IMPORT)
        ):
            bad.append(f"line {line}: {name}")
    return bad


def test_the_checker_catches_each_form() -> None:
    mod = "tokenfleet.producer.core.fleet_status"
    assert violations("import tokenfleet.worker.pool\n", mod) == ["line 1: tokenfleet.worker.pool"]
    assert violations("from tokenfleet.worker import pool\n", mod)
    assert violations("def f():\n    from tokenfleet.worker.pool.admin import pool_view\n", mod)
    assert violations("from ...worker.pool import admin\n", mod) == [
        "line 1: tokenfleet.worker.pool",
        "line 1: tokenfleet.worker.pool.admin",
    ]
    assert violations("from ... import worker\n", mod) == ["line 1: tokenfleet.worker"]
    assert violations("import importlib\nimportlib.import_module('tokenfleet.worker.cli')\n", mod)
    assert violations("__import__('tokenfleet.worker')\n", mod)
    assert violations("from tokenfleet.producer import client\n", "tokenfleet.shared.keys")
    # Allowed: the producer importing shared, a name that only starts alike, the worker itself.
    assert violations("from tokenfleet.shared.pool import view\n", mod) == []
    assert violations("import tokenfleet.workers_elsewhere\n", mod) == []
    assert violations("from tokenfleet.shared import keys\n", "tokenfleet.worker.cli") == []
    # The engine: itself and shared only.
    engine = "tokenfleet.worker.engine.scheduler"
    assert violations("from tokenfleet.worker.engine import sequence\n", engine) == []
    assert violations("from tokenfleet.worker.service import loop\n", engine)
    assert violations("from ..pool import link\n", engine) == [
        "line 1: tokenfleet.worker.pool",
        "line 1: tokenfleet.worker.pool.link",
    ]


def _sources() -> list[Path]:
    folders = ("shared", "producer", "worker/engine")
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_against_the_layers(path: Path) -> None:
    module = _module_name(path)
    assert violations(path.read_text(), module, path.name == "__init__.py") == []


def test_a_producer_process_loads_no_worker_module() -> None:
    """What the AST check cannot see (an import by a library hook, a plugin): the client, the
    gateway with its console, the fleet status and the producer's commands, imported in a fresh
    interpreter, leave no ``tokenfleet.worker`` module behind."""
    probe = (
        "import sys\n"
        "import tokenfleet.producer.client, tokenfleet.producer.async_client\n"
        "import tokenfleet.producer.core.fleet_status\n"
        "import tokenfleet.producer.gateway.app, tokenfleet.producer.gateway.console.app\n"
        "import tokenfleet.producer.commands.console, tokenfleet.producer.commands.queues\n"
        "from tokenfleet.producer.gateway.settings import GatewaySettings\n"
        "GatewaySettings.from_env({})\n"
        "print(sorted(m for m in sys.modules if m.startswith('tokenfleet.worker')))\n"
    )
    out = run_command([sys.executable, "-c", probe])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
