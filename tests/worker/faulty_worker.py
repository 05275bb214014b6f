"""A real worker process whose engine raises inside ``step()`` while a request whose id starts with
``fault`` is in it: the fault is injected here, in the test tree, not in the product.

Usage: python tests/worker/faulty_worker.py WORKER-FLAGS...  (the flags of ``tokenfleet worker``)
"""

from __future__ import annotations

import logging
import sys
from typing import Any


def main(argv: list[str]) -> int:
    import torch

    from tokenfleet.worker.cli import build_parser
    from tokenfleet.worker.commands.worker import build_settings
    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.service import WorkerService

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    args = build_parser().parse_args(["worker", *argv])
    settings, ws = build_settings(args)
    torch.set_num_threads(1)
    engine = Engine(ws.model, **ws.engine_overrides())
    real_step = engine.step

    def faulty_step() -> Any:
        if any(
            rid.startswith("fault") and not req.finished for rid, req in engine._requests.items()
        ):
            raise RuntimeError("injected fault: the model runner blew up")
        return real_step()

    vars(engine)["step"] = faulty_step  # instance attribute shadows the method
    service = WorkerService(engine, settings, ws)
    service.install_signal_handlers()
    return service.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
