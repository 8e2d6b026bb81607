"""Every role against every RegistryService RPC on a real server with tokens: allowed calls get
past authorization (whatever the domain then answers), refused ones are PERMISSION_DENIED with
the reason, counted, and change nothing; no identity is UNAUTHENTICATED."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from tests.auth.helpers import ROLES, auth_settings, bearer, denial, token
from tests.support.cli_runner import arun_cli
from tests.support.clock import FakeClock
from tests.support.registry_messages import CONV, node, retention, seconds

from kvshuttle.cli.main import TOKEN_FILE_ENV
from kvshuttle.core.nodes import POOL_OF_LABEL
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.config import RegistrySettings
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.main import build_server
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc
from kvshuttle.serving.settings import ServerSettings

RETENTION = f"{CONV}/retentions/1"

# RPC -> (request, the roles the spec allows). The requests name the agent's own node.
MATRIX: dict[str, tuple[Callable[[], Any], set[str]]] = {
    "RegisterNode": (lambda: pb.RegisterNodeRequest(node=node(), ttl=seconds(30)), {"agent-d0", "admin"}),
    "HeartbeatNode": (lambda: pb.HeartbeatNodeRequest(name="nodes/d0", incarnation=1), {"agent-d0", "admin"}),
    "ReportBlockEvents": (
        lambda: pb.ReportBlockEventsRequest(node="nodes/d0", incarnation=1),
        {"agent-d0", "admin"},
    ),
    "GetNode": (lambda: pb.GetNodeRequest(name="nodes/d0"), {"router", "admin", "viewer"}),
    "ListNodes": (pb.ListNodesRequest, {"router", "admin", "viewer"}),
    "LookupBlocks": (
        lambda: pb.LookupBlocksRequest(block_hashes=[1, 2], model="m"),
        {"router", "admin", "viewer"},
    ),
    "PutRetention": (
        lambda: pb.PutRetentionRequest(parent=CONV, retention=retention(7), ttl=seconds(30)),
        {"router", "admin"},
    ),
    "GetRetention": (lambda: pb.GetRetentionRequest(name=RETENTION), {"router", "admin", "viewer"}),
    "GetConversation": (lambda: pb.GetConversationRequest(name=CONV), {"router", "admin", "viewer"}),
    "RenewRetention": (
        lambda: pb.RenewRetentionRequest(name=RETENTION, ttl=seconds(30)),
        {"router", "admin"},
    ),
    "ListRetentions": (
        lambda: pb.ListRetentionsRequest(parent="tenants/acme"),
        {"router", "admin", "viewer"},
    ),
    "ClaimRetention": (
        lambda: pb.ClaimRetentionRequest(name=f"{CONV}/retentions/9", holder="t", claim_ttl=seconds(5)),
        {"router", "admin"},
    ),
    "ReleaseRetention": (
        lambda: pb.ReleaseRetentionRequest(name=f"{CONV}/retentions/9", claim_id="x"),
        {"router", "admin"},
    ),
    "ForceRelease": (
        lambda: pb.ReleaseRetentionRequest(name=f"{CONV}/retentions/9", force=True),
        {"admin"},
    ),
    "DeregisterNode": (lambda: pb.DeregisterNodeRequest(name="nodes/d1"), {"admin"}),  # not the agent's node
    "MoveRetention": (
        lambda: pb.MoveRetentionRequest(
            name=RETENTION,
            claim_id="x",
            node="nodes/d0-pool",
            kv_transfer_params=retention(1).kv_transfer_params,
        ),
        {"router", "admin"},
    ),
    # Node-scoped, not tenant-scoped: the agent evicts from its own pool node.
    "EvictRetention": (
        lambda: pb.EvictRetentionRequest(name=RETENTION, node="nodes/d0-pool"),
        {"router", "agent-d0", "admin"},
    ),
}


class Env:
    def __init__(self, channel: grpc.aio.Channel, metrics: CollectorRegistry, address: str) -> None:
        self.channel = channel
        self.address = address
        self.stub = pb_grpc.RegistryServiceStub(channel)
        self.metrics = metrics

    async def snapshot(self) -> tuple[Any, ...]:
        admin = bearer("admin")
        nodes = await self.stub.ListNodes(pb.ListNodesRequest(), metadata=admin)
        kept = await self.stub.ListRetentions(pb.ListRetentionsRequest(parent="tenants/acme"), metadata=admin)
        # Every record and field, but the load/expiry a heartbeat may move.
        return (
            [(n.name, n.engine_id, n.incarnation, n.retention_count, n.retained_bytes) for n in nodes.nodes],
            [r.SerializeToString(deterministic=True) for r in kept.retentions],
        )


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    registry = Registry(InMemoryStore(), FakeClock(), BlockIndex(10_000), RegistryLimits())
    settings = RegistrySettings(server=ServerSettings(listen="127.0.0.1:0"), auth=auth_settings())
    metrics = CollectorRegistry()
    server = build_server(settings, registry, metrics)
    port = await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        e = Env(channel, metrics, f"127.0.0.1:{port}")
        admin = bearer("admin")
        # A node and a retention, so that refused writes would have something to change.
        await e.stub.RegisterNode(pb.RegisterNodeRequest(node=node(), ttl=seconds(60)), metadata=admin)
        await e.stub.PutRetention(
            pb.PutRetentionRequest(parent=CONV, retention=retention(1), ttl=seconds(60)), metadata=admin
        )
        yield e
    registry.close()
    await server.stop()


async def call(env: Env, rpc: str, request: Any, identity: str | None) -> tuple[str, str]:
    """(code, reason) of one call; ("OK", "") when it succeeded."""
    metadata = bearer(identity) if identity else ()
    method = getattr(env.stub, "ReleaseRetention" if rpc == "ForceRelease" else rpc)
    try:
        await method(request, metadata=metadata)
    except grpc.aio.AioRpcError as err:
        return denial(err)
    return "OK", ""


@pytest.mark.parametrize("rpc", sorted(MATRIX))
async def test_role_matrix(env: Env, rpc: str) -> None:
    make, allowed = MATRIX[rpc]
    for role in ROLES:
        before = await env.snapshot()
        code, reason = await call(env, rpc, make(), role)
        if role in allowed:
            assert code not in ("PERMISSION_DENIED", "UNAUTHENTICATED"), (rpc, role, code, reason)
        else:
            assert code == "PERMISSION_DENIED", (rpc, role, code, reason)
            expected = (
                "NODE_NOT_IN_SCOPE"
                if role == "agent-d0" and rpc == "DeregisterNode"
                else "PERMISSION_MISSING"
            )
            assert reason == expected, (rpc, role)
            assert await env.snapshot() == before, (rpc, role)


async def test_watch_is_authorized_like_reads(env: Env) -> None:
    for role in ROLES:
        stream = env.stub.WatchRetentions(
            pb.WatchRetentionsRequest(parent="tenants/acme"), metadata=bearer(role)
        )
        try:
            await asyncio.wait_for(stream.read(), 0.3)
        except TimeoutError:
            assert role in {"router", "admin", "viewer"}, role  # open: allowed, nothing changed yet
        except grpc.aio.AioRpcError as err:
            assert role not in {"router", "admin", "viewer"}, role
            assert denial(err) == ("PERMISSION_DENIED", "PERMISSION_MISSING")
        finally:
            stream.cancel()


async def test_an_agent_acts_for_its_own_node_only(env: Env) -> None:
    before = await env.snapshot()
    other = pb.Node()
    other.CopyFrom(node(name="nodes/d1", engine_id="engine-d1"))
    for rpc, request in (
        ("RegisterNode", pb.RegisterNodeRequest(node=other, ttl=seconds(30))),
        ("HeartbeatNode", pb.HeartbeatNodeRequest(name="nodes/d1", incarnation=1)),
        ("ReportBlockEvents", pb.ReportBlockEventsRequest(node="nodes/d1", incarnation=1)),
    ):
        assert await call(env, rpc, request, "agent-d0") == ("PERMISSION_DENIED", "NODE_NOT_IN_SCOPE")
    assert await env.snapshot() == before


async def test_an_agent_acts_for_its_own_pool_node_too(env: Env) -> None:
    pool = pb.Node()
    pool.CopyFrom(node(name="nodes/d0-pool", engine_id="pool-d0", role=pb.NODE_ROLE_POOL))
    pool.labels[POOL_OF_LABEL] = "nodes/d0"
    registered = await env.stub.RegisterNode(
        pb.RegisterNodeRequest(node=pool, ttl=seconds(30)), metadata=bearer("agent-d0")
    )
    incarnation = registered.node.incarnation
    await env.stub.HeartbeatNode(
        pb.HeartbeatNodeRequest(name="nodes/d0-pool", incarnation=incarnation), metadata=bearer("agent-d0")
    )
    before = await env.snapshot()
    other_pool = pb.Node()
    other_pool.CopyFrom(pool)
    other_pool.name = "nodes/d1-pool"
    other_pool.labels[POOL_OF_LABEL] = "nodes/d1"
    for rpc, request in (
        ("RegisterNode", pb.RegisterNodeRequest(node=other_pool, ttl=seconds(30))),
        ("HeartbeatNode", pb.HeartbeatNodeRequest(name="nodes/d1-pool", incarnation=1)),
        ("EvictRetention", pb.EvictRetentionRequest(name=RETENTION, node="nodes/d1-pool")),
        ("EvictRetention", pb.EvictRetentionRequest(name=RETENTION, node="nodes/d0-poolx")),
    ):
        assert await call(env, rpc, request, "agent-d0") == ("PERMISSION_DENIED", "NODE_NOT_IN_SCOPE"), rpc
    # A gateway bound to the retention's tenant still may not evict: eviction is no tenant's call.
    evict = pb.EvictRetentionRequest(name=RETENTION, node="nodes/d0")
    assert await call(env, "EvictRetention", evict, "gateway-acme") == (
        "PERMISSION_DENIED",
        "PERMISSION_MISSING",
    )
    # The agent moves nothing: the router orchestrates moves.
    move = pb.MoveRetentionRequest(name=RETENTION, claim_id="x", node="nodes/d0-pool")
    assert await call(env, "MoveRetention", move, "agent-d0") == ("PERMISSION_DENIED", "PERMISSION_MISSING")
    assert await env.snapshot() == before
    # Its own node's retention, from its own node: allowed (and done).
    assert await call(env, "EvictRetention", evict, "agent-d0") == ("OK", "")
    assert (await env.snapshot())[1] == []


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer not-a-token-of-anyone"),), (("authorization", "Basic abc"),)],
    ids=["none", "unknown", "not-bearer"],
)
async def test_no_valid_identity_is_unauthenticated(env: Env, metadata: tuple[tuple[str, str], ...]) -> None:
    before = await env.snapshot()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await env.stub.PutRetention(
            pb.PutRetentionRequest(parent=CONV, retention=retention(8), ttl=seconds(30)), metadata=metadata
        )
    assert denial(err.value) == ("UNAUTHENTICATED", "UNAUTHENTICATED")
    assert await env.snapshot() == before
    denied = env.metrics.get_sample_value(
        "kvshuttle_auth_denied_total",
        {
            "service": "kvshuttle.registry.v1.RegistryService",
            "method": "PutRetention",
            "reason": "UNAUTHENTICATED",
        },
    )
    assert denied == 1


async def test_health_needs_no_identity(env: Env) -> None:
    health: Any = health_pb2_grpc.HealthStub(env.channel)  # typed for the sync stub only
    answer = await health.Check(health_pb2.HealthCheckRequest())
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_the_cli_passes_its_token(env: Env, tmp_path: Path) -> None:
    address = env.address
    token_file = tmp_path / "viewer.token"
    token_file.write_text(token("viewer") + "\n")
    listed = await arun_cli(
        ["--json", "registry", "nodes"], registry=address, env={TOKEN_FILE_ENV: str(token_file)}
    )
    assert listed.exit_code == 0, listed.stderr
    assert [n["name"] for n in listed.json()["nodes"]] == ["nodes/d0"]
    refused = await arun_cli(["registry", "nodes"], registry=address)
    assert refused.exit_code != 0 and "UNAUTHENTICATED" in refused.stderr
    # A viewer reads; it does not release.
    denied = await arun_cli(
        ["--token-file", str(token_file), "registry", "release", RETENTION, "--force"], registry=address
    )
    assert denied.exit_code != 0 and "PERMISSION_DENIED (PERMISSION_MISSING)" in denied.stderr
