"""Test processes forked from one that has imported torch and transformers already.

Every ``tokenfleet worker`` a test starts spends about 6 s of CPU importing torch and
transformers before it does anything, and the crash, signal, HA and gateway tests start more than
a hundred of them: on a 2-core machine that import was a third of the suite's CPU. The fork
server (the scheme of CPython's ``multiprocessing.forkserver`` and Android's zygote) imports them
once per pytest process; each ``python -m tokenfleet...`` or ``python SCRIPT.py`` command that
:class:`~child_process.ChildProcess` starts is forked from it and then runs the command with the
test's arguments, environment, working directory and output files. The result is a real process:
its own pid, signals delivered by the kernel, and an exit code (or death by a signal) reported
as ``subprocess.Popen.returncode`` reports it (:class:`ForkedProcess`).

What a forked command would see differently from a fresh interpreter, and how that is undone:
    * modules imported before it ran: third-party libraries only (none of them reads the
      environment at import in a way the suite changes; tokenfleet itself imports in the child);
    * OpenMP read ``OMP_NUM_THREADS`` when torch was loaded: the child sets torch's thread count
      from its own environment (or the per-core default, as a fresh process has);
    * numpy's OpenBLAS starts its threads when loaded, and a fork keeps none of them: the server
      loads it single-threaded (torch computes in OpenMP; no code path here runs BLAS on numpy);
    * Python's ``random`` state: reseeded from the OS, as at a fresh start;
    * stdio objects and signal dispositions: made again as Python makes them at startup, from the
      child's environment (``PYTHONUNBUFFERED``);
    * ``sys.argv``, ``sys.path[0]``, ``__main__``: as ``python -m`` / ``python SCRIPT`` sets them.

Protocol (one Unix-socket connection per command): the client sends a length-prefixed JSON
request (``argv`` without the interpreter, ``env``, ``cwd``) with the child's stdin, stdout and
stderr descriptors attached (``SCM_RIGHTS``); a helper forked for the connection forks the
command, writes ``pid N``, waits for it and writes ``exit STATUS`` (the raw wait status). The
server exits when its stdin closes (the pytest process that started it ended).

``TESTS_FORK_SERVER=0`` turns it off: every command then starts a fresh interpreter (a named
variable outside ``TOKENFLEET_*``: the worker warns about unknown ones of its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

SWITCH = "TESTS_FORK_SERVER"
START_TIMEOUT_S = 180.0  # the server's imports (seconds on an idle machine, more under load)
PRELOAD = (  # what a worker and a gateway import that costs seconds (third-party only)
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "tokenizers",
    "numpy",
    "redis",
    "orjson",
    "fastapi",
    "starlette",
    "uvicorn",
    "sse_starlette",
    "pydantic",
    "jinja2",
    "prometheus_client",
    "llguidance",
    "gguf",
)
_HEADER = struct.Struct("!I")
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # left to each command's environment


# -- the client side (the pytest process) ---------------------------------------------------------
class ForkedProcess:
    """A command forked by the server: the part of ``subprocess.Popen``'s interface the suite
    uses (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``).

    Invariant: ``returncode`` is None until the helper reported the exit, then what ``Popen``
    would have set (negative: the signal that ended it)."""

    def __init__(self, args: Sequence[str], conn: socket.socket, pid: int, rest: bytes) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self._conn: socket.socket | None = conn
        self._buf = rest
        self._take_exit()

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (never signal a pid that may have been reused)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout_s: float | None) -> None:
        conn = self._conn
        if conn is None or not select.select([conn], [], [], timeout_s)[0]:
            return
        data = conn.recv(4096)
        if not data:
            self._close()
            if self.returncode is None:
                raise RuntimeError(f"the fork server's helper for pid {self.pid} ended silently")
            return
        self._buf += data
        self._take_exit()

    def _take_exit(self) -> None:
        if b"\n" in self._buf:
            line = self._buf.split(b"\n", 1)[0].decode()
            kind, value = line.split()
            assert kind == "exit", line
            self.returncode = os.waitstatus_to_exitcode(int(value))
            self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __del__(self) -> None:
        self._close()


class ForkServer:
    """This pytest process's fork server, started at the first command that can use it.

    Invariant: ``path`` is set once the server said it is ready; ``failed`` says why it is not
    used (every command then starts a fresh interpreter)."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.failed = "" if os.environ.get(SWITCH, "1") != "0" else f"{SWITCH}=0"
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid = 0  # the process that started it (a forked pytest process starts its own)

    def spawn(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        stdout: int,
        stderr: int,
        cwd: str | None = None,
    ) -> ForkedProcess | None:
        """``args`` forked from the server, or None when it cannot be (not a Python command of
        this interpreter, or the server is off or failed)."""
        command = forkable(args)
        if command is None or not self._ready():
            return None
        assert self.path is not None
        request = json.dumps(
            {"argv": command, "env": dict(env), "cwd": cwd or os.getcwd(), "ignored": _ignored()}
        ).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [_HEADER.pack(len(request))], [0, stdout, stderr])
            conn.sendall(request)
            buf = b""
            while b"\n" not in buf:
                data = conn.recv(4096)
                if not data:
                    raise RuntimeError("the fork server closed the connection before a pid")
                buf += data
        except BaseException:
            conn.close()
            raise
        line, rest = buf.split(b"\n", 1)
        kind, value = line.decode().split()
        assert kind == "pid", line
        return ForkedProcess(args, conn, int(value), rest)

    def close(self) -> None:
        """Stop the server (the commands it forked live on: their tests stop them)."""
        proc, self._proc, self.path = self._proc, None, None
        if proc is not None and self._pid == os.getpid():
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.close()  # its loop ends at this EOF
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()

    def _ready(self) -> bool:
        if self.failed:
            return False
        if self.path is not None and self._pid == os.getpid():
            return True
        tmp = tempfile.mkdtemp(prefix="tf-fork-")
        path = os.path.join(tmp, "server.sock")
        env = {
            k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
        }
        env["OPENBLAS_NUM_THREADS"] = "1"  # numpy's BLAS starts no thread the fork would lose
        with open(os.path.join(tmp, "server.log"), "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, __file__, path],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                cwd=tmp,
            )
        assert proc.stdout is not None
        said = b""
        if select.select([proc.stdout], [], [], START_TIMEOUT_S)[0]:
            said = proc.stdout.readline()
        if said != b"ready\n":
            proc.kill()
            proc.wait()
            self.failed = f"the fork server did not start ({said!r}; log in {tmp})"
            print(f"fork_server: {self.failed}; commands start fresh interpreters", file=sys.stderr)
            return False
        self._proc, self.path, self._pid = proc, path, os.getpid()
        return True


def forkable(args: Sequence[str]) -> list[str] | None:
    """The command line after the interpreter when ``args`` runs this interpreter on a module
    (``-m tokenfleet...``) or on a script; None otherwise (a binary, ``-c``, other options)."""
    if len(args) < 2 or args[0] != sys.executable:
        return None
    if args[1] == "-m" and len(args) >= 3 and args[2].startswith("tokenfleet."):
        return list(args[1:])
    if args[1].endswith(".py") and os.path.isfile(args[1]):
        return list(args[1:])
    return None


SERVER = ForkServer()  # this process's (tests/conftest.py closes it at the session's end)


# -- the server side ------------------------------------------------------------------------------
def _preload() -> None:
    import importlib

    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve(path: str) -> None:
    """Import, then fork a helper for each connection until stdin closes (module docstring)."""
    _preload()
    if _threads() != 1:  # a fork would copy a process whose other threads do not come along
        print(f"refused: {_threads()} threads after the imports", flush=True)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the helpers are reaped by the kernel
    print("ready", flush=True)
    while True:
        readable = select.select([listener, sys.stdin], [], [])[0]
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return  # the pytest process ended
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError) as exc:
            print(f"fork_server: a bad request: {exc}", file=sys.stderr, flush=True)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _helper(conn, request, fds)  # returns only in the command's process
            return _become(request)
        conn.close()
        for fd in fds:
            os.close(fd)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    if len(fds) != 3 or len(head) != _HEADER.size:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"{len(fds)} descriptors and {len(head)} header bytes")
    (size,) = _HEADER.unpack(head)
    body = b""
    while len(body) < size:
        data = conn.recv(size - len(body))
        if not data:
            raise ValueError("the request ended early")
        body += data
    request = json.loads(body)
    request["fds"] = fds
    return request, fds


def _helper(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the helper: fork the command (which returns from here), report its pid and exit."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        return
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(f"pid {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        conn.sendall(f"exit {status}\n".encode())
    except OSError:
        pass  # the client went away: nobody is waiting for the status
    os._exit(0)


def _become(request: dict[str, Any]) -> None:
    """In the command's process: take the request's descriptors, directory and environment,
    undo what the server's state would change (module docstring), run the command. Its end
    (a return, ``SystemExit``, an exception) propagates out of ``serve`` to the interpreter's
    own exit, so threads are joined, ``atexit`` runs and the exit code is Python's."""
    import random
    import runpy

    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _exec_signals(set(request["ignored"]))
    _fresh_stdio()
    random.seed()
    _torch_threads()
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


# what exec keeps: an ignored signal stays ignored, a handled one is reset (SIGKILL and SIGSTOP
# cannot be changed; SIGPIPE and SIGXFSZ are reset by Popen's restore_signals and ignored again
# by Python's start-up, whatever the caller had)
_KEPT_BY_EXEC = sorted(
    set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ}
)


def _ignored() -> list[int]:
    """The signals the calling process ignores, which a command it execs would ignore too."""
    return [int(s) for s in _KEPT_BY_EXEC if signal.getsignal(s) == signal.SIG_IGN]


def _exec_signals(ignored: set[int]) -> None:
    """The dispositions a fresh interpreter exec'd by the caller starts with: what the caller
    ignores stays ignored, the rest is the default; Python then installs its SIGINT handler
    (unless SIGINT is ignored) and ignores SIGPIPE and SIGXFSZ."""
    for sig in _KEPT_BY_EXEC:
        signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _fresh_stdio() -> None:
    """``sys.stdin``/``stdout``/``stderr`` on descriptors 0-2 as a fresh interpreter makes them:
    block-buffered (line-buffered on a terminal), unbuffered under ``PYTHONUNBUFFERED``; stderr
    line-buffered with ``backslashreplace``."""
    import io

    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    encoding = sys.stdout.encoding

    def stream(fd: int, mode: str, errors: str, line: bool) -> io.TextIOWrapper:
        raw = open(fd, mode + "b", buffering=0 if unbuffered and mode == "w" else -1, closefd=False)  # noqa: SIM115
        return io.TextIOWrapper(
            raw,
            encoding=encoding,
            errors=errors,
            line_buffering=line or os.isatty(fd),
            write_through=unbuffered and mode == "w",
        )

    for name, fd, mode, errors, line in (
        ("stdin", 0, "r", "strict", False),
        ("stdout", 1, "w", "strict", False),
        ("stderr", 2, "w", "backslashreplace", True),
    ):
        made = stream(fd, mode, errors, line)
        setattr(sys, name, made)
        setattr(sys, f"__{name}__", made)


def _torch_threads() -> None:
    """torch's intra-op threads from this process's ``OMP_NUM_THREADS``, else one per core (what
    a fresh process gets; the server was started without the variable)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    wanted = os.environ.get("OMP_NUM_THREADS", "")
    if wanted.isdigit() and int(wanted) > 0:
        torch.set_num_threads(int(wanted))


if __name__ == "__main__":
    serve(sys.argv[1])
