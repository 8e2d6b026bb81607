"""The block pool as users see it: settings, the engine check at start, GetStatus, metrics and
`kvshuttle agent status`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import zmq.asyncio
from prometheus_client import generate_latest
from pydantic import ValidationError
from tests.agent.engine_fakes import FakeEngineHttp, FakeSideChannel, engine_metadata
from tests.agent.helpers import MIB, AgentEnv, agent_settings, eventually, pooled_settings, start_agent
from tests.support.cli_runner import arun_cli
from tests.support.registry_env import RegistryEnv

from kvshuttle.agent.agent import Agent
from kvshuttle.agent.config import AgentSettings, PoolSettings
from kvshuttle.agent.main import connect_registry
from kvshuttle.agent.pool.blocks import PoolLayout
from kvshuttle.agent.pool.side_channel import fetch_handshake
from kvshuttle.agent.registry_port import GrpcRegistryPort
from kvshuttle.agent.v1 import agent_service_pb2 as apb
from kvshuttle.agent.v1 import agent_service_pb2_grpc as apb_grpc
from kvshuttle.client import KvshuttleRpcError
from kvshuttle.core.errors import FailedPrecondition
from kvshuttle.core.prototime import to_duration
from kvshuttle.registry.v1 import registry_service_pb2 as rpb
from kvshuttle.vllm.kv_transfer_params import from_vllm, to_vllm


@pytest.fixture
async def side_channel() -> AsyncIterator[FakeSideChannel]:
    # The fixture's engine block: 32 tokens x 4096 bytes = 128 KiB, in 4 regions of 32 KiB.
    channel = FakeSideChannel(zmq.asyncio.Context.instance(), engine_metadata(PoolLayout(4, 64, 32 * 1024)))
    yield channel
    await channel.close()


@pytest.fixture
async def pooled(
    registry_env: RegistryEnv, engine: FakeEngineHttp, side_channel: FakeSideChannel
) -> AsyncIterator[AgentEnv]:
    env = await start_agent(pooled_settings(registry_env.address, engine.url, side_channel.port))
    yield env
    await env.stop()


def test_pool_layout_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "NODE__NAME": "decode-0",
        "NODE__ROLE": "decode",
        "NODE__ENGINE_ID": "e",
        "NODE__HTTP_ENDPOINT": "http://127.0.0.1:8000",
        "NODE__MODEL": "m",
        "NODE__BLOCK_SIZE": "16",
        "NODE__KV_BYTES_PER_TOKEN": "1024",
    }.items():
        monkeypatch.setenv(f"KVSHUTTLE_AGENT_{key}", value)
    assert AgentSettings().pool_layout() is None  # type: ignore[call-arg]  # off by default
    monkeypatch.setenv("KVSHUTTLE_AGENT_POOL__SIZE_BYTES", str(4 * MIB))
    monkeypatch.setenv("KVSHUTTLE_AGENT_POOL__REGIONS", "8")
    layout = AgentSettings().pool_layout()  # type: ignore[call-arg]
    assert layout == PoolLayout(regions=8, blocks=256, block_bytes=2048)
    monkeypatch.setenv("KVSHUTTLE_AGENT_POOL__REGIONS", "3")  # 16 KiB blocks do not split in 3
    with pytest.raises(ValidationError, match=r"set pool\.block_bytes"):
        AgentSettings()  # type: ignore[call-arg]
    monkeypatch.setenv("KVSHUTTLE_AGENT_POOL__BLOCK_BYTES", "4096")
    assert AgentSettings().pool_layout() == PoolLayout(3, 341, 4096)  # type: ignore[call-arg]
    monkeypatch.setenv("KVSHUTTLE_AGENT_POOL__SIZE_BYTES", "100")
    with pytest.raises(ValidationError, match="holds no slot"):
        AgentSettings()  # type: ignore[call-arg]
    assert PoolSettings().size_bytes == 0


async def test_status_metrics_and_cli_report_the_pool(pooled: AgentEnv) -> None:
    pool = pooled.agent.pool
    assert pool is not None and pooled.agent.opened is not None
    assert pooled.agent.opened.memory.base_address % 4096 == 0
    pool.allocate("tenants/t/conversations/c/retentions/1", 3, expire_at=1e18)
    pool.seal("tenants/t/conversations/c/retentions/1")
    pool.allocate("tenants/t/conversations/c/retentions/2", 1, expire_at=1e18)

    status = (await pooled.client.get_status()).pool
    assert (status.capacity_bytes, status.total_blocks, status.block_bytes, status.regions) == (
        MIB,
        8,
        128 * 1024,
        4,
    )
    assert (status.used_blocks, status.free_blocks, status.used_bytes) == (4, 4, 4 * 128 * 1024)
    assert (status.parked_retentions, status.filling_retentions) == (1, 1)

    text = generate_latest(pooled.metrics).decode()
    assert "kvshuttle_agent_pool_capacity_bytes 1.048576e+06" in text
    assert 'kvshuttle_agent_pool_blocks{state="used"} 4.0' in text
    assert 'kvshuttle_agent_pool_blocks{state="free"} 4.0' in text
    assert 'kvshuttle_agent_pool_retentions{state="parked"} 1.0' in text

    result = await arun_cli(["agent", "status", "--agent", pooled.address])
    assert result.exit_code == 0, result.stderr
    assert "1.0 MiB in 8 blocks" in result.stdout
    assert "4 blocks, 512.0 KiB" in result.stdout
    assert "1 parked, 1 filling" in result.stdout
    doc = (await arun_cli(["agent", "status", "--agent", pooled.address, "--json"])).json()
    assert (doc["pool"]["used_blocks"], doc["pool"]["parked_retentions"]) == ("4", 1)


async def test_expiry_runs_on_a_timer(pooled: AgentEnv) -> None:
    pool = pooled.agent.pool
    assert pool is not None
    pool.allocate("tenants/t/conversations/c/retentions/1", 2, expire_at=0.0)
    await eventually(lambda: pool.stats().expired_retentions == 1, what="the expiry sweep")
    assert (pool.stats().used_blocks, pool.stats().expired_retentions) == (0, 1)


async def test_cli_names_an_unreachable_agent() -> None:
    result = await arun_cli(["agent", "status", "--agent", "127.0.0.1:1", "--timeout", "0.5"])
    assert result.exit_code == 1
    assert "the agent at 127.0.0.1:1" in result.stderr


@contextlib.asynccontextmanager
async def started(settings: AgentSettings) -> AsyncIterator[Agent]:
    """An agent past start() (which raises what start raised), shut down after."""
    client = connect_registry(settings)
    agent = Agent(settings, GrpcRegistryPort(client))
    try:
        await agent.start()
        yield agent
    finally:
        await agent.shutdown()
        await client.close()


async def test_the_agent_waits_for_an_engine_that_does_not_answer_yet(
    registry_env: RegistryEnv, engine: FakeEngineHttp, side_channel: FakeSideChannel
) -> None:
    answer, side_channel.metadata = side_channel.metadata, None  # still starting
    settings = pooled_settings(registry_env.address, engine.url, side_channel.port)
    settings.engine.poll_timeout = 0.1
    ready = asyncio.Event()

    async def run() -> None:
        async with started(settings) as agent:
            assert agent.engine_nixl is not None and agent.engine_nixl.metadata.engine_id == "engine-a"
            assert agent.parker is not None and agent.opened is not None
            ready.set()

    start = asyncio.create_task(run())
    await eventually(lambda: side_channel.requests >= 3, what="handshake retries")
    assert not start.done()
    side_channel.metadata = answer
    await asyncio.wait_for(start, 10)
    assert ready.is_set()


@pytest.mark.parametrize(
    ("engine_side", "refused"),
    [
        ({"engine_id": "engine-b"}, "engine_id: expected engine-a, got engine-b"),
        ({"block_size": 16}, "block_size: expected 32, got 16"),
        ({"kv_cache_layout": "NHD"}, "kv_cache_layout"),
        ({"layout": PoolLayout(2, 64, 64 * 1024)}, "2 KV regions, the pool 4: set pool.regions"),
        ({"layout": PoolLayout(4, 64, 16 * 1024)}, "16384 bytes in a region, the pool's 32768"),
    ],
)
async def test_the_agent_refuses_an_engine_it_cannot_read(
    registry_env: RegistryEnv,
    engine: FakeEngineHttp,
    side_channel: FakeSideChannel,
    engine_side: dict[str, Any],
    refused: str,
) -> None:
    layout = engine_side.pop("layout", PoolLayout(4, 64, 32 * 1024))
    side_channel.metadata = dataclasses.replace(engine_metadata(layout), **engine_side)
    settings = pooled_settings(registry_env.address, engine.url, side_channel.port)
    with pytest.raises(FailedPrecondition, match=re.escape(refused)):
        async with started(settings):
            pass
    assert side_channel.requests == 1  # refused at once, not retried


async def test_the_agent_serves_its_pool_on_a_side_channel_of_its_own(
    pooled: AgentEnv, side_channel: FakeSideChannel
) -> None:
    server, opened = pooled.agent.server, pooled.agent.opened
    assert server is not None and opened is not None and server.port > 0
    memory = opened.memory
    got = await fetch_handshake(zmq.asyncio.Context.instance(), "127.0.0.1", server.port, reply_timeout=5)
    assert side_channel.metadata is not None
    assert got.payload.compatibility_hash == "ab" * 32  # the engine's, copied
    assert got.metadata.engine_id == server.engine_id != side_channel.metadata.engine_id
    assert got.metadata.kv_caches_base_addr[0] == memory.base_address


def test_serving_settings() -> None:
    assert PoolSettings().serve_port == 0  # with a pool: served, on any free port
    with pytest.raises(ValidationError, match="serve_host"):
        PoolSettings(serve_host="0.0.0.0")
    with pytest.raises(ValidationError, match="serve_lease"):
        PoolSettings(serve_lease=5.0)


async def test_an_agent_configured_not_to_serve_has_no_side_channel(
    registry_env: RegistryEnv, engine: FakeEngineHttp, side_channel: FakeSideChannel
) -> None:
    settings = pooled_settings(registry_env.address, engine.url, side_channel.port)
    settings.pool.serve_port = None
    env = await start_agent(settings)
    try:
        assert env.agent.opened is not None and env.agent.server is None
    finally:
        await env.stop()


async def test_a_served_pool_registers_as_a_node_of_its_own(pooled: AgentEnv) -> None:
    agent = pooled.agent
    server, pool_lease = agent.server, agent.pool_lease
    assert server is not None and pool_lease is not None
    await eventually(lambda: pool_lease.state.heartbeats > 0, what="the pool node's heartbeat")
    node = (await pooled.registry_client.get_node("nodes/agent-0-pool")).node
    assert node.role == rpb.NODE_ROLE_POOL
    assert (node.engine_id, node.side_channel_host, node.side_channel_port) == (
        server.engine_id,
        "127.0.0.1",
        server.port,
    )
    assert node.agent_endpoint == pooled.address
    assert (node.model, node.block_size, node.kv_bytes_per_token) == ("tiny-llama", 32, 4096)
    assert dict(node.labels) == {
        "kvshuttle.io/pool-of": "nodes/agent-0",
        "kvshuttle.io/pool-capacity-bytes": str(MIB),
    }
    assert node.load.engine_healthy and node.load.kv_cache_usage == 0.0
    assert agent.mover is not None and agent.mover.pool_node == "nodes/agent-0-pool"
    text = generate_latest(pooled.metrics).decode()
    assert "kvshuttle_agent_pool_node_registered 1.0" in text

    await pooled.stop()
    client = connect_registry(pooled.settings)
    try:
        with pytest.raises(KvshuttleRpcError) as gone:
            await client.get_node("nodes/agent-0-pool")
    finally:
        await client.close()
    assert gone.value.reason == "NODE_NOT_FOUND"


async def test_an_agent_not_serving_its_pool_registers_no_pool_node_and_moves_nothing(
    registry_env: RegistryEnv, engine: FakeEngineHttp, side_channel: FakeSideChannel
) -> None:
    settings = pooled_settings(registry_env.address, engine.url, side_channel.port)
    settings.pool.serve_port = None
    env = await start_agent(settings)
    try:
        assert env.agent.pool_lease is None and env.agent.mover is None
        with pytest.raises(KvshuttleRpcError) as refused:
            await env.client.park_retention(RETENTION, source=SOURCE, ttl=60)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "does not serve its pool" in refused.value.message
    finally:
        await env.stop()


RETENTION = "tenants/t/conversations/c/retentions/1"
SOURCE = from_vllm(
    {
        "do_remote_decode": True,
        "remote_engine_id": "engine-a",
        "remote_request_id": "cmpl-1-0",
        "remote_block_ids": [[1, 2]],
        "remote_num_tokens": 40,
        "remote_blocks_expiry_time": 1e12,
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
    }
)


async def test_the_moves_errors_over_grpc(pooled: AgentEnv) -> None:
    client = pooled.client
    cases: list[tuple[Any, grpc.StatusCode, str, str]] = [
        (
            client.park_retention(RETENTION, source=SOURCE, ttl=0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "ttl",
        ),
        (
            client.park_retention(
                RETENTION, source=from_vllm({**_params(), "remote_engine_id": "engine-b"}), ttl=60
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "NODE_MISMATCH",
            "",
        ),
        (
            client.prefetch(RETENTION, "nodes/prefill-1", source=SOURCE, ttl=60),
            grpc.StatusCode.FAILED_PRECONDITION,
            "NODE_MISMATCH",
            "",
        ),
        (
            client.pull_blocks(from_vllm({"remote_engine_id": "engine-a"}), ttl=60),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "source.remote_request_id",
        ),
    ]
    for call, code, reason, field in cases:
        with pytest.raises(KvshuttleRpcError) as err:
            await call
        assert (err.value.code, err.value.reason) == (code, reason), err.value.message
        if field:
            assert err.value.metadata.get("field") == field
    async with grpc.aio.insecure_channel(pooled.address) as channel:
        stub = apb_grpc.AgentServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.ParkRetention(apb.ParkRetentionRequest(retention=RETENTION, ttl=to_duration(60)))
        assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "source" in str(missing.value.details())
    text = generate_latest(pooled.metrics).decode()
    assert 'kvshuttle_agent_moves_total{kind="park",outcome="node_mismatch"} 1.0' in text
    assert 'kvshuttle_agent_pool_evictions_total{why="pool_full"} 0.0' in text


def _params() -> dict[str, Any]:
    return to_vllm(SOURCE)


def test_a_served_pools_node_name_must_leave_room_for_its_pool_node() -> None:
    settings = agent_settings("127.0.0.1:1", "http://127.0.0.1:1").model_dump()
    settings["node"]["name"] = "nodes/decode-pool"
    with pytest.raises(ValidationError, match="pool node"):
        AgentSettings.model_validate({**settings, "pool": {"size_bytes": MIB, "regions": 4}})
    # Without a pool (or not served) the name is free.
    AgentSettings.model_validate(settings)
    AgentSettings.model_validate({**settings, "pool": {"size_bytes": MIB, "regions": 4, "serve_port": None}})
