"""A private Redis Cluster on loopback ports, for the HA tests, the benchmark and people trying it.

``LocalCluster`` starts ``num_primaries`` primaries and as many replicas (``redis-server
--cluster-enabled yes``, each in its own directory under one temporary folder, on a free
127.0.0.1 port whose cluster-bus port, +10000, is free too), then joins them with
``redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes``. Node timeouts are short
(``node_timeout_ms``) so that a failover ends in seconds.

It also drives the events a fleet must ride out: :meth:`failover` (``CLUSTER FAILOVER`` on
a replica of the slot's primary), :meth:`crash_primary` (the slot's primary SIGKILLed: the
cluster promotes its replica on its own after ``node_timeout_ms``) and :meth:`migrate_slot`
(``CLUSTER SETSLOT ... IMPORTING`` / ``MIGRATING``, ``MIGRATE`` of every key, ``SETSLOT ...
NODE``, as ``redis-cli --cluster reshard`` does).

Invariant: after ``start()`` (and after ``failover``/``crash_primary``/``migrate_slot``) every
node reports
``cluster_state:ok`` and names the same primary for every slot asked about; ``stop()`` kills
every process and removes the folder. ``settings_env()`` gives the environment that puts a
tokenfleet process in cluster mode here.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from tokenfleet.shared.cluster_connection import owner_in
from tokenfleet.worker.devtools.local_redis import find_redis_server, free_port


def cluster_port() -> int:
    """A free 127.0.0.1 port whose cluster-bus port (+10000) was free a moment ago too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) on 127.0.0.1")


class LocalCluster:
    """N primaries + N replicas, all ``redis-server`` processes on loopback ports."""

    def __init__(
        self, *, num_primaries: int = 3, node_timeout_ms: int = 2000, binary: Path | None = None
    ) -> None:
        self.binary = binary or find_redis_server("system")
        cli = shutil.which("redis-cli") or str(Path(self.binary).with_name("redis-cli"))
        self.cli = cli
        self.num_primaries = num_primaries
        self.node_timeout_ms = node_timeout_ms
        self.dir = Path(tempfile.mkdtemp(prefix="tokenfleet-cluster-"))
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen[bytes]] = {}  # port -> process

    @property
    def seed_url(self) -> str:
        """A URL naming one node (cluster mode's ``REDIS_URL``)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def settings_env(self) -> dict[str, str]:
        """Environment for a tokenfleet process in cluster mode against this cluster."""
        return {"TOKENFLEET_REDIS_MODE": "cluster", "REDIS_URL": self.seed_url}

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        """Start every node and create the cluster; ``RuntimeError`` (with logs) if it fails."""
        self.ports = [cluster_port() for _ in range(2 * self.num_primaries)]
        for port in self.ports:
            self._spawn(port)
        try:
            self._wait(lambda: all(self._ping(p) for p in self.ports), "the nodes", timeout_s)
            nodes = [f"127.0.0.1:{p}" for p in self.ports]
            done = subprocess.run(
                [self.cli, "--cluster", "create", *nodes, "--cluster-replicas", "1",
                 "--cluster-yes"],
                capture_output=True, timeout=timeout_s, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout!r}")
            self._wait(self._settled, "the cluster to settle", timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def owner_port(self, slot: int) -> int:
        """The port of the primary serving ``slot``, as the first node that answers says."""
        for port in self.ports:
            owner = self._owner_by(port, slot)
            if owner is not None:
                return owner
        raise RuntimeError(f"no node names a primary for slot {slot}")

    def replica_of(self, primary: int) -> int:
        """A port of a live replica of the primary on ``primary``."""
        for port in self.ports:
            info = self._info(port, "replication")
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == primary:
                return port
        raise RuntimeError(f"no replica of {primary}")

    def failover(self, slot: int, timeout_s: float = 30.0) -> tuple[int, int]:
        """``CLUSTER FAILOVER`` on a replica of ``slot``'s primary; waits until every node
        names it as the slot's primary and the old one is its replica. Returns (old, new)."""
        old = self.owner_port(slot)
        new = self.replica_of(old)
        with redis.Redis(port=new, socket_timeout=5) as c:
            c.execute_command("CLUSTER", "FAILOVER")

        def switched() -> bool:
            if self._role(new) != "master" or self._role(old) != "slave":
                return False
            return self._agreed(slot, new)

        self._wait(switched, f"the failover of slot {slot} to {new}", timeout_s)
        return old, new

    def crash_primary(self, slot: int, timeout_s: float = 60.0) -> tuple[int, int]:
        """SIGKILL ``slot``'s primary; wait until the cluster has promoted its replica on its own
        (the other primaries flag the dead one failed after ``node_timeout_ms`` and vote) and
        every live node names it; then start the killed node again — empty (no persistence),
        with its node id and config file — and wait until it has rejoined as the new primary's
        replica with its link up. Until then the new primary has no replica (what ``WAIT``
        waits for). Returns (old, new)."""
        old = self.owner_port(slot)
        new = self.replica_of(old)
        proc = self.procs[old]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

        def promoted() -> bool:
            return self._role(new) == "master" and self._agreed(slot, new)

        self._wait(promoted, f"the cluster to promote {new} for slot {slot}", timeout_s)
        self._spawn(old)

        def rejoined() -> bool:
            info = self._info(old, "replication")
            return (
                info.get("role") == "slave"
                and int(info.get("master_port", 0)) == new
                and info.get("master_link_status") == "up"
                and self._agreed(slot, new)
            )

        self._wait(rejoined, f"{old} to rejoin as {new}'s replica", timeout_s)
        return old, new

    def migrate_slot(self, slot: int, to_port: int, timeout_s: float = 60.0) -> int:
        """Move ``slot`` (and every key in it) to the primary on ``to_port``; returns how many
        keys moved. Writes to the slot meanwhile get ASK/TRYAGAIN (tokenfleet waits them out)."""
        src = self.owner_port(slot)
        if src == to_port:
            raise ValueError(f"slot {slot} is already on {to_port}")
        src_id, dst_id = self._node_id(src), self._node_id(to_port)
        moved = 0
        with redis.Redis(port=src, socket_timeout=30) as s, redis.Redis(port=to_port) as d:
            d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            while keys := s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 200):
                s.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 10_000, "KEYS", *keys)
                moved += len(keys)
            d.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
            s.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        for port in self.ports:  # the other primaries learn it now rather than by gossip
            if port not in (src, to_port) and self._role(port) == "master":
                with redis.Redis(port=port, socket_timeout=5) as c:
                    c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        self._wait(lambda: self._agreed(slot, to_port), f"slot {slot} on {to_port}", timeout_s)
        return moved

    def primaries(self) -> list[int]:
        """Ports of the nodes that are primaries now."""
        return [p for p in self.ports if self._role(p) == "master"]

    def stop(self) -> None:
        """Kill every process and remove the folder."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def logs(self, num_chars: int = 2000) -> str:
        parts = []
        for path in sorted(self.dir.glob("*.log")):
            parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-num_chars:])
        return "\n".join(parts)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ------------------------------------------------------------------------------
    def _spawn(self, port: int) -> None:
        node_dir = self.dir / f"node-{port}"
        node_dir.mkdir(exist_ok=True)  # a node started again keeps its nodes.conf (its identity)
        args = [str(self.binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(node_dir), "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms)]  # fmt: skip
        with open(self.dir / f"{port}.log", "ab") as log:  # the child keeps its own descriptor
            self.procs[port] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def _settled(self) -> bool:
        for port in self.ports:
            info = self._cluster_info(port)
            if info.get("cluster_state") != "ok" or info.get("cluster_known_nodes") != str(
                len(self.ports)
            ):
                return False
        replicas = [p for p in self.ports if self._role(p) == "slave"]
        return len(replicas) == self.num_primaries and all(
            self._info(p, "replication").get("master_link_status") == "up" for p in replicas
        )

    def _agreed(self, slot: int, port: int) -> bool:
        live = [p for p in self.ports if self.procs[p].poll() is None]
        return all(self._owner_by(p, slot) == port for p in live) and all(
            self._cluster_info(p).get("cluster_state") == "ok" for p in live
        )

    def _owner_by(self, port: int, slot: int) -> int | None:
        try:
            with redis.Redis(port=port, socket_timeout=1) as c:
                conn = c.connection_pool.get_connection()
                try:
                    conn.send_command("CLUSTER", "SLOTS")
                    owner, _ = owner_in(conn.read_response(), slot, ("127.0.0.1", port))
                finally:
                    c.connection_pool.release(conn)
        except redis.RedisError:
            return None
        return owner[1] if owner else None

    def _node_id(self, port: int) -> str:
        with redis.Redis(port=port, socket_timeout=5) as c:
            return str(c.execute_command("CLUSTER", "MYID").decode())

    def _ping(self, port: int) -> bool:
        try:
            with redis.Redis(port=port, socket_timeout=1) as c:
                return bool(c.ping())
        except redis.RedisError:
            return False

    def _role(self, port: int) -> str:
        return str(self._info(port, "replication").get("role", ""))

    def _info(self, port: int, section: str) -> dict[str, Any]:
        try:
            with redis.Redis(port=port, socket_timeout=1) as c:
                return dict(c.info(section))
        except redis.RedisError:
            return {}

    def _cluster_info(self, port: int) -> dict[str, str]:
        try:
            with redis.Redis(port=port, socket_timeout=1) as c:
                text = c.execute_command("CLUSTER", "INFO")
        except redis.RedisError:
            return {}
        text = text.decode() if isinstance(text, bytes) else str(text)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def _wait(self, predicate: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for port, proc in self.procs.items():
                if proc.poll() is not None and proc.returncode != -signal.SIGKILL:
                    raise RuntimeError(f"redis node on {port} exited:\n{self.logs()}")
            if predicate():
                return
            time.sleep(0.05)
        raise RuntimeError(f"timed out waiting for {what} after {timeout_s}s:\n{self.logs()}")
