"""The suite's one child-process helper: a real process (``tokenfleet worker``, ``tokenfleet
serve``, any command) with its output in a log file, signalled, awaited and stopped
(:class:`ChildProcess`); and :func:`run_command`, a one-shot command run to its end with its
output returned (a CLI call or a probe script whose output the test reads).

A ``python -m tokenfleet...`` or ``python SCRIPT.py`` child is forked from the suite's fork
server (tests/fork_server.py: torch and transformers imported once, not in every worker); any
other command is a plain ``subprocess.Popen``.

A test that starts one is marked ``slow`` automatically (tests/conftest.py), and a test not
marked ``slow`` that starts a Python process fails (the guard in tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import fork_server

from tokenfleet.worker.devtools.local_redis import free_port

__all__ = ["ChildProcess", "free_port", "run_command", "tokenfleet_args"]


def tokenfleet_args(*args: str) -> list[str]:
    """The command line of ``tokenfleet ARGS`` run by this interpreter."""
    return [sys.executable, "-m", "tokenfleet.worker.cli", *args]


def _environment(env: Mapping[str, str] | None, inherit_env: bool) -> dict[str, str]:
    """``env`` added to this process's environment, or alone when ``inherit_env`` is False."""
    return {**os.environ, **(env or {})} if inherit_env else dict(env or {})


def run_command(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    inherit_env: bool = True,
    cwd: Path | None = None,
    timeout_s: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``args`` run to its end with stdout and stderr captured as text (``env`` as for
    :class:`ChildProcess`). The exit code is the caller's to assert, with ``stderr`` as the
    message; running past ``timeout_s`` kills it and raises ``subprocess.TimeoutExpired``."""
    return subprocess.run(
        list(args),
        env=_environment(env, inherit_env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


class ChildProcess:
    """``args`` run as a child process, stdout and stderr into ``log_path`` (stderr into
    ``stderr_path`` instead when given: a test that parses the output line by line).

    ``env``: the child's whole environment when ``inherit_env`` is False, else added to this
    process's. Invariant: after :meth:`close` the process has exited and the logs are closed.
    """

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        *,
        inherit_env: bool = True,
        stderr_path: Path | None = None,
    ) -> None:
        self.log_path = log_path
        self.stderr_path = stderr_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.err_log = open(stderr_path, "wb") if stderr_path else None  # noqa: SIM115 - same
        environment = _environment(env, inherit_env)
        forked = fork_server.SERVER.spawn(
            args, environment, self.log.fileno(), (self.err_log or self.log).fileno()
        )
        self.proc: subprocess.Popen[bytes] | fork_server.ForkedProcess = (
            forked
            if forked is not None
            else subprocess.Popen(
                list(args),
                env=environment,
                stdout=self.log,
                stderr=self.err_log or subprocess.STDOUT,
            )
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self, tail: int | None = 6000) -> str:
        """The log's last ``tail`` characters (all of it when ``tail`` is None)."""
        self.log.flush()
        text = self.log_path.read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def errors(self) -> str:
        """What it wrote to stderr, when that has its own file (``stderr_path``)."""
        assert self.stderr_path is not None, "stderr goes to the log: read output()"
        return self.stderr_path.read_text(errors="replace")

    def lines(self) -> list[str]:
        """The log's complete lines so far (a line still being written is left out)."""
        lines = self.output(tail=None).splitlines(keepends=True)
        return lines if not lines or lines[-1].endswith("\n") else lines[:-1]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self, what: str) -> None:
        """``AssertionError`` with the log when the process has exited (``what``: its name)."""
        if self.proc.poll() is not None:
            raise AssertionError(f"{what} exited early:\n{self.output()}")

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait(self, timeout_s: float = 60) -> int:
        """Its exit code; ``AssertionError`` with the log if it runs past ``timeout_s``."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.log_path.stem} did not exit within {timeout_s}s:\n{self.output()}"
            ) from None

    def kill(self) -> None:
        """SIGKILL, and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def close(self, grace_s: float = 0.0) -> None:
        """Stop it: SIGTERM and up to ``grace_s`` to exit when ``grace_s`` > 0, then SIGKILL."""
        if grace_s > 0 and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        self.kill()
        self.log.close()
        if self.err_log is not None:
            self.err_log.close()
