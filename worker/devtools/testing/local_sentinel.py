"""A private Redis Sentinel setup on loopback ports, for the HA tests and people trying it locally.

``LocalSentinel`` starts one primary, one replica (``--replicaof`` the primary) and three
sentinels (``redis-server sentinel.conf --sentinel``) monitoring them as ``service``, each on a
free 127.0.0.1 port with its own directory under one temporary folder. Failure detection is short
(``down_after_ms``, default 1000 ms) so that a failover ends in a few seconds.

The data nodes run with ``min-replicas-to-write 1`` / ``min-replicas-max-lag 3`` (the safe
default of docs/redis-modes.md; ``min_replicas_to_write=0`` turns it off). Optionally the data
nodes require a password (``password``: ``requirepass``, and ``masterauth``
for replication), the sentinels one of their own (``sentinel_password``), and the data nodes
speak TLS only (``tls``: files from ``local_tls.make_certs``; replication and the sentinels'
connections to them use TLS too), and then the sentinels too (TLS port only: with
``tls-replication`` sentinels also reach each other over TLS, so their plain ports would refuse
one another and no failover could be voted).

Invariant: after ``start()`` returns, the replica's link to the primary is up and every sentinel
names the primary as the service's master and knows the replica and the two other sentinels (so
a failover can be voted at once); ``stop()`` kills every process and removes the folder.
``settings_env()`` gives the environment that puts a tokenfleet process in sentinel mode here.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from tokenfleet.worker.devtools.local_redis import find_redis_server, free_port
from tokenfleet.worker.devtools.testing.local_tls import TlsFiles

QUORUM = 2  # of 3 sentinels


class LocalSentinel:
    """1 primary + 1 replica + 3 sentinels, all ``redis-server`` processes on loopback ports."""

    def __init__(
        self,
        *,
        service: str = "tokenfleet",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 4000,
        binary: Path | None = None,
        password: str = "",
        sentinel_password: str = "",
        tls: TlsFiles | None = None,
        min_replicas_to_write: int = 1,
        min_replicas_max_lag: int = 3,
    ) -> None:
        # the safe default (docs/redis-modes.md, "What each setting guarantees"): a primary cut
        # off from its replica refuses writes after about ``min_replicas_max_lag`` seconds
        # instead of acknowledging writes a failover discards; 0 turns it off
        self.min_replicas_to_write = min_replicas_to_write
        self.min_replicas_max_lag = min_replicas_max_lag
        self.password = password
        self.sentinel_password = sentinel_password
        self.tls = tls
        self.binary = binary or find_redis_server("system")
        self.service = service
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.dir = Path(tempfile.mkdtemp(prefix="tokenfleet-sentinel-"))
        self.data_ports: list[int] = []  # [first primary, first replica]
        self.sentinel_ports: list[int] = []
        self.procs: dict[int, subprocess.Popen[bytes]] = {}  # port -> process

    @property
    def sentinels(self) -> str:
        """``host:port,...`` as ``TOKENFLEET_SENTINELS`` takes it."""
        return ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)

    def settings_env(self) -> dict[str, str]:
        """Environment for a tokenfleet process in sentinel mode against this setup."""
        return {
            "TOKENFLEET_REDIS_MODE": "sentinel",
            "TOKENFLEET_SENTINELS": self.sentinels,
            "TOKENFLEET_SENTINEL_SERVICE": self.service,
        }

    def start(self, timeout_s: float = 30.0) -> LocalSentinel:
        """Start all five processes; ``RuntimeError`` (with the logs) if they do not settle."""
        primary, replica = free_port(), free_port()
        self.data_ports = [primary, replica]
        self._spawn(primary, self._data_args(primary))
        self._spawn(replica, [*self._data_args(replica), "--replicaof", "127.0.0.1", str(primary)])
        for _ in range(3):
            port = free_port()
            self.sentinel_ports.append(port)
            conf = self.dir / f"sentinel-{port}.conf"
            ports = f"port {port}\n" if self.tls is None else f"port 0\ntls-port {port}\n"
            conf.write_text(
                f"{ports}bind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {self.service} 127.0.0.1 {primary} {QUORUM}\n"
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {self.service} 1\n" + self._sentinel_conf_extra()
            )
            self._spawn(port, [str(conf), "--sentinel"])
        try:
            self._wait(self._settled, "the sentinel setup to settle", timeout_s)
        except RuntimeError:
            self.stop()
            raise
        return self

    def primary_port(self) -> int:
        """The port of the current primary, as the first sentinel that answers reports it."""
        for port in self.sentinel_ports:
            try:
                with self._sentinel(port, 1) as s:
                    addr = s.sentinel_get_master_addr_by_name(self.service)
            except redis.RedisError:
                continue
            if addr:
                return int(addr[1])
        raise RuntimeError("no sentinel names a primary")

    def url(self, port: int) -> str:
        """A direct URL of one data node (for test checks; tokenfleet goes through sentinels),
        with the password and TLS options the nodes need."""
        auth = f":{self.password}@" if self.password else ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{port}/0"
        return f"rediss://{auth}127.0.0.1:{port}/0?ssl_ca_certs={self.tls.ca_cert}"

    def data_client(self, port: int, timeout_s: float = 5) -> redis.Redis:
        """A direct client of one data node (password, TLS as needed)."""
        return redis.Redis.from_url(self.url(port), socket_timeout=timeout_s)

    def failover(self, timeout_s: float = 30.0) -> int:
        """``SENTINEL FAILOVER`` and wait until every sentinel names the new primary, it accepts
        writes, and the old primary (if alive) has been turned into its replica (until then
        the old one still takes writes that the switch will discard); returns the new port."""
        old = self.primary_port()
        with self._sentinel(self._live_sentinels()[0], 5) as s:
            s.execute_command("SENTINEL", "FAILOVER", self.service)

        def switched() -> bool:
            ports = {self._master_port(p) for p in self._live_sentinels()}
            new = ports.pop() if len(ports) == 1 else None
            if new is None or new == old or self._role(new) != "master":
                return False
            return self.procs[old].poll() is not None or self._role(old) == "slave"

        self._wait(switched, "the failover", timeout_s)
        return self.primary_port()

    def crash_primary(self, timeout_s: float = 60.0) -> int:
        """SIGKILL the primary, wait until every live sentinel names the promoted replica and it
        accepts writes, then start the killed node again (empty: no persistence) and wait until
        the sentinels have made it the new primary's replica, its link up; returns the new
        primary's port. Until then the new primary has no replica (what ``WAIT`` waits for)."""
        old = self.primary_port()
        self.kill(old)

        def promoted() -> bool:
            ports = {self._master_port(p) for p in self._live_sentinels()}
            new = ports.pop() if len(ports) == 1 else None
            return new is not None and new != old and self._role(new) == "master"

        self._wait(promoted, "the sentinels to promote the replica", timeout_s)
        new = self.primary_port()
        self._spawn(old, self._data_args(old))

        def rejoined() -> bool:
            info = self._info(old, "replication")
            return (
                info.get("role") == "slave"
                and info.get("master_port") == new
                and (info.get("master_link_status") == "up")
            )

        self._wait(rejoined, "the killed node to rejoin as a replica", timeout_s)
        return new

    def kill(self, port: int) -> None:
        """SIGKILL one process (a data node or a sentinel)."""
        proc = self.procs[port]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        """Kill every process and remove the folder."""
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)

    def logs(self, num_chars: int = 2000) -> str:
        parts = []
        for path in sorted(self.dir.glob("*.log")):
            parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-num_chars:])
        return "\n".join(parts)

    def __enter__(self) -> LocalSentinel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ------------------------------------------------------------------------------
    def _data_args(self, port: int) -> list[str]:
        node_dir = self.dir / f"node-{port}"
        node_dir.mkdir(exist_ok=True)  # (a restarted node: its folder is there)
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(node_dir)]  # fmt: skip
        if self.min_replicas_to_write:  # (a replica keeps it too: it applies once promoted)
            args += ["--min-replicas-to-write", str(self.min_replicas_to_write),
                     "--min-replicas-max-lag", str(self.min_replicas_max_lag)]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.tls is not None:  # TLS only: the plain port closed, replication over TLS
            args[1] = "0"
            args += ["--tls-port", str(port), "--tls-replication", "yes", "--tls-auth-clients",
                     "no", *self.tls.server_args()]  # fmt: skip
        return args

    def _sentinel_conf_extra(self) -> str:
        lines = ""
        if self.password:
            lines += f"sentinel auth-pass {self.service} {self.password}\n"
        if self.sentinel_password:
            lines += f"requirepass {self.sentinel_password}\n"
            lines += f"sentinel sentinel-pass {self.sentinel_password}\n"
        if self.tls is not None:
            lines += "tls-replication yes\ntls-auth-clients no\n" + self.tls.conf_lines()
        return lines

    def _sentinel(self, port: int, timeout_s: float) -> redis.Redis:
        tls: dict[str, object] = {}
        if self.tls is not None:
            tls = {"ssl": True, "ssl_ca_certs": str(self.tls.ca_cert)}
        return redis.Redis(
            host="127.0.0.1",
            port=port,
            password=self.sentinel_password or None,
            socket_timeout=timeout_s,
            **tls,  # type: ignore[arg-type]  # (ssl options only with tls)
        )

    def _spawn(self, port: int, args: list[str]) -> None:
        with open(self.dir / f"{port}.log", "ab") as log:  # the child keeps its own descriptor
            self.procs[port] = subprocess.Popen(
                [str(self.binary), *args], stdout=log, stderr=subprocess.STDOUT
            )

    def _settled(self) -> bool:
        primary, _ = self.data_ports
        info = self._info(self.data_ports[1], "replication")
        if info.get("master_link_status") != "up":
            return False
        for port in self.sentinel_ports:
            if self._master_port(port) != primary:
                return False
            with self._sentinel(port, 1) as s:
                others = s.execute_command("SENTINEL", "SENTINELS", self.service)
                replicas = s.execute_command("SENTINEL", "REPLICAS", self.service)
            if len(others) != 2 or len(replicas) != 1:
                return False
        return True

    def _master_port(self, sentinel_port: int) -> int | None:
        try:
            with self._sentinel(sentinel_port, 1) as s:
                addr = s.sentinel_get_master_addr_by_name(self.service)
        except redis.RedisError:
            return None
        return int(addr[1]) if addr else None

    def _role(self, port: int) -> str:
        return str(self._info(port, "replication").get("role", ""))

    def _info(self, port: int, section: str) -> dict[str, Any]:
        try:
            with self.data_client(port, 1) as c:
                return dict(c.info(section))
        except redis.RedisError:
            return {}

    def _wait(self, predicate: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for port, proc in self.procs.items():
                if proc.poll() is not None and port not in self._killed():
                    raise RuntimeError(f"redis process on {port} exited:\n{self.logs()}")
            try:
                if predicate():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"timed out waiting for {what} after {timeout_s}s:\n{self.logs()}")

    def _live_sentinels(self) -> list[int]:
        """The sentinels not killed (``kill``): a vote needs only the quorum of them."""
        return [p for p in self.sentinel_ports if p not in self._killed()]

    def _killed(self) -> set[int]:
        return {p for p, proc in self.procs.items() if proc.returncode == -signal.SIGKILL}
