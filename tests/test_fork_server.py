"""The fork server (tests/fork_server.py): a command forked from it is a real process that sees
what a fresh interpreter sees, and its end is reported as ``subprocess.Popen`` reports it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from child_process import ChildProcess, tokenfleet_args
from fork_server import ForkedProcess, ForkServer, forkable
from waiting import wait_for

pytestmark = pytest.mark.slow

PROBE = """
import json, os, random, signal, sys
import torch
out = {
    "name": __name__,
    "argv": sys.argv[1:],
    "argv0": os.path.basename(sys.argv[0]),
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "env": {k: v for k, v in os.environ.items() if k.startswith("PROBE_")},
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "torch_threads": torch.get_num_threads(),
    "stdout_line_buffering": sys.stdout.line_buffering,
    "stderr_line_buffering": sys.stderr.line_buffering,
    "stdout_is_stdout": sys.stdout is sys.__stdout__,
    "signals": {s.name: str(signal.getsignal(s)) for s in
                (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD, signal.SIGXFSZ)},
    "random": random.random(),
    "pid_is_new": os.getpid() != int(os.environ["PROBE_PARENT"]),
}
print(json.dumps(out), flush=True)
print("to stderr", file=sys.stderr)
mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise RuntimeError("probe failed on purpose")
if mode == "wait":
    print("waiting", flush=True)
    signal.pause()
"""


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    """A server of the module's own (the suite's, ``fork_server.SERVER``, serves ChildProcess)."""
    s = ForkServer()
    yield s
    s.close()


def _run(
    server: ForkServer, tmp: Path, *args: str, fork: bool, env: dict[str, str]
) -> tuple[int, dict[str, object], str]:
    probe = tmp / "probe.py"
    probe.write_text(PROBE)
    out, err = tmp / f"out-{fork}-{args}", tmp / f"err-{fork}-{args}"
    full_env = {**env, "PROBE_PARENT": str(os.getpid())}
    argv = [sys.executable, str(probe), *args]
    with open(out, "wb") as o, open(err, "wb") as e:
        proc: ForkedProcess | subprocess.Popen[bytes] | None
        proc = server.spawn(argv, full_env, o.fileno(), e.fileno(), cwd=str(tmp)) if fork else None
        if fork:
            assert isinstance(proc, ForkedProcess), server.failed
        else:
            proc = subprocess.Popen(argv, env=full_env, stdout=o, stderr=e, cwd=tmp)
        assert proc is not None
        code = proc.wait(120)
    lines = out.read_text().splitlines()
    return code, json.loads(lines[0]), err.read_text()


def test_a_forked_command_sees_what_a_fresh_interpreter_sees(
    server: ForkServer, tmp_path: Path
) -> None:
    env = {**os.environ, "PROBE_A": "1", "PROBE_B": "two", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONUNBUFFERED", None)
    code_fresh, fresh, err_fresh = _run(server, tmp_path, "x", "--y", fork=False, env=env)
    code_forked, forked, err_forked = _run(server, tmp_path, "x", "--y", fork=True, env=env)
    assert code_fresh == code_forked == 0
    assert err_fresh == err_forked == "to stderr\n"
    assert fresh.pop("random") != forked.pop("random")  # reseeded: not the server's state
    assert forked == fresh
    assert forked["env"] == {"PROBE_A": "1", "PROBE_B": "two", "PROBE_PARENT": str(os.getpid())}
    assert forked["torch_threads"] == 1 and forked["pid_is_new"] is True
    # two forks do not share a random state either
    _, again, _ = _run(server, tmp_path, "x", "--y", fork=True, env=env)
    _, third, _ = _run(server, tmp_path, "x", "--y", fork=True, env=env)
    assert again["random"] != third["random"]


def test_signals_the_caller_ignores_stay_ignored_as_across_exec(
    server: ForkServer, tmp_path: Path
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as rq's SimpleWorker leaves it
    try:
        _, fresh, _ = _run(server, tmp_path, fork=False, env=env)
        _, forked, _ = _run(server, tmp_path, fork=True, env=env)
    finally:
        signal.signal(signal.SIGINT, saved)
    signals = fresh["signals"]
    assert isinstance(signals, dict) and signals["SIGINT"] == str(signal.SIG_IGN)  # no handler
    assert forked["signals"] == signals


def test_the_thread_count_follows_each_commands_environment(
    server: ForkServer, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    _, forked, _ = _run(server, tmp_path, fork=True, env={**env, "OMP_NUM_THREADS": "2"})
    assert forked["torch_threads"] == 2  # (what a fresh one gets from it; "1": the test above)
    _, fresh, _ = _run(server, tmp_path, fork=False, env=env)
    _, forked, _ = _run(server, tmp_path, fork=True, env=env)
    assert forked["torch_threads"] == fresh["torch_threads"]  # the per-core default


@pytest.mark.parametrize(("mode", "want"), [("exit3", 3), ("raise", 1)])
def test_exit_codes_are_reported_as_popen_reports_them(
    server: ForkServer, tmp_path: Path, mode: str, want: int
) -> None:
    code, _, err = _run(server, tmp_path, mode, fork=True, env=dict(os.environ))
    assert code == want  # what a fresh interpreter exits with (SystemExit(3), an uncaught error)
    if mode == "raise":
        assert err.splitlines()[-1] == "RuntimeError: probe failed on purpose", err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_a_signal_reaches_the_command_and_its_death_is_reported(
    server: ForkServer, tmp_path: Path, sig: signal.Signals
) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = {**os.environ, "PROBE_PARENT": str(os.getpid())}
    # started as from an interactive shell: a run started in the background (``make test &``)
    # ignores SIGINT, and so would the command, fresh or forked
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        child = ChildProcess([sys.executable, str(probe), "wait"], tmp_path / "w.log", env)
    finally:
        if saved is not None:
            signal.signal(signal.SIGINT, saved)
    try:
        assert isinstance(child.proc, ForkedProcess)
        wait_for(lambda: "waiting" in child.output(), "the probe to wait")
        assert child.alive() and child.proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            child.proc.wait(0.2)
        child.signal(sig)
        assert child.wait(60) == -sig  # SIGINT too: Python dies by it after KeyboardInterrupt
        assert not child.alive()
    finally:
        child.close()


def test_only_python_commands_of_this_interpreter_are_forked(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    assert forkable(tokenfleet_args("worker", "--name", "a")) == [
        "-m",
        "tokenfleet.worker.cli",
        "worker",
        "--name",
        "a",
    ]
    assert forkable([sys.executable, str(script), "x"]) == [str(script), "x"]
    assert forkable([sys.executable, "-c", "pass"]) is None
    assert forkable([sys.executable, "-m", "pip"]) is None
    assert forkable(["redis-server", "--port", "0"]) is None
    assert (
        forkable(["/usr/bin/python3", str(script)]) is None or sys.executable == "/usr/bin/python3"
    )


def test_switched_off_every_command_is_a_fresh_interpreter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TESTS_FORK_SERVER", "0")
    off = ForkServer()
    assert off.failed == "TESTS_FORK_SERVER=0"
    with open(tmp_path / "o", "wb") as o:
        assert (
            off.spawn(tokenfleet_args("--help"), dict(os.environ), o.fileno(), o.fileno()) is None
        )
