"""Which tests pytest-xdist must run in one worker: an ``xdist_group`` per test at collection.

``make test`` runs the suite in parallel workers (``-n``, ``--dist loadgroup``): a test with an
``xdist_group`` mark runs in the same worker as every other test of its group, one after the
other; a test without one goes to whichever worker is free. Nobody has to remember the mark:

* the tests under ``tests/models`` are in three groups by the session fixture they share
  (:data:`MODELS_GROUPS`): those on the SmolLM2 fleet (tests/models/real_fleet.py, a gateway and
  two workers), those comparing with the model loaded in Hugging Face, and the rest. Each is built
  once, in its group's worker; the three groups run beside each other (one group was the run's
  critical path: 800 of its 853 s, 2026-11-28), each of their processes on one thread;
* a test that uses a module- or class-scoped fixture (a module's gateway, a worker in a thread)
  is grouped with the rest of its module, so that fixture is still set up once;
* the rest (the HA tests' Sentinel and Cluster failovers among them, which mostly wait on the
  servers' timers) spread over the workers one test at a time. Session-scoped fixtures (the
  private redis-server, the Sentinel set, the Cluster, the tiny models) are per worker.

:func:`group_of` names a test's group (None: no group); tests/conftest.py marks each test.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
MODELS = TESTS / "models"
# a tests/models test's group: the first of these session fixtures it uses, else "models"
MODELS_GROUPS = (("started_fleet", "models-fleet"), ("hf_smollm2", "models-hf"))
MODELS_GROUP = "models"
MODULE_SCOPES = frozenset({"module", "class", "package"})


def _module_scoped(item: Any) -> bool:
    """Whether one of the fixtures a collected test uses lives longer than the test but not the
    whole session (module, class or package scope)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope in MODULE_SCOPES for ds in defs for d in ds)


def group_of(item: Any) -> str | None:
    """The ``xdist_group`` a collected test belongs to, or None (any worker, on its own)."""
    path = Path(item.path)
    if MODELS in path.parents:
        used = set(getattr(item, "fixturenames", ()))
        return next((g for fixture, g in MODELS_GROUPS if fixture in used), MODELS_GROUP)
    if _module_scoped(item):
        return path.relative_to(TESTS).as_posix()
    return None


# pytest-xdist 3.8 tells its scheduler a test's group by appending ``@group`` to the node id in
# the worker, which pytest >= 9.2 (structured node ids) silently ignores: every test would go to
# any worker (pytest-dev/pytest-xdist#1386). So each worker writes the groups it collected into a
# folder the controller named, and the controller's scheduler (loadgroup's, with that table in
# front) reads them: only xdist's public hooks, whichever pytest.
GROUPS_DIR = "tokenfleet_xdist_groups"  # the workerinput key naming that folder


def groups_table(items: list[Any]) -> dict[str, str]:
    """Node id -> ``xdist_group`` name of each collected test that has one."""
    table = {}
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})  # fmt: skip
        if names:
            table[item.nodeid] = "_".join(names)
    return table


class XdistGroups:
    """The pytest plugin doing that (registered by tests/conftest.py when xdist is loaded)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.dir: Path | None = None

    def pytest_configure_node(self, node: Any) -> None:  # the controller, per worker started
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="tokenfleet-xdist-groups-"))
        node.workerinput[GROUPS_DIR] = str(self.dir)

    def pytest_xdist_make_scheduler(self, config: Any, log: Any) -> Any:
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadGroupScheduling

        plugin = self

        class Scheduling(LoadGroupScheduling):
            table: dict[str, str] | None = None

            def _split_scope(self, nodeid: str) -> str:
                if self.table is None:  # every worker has collected (and written) by now
                    self.table = plugin.read_table()
                return self.table.get(nodeid) or super()._split_scope(nodeid)

        return Scheduling(config, log)

    def read_table(self) -> dict[str, str]:
        """One worker's table (all collected the same tests: xdist checks that)."""
        files = sorted(self.dir.glob("*.json")) if self.dir is not None else []
        return dict(json.loads(files[0].read_text())) if files else {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[Any]) -> None:  # a worker
        workerinput = getattr(self.config, "workerinput", None)
        if workerinput is None or GROUPS_DIR not in workerinput:
            return
        out = Path(workerinput[GROUPS_DIR]) / f"{workerinput['workerid']}.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups_table(items)))
        tmp.rename(out)  # the controller never reads half a table

    def pytest_unconfigure(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
