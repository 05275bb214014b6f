"""Structure by judgement: ruff's complexity rules, each exception with its reason.

Size is a smell to look at, not a law (a module that reads top to bottom is fine at any
length), so there are no line or method caps. What is checked is complexity: ruff's mccabe
``C901`` and pylint's ``PLR0912`` (branches) and ``PLR0915`` (statements) at the thresholds set in
``pyproject.toml``. A function over them is split where that reads better, or carries
``# noqa: <rule> (<why it is one concept>)``; these tests hold both halves.

Lua only in ``.lua`` files is checked by tests/shared/test_lua_files.py; the dev tooling's
import boundary by tests/devtools/test_boundary.py.
"""

from __future__ import annotations

import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest
from child_process import run_command

ROOT = Path(__file__).resolve().parent.parent
RULES = ("C901", "PLR0912", "PLR0915")
FOLDERS = ("shared", "producer", "worker", "benchmarks", "tests", "scripts")
# a noqa comment naming the rules, then a reason in parentheses on the same line
NOQA = re.compile(r"#\s*noqa:\s*(?P<codes>[A-Z0-9, ]+?)\s*(?P<reason>\(.+\))?\s*$")


def _ruff() -> str:
    found = Path(sys.executable).parent / "ruff"
    return str(found) if found.exists() else (shutil.which("ruff") or "ruff")


def _ruff_complexity(path: Path) -> list[str]:
    """What the complexity rules report on ``path`` under the project's configuration."""
    out = run_command(
        [
            _ruff(),
            "check",
            "--no-cache",
            "--select",
            ",".join(RULES),
            "--output-format",
            "concise",
            "--config",
            str(ROOT / "pyproject.toml"),
            str(path),
        ],
        cwd=ROOT,
    )
    return [line for line in out.stdout.splitlines() if any(r in line for r in RULES)]


def test_the_complexity_rules_are_on_at_the_documented_thresholds() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert set(RULES) <= set(config["select"])
    assert config["mccabe"]["max-complexity"] == 15
    assert config["pylint"]["max-branches"] == 15
    assert config["pylint"]["max-statements"] == 60


def test_the_rules_catch_a_tangled_function(tmp_path: Path) -> None:
    branches = "".join(f"    if x == {i}:\n        y += {i}\n" for i in range(16))
    (tmp_path / "tangled.py").write_text(f"def f(x):\n    y = 0\n{branches}    return y\n")
    (tmp_path / "plain.py").write_text("def g(x):\n    return x + 1\n")
    found = _ruff_complexity(tmp_path)
    assert any("C901" in line and "tangled.py" in line for line in found), found
    assert any("PLR0912" in line and "tangled.py" in line for line in found), found
    assert not any("plain.py" in line for line in found), found


def test_the_project_is_within_the_complexity_rules() -> None:
    assert _ruff_complexity(ROOT) == []


def noqa_without_reason(source: str) -> list[int]:
    """Lines of ``source`` that silence a complexity rule without saying why."""
    bad = []
    for number, line in enumerate(source.splitlines(), 1):
        match = NOQA.search(line)
        if match and any(r in match["codes"] for r in RULES) and not match["reason"]:
            bad.append(number)
    return bad


def test_the_reason_check_sees_a_bare_noqa() -> None:
    assert noqa_without_reason("def f():  # noqa: C901\n") == [1]
    assert noqa_without_reason("def f():  # noqa: C901, PLR0912 (one check per field)\n") == []
    assert noqa_without_reason("x = 1  # noqa: E501\n") == []


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_complexity_exception_says_why(folder: str) -> None:
    bad = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (lines := noqa_without_reason(path.read_text()))
    }
    assert bad == {}
