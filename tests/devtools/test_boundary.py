"""The dev tooling stays apart from the service: nothing in the service imports from it.

``tokenfleet.worker.devtools`` may use the producer and the service (the demo submits requests,
the local fleet runs ``tokenfleet worker``); the reverse direction is refused so that a worker
host never depends on demo code. The CLI (``tokenfleet.worker.cli``) is the one module that
composes both sides, and the only one outside the package allowed to import it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {folder: f"tokenfleet.{folder}" for folder in ("shared", "producer", "worker")}
DEVTOOLS = "tokenfleet.worker.devtools"
COMPOSER = "tokenfleet.worker.cli"


def _module_name(path: Path) -> tuple[str, bool]:
    """(dotted module name, whether it is a package's ``__init__``) of a source file."""
    folder = path.relative_to(ROOT).parts[0]
    parts = [FOLDERS[folder], *path.relative_to(ROOT / folder).with_suffix("").parts]
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def imported_modules(source: str, name: str, is_package: bool = False) -> set[str]:
    """Every module that ``source`` (module ``name``) imports, at the top or inside functions,
    relative imports resolved; ``from X import y`` counts as importing ``X.y`` too (``y`` may be
    a submodule)."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def _imports_of(path: Path) -> set[str]:
    return imported_modules(path.read_text(), *_module_name(path))


def _service_files() -> list[Path]:
    files = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    return [p for p in files if not _module_name(p)[0].startswith((DEVTOOLS, COMPOSER))]


def test_nothing_outside_devtools_but_the_cli_imports_it() -> None:
    files = _service_files()
    assert ROOT / "worker" / "commands" / "worker.py" in files
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in _imports_of(path) if m.startswith(DEVTOOLS))
        for path in files
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}


def test_the_check_sees_relative_and_from_imports() -> None:
    # The detector itself: absolute, from- and relative imports of the package are all caught.
    name = "tokenfleet.worker.commands.probe"
    assert imported_modules("from ..devtools import local_fleet\n", name) == {
        "tokenfleet.worker.devtools",
        "tokenfleet.worker.devtools.local_fleet",
    }
    assert DEVTOOLS in imported_modules("from tokenfleet.worker import devtools\n", name)
    assert DEVTOOLS in imported_modules("def f():\n    import tokenfleet.worker.devtools\n", name)
    assert f"{DEVTOOLS}.commands" in imported_modules(
        "from .devtools import commands\n", "tokenfleet.worker", is_package=True
    )
    assert any(m.startswith(DEVTOOLS) for m in _imports_of(ROOT / "worker" / "cli.py"))


TESTING = f"{DEVTOOLS}.testing"


def test_only_the_testing_harnesses_import_each_other() -> None:
    # The test-only harnesses (local Sentinel, Cluster, TLS) serve the tests and benchmarks: no
    # module of the three packages outside ``devtools.testing`` imports them, the CLI included.
    files = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    outside = [p for p in files if not _module_name(p)[0].startswith(TESTING)]
    assert ROOT / "worker" / "cli.py" in outside
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in _imports_of(path) if m.startswith(TESTING))
        for path in outside
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}
    assert imported_modules("from .testing import local_tls\n", DEVTOOLS, is_package=True) >= {
        TESTING,
        f"{TESTING}.local_tls",
    }
