"""kvshuttle's services beside a running vLLM pair, on one machine: a registry, a router, one
agent per engine and the gateway, each its own process (as in production), logs in one folder.

Authentication is on, as it should be everywhere: every caller has its own bearer token (files
under `work_dir/tokens/`, fresh per stack), each service knows the identities that may call it,
and an agent may act only for its own node. `stack.admin_metadata` is the admin's, for tests and
tools that call the services directly.

    with VllmPair(model_dir) as pair, KvshuttleStack(pair, work_dir=...) as stack:
        stack.gateway_url  # OpenAI-compatible, conversation-aware

The pair is anything shaped like `VllmPair` (`EnginePair`, deploy/local/engine_pair.py): real
vLLM, or the stand-in engines of bench/emulator/http/launcher.py (no model); with stand-ins and pools,
run `agent_module="bench.emulator.http.agent"` with `pool_regions=1`.

The registry keeps its state in memory (the default) or, with `registry_store="redis"`, in a
`redis-server` the stack starts first on loopback (deploy/local/redis.py: its own port and
directory under `work_dir/redis`, AOF on) and stops last; `stack.redis` is that server
(`stack.kill("redis")` / `stack.restart("redis")` crash and restart it on its AOF).

Replicas: `registry_replicas=N` (Redis store only: the replicas share its state) and
`router_replicas=M` start N registry and M router processes, named `registry-0`, ... and
`router-0`, ... (one replica keeps the plain name, "registry" / "router"). The routers and the
gateway call the comma-list of every replica of the service they call (client-side round robin
with failover, kvshuttle.client.channel), the agents too: any replica takes their KV events (the
block index is fed to every replica from one Redis stream). The routers share
one turn-signing key, so any replica commits a turn another planned. `stack.registry` /
`stack.router` and `registry_addr` / `router_addr` are the first replica's.

With `otlp_endpoint` ("http://host:4317") every service exports its spans to that OTLP/gRPC
collector (TELEMETRY__OTLP_ENDPOINT); start the engines with the same endpoint (`VllmPair`'s
`otlp_traces_endpoint`) and a turn is one trace, engines included (docs/operations/tracing.md).

Used by `make demo`, the end-to-end tests and bench/e2e_vllm.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

import grpc

from deploy.local.engine_pair import Engine, EnginePair
from deploy.local.models import kv_bytes_per_token as model_kv_bytes_per_token
from deploy.local.models import model_facts
from deploy.local.processes import free_ports
from deploy.local.redis import RedisServer
from deploy.local.services import Service, grpc_ready, http_ready, prefixed, registry_service
from deploy.local.tokens import Tokens
from kvshuttle.registry.v1 import registry_service_pb2 as rpb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as rpb_grpc

HOST = "127.0.0.1"
Progress = Callable[[str], None]
RegistryStore = Literal["memory", "redis"]
REGISTRY_STORES: tuple[RegistryStore, ...] = ("memory", "redis")
_T = TypeVar("_T")


def _quiet(_: str) -> None:
    pass


class KvshuttleStack:
    def __init__(
        self,
        pair: EnginePair,
        *,
        work_dir: Path,
        profile: Mapping[str, Any],
        served_model_name: str = "m",
        block_size: int = 32,
        decoder_kv_blocks_ttl: float = 480.0,
        pool_bytes: int = 0,
        progress: Progress = _quiet,
        extra_env: Mapping[str, Mapping[str, str]] | None = None,
        registry_store: RegistryStore = "memory",
        registry_replicas: int = 1,
        router_replicas: int = 1,
        kv_bytes_per_token: int | None = None,
        pool_regions: int | None = None,
        agent_module: str = "kvshuttle.agent.main",
        gateway_port: int | None = None,
        otlp_endpoint: str | None = None,
    ) -> None:
        _check_topology(registry_store, registry_replicas, router_replicas)
        self.pair = pair
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        self.model = served_model_name
        self.block_size = block_size
        # The engines' KV per token: the model's own (float32, as the local launcher runs it),
        # or the one given (an emulated cluster's profile: its model_dir holds only a tokenizer).
        self.kv_bytes_per_token = kv_bytes_per_token or model_kv_bytes_per_token(
            pair.model_dir, dtype="float32"
        )
        # Each agent's DRAM pool for parked and prefetched KV (0: none), in the engine's layout:
        # one NIXL region per attention layer (or `pool_regions`: stand-ins have one).
        # What runs beside each engine: kvshuttle's agent, or with stand-in engines and pools
        # bench.emulator.http.agent (its pool's KV moved over the stand-ins' side channel, not NIXL).
        self.pool_bytes, self._agent_module = pool_bytes, agent_module
        self._pool_regions = (
            (pool_regions or model_facts(pair.model_dir, dtype="float32").layers) if pool_bytes else 0
        )
        # The tenth: the Redis store's server, if any; then each further replica's listen and
        # metrics ports, then the agents' beyond two (one call, so no port is drawn twice).
        engines = len(pair.engines)
        ports = free_ports(
            10 + 2 * (registry_replicas - 1) + 2 * (router_replicas - 1) + 2 * max(0, engines - 2)
        )
        more = iter(ports[10:])
        registry_ports = _replica_ports(ports[0], registry_replicas, more)
        router_ports = _replica_ports(ports[1], router_replicas, more)
        registry_metrics = _replica_ports(ports[5], registry_replicas, more)
        router_metrics = _replica_ports(ports[6], router_replicas, more)
        self.registry_addrs = tuple(f"{HOST}:{port}" for port in registry_ports)
        self.router_addrs = tuple(f"{HOST}:{port}" for port in router_ports)
        self.registry_addr = self.registry_addrs[0]
        self.router_addr = self.router_addrs[0]
        # A fixed gateway port (make up's GATEWAY_PORT) keeps the URL a user copied valid.
        self.gateway_url = f"http://{HOST}:{gateway_port or ports[2]}"
        # The gateway's HMAC key of the tenants' vLLM cache salts (tests derive a tenant's salt).
        self.cache_salt_key = os.urandom(24).hex()
        agent_ports = (ports[3], ports[4], *(next(more) for _ in range(engines - 2)))[:engines]
        self.agent_addrs = tuple(f"{HOST}:{port}" for port in agent_ports)
        registry_names = _replica_names("registry", registry_replicas)
        router_names = _replica_names("router", router_replicas)
        self.metrics_ports = dict(zip(registry_names, registry_metrics, strict=True)) | dict(
            zip(router_names, router_metrics, strict=True)
        )
        self.agent_metrics_ports = (ports[7], ports[8], *(next(more) for _ in range(engines - 2)))[:engines]
        extra = extra_env or {}
        self._telemetry = log = {"TELEMETRY__LOG_FORMAT": "json"} | (
            {"TELEMETRY__OTLP_ENDPOINT": otlp_endpoint} if otlp_endpoint else {}
        )
        self._tokens = Tokens(self.work_dir / "tokens")
        agent_ids = {engine.name: f"agent-{engine.name}" for engine in pair.engines}
        registry_auth = self._tokens.auth(
            {"router": {"role": "router"}, "admin": {"role": "admin"}}
            | {ident: {"role": "agent", "node": f"nodes/{name}"} for name, ident in agent_ids.items()}
        )
        router_auth = self._tokens.auth(
            {"gateway": {"role": "gateway", "tenants": ["*"]}, "admin": {"role": "admin"}}
        )
        self._agent_auth = self._tokens.auth({"router": {"role": "router"}, "admin": {"role": "admin"}})
        self._agent_ids = agent_ids
        self.registry_store = registry_store
        # With the Redis store: the server the registry keeps its state in (started first),
        # fresh for every stack as the tokens are (a previous run's AOF is removed).
        self.redis: RedisServer | None = None
        if registry_store == "redis":
            shutil.rmtree(self.work_dir / "redis", ignore_errors=True)
            self.redis = RedisServer(self.work_dir / "redis", port=ports[9])
        self.registries = tuple(
            registry_service(
                listen=addr,
                log_dir=self.work_dir,
                auth=registry_auth,
                metrics_listen=f"{HOST}:{metrics}",
                redis_url=None if self.redis is None else self.redis.url,
                extra={**log, **extra.get("registry", {})},
                name=name,
            )
            for name, addr, metrics in zip(registry_names, self.registry_addrs, registry_metrics, strict=True)
        )
        self.registry = self.registries[0]
        # Shared by the replicas: a turn planned by one is committed or aborted by any.
        turn_signing_key = os.urandom(24).hex()
        self.routers = tuple(
            self._router(name, addr, metrics, profile, turn_signing_key, decoder_kv_blocks_ttl, router_auth,
                         {**log, **extra.get("router", {})})
            for name, addr, metrics in zip(router_names, self.router_addrs, router_metrics, strict=True)
        )  # fmt: skip
        self.router = self.routers[0]
        self.gateway = Service("gateway", "kvshuttle.gateway.main", prefixed("KVSHUTTLE_GATEWAY_", {
            **log, "LISTEN": self.gateway_url.removeprefix("http://"),
            "ROUTER__ADDRESS": ",".join(self.router_addrs),
            "ROUTER__TOKEN_FILE": str(self._tokens.file("gateway")), "CACHE_SALT_KEY": self.cache_salt_key,
            # The test models' template and added tokens are Hermes-style (deploy/vllm/make_model.py).
            "MODELS": json.dumps(
                {served_model_name: {"tokenizer": str(pair.model_dir), "tool_call_parser": "hermes"}}
            ),
            **extra.get("gateway", {})}),
            self.work_dir)  # fmt: skip
        self._agent_extra = dict(extra.get("agent", {}))
        self.agents = self._agents(self._agent_extra)

    def _router(
        self,
        name: str,
        listen: str,
        metrics_port: int,
        profile: Mapping[str, Any],
        turn_signing_key: str,
        decoder_kv_blocks_ttl: float,
        auth: Mapping[str, str],
        extra: Mapping[str, str],
    ) -> Service:
        return Service(
            name,
            "kvshuttle.router.main",
            prefixed(
                "KVSHUTTLE_ROUTER_",
                {
                    "SERVER__LISTEN": listen,
                    "REGISTRY__ADDRESS": ",".join(self.registry_addrs),
                    "REGISTRY__TOKEN_FILE": str(self._tokens.file("router")),
                    # The router orders the agents' NIXL moves (park, prefetch) with its own token.
                    "AGENTS__TOKEN_FILE": str(self._tokens.file("router")),
                    "PROFILES": json.dumps([dict(profile)]),
                    "TURN_SIGNING_KEY": turn_signing_key,
                    "POLICY__DECODER_KV_BLOCKS_TTL_S": str(decoder_kv_blocks_ttl),
                    "TELEMETRY__METRICS_LISTEN": f"{HOST}:{metrics_port}",
                    **auth,
                    **extra,
                },
            ),
            self.work_dir,
        )

    def _agents(self, extra: Mapping[str, str]) -> tuple[Service, ...]:
        def agent(engine: Engine, listen: str, metrics_port: int, registry: str) -> Service:
            host, side_port = engine.side_channel
            return Service(f"agent-{engine.name}", self._agent_module, prefixed("KVSHUTTLE_AGENT_", {
                **self._telemetry, "SERVER__LISTEN": listen,
                "TELEMETRY__METRICS_LISTEN": f"{HOST}:{metrics_port}",
                "REGISTRY__ADDRESS": registry, "NODE__NAME": f"nodes/{engine.name}",
                "REGISTRY__TOKEN_FILE": str(self._tokens.file(self._agent_ids[engine.name])),
                **self._agent_auth,
                "NODE__ROLE": engine.spec.role, "NODE__ENGINE_ID": engine.engine_id,
                "NODE__HTTP_ENDPOINT": engine.url, "NODE__MODEL": self.model,
                "NODE__BLOCK_SIZE": str(self.block_size),
                "NODE__KV_BYTES_PER_TOKEN": str(self.kv_bytes_per_token),
                "NODE__SIDE_CHANNEL_HOST": host, "NODE__SIDE_CHANNEL_PORT": str(side_port),
                "EVENTS__ENDPOINT": engine.events_endpoint, "EVENTS__REPLAY_ENDPOINT": engine.replay_endpoint,
                "EVENTS__TOPIC": "kv-events", "LEASE__TTL": "10", "LEASE__HEARTBEAT_INTERVAL": "1",
                "ENGINE__POLL_INTERVAL": "0.5", **self._pool_env(), **extra}), self.work_dir)  # fmt: skip

        registries = ",".join(self.registry_addrs)
        return tuple(
            agent(engine, listen, metrics, registries)
            for engine, listen, metrics in zip(
                self.pair.engines, self.agent_addrs, self.agent_metrics_ports, strict=True
            )
        )

    def _pool_env(self) -> dict[str, str]:
        if not self.pool_bytes:
            return {}
        return {
            "POOL__SIZE_BYTES": str(self.pool_bytes),
            "POOL__REGIONS": str(self._pool_regions),
            "POOL__SERVE_HOST": HOST,
            "POOL__SERVE_PORT": "0",
        }

    def token_file(self, identity: str) -> Path:
        """The bearer token file of `identity` ("gateway", "admin"): for the clients a test starts
        beside the stack (an endpoint picker, a decode-side sidecar)."""
        return self._tokens.file(identity)

    @property
    def admin_metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata that authenticates as the stack's admin (every service accepts it)."""
        return (("authorization", f"Bearer {self._tokens.token('admin')}"),)

    @property
    def admin_token_file(self) -> Path:
        """The file holding the admin's bearer token (`kvshuttle --token-file`)."""
        return self._tokens.file("admin").resolve()

    def retention_holder(self, conversation: str) -> str:
        """The node holding the conversation's retained KV now (`conversation`: its full name,
        tenants/{t}/conversations/{c}); "" when it holds none or the registry knows no such
        conversation (its first commit is not stored yet)."""
        got = self.conversation(conversation)
        return got.retention.node if got is not None and got.HasField("retention") else ""

    def conversation(self, name: str) -> rpb.Conversation | None:
        """The registry's record of conversation `name` (its fence and live retention, if any);
        None when it knows no such conversation. Asks the replicas in turn until one answers."""
        try:
            got = self._on_a_registry(
                lambda stub: stub.GetConversation(
                    rpb.GetConversationRequest(name=name), timeout=5, metadata=self.admin_metadata
                )
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return got.conversation

    def _on_a_registry(self, call: Callable[[rpb_grpc.RegistryServiceStub], _T]) -> _T:
        """`call` on the first registry replica that is up (UNAVAILABLE: the next one)."""
        for i, addr in enumerate(self.registry_addrs):
            with grpc.insecure_channel(addr) as channel:
                try:
                    return call(rpb_grpc.RegistryServiceStub(channel))
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.UNAVAILABLE or i == len(self.registry_addrs) - 1:
                        raise
        raise AssertionError("unreachable: registry_addrs is never empty")

    @property
    def services(self) -> list[Service]:
        return [*self.registries, *self.routers, *self.agents, self.gateway]

    def service(self, name: str) -> Service:
        """The service called `name`: "registry", "router", "gateway", "agent-prefill", ...
        (with replicas: "registry-0", "router-1", ...)."""
        for service in self.services:
            if service.name == name:
                return service
        raise KeyError(f"no service {name!r}: {[s.name for s in self.services]}")

    def _process(self, name: str) -> Service | RedisServer:
        if name == "redis" and self.redis is not None:
            return self.redis
        return self.service(name)

    def kill(self, name: str) -> None:
        """SIGKILL one service (see Service.kill), or "redis" (the Redis store's server); it
        stays down until restarted."""
        self.progress(f"killing {name}")
        self._process(name).kill()

    def restart(self, name: str) -> None:
        """SIGKILL one service and start it again on the same port; returns at once (the
        caller decides what ready means: wait_ready() for everything). "redis" restarts the
        Redis store's server on its AOF and returns once it answers PING."""
        self.progress(f"restarting {name}")
        self._process(name).restart()

    def start(self, timeout: float = 120.0) -> None:
        try:
            if self.redis is not None:
                self.progress(f"starting {self.redis.describe()}")
                self.redis.start()
            for service in self.services:
                self.progress(f"starting {service.name}")
                service.start()
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until every service answers and every engine's node is registered and healthy."""
        deadline = time.monotonic() + timeout
        replicas = zip(self.registries + self.routers, self.registry_addrs + self.router_addrs, strict=True)
        pending = {service.name: addr for service, addr in replicas}
        while time.monotonic() < deadline:
            if self.redis is not None:
                self.redis.check()
            for service in self.services:
                service.check()
            pending = {name: addr for name, addr in pending.items() if not grpc_ready(addr)}
            if not pending and http_ready(f"{self.gateway_url}/health") and self._nodes_ready():
                self.progress(f"kvshuttle is up: {', '.join(s.name for s in self.services)}")
                return
            time.sleep(0.2)
        raise TimeoutError(f"kvshuttle services not ready in {timeout:.0f} s; logs in {self.work_dir}")

    def _nodes_ready(self) -> bool:
        try:
            nodes = self._on_a_registry(
                lambda stub: (
                    stub.ListNodes(rpb.ListNodesRequest(), timeout=2, metadata=self.admin_metadata).nodes
                )
            )
        except grpc.RpcError:
            return False
        engines = {engine.engine_id for engine in self.pair.engines}
        healthy = {n.engine_id for n in nodes if n.load.engine_healthy} >= engines
        # With pools, each agent's pool registers as a node of its own once it serves.
        pools = {f"nodes/{e.name}-pool" for e in self.pair.engines} if self.pool_bytes else set()
        return healthy and {n.name for n in nodes if n.load.engine_healthy} >= pools

    def restart_agents(self, timeout: float = 60.0) -> None:
        """After `pair.restart()` (new engine ids and ports), agents that follow the new engines."""
        for agent in self.agents:
            agent.stop()
        self.agents = self._agents(self._agent_extra)
        for agent in self.agents:
            agent.start()
        self.wait_ready(timeout)

    def stop(self) -> dict[str, int | None]:
        """Stops everything, gateway first and the Redis server (if any) last; returns each
        one's exit code. A stop that fails does not keep the others running: the first such
        error is raised after all were stopped."""
        codes: dict[str, int | None] = {}
        errors: list[Exception] = []
        stops: list[tuple[str, Callable[[], int | None]]] = [
            (s.name, s.stop) for s in reversed(self.services)
        ]
        if self.redis is not None:
            stops.append(("redis", self.redis.stop))
        for name, stop in stops:
            try:
                codes[name] = stop()
            except Exception as exc:  # stop the rest regardless
                errors.append(exc)
        if errors:
            raise errors[0]
        return codes

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _check_topology(store: str, registry_replicas: int, router_replicas: int) -> None:
    if store not in REGISTRY_STORES:
        raise ValueError(f"registry_store must be one of {REGISTRY_STORES}, not {store!r}")
    if registry_replicas < 1 or router_replicas < 1:
        raise ValueError("registry_replicas and router_replicas must be at least 1")
    if registry_replicas > 1 and store != "redis":
        raise ValueError("registry replicas share their state through Redis: set registry_store='redis'")


def _replica_ports(first: int, replicas: int, more: Iterator[int]) -> tuple[int, ...]:
    return (first, *(next(more) for _ in range(replicas - 1)))


def _replica_names(service: str, replicas: int) -> list[str]:
    return [service] if replicas == 1 else [f"{service}-{i}" for i in range(replicas)]
