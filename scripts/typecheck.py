"""Run mypy over the installed package layout.

The three folders install as ``tokenfleet.shared``/``producer``/``worker`` through setuptools'
package-dir mapping, whose editable finder mypy cannot follow. This script points mypy at the
mirror of that mapping (``package_mirror.py``: symlinks in ``.pkg-mirror/tokenfleet``), so module
names (and every ``tokenfleet.…`` import) resolve exactly as they do when installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

from package_mirror import MAPPING, ROOT, build_mirror


def main() -> int:
    """Build the mirror and run mypy on the packages, then on tests and benchmarks."""
    env = dict(os.environ, MYPYPATH=str(build_mirror()))
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
