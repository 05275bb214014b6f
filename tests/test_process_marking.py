"""The fast tier's guard: tests that start processes are found and marked ``slow``, and an
unmarked test that starts one anyway fails (tests/process_marking.py)."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from child_process import ChildProcess, tokenfleet_args
from process_marking import UnmarkedProcess, guarded, item_starts_processes, starts_processes


def _subprocess() -> ModuleType:
    """``subprocess``, looked up at run time: reading the tests that use it finds no process
    starter, so they run unmarked, under the guard (what they show)."""
    return importlib.import_module("subprocess")


TESTS = Path(__file__).resolve().parent


def _plain(x: int) -> int:
    return x + 1


def _runs_a_command() -> None:
    subprocess.run(["true"], check=True)


def _starts_a_worker(tmp: Path) -> ChildProcess:
    return ChildProcess(tokenfleet_args("worker"), tmp / "w.log")


def _through_a_helper(tmp: Path) -> None:
    _starts_a_worker(tmp).close()


class _Fleet(ChildProcess):
    pass


class _Holder:
    def start(self, tmp: Path) -> None:
        _through_a_helper(tmp)


def test_the_reader_finds_process_starters_through_helpers() -> None:
    assert starts_processes(_starts_a_worker)
    assert starts_processes(_through_a_helper)  # one helper further
    assert starts_processes(_Fleet)  # a subclass of a starter
    assert starts_processes(_Holder)  # a helper class whose method starts one
    assert starts_processes(lambda tmp: _through_a_helper(tmp))
    assert starts_processes(_runs_a_command)
    assert not starts_processes(_plain)
    assert not starts_processes(test_an_unmarked_test_that_starts_a_process_fails)


def _load(path: Path) -> ModuleType:
    """A helper module of a test folder (those folders are not on ``sys.path`` here)."""
    spec = importlib.util.spec_from_file_location(f"_marking_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_the_suites_own_helpers_are_recognised() -> None:
    gateway_helpers = _load(TESTS / "gateway" / "gateway_helpers.py")
    worker_helpers = _load(TESTS / "worker" / "worker_helpers.py")
    assert starts_processes(gateway_helpers.start_fleet)
    assert starts_processes(worker_helpers.WorkerProc)
    assert not starts_processes(worker_helpers.make_request)
    assert not starts_processes(worker_helpers.wait_terminal)


def _item(function: object, **fixtures: object) -> SimpleNamespace:
    """What ``item_starts_processes`` reads of a collected test."""
    defs = {name: [SimpleNamespace(func=f)] for name, f in fixtures.items()}
    return SimpleNamespace(function=function, _fixtureinfo=SimpleNamespace(name2fixturedefs=defs))


def test_a_test_is_slow_by_its_own_code_or_by_a_fixture() -> None:
    assert item_starts_processes(_item(_through_a_helper))
    assert item_starts_processes(_item(_plain, fleet=_starts_a_worker, x=_plain))
    assert not item_starts_processes(_item(_plain, x=_plain))
    # the session's one redis-server does not make every Redis test slow
    redis_server = SimpleNamespace(func=_starts_a_worker)
    item = _item(_plain)
    item._fixtureinfo.name2fixturedefs["redis_server"] = [redis_server]
    assert not item_starts_processes(item)


def test_this_session_marked_what_it_collected(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("slow") is None  # this test starts nothing
    for item in request.session.items:
        if item_starts_processes(item):
            assert item.get_closest_marker("slow") is not None, item.nodeid


def test_an_unmarked_test_that_starts_a_process_fails() -> None:
    # This test is not marked slow, so the guard is on while it runs.
    with pytest.raises(UnmarkedProcess, match="not marked slow"):
        _subprocess().run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(UnmarkedProcess):
        _subprocess().run(["true"], check=True)
    multiprocessing = importlib.import_module("multiprocessing")
    with pytest.raises(UnmarkedProcess):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_the_guard_puts_everything_back() -> None:
    popen = _subprocess().Popen
    popen_init = popen.__init__
    with guarded("x"), pytest.raises(UnmarkedProcess):
        popen(["true"])
    assert popen.__init__ is popen_init
