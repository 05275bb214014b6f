"""``tokenfleet models``: the bundled models and the cache of converted GGUF files; the fleet's
served and declared models.

``list`` shows the short names and the converted folders; ``prepare MODEL`` resolves (and for a
GGUF file, converts) a model ahead of the first worker start, e.g. in an image build; ``clear``
empties the conversion cache. These three are local. ``fleet``, ``declare`` and ``undeclare``
read and edit what the fleet's Redis says (``fleet_models``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from tokenfleet.worker.commands import fleet_models


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "models",
        help="list, prepare or clear models; the fleet's served and declared models",
        description="Bundled model names and the cache of GGUF files converted into Hugging "
        "Face folders ($TOKENFLEET_MODEL_CACHE, else ~/.cache/tokenfleet/models); the models "
        "the fleet serves and declares (fleet, declare, undeclare).",
    )
    sub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    sub.add_parser("list", help="bundled names and converted folders").set_defaults(func=_list)
    prepare = sub.add_parser("prepare", help="resolve a model now (converting a GGUF file once)")
    prepare.add_argument("model", help="bundled name, .gguf file, folder or cached hub id")
    prepare.set_defaults(func=_prepare)
    sub.add_parser("clear", help="delete every converted folder").set_defaults(func=_clear)
    fleet_models.register_actions(sub)


def _list(args: argparse.Namespace) -> int:
    from tokenfleet.worker.models.catalog import BUNDLED
    from tokenfleet.worker.models.errors import ModelFileError
    from tokenfleet.worker.models.gguf_cache import cache_root

    for name, model in sorted(BUNDLED.items()):
        try:
            where = str(model.path())
        except ModelFileError as exc:
            where = f"not installed ({exc})"
        print(f"{name}\t{where}")
    root = cache_root()
    print(f"cache {root}")
    for folder in sorted(root.glob("[!.]*")) if root.is_dir() else []:
        print(f"  {folder.name}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from tokenfleet.worker.models.errors import EXIT_MODEL_UNAVAILABLE, ModelFileError
    from tokenfleet.worker.models.resolve import resolve_model

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        print(resolve_model(args.model))
    except ModelFileError as exc:
        print(f"tokenfleet models prepare: {exc}", file=sys.stderr)
        return EXIT_MODEL_UNAVAILABLE
    return 0


def _clear(args: argparse.Namespace) -> int:
    from tokenfleet.worker.models.gguf_cache import cache_root, clear

    removed = clear()
    print(f"removed {len(removed)} entries from {cache_root()}")
    return 0
