"""``tokenfleet make-tiny-model DIR [--flavour llama|qwen2] [--seed N]``: build the offline model.

Writes a tiny randomly initialised causal LM and its byte-level BPE tokenizer with
``save_pretrained`` (see :mod:`tokenfleet.worker.devtools.tiny_model`); the folder then serves
as ``--model`` for the worker and the demo. Same flavour and seed give identical files.
"""

from __future__ import annotations

import argparse
from typing import Any

FLAVOURS = ("llama", "qwen2")  # kept in step with tiny_model.FLAVOURS (checked by a test)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "make-tiny-model",
        help="write a tiny random model + tokenizer for tests and the offline demo",
        description="Build a tiny randomly initialised causal LM with a byte-level BPE tokenizer "
        "and save it to DIR (loadable with from_pretrained). No download needed.",
    )
    p.add_argument("dir", help="output folder (created if missing)")
    p.add_argument("--flavour", choices=FLAVOURS, default="llama", help="architecture (llama)")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed (0)")
    p.set_defaults(func=func)


def func(args: argparse.Namespace) -> int:
    from tokenfleet.worker.devtools.tiny_model import make_tiny_model

    path = make_tiny_model(args.dir, flavour=args.flavour, seed=args.seed)
    print(f"wrote a tiny {args.flavour} model (seed {args.seed}) to {path}")
    return 0
