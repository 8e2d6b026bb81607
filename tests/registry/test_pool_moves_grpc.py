"""MoveRetention and EvictRetention over a real gRPC server, through RegistryClient: status codes,
ErrorInfo reasons and fields, the watch stream's MOVED and EVICTED, and nothing changed on error."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest
from tests.support.registry_env import RegistryEnv
from tests.support.registry_messages import CONV, node, put, register, retention

from kvshuttle.client import KvshuttleRpcError, RegistryClient
from kvshuttle.client.retry import REGISTRY_SERVICE, RETRY_POLICY, Retry
from kvshuttle.core.nodes import POOL_CAPACITY_LABEL, POOL_OF_LABEL
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import BlockIdList, KvTransferParams

NAME = f"{CONV}/retentions/1"
POOL = "nodes/d0-pool"


def pool_node() -> pb.Node:
    out = node(name=POOL, engine_id="pool-d0", role=pb.NODE_ROLE_POOL)
    out.side_channel_port = 5700
    out.agent_endpoint = "127.0.0.1:50061"
    out.labels[POOL_OF_LABEL] = "nodes/d0"
    out.labels[POOL_CAPACITY_LABEL] = str(2**30)
    return out


def pooled(**kw: Any) -> KvTransferParams:
    fields: dict[str, Any] = {
        "do_remote_decode": True,
        "remote_engine_id": "pool-d0",
        "remote_host": "127.0.0.1",
        "remote_port": 5700,
        "remote_block_ids": [BlockIdList(block_ids=[0, 1, 2, 3, 4, 5])],
        "remote_num_tokens": 100,
        "remote_request_id": "read-1",
        "tp_size": 1,
    }
    fields.update(kw)
    return KvTransferParams(**fields)


@pytest.fixture
async def client(registry_env: RegistryEnv) -> RegistryClient:
    await register(registry_env)
    await register(registry_env, pool_node())
    return RegistryClient(registry_env.channel)


async def claim(client: RegistryClient, registry_env: RegistryEnv) -> str:
    await put(registry_env)
    return (await client.claim_retention(NAME, "router/park", 10)).retention.claim.claim_id


async def snapshot(client: RegistryClient) -> tuple[Any, ...]:
    nodes = [(n.name, n.retained_bytes, n.retention_count) async for n in client.iter_nodes()]
    kept = [r.SerializeToString(deterministic=True) async for r in client.iter_retentions("tenants/acme")]
    return nodes, kept


async def test_move_then_evict_over_grpc(client: RegistryClient, registry_env: RegistryEnv) -> None:
    watch = registry_env.stub.WatchRetentions(pb.WatchRetentionsRequest(node="nodes/d0"))
    await asyncio.sleep(0.05)  # let the subscription open before the changes
    claim_id = await claim(client, registry_env)
    moved = (
        await client.move_retention(
            NAME, claim_id=claim_id, node=POOL, kv_transfer_params=pooled(), kv_bytes=4096, ttl=120
        )
    ).retention
    assert moved.node == POOL
    assert moved.state == pb.RETENTION_STATE_ACTIVE
    assert not moved.HasField("claim") and not moved.HasField("pin_expire_time")
    assert moved.kv_transfer_params == pooled()
    assert moved.kv_bytes == 4096
    assert moved.expire_time.ToNanoseconds() == int((registry_env.clock.now() + 120) * 1e9)
    assert moved.block_hashes == retention().block_hashes
    assert (await client.get_retention(NAME)).retention == moved
    pool = (await client.get_node(POOL)).node
    assert (pool.role, pool.retention_count, pool.retained_bytes) == (pb.NODE_ROLE_POOL, 1, 4096)
    assert (await client.get_node("nodes/d0")).node.retention_count == 0
    listed = await client.list_nodes(role=pb.NODE_ROLE_DECODE)
    assert [n.name for n in listed.nodes] == ["nodes/d0"]
    await client.evict_retention(NAME, node=POOL)
    with pytest.raises(KvshuttleRpcError) as gone:
        await client.evict_retention(NAME, node=POOL)
    assert (gone.value.code, gone.value.reason) == (grpc.StatusCode.NOT_FOUND, "RETENTION_NOT_FOUND")
    changes: list[pb.WatchRetentionsResponse] = []
    for _ in range(3):
        change = await asyncio.wait_for(watch.read(), 2)
        assert isinstance(change, pb.WatchRetentionsResponse)
        changes.append(change)
    watch.cancel()
    assert [(c.change, c.retention.node, c.previous_node) for c in changes] == [
        (pb.RETENTION_CHANGE_PUT, "nodes/d0", ""),
        (pb.RETENTION_CHANGE_CLAIMED, "nodes/d0", ""),
        (pb.RETENTION_CHANGE_MOVED, POOL, "nodes/d0"),
    ]
    text = generate_latest(registry_env.metrics).decode().splitlines()
    assert "kvshuttle_registry_retentions_moved_total 1.0" in text
    assert "kvshuttle_registry_retentions_evicted_total 1.0" in text


async def test_move_is_retried_under_its_request_id(
    client: RegistryClient, registry_env: RegistryEnv
) -> None:
    claim_id = await claim(client, registry_env)
    args: dict[str, Any] = {"claim_id": claim_id, "node": POOL, "kv_transfer_params": pooled(), "kv_bytes": 1}
    first = await client.move_retention(NAME, **args, ttl=60, request_id="move-1")
    registry_env.clock.advance(3)
    again = await client.move_retention(NAME, **args, ttl=60, request_id="move-1")
    assert again == first
    with pytest.raises(KvshuttleRpcError) as reused:
        await client.move_retention(NAME, **{**args, "kv_bytes": 2}, ttl=60, request_id="move-1")
    assert (reused.value.code, reused.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_REUSED")
    assert RETRY_POLICY[REGISTRY_SERVICE]["MoveRetention"] is Retry.WITH_REQUEST_ID
    assert RETRY_POLICY[REGISTRY_SERVICE]["EvictRetention"] is Retry.ALWAYS


@pytest.mark.parametrize(
    ("change", "code", "reason", "field"),
    [
        ({"claim_id": "not-the-claim"}, grpc.StatusCode.FAILED_PRECONDITION, "CLAIM_MISMATCH", "claim_id"),
        ({"node": "nodes/d9-pool"}, grpc.StatusCode.NOT_FOUND, "NODE_NOT_FOUND", ""),
        (
            {"kv_transfer_params": pooled(remote_engine_id="engine-d0", remote_port=5601)},
            grpc.StatusCode.FAILED_PRECONDITION,
            "NODE_MISMATCH",
            "kv_transfer_params.remote_engine_id",
        ),
        (
            {"kv_transfer_params": pooled(remote_port=5701)},
            grpc.StatusCode.FAILED_PRECONDITION,
            "NODE_MISMATCH",
            "kv_transfer_params.remote_port",
        ),
        ({"name": f"{CONV}/retentions/5"}, grpc.StatusCode.NOT_FOUND, "RETENTION_NOT_FOUND", ""),
        ({"node": "pool"}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "node"),
        ({"ttl": 10**6}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "ttl"),
        ({"kv_bytes": 2**50}, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "kv_bytes"),
    ],
)
async def test_move_refusals_carry_their_reason_and_change_nothing(
    client: RegistryClient,
    registry_env: RegistryEnv,
    change: dict[str, Any],
    code: grpc.StatusCode,
    reason: str,
    field: str,
) -> None:
    claim_id = await claim(client, registry_env)
    args: dict[str, Any] = {
        "name": NAME,
        "claim_id": claim_id,
        "node": POOL,
        "kv_transfer_params": pooled(),
        "kv_bytes": 1,
        "ttl": 60,
        **change,
    }
    name = args.pop("name")
    before = await snapshot(client)
    with pytest.raises(KvshuttleRpcError) as err:
        await client.move_retention(name, **args)
    assert (err.value.code, err.value.reason) == (code, reason)
    assert err.value.metadata.get("field", "") == field
    assert await snapshot(client) == before


async def test_move_needs_params_and_evict_refusals(
    client: RegistryClient, registry_env: RegistryEnv
) -> None:
    claim_id = await claim(client, registry_env)
    request = pb.MoveRetentionRequest(name=NAME, claim_id=claim_id, node=POOL, kv_bytes=1)
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await registry_env.stub.MoveRetention(request)
    parsed = KvshuttleRpcError.from_rpc_error(missing.value)
    assert (parsed.reason, parsed.metadata["field"]) == ("INVALID_ARGUMENT", "kv_transfer_params")
    before = await snapshot(client)
    with pytest.raises(KvshuttleRpcError) as claimed:
        await client.evict_retention(NAME, node="nodes/d0")
    assert (claimed.value.code, claimed.value.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "RETENTION_ALREADY_CLAIMED",
    )
    with pytest.raises(KvshuttleRpcError) as other:
        await client.evict_retention(NAME, node=POOL)
    assert (other.value.code, other.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "NODE_MISMATCH")
    assert await snapshot(client) == before


async def test_pool_role_is_validated_at_registration(registry_env: RegistryEnv) -> None:
    bad = pool_node()
    del bad.labels[POOL_OF_LABEL]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await register(registry_env, bad)
    parsed = KvshuttleRpcError.from_rpc_error(err.value)
    assert (parsed.reason, parsed.metadata["field"]) == ("INVALID_ARGUMENT", "node.labels")
    with pytest.raises(grpc.aio.AioRpcError) as reserved:
        await register(registry_env, node(name="nodes/x-pool", engine_id="engine-x"))
    assert KvshuttleRpcError.from_rpc_error(reserved.value).metadata["field"] == "node.name"
