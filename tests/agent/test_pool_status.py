"""The block pool as users see it: settings, the engine check at start, GetStatus, metrics and
`kvshuttle agent status`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq.asyncio
from prometheus_client import generate_latest
from pydantic import ValidationError
from tests.agent.helpers import (
    AgentEnv,
    FakeEngineHttp,
    FakeSideChannel,
    agent_settings,
    engine_metadata,
    eventually,
    start_agent,
)
from tests.client.cli_runner import arun_cli
from tests.conftest import RegistryEnv

from kvshuttle.agent.agent import Agent
from kvshuttle.agent.block_pool import PoolLayout
from kvshuttle.agent.config import AgentSettings, PoolSettings
from kvshuttle.agent.main import connect_registry
from kvshuttle.agent.registry_port import GrpcRegistryPort
from kvshuttle.agent.side_channel import fetch_handshake
from kvshuttle.core.errors import FailedPrecondition

MIB = 1024 * 1024


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngineHttp]:
    server = FakeEngineHttp()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def side_channel() -> AsyncIterator[FakeSideChannel]:
    # The fixture's engine block: 32 tokens x 4096 bytes = 128 KiB, in 4 regions of 32 KiB.
    channel = FakeSideChannel(zmq.asyncio.Context.instance(), engine_metadata(PoolLayout(4, 64, 32 * 1024)))
    yield channel
    await channel.close()


def pooled_settings(registry_address: str, engine_url: str, side_channel_port: int) -> AgentSettings:
    settings = agent_settings(registry_address, engine_url).model_dump()
    settings["node"]["side_channel_port"] = side_channel_port
    return AgentSettings.model_validate(
        {**settings, "pool": {"size_bytes": MIB + 1, "regions": 4, "expire_interval": 0.05}}
    )


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
    assert pool is not None and pooled.agent.pool_memory is not None
    assert pooled.agent.pool_memory.base_address % 4096 == 0
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
    assert (status.parked_retentions, status.filling_retentions, status.claimed_retentions) == (1, 1, 0)

    text = generate_latest(pooled.metrics).decode()
    assert "kvshuttle_agent_pool_capacity_bytes 1.048576e+06" in text
    assert 'kvshuttle_agent_pool_blocks{state="used"} 4.0' in text
    assert 'kvshuttle_agent_pool_blocks{state="free"} 4.0' in text
    assert 'kvshuttle_agent_pool_retentions{state="parked"} 1.0' in text

    result = await arun_cli(["agent", "status", "--agent", pooled.address])
    assert result.exit_code == 0, result.stderr
    assert "1.0 MiB in 8 blocks" in result.stdout
    assert "4 blocks, 512.0 KiB" in result.stdout
    assert "1 parked, 0 claimed, 1 filling" in result.stdout
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
            assert agent.parker is not None and agent.pool_memory is not None
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
    server, memory = pooled.agent.server, pooled.agent.pool_memory
    assert server is not None and memory is not None and server.port > 0
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
        assert env.agent.pool_memory is not None and env.agent.server is None
    finally:
        await env.stop()
