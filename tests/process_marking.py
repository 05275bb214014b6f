"""Which tests start processes: marked ``slow`` at collection, and a guard for the rest.

The fast tier (``make check``: ``-m "not slow"``) holds no test that starts a process, because a
``tokenfleet worker`` or ``serve`` child imports torch or uvicorn for seconds. Nobody has to
remember the mark:

* :func:`starts_processes` reads a test function and the fixtures it uses, following every name
  they use into the suite's own helpers (functions and classes defined under ``tests/``), and
  answers whether they reach a process starter (:data:`STARTERS`: ``subprocess``,
  ``multiprocessing``, :class:`child_process.ChildProcess`, the local Redis, Sentinel, Cluster and
  fleet harnesses; and :class:`thread_worker.ThreadWorker`, a worker in a thread, which loads a
  model as a worker process does). tests/conftest.py marks each such test ``slow``.
* What that reading cannot see (a process started inside the package's own code, say) the guard
  catches as it happens: while a test not marked ``slow`` runs, starting a process raises
  :class:`UnmarkedProcess` (:func:`guarded`). The fast tier therefore proves itself: it passes
  only if none of its tests starts a process.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing
import multiprocessing.process
import subprocess
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from child_process import ChildProcess
from thread_worker import ThreadWorker

from tokenfleet.worker.devtools.local_fleet import LocalFleet
from tokenfleet.worker.devtools.local_redis import RedisServer
from tokenfleet.worker.devtools.testing.local_cluster import LocalCluster
from tokenfleet.worker.devtools.testing.local_sentinel import LocalSentinel

TESTS = Path(__file__).resolve().parent
# What starts a process when used: modules, and classes (a subclass counts as its base).
STARTERS: tuple[Any, ...] = (subprocess, multiprocessing)
STARTER_CLASSES: tuple[type, ...] = (
    ChildProcess,
    RedisServer,
    LocalFleet,
    LocalSentinel,
    LocalCluster,
    ThreadWorker,  # no process, but a worker loading its model: as slow as one, nearly
)


STARTER_NAMES = {starter.__name__: starter for starter in (*STARTERS, *STARTER_CLASSES)}
# The suite's one redis-server, started once per session: not a reason to call a test slow.
SHARED_PROCESS_FIXTURES = frozenset({"redis_server"})


class UnmarkedProcess(RuntimeError):
    """A test not marked ``slow`` started a process."""


def _in_tests(obj: Any) -> bool:
    """Whether ``obj`` (a function or class) is defined in a file under ``tests/``."""
    try:
        source = inspect.getsourcefile(obj)
    except TypeError:
        return False
    return source is not None and Path(source).resolve().is_relative_to(TESTS)


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _referenced(func: types.FunctionType) -> Iterator[Any]:
    """The module-level objects ``func`` (and the functions nested in it) names, and the
    starters it imports inside itself (named in its code, not in its module)."""
    names = {name for code in _code_objects(func.__code__) for name in code.co_names}
    names |= set(func.__code__.co_freevars)
    for name in names:
        if name in STARTER_NAMES:
            yield STARTER_NAMES[name]
        if name in func.__globals__:
            yield func.__globals__[name]
    for cell in func.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell
            yield cell.cell_contents


def starts_processes(obj: Any, seen: set[int] | None = None) -> bool:
    """Whether ``obj`` (a test, a fixture's function, a helper) reaches a process starter."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if any(obj is starter for starter in STARTERS):
        return True
    if isinstance(obj, type):
        if issubclass(obj, STARTER_CLASSES):
            return True
        if not _in_tests(obj):
            return False
        members = [m for c in obj.__mro__ if _in_tests(c) for m in vars(c).values()]
        return any(starts_processes(m, seen) for m in members)
    if isinstance(obj, staticmethod | classmethod):
        return starts_processes(obj.__func__, seen)
    if isinstance(obj, property):
        return any(starts_processes(f, seen) for f in (obj.fget, obj.fset) if f is not None)
    func = getattr(obj, "__wrapped__", obj)  # a fixture's function, functools.wraps
    if isinstance(func, types.FunctionType) and _in_tests(func):
        return any(starts_processes(target, seen) for target in _referenced(func))
    return False


_starts_cache: dict[int, tuple[Any, bool]] = {}


def _starts(obj: Any) -> bool:
    """``starts_processes`` once per object (a fixture serves many tests)."""
    cached = _starts_cache.get(id(obj))
    if cached is None or cached[0] is not obj:
        cached = _starts_cache[id(obj)] = (obj, starts_processes(obj))
    return cached[1]


def item_starts_processes(item: Any) -> bool:
    """Whether a collected test's function or one of its fixtures (but the session's shared
    redis-server) starts a process."""
    function = getattr(item, "function", None)
    if function is not None and _starts(function):
        return True
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.items() if info is not None else ()
    return any(
        _starts(d.func) for name, ds in defs if name not in SHARED_PROCESS_FIXTURES for d in ds
    )


@contextlib.contextmanager
def guarded(nodeid: str) -> Iterator[None]:
    """While the block runs (a test not marked ``slow``), starting a process through
    ``subprocess`` or ``multiprocessing`` raises :class:`UnmarkedProcess` naming ``nodeid``."""

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise UnmarkedProcess(
                f"{nodeid} started a process ({what}) but is not marked slow: mark it "
                "@pytest.mark.slow, or use a helper tests/process_marking.py recognises"
            )

        return refused

    with contextlib.ExitStack() as stack:
        for owner, name in (
            (subprocess.Popen, "__init__"),
            (multiprocessing.process.BaseProcess, "start"),
        ):
            original = getattr(owner, name)
            setattr(owner, name, refuse(f"{owner.__name__}.{name}"))
            stack.callback(setattr, owner, name, original)
        yield
