"""An agent's test kit, all real sockets on 127.0.0.1: a registry on a given port, the agent
itself in-process with short intervals (beside the engine's stand-ins, tests.agent.engine_fakes),
and what the registry's block index should hold of the fixture's events."""

from __future__ import annotations

import asyncio
import inspect
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry
from tests.agent.engine_fakes import BLOCK_SIZE, FakePublisher
from tests.support.clock import FakeClock
from tests.support.fixtures_vllm import FIXTURE_TOPIC, live_batches
from tests.support.registry_env import RegistryEnv

from kvshuttle.agent.agent import Agent
from kvshuttle.agent.config import (
    AgentSettings,
    EngineSettings,
    EventsSettings,
    LeaseSettings,
    NodeSettings,
)
from kvshuttle.agent.main import build_server, connect_registry
from kvshuttle.agent.registry_port import GrpcRegistryPort
from kvshuttle.client import AgentClient, RegistryClient
from kvshuttle.client.settings import ServiceConnection
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.core.kv_events import BlockStored, EventBatch
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.config import RegistrySettings
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.main import build_server as build_registry_server
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.registry.v1 import registry_service_pb2_grpc as rpb_grpc
from kvshuttle.serving.server import GrpcServer
from kvshuttle.serving.settings import ServerSettings

NODE = "nodes/agent-0"
MODEL = "tiny-llama"
MIB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def eventually(
    check: Callable[[], Any | Awaitable[Any]], *, within: float = 10.0, what: str = "condition"
) -> None:
    """Poll `check` (sync or async) until it returns true; fail after `within` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.01)


# -- registry -------------------------------------------------------------------------------------


async def start_registry_on(listen: str) -> RegistryEnv:
    """tests.conftest.start_registry on a given address (to restart a registry in place).
    Incarnations restart at 1, as a restarted registry without a clock base would."""
    clock = FakeClock()
    registry = Registry(
        InMemoryStore(StoreLimits(max_retentions_per_tenant=50)), clock, BlockIndex(10_000), RegistryLimits()
    )
    settings = RegistrySettings(server=ServerSettings(listen=listen, grace_seconds=1))
    metrics = CollectorRegistry()
    server = build_registry_server(settings, registry, metrics)
    port = await server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    return RegistryEnv(
        clock, registry, server, address, channel, rpb_grpc.RegistryServiceStub(channel), metrics
    )


async def stop_registry(env: RegistryEnv) -> None:
    await env.channel.close()
    env.registry.close()
    await env.server.stop()


# -- the agent ------------------------------------------------------------------------------------


def agent_settings(
    registry_address: str,
    engine_url: str,
    publisher: FakePublisher | None = None,
    *,
    replay: bool = True,
    queue_size: int = 4096,
    max_batches: int = 64,
    linger: float = 0.005,
) -> AgentSettings:
    return AgentSettings(
        server=ServerSettings(listen="127.0.0.1:0", grace_seconds=1),
        registry=ServiceConnection(address=registry_address, timeout=0.5),
        node=NodeSettings(
            name=NODE,
            role="decode",
            engine_id="engine-a",
            http_endpoint=engine_url,
            side_channel_host="127.0.0.1",
            side_channel_port=5600,
            model=MODEL,
            block_size=BLOCK_SIZE,
            kv_bytes_per_token=4096,
            labels={"zone": "test"},
        ),
        lease=LeaseSettings(ttl=10.0, heartbeat_interval=0.05, retry_initial=0.02, retry_max=0.1),
        events=EventsSettings(
            endpoint=None if publisher is None else publisher.endpoint,
            replay_endpoint=None if publisher is None or not replay else publisher.replay_endpoint,
            topic=FIXTURE_TOPIC.decode(),
            queue_size=queue_size,
            max_batches_per_report=max_batches,
            linger=linger,
            replay_timeout=1.0,
        ),
        engine=EngineSettings(poll_interval=0.05, poll_timeout=0.5),
        shutdown_flush_timeout=1.0,
    )


@dataclass
class AgentEnv:
    settings: AgentSettings
    agent: Agent
    server: GrpcServer
    address: str
    client: AgentClient
    registry_client: RegistryClient
    metrics: CollectorRegistry
    stopped: bool = False

    async def stop(self) -> None:
        """What main() does on SIGTERM: the agent's shutdown, then the server's."""
        if self.stopped:
            return
        self.stopped = True
        await self.agent.shutdown()
        await self.server.stop()
        await self.client.close()
        await self.registry_client.close()


async def start_agent(settings: AgentSettings, *, subscribed: FakePublisher | None = None) -> AgentEnv:
    """The agent and its gRPC server, as main() wires them; waits for the subscription of
    `subscribed` when given."""
    registry_client = connect_registry(settings)
    agent = Agent(settings, GrpcRegistryPort(registry_client))
    metrics = CollectorRegistry()
    server = build_server(settings, agent, metrics)
    port = await server.start()
    await agent.start(agent_endpoint=settings.advertised_endpoint(port))
    if subscribed is not None:
        await subscribed.wait_subscribed()
    address = f"127.0.0.1:{port}"
    return AgentEnv(settings, agent, server, address, AgentClient.connect(address), registry_client, metrics)


def pooled_settings(registry_address: str, engine_url: str, side_channel_port: int) -> AgentSettings:
    settings = agent_settings(registry_address, engine_url).model_dump()
    settings["node"]["side_channel_port"] = side_channel_port
    return AgentSettings.model_validate(
        {**settings, "pool": {"size_bytes": MIB + 1, "regions": 4, "expire_interval": 0.05}}
    )


# -- what the index should hold -------------------------------------------------------------------


def fixture_chains() -> list[list[int]]:
    """kvshuttle chains of every prefix the fixture's engine ever cached."""
    prefixes: dict[int, tuple[int, ...]] = {}
    chains: list[list[int]] = []
    for batch in live_batches():
        for event in batch.events:
            if not isinstance(event, BlockStored):
                continue
            base = () if event.parent_block_hash is None else prefixes.get(event.parent_block_hash)
            if base is None:
                continue
            tokens = base + event.token_ids
            for i, block in enumerate(event.block_hashes):
                prefixes[block] = tokens[: len(base) + (i + 1) * BLOCK_SIZE]
            chains.append(chain_hashes(tokens, BLOCK_SIZE))
    return chains


def index_view(index: BlockIndex, node: str = NODE) -> tuple[int, list[list[tuple[str, int]]]]:
    """What placement can learn of `node` from an index: its block count and every lookup."""
    return index.node_block_count(node), [
        [m for m in index.lookup(chain) if m[0] == node] for chain in fixture_chains()
    ]


def expected_view(batches: Sequence[EventBatch]) -> tuple[int, list[list[tuple[str, int]]]]:
    """The view of an index that had `batches` applied directly."""
    index = BlockIndex(10_000)
    index.apply(NODE, batches)
    return index_view(index)
