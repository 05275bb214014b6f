"""Run mypy over the installed package layout.

The three folders install as ``tokenfleet.shared``/``producer``/``worker`` through setuptools'
package-dir mapping, whose editable finder mypy cannot follow. This script mirrors the mapping
with symlinks in ``.typecheck/tokenfleet`` and points mypy there, so module names (and
every ``tokenfleet.…`` import) resolve exactly as they do when installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPING = {"shared": "shared", "producer": "producer", "worker": "worker"}


def main() -> int:
    """Build the mirror and run mypy on the packages, then on tests and benchmarks."""
    mirror = ROOT / ".typecheck" / "tokenfleet"
    mirror.mkdir(parents=True, exist_ok=True)
    for name, folder in MAPPING.items():
        link = mirror / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(ROOT / folder, target_is_directory=True)
    env = dict(os.environ, MYPYPATH=str(mirror.parent))
    mypy = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    packages = [arg for name in MAPPING for arg in ("-p", f"tokenfleet.{name}")]
    status = subprocess.call([*mypy, *packages], cwd=ROOT, env=env)
    extra = [p for p in ("tests", "benchmarks", "examples", "scripts") if (ROOT / p).is_dir()]
    if extra:
        status |= subprocess.call(
            [*mypy, "--explicit-package-bases", "--namespace-packages", *extra], cwd=ROOT, env=env
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
