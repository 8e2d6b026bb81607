"""kvshuttle's control plane alone, each piece its own process on loopback: a registry (in memory,
or several replicas over one `redis-server`) and several router replicas sharing one turn-signing
key, authentication on as in the stack. No engines and no agents: the caller registers nodes
for its stand-in engines with `register_node` (a long lease, reported healthy once).

    with ControlPlane(work_dir, routers=3) as plane:
        plane.register_node("nodes/p0", "prefill", http_endpoint=url)
        plane.router_addrs       # ["127.0.0.1:p1", ...]; plane.token_file("gateway") for callers
        plane.kill_router(0)     # SIGKILL; plane.restart_router(0) starts it again on its port

Used by tests/deploy/test_router_replicas.py and bench/router_replicas.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import grpc
from google.protobuf.duration_pb2 import Duration
from prometheus_client.parser import text_string_to_metric_families

from deploy.local.processes import free_ports
from deploy.local.redis import RedisServer
from deploy.local.services import Service, grpc_ready, prefixed, registry_service
from deploy.local.stack import HOST, RegistryStore
from deploy.local.tokens import Tokens
from kvshuttle.registry.v1 import registry_service_pb2 as rpb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as rpb_grpc

# Stand-in engines answer at once, so a router's cost model learns that prefill is nearly free
# (its scale bottoms out at 1/8 of the profile) and a real profile's KV read (21 ms fixed) would
# lose to recompute. This one keeps reading cheaper than computing at any learned scale, so the
# reuse decisions stay the subject.
STAND_IN_PROFILE: dict[str, Any] = {
    "model": "Qwen/Qwen3-32B",
    "kv_bytes_per_token": 4096,
    "min_reuse_tokens": 64,
    "prefill": {"fixed_ms": 20.0, "per_token_ms": 0.1, "per_cached_token_ms": 0.001, "per_pair_ns": 0.0},
    "link": {"bandwidth_gb_s": 1000.0, "fixed_ms": 0.5},
}
_ROLES = {"prefill": rpb.NODE_ROLE_PREFILL, "decode": rpb.NODE_ROLE_DECODE}


class ControlPlane:
    def __init__(
        self,
        work_dir: Path,
        *,
        routers: int = 3,
        store: RegistryStore = "memory",
        registry_replicas: int = 1,
        profile: dict[str, Any] = STAND_IN_PROFILE,
        router_env: dict[str, str] | None = None,
    ) -> None:
        if store == "memory" and registry_replicas != 1:
            raise ValueError("registry replicas share state only in Redis: store='redis'")
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        ports = iter(free_ports(1 + registry_replicas + 2 * routers))
        self.redis: RedisServer | None = None
        redis_port = next(ports)
        if store == "redis":
            shutil.rmtree(self.work_dir / "redis", ignore_errors=True)
            self.redis = RedisServer(self.work_dir / "redis", port=redis_port)
        self._tokens = Tokens(self.work_dir / "tokens")
        registry_auth = self._tokens.auth({"router": {"role": "router"}, "admin": {"role": "admin"}})
        router_auth = self._tokens.auth(
            {"gateway": {"role": "gateway", "tenants": ["*"]}, "admin": {"role": "admin"}}
        )
        self.registry_addrs = [f"{HOST}:{next(ports)}" for _ in range(registry_replicas)]
        self.registries = [
            registry_service(
                listen=addr,
                log_dir=self.work_dir,
                auth=registry_auth,
                redis_url=None if self.redis is None else self.redis.url,
                name=f"registry-{i}",
                extra={"TELEMETRY__LOG_FORMAT": "json"},
            )
            for i, addr in enumerate(self.registry_addrs)
        ]
        self.router_addrs = [f"{HOST}:{next(ports)}" for _ in range(routers)]
        self.router_metrics_addrs = [f"{HOST}:{next(ports)}" for _ in range(routers)]
        key = os.urandom(24).hex()  # one key: any replica commits a turn another planned
        self.routers = [
            Service(
                f"router-{i}",
                "kvshuttle.router.main",
                prefixed(
                    "KVSHUTTLE_ROUTER_",
                    {
                        "TELEMETRY__LOG_FORMAT": "json",
                        "SERVER__LISTEN": addr,
                        "TELEMETRY__METRICS_LISTEN": metrics,
                        "REGISTRY__ADDRESS": ",".join(self.registry_addrs),
                        "REGISTRY__TOKEN_FILE": str(self._tokens.file("router")),
                        "PROFILES": json.dumps([profile]),
                        "TURN_SIGNING_KEY": key,
                        **router_auth,
                        **(router_env or {}),
                    },
                ),
                self.work_dir,
            )
            for i, (addr, metrics) in enumerate(
                zip(self.router_addrs, self.router_metrics_addrs, strict=True)
            )
        ]

    @property
    def admin_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self._tokens.token('admin')}"),)

    def token_file(self, identity: str) -> Path:
        """The bearer-token file of "gateway" (the routers' caller) or "admin"."""
        self._tokens.token(identity)
        return self._tokens.file(identity)

    def start(self, timeout: float = 60.0) -> None:
        try:
            if self.redis is not None:
                self.redis.start()
            for service in [*self.registries, *self.routers]:
                service.start()
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        pending = [*self.registry_addrs, *self.router_addrs]
        while pending:
            for service in [*self.registries, *self.routers]:
                service.check()
            pending = [a for a in pending if not grpc_ready(a)]
            if time.monotonic() > deadline:
                raise TimeoutError(f"not serving after {timeout:.0f} s: {pending}; logs in {self.work_dir}")

    def kill_router(self, i: int) -> None:
        """SIGKILL router replica `i` (a crash); it stays down until restart_router."""
        self.routers[i].kill()

    def restart_router(self, i: int, timeout: float = 60.0) -> None:
        self.routers[i].restart()
        deadline = time.monotonic() + timeout
        while not grpc_ready(self.router_addrs[i]):
            self.routers[i].check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"router-{i} not serving after {timeout:.0f} s")

    def register_node(
        self,
        name: str,
        role: Literal["prefill", "decode"],
        *,
        http_endpoint: str,
        model: str,
        engine_id: str = "",
        block_size: int = 16,
        kv_bytes_per_token: int = STAND_IN_PROFILE["kv_bytes_per_token"],
        side_channel_port: int = 5600,
    ) -> None:
        """A node of a stand-in engine, leased for the registry's longest TTL and healthy."""
        node = rpb.Node(
            name=name,
            role=_ROLES[role],
            engine_id=engine_id or f"engine-{name.removeprefix('nodes/')}",
            http_endpoint=http_endpoint,
            side_channel_host=HOST,
            side_channel_port=side_channel_port,
            model=model,
            block_size=block_size,
            kv_bytes_per_token=kv_bytes_per_token,
        )
        ttl = Duration(seconds=300)
        with grpc.insecure_channel(self.registry_addrs[0]) as channel:
            stub = rpb_grpc.RegistryServiceStub(channel)
            got = stub.RegisterNode(
                rpb.RegisterNodeRequest(node=node, ttl=ttl), timeout=10, metadata=self.admin_metadata
            )
            beat = rpb.HeartbeatNodeRequest(
                name=name, incarnation=got.node.incarnation, ttl=ttl, load=rpb.NodeLoad(engine_healthy=True)
            )
            stub.HeartbeatNode(beat, timeout=10, metadata=self.admin_metadata)

    def router_samples(self, i: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Router replica `i`'s metrics: (sample name, sorted labels) -> value."""
        url = f"http://{self.router_metrics_addrs[i]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def router_log(self, i: int) -> list[dict[str, object]]:
        """Router replica `i`'s JSON log lines so far."""
        lines = self.routers[i].log_path.read_text(errors="replace").splitlines()
        return [json.loads(x) for x in lines if x.startswith("{")]

    def stop(self) -> dict[str, int | None]:
        """Routers first, the Redis server (if any) last; each one's exit code."""
        codes = {s.name: s.stop() for s in [*self.routers, *self.registries]}
        if self.redis is not None:
            codes["redis"] = self.redis.stop()
        return codes

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
