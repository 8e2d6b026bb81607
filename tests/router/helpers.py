"""A registry and router servers on 127.0.0.1 port 0, wired as in production: the router
reaches the registry over gRPC through GrpcRegistryPort, on the registry's fake clock."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from tests.support.registry_env import RegistryEnv

from kvshuttle.client import RegistryClient, RouterClient
from kvshuttle.client.channel import ChannelOptions
from kvshuttle.client.settings import ServiceConnection
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.config import RouterSettings
from kvshuttle.router.cost import load_profiles
from kvshuttle.router.grpc.registry_port import GrpcRegistryPort
from kvshuttle.router.main import build_router, build_server, connect_registry
from kvshuttle.router.policy import PlacementWeights, RouterPolicy
from kvshuttle.router.router import Router
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.serving.server import GrpcServer
from kvshuttle.serving.settings import ServerSettings
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import BlockIdList, KvTransferParams

PROFILES = Path(__file__).resolve().parents[2] / "deploy" / "profiles" / "qwen3-32b-h200.toml"
QWEN = load_profiles(PROFILES)[0]
MODEL = QWEN.model
BS = 16
KEY = "shared-turn-key-" * 2
CONV = "tenants/t/conversations/c"


def seconds(s: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(round(s * 1e9))
    return d


COMMIT_REGISTRY_TIMEOUT_S = 30.0


# These tests name the node a turn lands on: exact ties go to the first name, no draws (placement's
# own draws among near-ties are tests/router/test_placement.py's).
TIES_BY_NAME = PlacementWeights(near_tie_ms=0.0, near_tie_fraction=0.0, near_tie_requests=0.0)


def settings(registry_address: str, key: str = KEY, **policy: Any) -> RouterSettings:
    return RouterSettings(
        server=ServerSettings(listen="127.0.0.1:0", grace_seconds=1),
        registry=ServiceConnection(address=registry_address),
        profiles_file=PROFILES,
        turn_signing_key=SecretStr(key),
        # The node list is re-read on every plan unless a test says otherwise: a lapsed node
        # shows at once. A commit's registry calls get COMMIT_REGISTRY_TIMEOUT_S, not the
        # router's 1 s: the flake hunt beside make demo saw a PutRetention take longer, the commit
        # store nothing (commit.not_stored REGISTRY_UNAVAILABLE, as designed) and the next turn
        # recompute where the test expected reuse. The 1 s bound itself is test_degraded's and
        # test_caller_gone's (0.05 s there).
        policy=RouterPolicy(
            **{
                "node_max_age_s": 0.0,
                "commit_registry_timeout_s": COMMIT_REGISTRY_TIMEOUT_S,
                "weights": TIES_BY_NAME,
                **policy,
            }
        ),
    )


@dataclass
class RouterEnv:
    router: Router
    server: GrpcServer
    registry_client: RegistryClient
    client: RouterClient
    metrics: CollectorRegistry

    async def close(self) -> None:
        await self.client.close()
        await self.server.stop()
        await self.registry_client.close()


async def start_router(
    registry: RegistryEnv,
    *,
    key: str = KEY,
    tracer_provider: TracerProvider | None = None,
    client_tracing: TracerProvider | None = None,
    **policy: Any,
) -> RouterEnv:
    """A router server over `registry`. With `tracer_provider`, its server, domain and registry
    calls trace there; `client_tracing` traces the test's own calls (the gateway's side)."""
    config = settings(registry.address, key, **policy)
    if tracer_provider is not None:
        registry_client = connect_registry(config, tracer_provider)
    else:
        registry_client = RegistryClient.connect(config.registry.channel_options())
    metrics = CollectorRegistry()
    router = build_router(
        config, GrpcRegistryPort(registry_client), registry.clock, metrics, tracer_provider=tracer_provider
    )
    server = build_server(config, router, metrics, tracer_provider=tracer_provider)
    port = await server.start()
    client = RouterClient.connect(ChannelOptions(f"127.0.0.1:{port}", tracer_provider=client_tracing))
    return RouterEnv(router, server, registry_client, client, metrics)


def node(name: str, role: reg_pb.NodeRole.ValueType) -> reg_pb.Node:
    short = name.removeprefix("nodes/")
    return reg_pb.Node(
        name=name,
        role=role,
        engine_id=f"engine-{short}",
        http_endpoint=f"http://{short}:8000",
        side_channel_host="127.0.0.1",
        side_channel_port=5600,
        model=MODEL,
        block_size=BS,
        kv_bytes_per_token=QWEN.kv_bytes_per_token,
    )


async def add_node(
    registry: RegistryEnv, name: str, role: reg_pb.NodeRole.ValueType, *, ttl: float = 300
) -> int:
    """Register a node and report its engine healthy; returns the incarnation."""
    registered = await registry.stub.RegisterNode(
        reg_pb.RegisterNodeRequest(node=node(name, role), ttl=seconds(ttl))
    )
    incarnation = registered.node.incarnation
    await heartbeat(registry, name, incarnation, ttl=ttl)
    return incarnation


async def heartbeat(
    registry: RegistryEnv, name: str, incarnation: int, *, ttl: float = 300, healthy: bool = True
) -> None:
    await registry.stub.HeartbeatNode(
        reg_pb.HeartbeatNodeRequest(
            name=name,
            incarnation=incarnation,
            ttl=seconds(ttl),
            load=reg_pb.NodeLoad(engine_healthy=healthy),
        )
    )


@dataclass
class Tokens:
    rng: random.Random = field(default_factory=lambda: random.Random(11))
    block_ids: Any = field(default_factory=lambda: iter(range(1, 10**9)))

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 150_000) for _ in range(n)]

    def decode_params(self, plan: pb.PlanTurnResponse, total_tokens: int) -> KvTransferParams:
        """What decode answers when it keeps the whole sequence (bidirectional KV on)."""
        blocks = -(-total_tokens // BS)
        return KvTransferParams(
            do_remote_decode=True,
            do_remote_prefill=False,
            remote_block_ids=[BlockIdList(block_ids=[next(self.block_ids) for _ in range(blocks)])],
            remote_engine_id=plan.decode.engine_id,
            remote_request_id=f"cmpl-{plan.generation}",
            remote_host="127.0.0.1",
            remote_port=5600,  # the decode node's side channel as registered (node())
            tp_size=1,
            remote_num_tokens=total_tokens,
        )


async def retentions(registry: RegistryEnv, parent: str = "tenants/t") -> list[reg_pb.Retention]:
    response = await registry.stub.ListRetentions(reg_pb.ListRetentionsRequest(parent=parent, page_size=100))
    return list(response.retentions)


async def registry_state(registry: RegistryEnv, conversations: Sequence[str] = (CONV,)) -> Any:
    """Everything a rejected request must leave alone: retentions and fences."""
    fences: list[int | None] = []
    for name in conversations:
        try:
            got = await registry.stub.GetConversation(reg_pb.GetConversationRequest(name=name))
            fences.append(got.conversation.fence_generation)
        except grpc.aio.AioRpcError:  # no fence yet: NOT_FOUND
            fences.append(None)
    return [r.SerializeToString(deterministic=True) for r in await retentions(registry)], fences
