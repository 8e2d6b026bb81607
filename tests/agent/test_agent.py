"""The agent end to end on real sockets: a registry over gRPC, an engine's HTTP server, and the
engine's KV-event publisher and replay endpoint over ZMQ replaying frames captured from real
vLLM. What a deployment relies on: the registry's block index ends up as the engine's events
say, gaps and restarts are repaired, the engine is never slowed, the lease holds through a
registry restart and ends with the agent, and GetStatus tells it all."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from prometheus_client import generate_latest
from tests.agent.engine_fakes import FakeEngineHttp, FakePublisher
from tests.agent.helpers import (
    NODE,
    AgentEnv,
    agent_settings,
    eventually,
    expected_view,
    free_port,
    index_view,
    start_agent,
    start_registry_on,
    stop_registry,
)
from tests.support.fixtures_vllm import live_batches, load_frames
from tests.support.registry_env import RegistryEnv

from kvshuttle.client import KvshuttleRpcError
from kvshuttle.core.kv_events import EventBatch
from kvshuttle.registry.v1 import registry_service_pb2 as rpb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

LIVE_FRAMES = load_frames()["live"]


@pytest.fixture
async def agent(
    registry_env: RegistryEnv, engine: FakeEngineHttp, publisher: FakePublisher
) -> AsyncIterator[AgentEnv]:
    env = await start_agent(agent_settings(registry_env.address, engine.url, publisher), subscribed=publisher)
    yield env
    await env.stop()


async def forwarded(env: AgentEnv, count: int) -> None:
    await eventually(lambda: env.agent.events.batches_forwarded >= count, what=f"{count} batches forwarded")


async def get_node(registry: RegistryEnv) -> rpb.Node:
    return (await registry.stub.GetNode(rpb.GetNodeRequest(name=NODE))).node


async def node_or_none(registry: RegistryEnv) -> rpb.Node | None:
    try:
        return await get_node(registry)
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise


async def test_the_registry_index_ends_up_as_the_engine_events_say(
    agent: AgentEnv, registry_env: RegistryEnv, publisher: FakePublisher
) -> None:
    live = live_batches()
    for frames in LIVE_FRAMES[:14]:  # up to the prefix-cache reset
        await publisher.publish(frames)
    await forwarded(agent, 14)
    index = registry_env.registry.index
    assert index_view(index) == expected_view(live[:14])
    assert index.node_block_count(NODE) == 41 - 19  # stored minus evicted

    await publisher.publish(LIVE_FRAMES[14])  # AllBlocksCleared, then one more request
    await forwarded(agent, 15)
    assert index_view(index) == expected_view(live)
    assert index.node_block_count(NODE) == 1

    status = (await agent.client.get_status()).events
    assert status.endpoint == publisher.endpoint
    assert (status.last_seq, status.batches_received, status.batches_forwarded) == (14, 15, 15)
    assert (status.batches_dropped, status.gaps_detected, status.engine_restarts) == (0, 0, 0)
    assert registry_env.registry.stats.event_gaps == 0
    assert publisher.replay_requests == []


async def test_a_message_the_agent_missed_is_filled_from_the_replay_endpoint(
    agent: AgentEnv, registry_env: RegistryEnv, publisher: FakePublisher
) -> None:
    for i, frames in enumerate(LIVE_FRAMES):
        await publisher.publish(frames, deliver=i != 5)  # the engine published 5; the agent never got it
    await forwarded(agent, 15)
    assert index_view(registry_env.registry.index) == expected_view(live_batches())
    assert publisher.replay_requests == [5]
    status = (await agent.client.get_status()).events
    assert (status.batches_received, status.batches_forwarded) == (14, 15)
    assert (status.gaps_detected, status.gaps_filled) == (1, 1)
    assert registry_env.registry.stats.event_gaps == 0  # the registry never saw the hole


@pytest.mark.parametrize("first_delivered", [True, False], ids=["seq0-received", "seq0-missed"])
async def test_a_sequence_going_back_is_an_engine_restart(
    agent: AgentEnv, registry_env: RegistryEnv, publisher: FakePublisher, first_delivered: bool
) -> None:
    live = live_batches()
    for frames in LIVE_FRAMES:
        await publisher.publish(frames)
    await forwarded(agent, 15)
    assert registry_env.registry.index.node_block_count(NODE) == 1

    publisher.buffer.clear()  # the restarted engine's replay buffer starts empty
    for i, frames in enumerate(LIVE_FRAMES[:3]):
        await publisher.publish(frames, deliver=first_delivered or i > 0)
    await forwarded(agent, 18)
    assert index_view(registry_env.registry.index) == expected_view(live[:3])
    assert (await agent.client.get_status()).events.engine_restarts == 1
    assert registry_env.registry.stats.engine_restarts == 1  # it cleared the node's index first
    assert publisher.replay_requests == ([] if first_delivered else [0])


async def test_a_restart_without_replay_still_clears_the_index(
    registry_env: RegistryEnv, engine: FakeEngineHttp, publisher: FakePublisher
) -> None:
    env = await start_agent(
        agent_settings(registry_env.address, engine.url, publisher, replay=False), subscribed=publisher
    )
    try:
        live = live_batches()
        for frames in LIVE_FRAMES:
            await publisher.publish(frames)
        await forwarded(env, 15)
        for frames in LIVE_FRAMES[1:3]:  # the restarted engine's seq 0 never arrived
            await publisher.publish(frames)
        await forwarded(env, 18)  # 1 and 2, after an empty seq 0 standing in for the lost one
        restart = EventBatch(seq=0, engine_time=0.0, events=())
        assert index_view(registry_env.registry.index) == expected_view([restart, *live[1:3]])
        assert registry_env.registry.stats.engine_restarts == 1
        assert env.agent.events.gaps_detected == 1
        assert env.agent.events.gaps_filled == 0
    finally:
        await env.stop()


async def test_a_full_queue_drops_without_blocking_and_the_replay_repairs_it(
    engine: FakeEngineHttp, publisher: FakePublisher
) -> None:
    # No registry yet: the forwarder cannot deliver, the queue (4) fills.
    address = f"127.0.0.1:{free_port()}"
    settings = agent_settings(address, engine.url, publisher, queue_size=4, max_batches=2, linger=0)
    env = await start_agent(settings, subscribed=publisher)
    registry: RegistryEnv | None = None
    try:
        for frames in LIVE_FRAMES:
            await publisher.publish(frames)
        events = env.agent.events
        await eventually(lambda: events.batches_received == 15, within=2, what="every message received")
        # At most 4 queued and 2 held by the forwarder waiting for the registry: the rest dropped.
        assert 15 - 4 - 2 <= events.batches_dropped <= 15 - 4
        assert 15 - 2 <= events.batches_dropped + env.agent.queue.qsize() <= 15
        assert not env.agent.lease.state.registered
        # Retrying, not crashed. Waited for: under load the 15 messages can all arrive before
        # the first RegisterNode to the closed port has failed.
        await eventually(lambda: env.agent.lease.state.failed_registrations > 0, what="a failed registration")

        registry = await start_registry_on(address)
        await eventually(lambda: env.agent.lease.state.registered, what="registration")
        # What was held and queued goes first; the replay brings back what was dropped.
        await eventually(
            lambda: index_view(registry.registry.index) == expected_view(live_batches()), what="full index"
        )
        await forwarded(env, 15)  # counted once the registry answered
        assert events.gaps_filled >= 1
        assert registry.registry.stats.event_gaps == 0
    finally:
        await env.stop()
        if registry is not None:
            await stop_registry(registry)


async def test_heartbeats_carry_the_load_from_the_engine_metrics(
    agent: AgentEnv, registry_env: RegistryEnv, engine: FakeEngineHttp
) -> None:
    async def load_is(running: int, waiting: int, usage: float, healthy: bool) -> bool:
        node = await node_or_none(registry_env)
        if node is None:
            return False
        load = node.load
        return (load.running_requests, load.waiting_requests, load.engine_healthy) == (
            running,
            waiting,
            healthy,
        ) and abs(load.kv_cache_usage - usage) < 1e-9

    await eventually(lambda: load_is(3, 5, 0.4583333333333333, True), what="the engine's load")

    engine.health_status = 503  # vLLM's engine died
    engine.metrics = engine.metrics.replace(
        'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0',
        'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0',
    )
    await eventually(lambda: load_is(0, 5, 0.4583333333333333, False), what="the unhealthy engine")
    engine_status = (await agent.client.get_status()).engine
    assert not engine_status.healthy
    assert engine.hits["/health"] > 1 and engine.hits["/metrics"] > 1

    # A metric the text lacks keeps its last value; garbage keeps them all.
    engine.health_status = 200
    engine.metrics = "\n".join(line for line in engine.metrics.splitlines() if "kv_cache_usage" not in line)
    await eventually(lambda: load_is(0, 5, 0.4583333333333333, True), what="health back")
    assert agent.agent.poller.state.missing_metrics > 0
    engine.metrics = "this is { not prometheus"
    polls = agent.agent.poller.state.failed_polls
    await eventually(lambda: agent.agent.poller.state.failed_polls > polls, what="a failed parse")
    assert await load_is(0, 5, 0.4583333333333333, True)


async def test_get_status_over_grpc(
    agent: AgentEnv, registry_env: RegistryEnv, engine: FakeEngineHttp, publisher: FakePublisher
) -> None:
    for frames in LIVE_FRAMES[:3]:
        await publisher.publish(frames)
    await forwarded(agent, 3)
    await eventually(lambda: agent.agent.poller.state.running_requests == 3, what="a poll")
    node = await get_node(registry_env)
    status = await agent.client.get_status()
    assert (status.node, status.incarnation, status.registered) == (NODE, node.incarnation, True)
    assert status.engine.http_endpoint == engine.url
    assert status.engine.engine_id == "engine-a"
    assert status.engine.healthy
    assert (status.engine.running_requests, status.engine.waiting_requests) == (3, 5)
    assert status.engine.kv_cache_usage == pytest.approx(0.4583333333333333)
    assert status.engine.HasField("last_poll_time")
    assert (status.events.batches_received, status.events.batches_forwarded, status.events.last_seq) == (
        3,
        3,
        2,
    )
    assert status.HasField("pool")
    assert (status.pool.capacity_bytes, status.pool.used_bytes, status.pool.parked_retentions) == (0, 0, 0)

    # What the agent registered.
    assert node.role == rpb.NODE_ROLE_DECODE
    assert (node.engine_id, node.http_endpoint, node.model) == ("engine-a", engine.url, "tiny-llama")
    assert (node.side_channel_host, node.side_channel_port) == ("127.0.0.1", 5600)
    assert (node.block_size, node.kv_bytes_per_token, dict(node.labels)) == (32, 4096, {"zone": "test"})
    assert node.agent_endpoint == agent.address
    assert node.indexed_blocks == registry_env.registry.index.node_block_count(NODE) > 0

    text = generate_latest(agent.metrics).decode()
    assert 'kvshuttle_agent_event_batches_total{outcome="forwarded"} 3.0' in text
    assert "kvshuttle_agent_registered 1.0" in text


@pytest.mark.parametrize("method", ["pull_blocks", "park_retention", "prefetch"])
async def test_the_nixl_moves_need_a_pool(agent: AgentEnv, method: str) -> None:
    source = KvTransferParams(remote_engine_id="engine-a", remote_request_id="cmpl-1", remote_num_tokens=3)
    retention = "tenants/t/conversations/c/retentions/1"
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "pull_blocks": lambda: agent.client.pull_blocks(source, ttl=30),
        "park_retention": lambda: agent.client.park_retention(retention, source=source, ttl=30),
        "prefetch": lambda: agent.client.prefetch(retention, NODE, source=source, ttl=30),
    }
    with pytest.raises(KvshuttleRpcError) as err:
        await calls[method]()
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "the agent has no pool" in err.value.message


async def test_the_lease_survives_a_registry_restart(
    engine: FakeEngineHttp, publisher: FakePublisher
) -> None:
    address = f"127.0.0.1:{free_port()}"
    first = await start_registry_on(address)
    env = await start_agent(agent_settings(address, engine.url, publisher), subscribed=publisher)
    second: RegistryEnv | None = None
    try:
        for frames in LIVE_FRAMES[:14]:
            await publisher.publish(frames)
        await forwarded(env, 14)
        assert (await get_node(first)).incarnation == 1

        await stop_registry(first)
        await eventually(lambda: env.agent.lease.state.failed_heartbeats > 0, what="a failed heartbeat")
        second = await start_registry_on(address)  # empty: no node, no index
        await eventually(lambda: env.agent.lease.state.epoch == 2, what="the new registration")
        node = await get_node(second)
        assert node.incarnation == 1  # the same number as before: the agent goes by epoch
        assert node.engine_id == "engine-a"
        # The index comes back from the replay endpoint without waiting for the engine.
        await eventually(
            lambda: index_view(second.registry.index) == expected_view(live_batches()[:14]),
            what="the rebuilt index",
        )
        status = await env.client.get_status()
        assert status.registered and status.incarnation == 1
        await eventually(lambda: load_healthy(second), what="heartbeats to the new registry")
    finally:
        await env.stop()
        if second is not None:
            await stop_registry(second)


async def load_healthy(registry: RegistryEnv) -> bool:
    node = await node_or_none(registry)
    return node is not None and node.load.engine_healthy


async def test_an_engine_that_turns_healthy_is_reported_at_once_not_a_heartbeat_interval_later(
    registry_env: RegistryEnv, engine: FakeEngineHttp
) -> None:
    # An agent back after a restart registers before its first poll of the engine: its first
    # heartbeat says unhealthy, and the router places nothing on the node until one says healthy.
    engine.health_status = 503
    settings = agent_settings(registry_env.address, engine.url)
    settings.lease.ttl, settings.lease.heartbeat_interval = 300.0, 90.0  # the longest the registry allows
    env = await start_agent(settings)
    try:
        await eventually(lambda: node_or_none(registry_env), what="the registration")
        await eventually(lambda: env.agent.poller.state.polls > 0, what="a poll of the unhealthy engine")
        assert not await load_healthy(registry_env)
        engine.health_status = 200
        await eventually(lambda: load_healthy(registry_env), within=60, what="the healthy engine reported")
        assert env.agent.lease.state.heartbeats <= 3  # the registration's, maybe one more, this one
    finally:
        await env.stop()


async def test_shutdown_flushes_and_deregisters(
    registry_env: RegistryEnv, engine: FakeEngineHttp, publisher: FakePublisher
) -> None:
    # A long linger keeps the last batches queued until shutdown flushes them.
    settings = agent_settings(registry_env.address, engine.url, publisher, linger=0.5)
    env = await start_agent(settings, subscribed=publisher)
    for frames in LIVE_FRAMES[:14]:
        await publisher.publish(frames)
    await eventually(lambda: env.agent.events.batches_received == 14, what="received")
    await env.stop()
    assert env.agent.events.batches_forwarded == 14  # flushed before deregistering
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await get_node(registry_env)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert registry_env.registry.index.node_block_count(NODE) == 0
    assert not env.agent.lease.state.registered


async def test_an_agent_without_events_still_keeps_the_lease(
    registry_env: RegistryEnv, engine: FakeEngineHttp
) -> None:
    env = await start_agent(agent_settings(registry_env.address, engine.url))
    try:
        await eventually(lambda: load_healthy(registry_env), what="a heartbeat with the engine's health")
        status = await env.client.get_status()
        assert status.registered and status.events.endpoint == ""
    finally:
        await env.stop()
    await asyncio.sleep(0)


async def test_a_newer_registration_of_the_node_makes_the_agent_register_again(
    agent: AgentEnv, registry_env: RegistryEnv, publisher: FakePublisher
) -> None:
    for frames in LIVE_FRAMES[:14]:
        await publisher.publish(frames)
    await forwarded(agent, 14)
    # Someone registers the node again (same engine: the registry keeps its index).
    node = await get_node(registry_env)
    node.ClearField("load")
    await registry_env.stub.RegisterNode(rpb.RegisterNodeRequest(node=node))
    await eventually(lambda: agent.agent.lease.state.epoch == 2, what="the agent's new registration")
    assert agent.agent.lease.state.incarnation == (await get_node(registry_env)).incarnation
    await publisher.publish(LIVE_FRAMES[14])
    await forwarded(agent, 15)
    # The registry's cursor was 14 after the re-registration: nothing replayed, nothing lost.
    assert index_view(registry_env.registry.index) == expected_view(live_batches())
    assert publisher.replay_requests == []
    assert agent.agent.events.gaps_detected == 0
