"""The layout stays readable: small modules, small classes, Lua only in ``.lua`` files.

Limits from issue 14 (rooms that show the architecture): no Python module of the three packages
over ``MAX_MODULE_LINES``, no class over ``MAX_CLASS_LINES`` lines or ``MAX_PUBLIC_METHODS``
public methods. A module that needs more is a sign that it holds two concepts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shared", "producer", "worker")
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300
MAX_PUBLIC_METHODS = 15


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _public_methods(node: ast.ClassDef) -> list[str]:
    return [
        f.name
        for f in node.body
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and not f.name.startswith("_")
    ]


def oversized(source: str) -> list[str]:
    """What in one module's ``source`` breaks the limits (empty: nothing)."""
    found = []
    num_lines = len(source.splitlines())
    if num_lines > MAX_MODULE_LINES:
        found.append(f"module of {num_lines} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            methods = _public_methods(node)
            if lines > MAX_CLASS_LINES or len(methods) > MAX_PUBLIC_METHODS:
                found.append(f"class {node.name}: {lines} lines, {len(methods)} public methods")
    return found


def test_the_checker_catches_each_limit() -> None:
    assert oversized("x = 1\n" * (MAX_MODULE_LINES + 1)) == [
        f"module of {MAX_MODULE_LINES + 1} lines"
    ]
    methods = "".join(f"    def m{i}(self): pass\n" for i in range(MAX_PUBLIC_METHODS + 1))
    assert oversized(f"class A:\n{methods}") == [
        f"class A: {MAX_PUBLIC_METHODS + 2} lines, 16 public methods"
    ]
    body = "    x = 1\n" * MAX_CLASS_LINES
    assert oversized(f"class B:\n{body}")[0].startswith("class B: 301 lines")
    assert oversized("class C:\n    def _private(self): pass\n") == []


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_within_limits(path: Path) -> None:
    assert oversized(path.read_text()) == []
