"""Replicated Redis for the failover tests: a Sentinel group (a master, its replicas, three
Sentinels) and a Cluster with a replica per master, each process on 127.0.0.1 with its own port
and directory, AOF on, all SIGKILLed on the way out whatever happened. Without a `redis-server`
binary (or `redis-cli`, for the Cluster) the caller skips, unless KVSHUTTLE_REQUIRE_REDIS is set."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from tests.support.redis_server import RedisServer, free_cluster_port, free_port, redis_binary, redis_cli

SERVICE = "kvmaster"
# What the failover tests run every data node with: AOF, so a restarted node has its writes.
AOF = ("--save", "", "--appendonly", "yes", "--appendfsync", "everysec")


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError, OSError):
            if check():
                return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def info(port: int, section: str) -> dict[str, Any]:
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
    try:
        return cast("dict[str, Any]", client.info(section))
    finally:
        client.close()


def in_sync(port: int) -> bool:
    """Whether the replica on `port` has its link to a master up."""
    return info(port, "replication").get("master_link_status") == "up"


class Sentinel:
    """One `redis-server --sentinel` process monitoring SERVICE (its config file its own: a
    Sentinel rewrites it)."""

    def __init__(self, directory: Path, master_port: int, *, quorum: int, down_after_ms: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.conf = directory / "sentinel.conf"
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {directory}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} {quorum}\n"
            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
            # Small: a failover not done by then is retried (at twice this) by another leader.
            f"sentinel failover-timeout {SERVICE} 4000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        self._proc = subprocess.Popen(
            [redis_binary(), str(self.conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=directory,
        )

    def ask(self, *args: str) -> Any:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
        try:
            return client.execute_command(*args)  # type: ignore[no-untyped-call]
        finally:
            client.close()

    def master_port(self) -> int:
        _, port = self.ask("SENTINEL", "get-master-addr-by-name", SERVICE)
        return int(port)

    def kill(self) -> None:
        self._proc.kill()
        self._proc.wait()


class SentinelGroup:
    """A master, `replicas` replicas (`replicaof`) and `sentinels` Sentinels (quorum `quorum`),
    up once every Sentinel sees the master, every replica in sync and the other Sentinels."""

    def __init__(
        self,
        stack: contextlib.ExitStack,
        root: Path,
        *,
        replicas: int = 1,
        sentinels: int = 3,
        quorum: int = 2,
        down_after_ms: int = 1000,
        options: tuple[str, ...] = AOF,
    ) -> None:
        self.master = self._server(stack, root / "master", options)
        self.replicas = [
            self._server(
                stack, root / f"replica{i}", (*options, "--replicaof", "127.0.0.1", str(self.master.port))
            )
            for i in range(replicas)
        ]
        self.sentinels: list[Sentinel] = []
        for i in range(sentinels):
            sentinel = Sentinel(
                root / f"sentinel{i}", self.master.port, quorum=quorum, down_after_ms=down_after_ms
            )
            stack.callback(sentinel.kill)
            self.sentinels.append(sentinel)
        for replica in self.replicas:
            wait_for("a replica in sync", functools.partial(in_sync, replica.port))
        for sentinel in self.sentinels:
            wait_for("a Sentinel to see the group", functools.partial(self._sees_all, sentinel))

    @staticmethod
    def _server(
        stack: contextlib.ExitStack, directory: Path, options: tuple[str, ...], port: int = 0
    ) -> RedisServer:
        directory.mkdir(parents=True)
        server = RedisServer(directory, options)
        server.port = port  # tried first (0: any free port)
        stack.callback(server.kill)
        return server.start()

    def _sees_all(self, sentinel: Sentinel) -> bool:
        state = dict(zip(*[iter(sentinel.ask("SENTINEL", "master", SERVICE))] * 2, strict=True))
        return (
            int(state[b"port"]) == self.master.port
            and int(state[b"num-slaves"]) == len(self.replicas)
            and int(state[b"num-other-sentinels"]) == len(self.sentinels) - 1
        )

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    def master_port(self) -> int:
        """The master's port as the first Sentinel that answers names it."""
        for sentinel in self.sentinels:
            with contextlib.suppress(redis.RedisError, OSError):
                return sentinel.master_port()
        raise AssertionError("no Sentinel answers")

    def promoted_port(self, old: int, timeout: float = 10.0) -> int:
        """The new master's port, once every Sentinel that answers names the same one, not `old`.
        The leader's failover reaches the other Sentinels through its hello messages (every 2 s),
        so right after writes resume on the new master a Sentinel may still name the old one."""
        deadline = time.monotonic() + timeout
        while True:
            named = set()
            for sentinel in self.sentinels:
                with contextlib.suppress(redis.RedisError, OSError):
                    named.add(sentinel.master_port())
            if len(named) == 1 and old not in named:
                return named.pop()
            assert time.monotonic() < deadline, f"the Sentinels name {sorted(named)} {timeout} s on"
            time.sleep(0.1)


@contextlib.contextmanager
def sentinel_group(root: Path, **kwargs: Any) -> Iterator[SentinelGroup]:
    with contextlib.ExitStack() as stack:
        yield SentinelGroup(stack, root, **kwargs)


class ReplicatedCluster:
    """A Redis Cluster of `masters` masters with one replica each (`redis-cli --cluster create
    --cluster-replicas 1`), `cluster-node-timeout` `node_timeout_ms` and
    `cluster-require-full-coverage` `full_coverage`: up once every node says cluster_state:ok and
    every replica is in sync."""

    def __init__(
        self,
        stack: contextlib.ExitStack,
        root: Path,
        *,
        masters: int = 3,
        node_timeout_ms: int = 1000,
        full_coverage: bool = True,
    ) -> None:
        cli = redis_cli()
        options = (
            *AOF,
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            "--cluster-require-full-coverage", "yes" if full_coverage else "no",
        )  # fmt: skip
        self.nodes = [
            SentinelGroup._server(stack, root / f"node{i}", options, free_cluster_port())
            for i in range(2 * masters)
        ]
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )
        for n in self.nodes:
            wait_for("cluster_state:ok", functools.partial(self.state_ok, n.port))
        for n in self.nodes:
            wait_for("every replica in sync", functools.partial(self._settled, n.port))

    @staticmethod
    def state_ok(port: int) -> bool:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
        try:
            return bool(cast("dict[str, Any]", client.cluster("info"))["cluster_state"] == "ok")
        finally:
            client.close()

    @staticmethod
    def _settled(port: int) -> bool:
        replication = info(port, "replication")
        return replication["role"] == "master" or replication.get("master_link_status") == "up"

    def master_of(self, slot: int, asking: RedisServer) -> int:
        """The port of the master serving `slot`, as the node `asking` sees it."""
        client = redis.Redis(host="127.0.0.1", port=asking.port, socket_timeout=2)
        try:
            ranges = client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
        finally:
            client.close()
        for start, end, master, *_ in ranges:
            if int(start) <= slot <= int(end):
                return int(master[1])
        raise AssertionError(f"slot {slot} is not served")

    def server(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)


@contextlib.contextmanager
def replicated_cluster(root: Path, **kwargs: Any) -> Iterator[ReplicatedCluster]:
    with contextlib.ExitStack() as stack:
        yield ReplicatedCluster(stack, root, **kwargs)


__all__ = [
    "AOF",
    "SERVICE",
    "ReplicatedCluster",
    "Sentinel",
    "SentinelGroup",
    "in_sync",
    "info",
    "redis_cli",
    "replicated_cluster",
    "sentinel_group",
    "wait_for",
]
