"""The installed package layout, mirrored with symlinks for tools that read source folders.

The three folders install as ``tokenfleet.shared``/``producer``/``worker`` through setuptools'
package-dir mapping, whose editable finder neither mypy nor griffe (mkdocstrings) can follow.
:func:`build_mirror` lays out ``<dest>/tokenfleet/{shared,producer,worker}`` as links to the
folders, so module names resolve exactly as they do when installed, from a clean clone and
without installing anything. ``scripts/typecheck.py`` points mypy at the mirror; as an MkDocs
hook (``hooks:`` in mkdocs.yml) this module builds it before mkdocstrings reads the sources.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MAPPING = {"shared": "shared", "producer": "producer", "worker": "worker"}
MIRROR = ROOT / ".pkg-mirror"  # git-ignored; the search path to give a tool


def build_mirror(dest: Path = MIRROR) -> Path:
    """Create (or refresh) the links under ``dest/tokenfleet``; returns ``dest``."""
    package = dest / "tokenfleet"
    package.mkdir(parents=True, exist_ok=True)
    for name, folder in MAPPING.items():
        link = package / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(ROOT / folder, target_is_directory=True)
    return dest


def on_startup(**kwargs: Any) -> None:
    """MkDocs hook, before any plugin's config event: mkdocstrings keeps only search paths that
    exist when it is configured, so the mirror must be there first."""
    build_mirror()
