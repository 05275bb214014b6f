"""Copy the console's vendored scripts and styles from their npm packages into the package.

``make setup`` runs ``npm ci`` in ``web/`` (versions pinned with their integrity hashes in
``web/package-lock.json``), then this script, which copies the files the console serves into
``producer/gateway/console/static/vendor/`` (package data: they ship inside the wheel, so the
console works with no network) with each package's license, and writes ``VERSIONS.json``:
package, version and SHA-256 of every copied file. It refuses a package whose installed
version is not the locked one (run ``npm ci`` again).

Usage: python scripts/console_assets.py [--check]   (--check: only verify the copies)
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "web"
VENDOR = ROOT / "producer" / "gateway" / "console" / "static" / "vendor"
# (package, file in the package, name served under /console/static/vendor/)
FILES = (
    ("htmx.org", "dist/htmx.min.js", "htmx.min.js"),
    ("htmx.org", "LICENSE", "LICENSE.htmx.txt"),
    ("htmx-ext-sse", "dist/sse.min.js", "htmx-ext-sse.min.js"),
    ("htmx-ext-sse", "LICENSE", "LICENSE.htmx-ext-sse.txt"),
    ("uplot", "dist/uPlot.iife.min.js", "uPlot.iife.min.js"),
    ("uplot", "dist/uPlot.min.css", "uPlot.min.css"),
    ("uplot", "LICENSE", "LICENSE.uplot.txt"),
)


def locked_versions() -> dict[str, str]:
    """Each package's version in ``web/package-lock.json``."""
    lock = json.loads((WEB / "package-lock.json").read_text())
    return {
        path.removeprefix("node_modules/"): entry["version"]
        for path, entry in lock["packages"].items()
        if path.startswith("node_modules/")
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str]) -> int:
    check_only = "--check" in argv
    locked = locked_versions()
    manifest: dict[str, dict[str, str]] = {}
    for package, source, name in FILES:
        folder = WEB / "node_modules" / package
        installed = json.loads((folder / "package.json").read_text())["version"]
        if installed != locked[package]:
            print(
                f"console_assets: {package} {installed} is installed, {locked[package]} is "
                "locked: run 'npm ci' in web/",
                file=sys.stderr,
            )
            return 1
        target = VENDOR / name
        if check_only:
            if not target.is_file() or _sha256(target) != _sha256(folder / source):
                print(f"console_assets: {target} differs from {package}/{source}", file=sys.stderr)
                return 1
        else:
            VENDOR.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / source, target)
        manifest[name] = {"package": package, "version": installed, "sha256": _sha256(target)}
    if not check_only:
        (VENDOR / "VERSIONS.json").write_text(json.dumps(manifest, indent=2) + "\n")
        print(f"console_assets: {len(FILES)} files from {len(locked)} locked packages -> {VENDOR}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
