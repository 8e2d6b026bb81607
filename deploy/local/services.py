"""One kvshuttle process as the local stacks run it (`Service`), the registry's in particular
(`registry_service`), and the probes that tell when a service answers.

    registry = registry_service(listen=addr, log_dir=work_dir, auth=tokens.auth({...}))
    registry.start()
    while not grpc_ready(addr): ...
    registry.kill()     # SIGKILL, a crash; registry.restart() starts it again on the same port

Settings go in as environment variables (`prefixed("KVSHUTTLE_REGISTRY_", {...})`); the caller's
own KVSHUTTLE_* variables are not passed on. Used by deploy/local/stack.py, control_plane.py, the
tests and the benchmarks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import grpc

from deploy.local.processes import kill_process, stop_process


class Service:
    """One kvshuttle process: started with its environment, stopped with SIGTERM; `kill` and
    `restart` end it with SIGKILL (a crash), `restart` then starts it again as it was (the same
    environment, so the same listen port; its log continues)."""

    def __init__(self, name: str, module: str, env: Mapping[str, str], log_dir: Path) -> None:
        self.name = name
        self.module = module
        self.env = dict(env)
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("KVSHUTTLE_")}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module], env=base | self.env,
                                     stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log tail:\n{tail}")

    def kill(self) -> None:
        """SIGKILL: no drain, nothing said to anyone, as a crash or an OOM kill ends it."""
        kill_process(self.proc)

    def restart(self) -> None:
        """SIGKILL, then start again with the same environment."""
        self.kill()
        self.start()

    def stop(self, timeout: float = 15.0) -> int | None:
        return stop_process(self.proc, timeout)


def registry_service(
    *,
    listen: str,
    log_dir: Path,
    auth: Mapping[str, str],
    metrics_listen: str = "",
    redis_url: str | None = None,
    extra: Mapping[str, str] | None = None,
    name: str = "registry",
) -> Service:
    """The registry process as the stack runs it: listening on `listen`, accepting the
    identities of `auth` (`Tokens.auth`), its state in memory or, with `redis_url`, in Redis
    (KVSHUTTLE_REGISTRY_STORE=redis). `extra`: more KVSHUTTLE_REGISTRY_* settings, unprefixed."""
    store = {"STORE": "memory"} if redis_url is None else {"STORE": "redis", "REDIS__URL": redis_url}
    env = {
        "SERVER__LISTEN": listen,
        "TELEMETRY__METRICS_LISTEN": metrics_listen,
        **store,
        **auth,
        **(extra or {}),
    }
    return Service(name, "kvshuttle.registry.main", prefixed("KVSHUTTLE_REGISTRY_", env), log_dir)


def prefixed(prefix: str, env: Mapping[str, str]) -> dict[str, str]:
    """`env` as a service reads it: every key under its settings' prefix (KVSHUTTLE_ROUTER_...)."""
    return {f"{prefix}{key}": value for key, value in env.items()}


def grpc_ready(addr: str) -> bool:
    """True when a gRPC server answers at `addr` (waits up to half a second)."""
    with grpc.insecure_channel(addr) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=0.5)
        except grpc.FutureTimeoutError:
            return False
    return True


def http_ready(url: str) -> bool:
    """True when `url` answers 200 within a second."""
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False
