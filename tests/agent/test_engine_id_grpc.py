"""The agent following its engine id file, on real sockets: a registry over gRPC, the engine's
HTTP server and KV-event publisher. When the file names a new engine the node is registered
again with its id: the old engine's retentions and block index are gone, and the new engine's
event sequence (from 0 again) fills the index."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import zmq.asyncio
from google.protobuf.duration_pb2 import Duration
from tests.agent.engine_fakes import (
    BLOCK_SIZE,
    FakeEngineHttp,
    FakePublisher,
    FakeSideChannel,
    engine_metadata,
    write_id,
)
from tests.agent.helpers import (
    MODEL,
    NODE,
    agent_settings,
    eventually,
    expected_view,
    index_view,
    pooled_settings,
    start_agent,
)
from tests.support.fixtures_vllm import live_batches, load_frames
from tests.support.registry_env import RegistryEnv

from kvshuttle.agent.config import AgentSettings
from kvshuttle.agent.pool.blocks import PoolLayout
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.registry.v1 import registry_service_pb2 as rpb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import BlockIdList, KvTransferParams

LIVE_FRAMES = load_frames()["live"]
CONVERSATION = "tenants/t/conversations/c"
POOL_NODE = f"{NODE}-pool"


def following(settings: AgentSettings, id_file: Path) -> AgentSettings:
    node = settings.node.model_copy(update={"engine_id": None, "engine_id_file": id_file})
    engine = settings.engine.model_copy(update={"id_poll_interval": 0.02, "id_wait_timeout": 30})
    return settings.model_copy(update={"node": node, "engine": engine})


async def put_retention(registry: RegistryEnv, engine_id: str) -> str:
    tokens = 3 * BLOCK_SIZE
    ttl = Duration()
    ttl.FromSeconds(600)
    retention = rpb.Retention(
        node=NODE,
        generation=1,
        model=MODEL,
        block_size=BLOCK_SIZE,
        num_tokens=tokens,
        block_hashes=chain_hashes(list(range(tokens)), BLOCK_SIZE),
        kv_bytes=tokens * 4096,
        kv_transfer_params=KvTransferParams(
            do_remote_decode=True,
            remote_engine_id=engine_id,
            remote_host="127.0.0.1",
            remote_port=5600,
            remote_block_ids=[BlockIdList(block_ids=[1, 2, 3])],
            remote_num_tokens=tokens,
        ),
    )
    response = await registry.stub.PutRetention(
        rpb.PutRetentionRequest(parent=CONVERSATION, retention=retention, ttl=ttl)
    )
    return response.retention.name


async def test_a_new_engine_id_registers_the_node_again_and_drops_the_old_engines_state(
    registry_env: RegistryEnv, engine: FakeEngineHttp, publisher: FakePublisher, tmp_path: Path
) -> None:
    id_file = tmp_path / "engine-id"
    write_id(id_file, "decode-0-aaaa")
    # No replay: the index after the change holds only what the new engine publishes.
    settings = following(agent_settings(registry_env.address, engine.url, publisher, replay=False), id_file)
    env = await start_agent(settings, subscribed=publisher)
    try:
        for frames in LIVE_FRAMES[:5]:
            await publisher.publish(frames)
        await eventually(lambda: env.agent.events.batches_forwarded >= 5, what="5 batches forwarded")
        first = (await registry_env.stub.GetNode(rpb.GetNodeRequest(name=NODE))).node
        assert first.engine_id == "decode-0-aaaa"
        assert registry_env.registry.index.node_block_count(NODE) > 0
        name = await put_retention(registry_env, "decode-0-aaaa")

        write_id(id_file, "decode-0-bbbb")  # the engine restarted

        async def registered_anew() -> bool:
            node = (await registry_env.stub.GetNode(rpb.GetNodeRequest(name=NODE))).node
            return node.engine_id == "decode-0-bbbb" and env.agent.lease.state.registered

        await eventually(registered_anew, what="the node registered with the new engine id")
        second = (await registry_env.stub.GetNode(rpb.GetNodeRequest(name=NODE))).node
        assert second.incarnation > first.incarnation
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await registry_env.stub.GetRetention(rpb.GetRetentionRequest(name=name))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert registry_env.registry.index.node_block_count(NODE) == 0
        status = await env.client.get_status()
        assert (status.engine.engine_id, status.registered) == ("decode-0-bbbb", True)

        # The new engine's sequence starts at 0 again: forwarded, under the new registration.
        for frames in LIVE_FRAMES[:3]:
            await publisher.publish(frames)
        await eventually(
            lambda: index_view(registry_env.registry.index) == expected_view(live_batches()[:3]),
            what="the new engine's index",
        )
        assert env.agent.engine_ids is not None and env.agent.engine_ids.changes == 1
    finally:
        await env.stop()


async def test_the_agent_waits_for_the_id_file_before_registering(
    registry_env: RegistryEnv, engine: FakeEngineHttp, tmp_path: Path
) -> None:
    id_file = tmp_path / "engine-id"
    settings = following(agent_settings(registry_env.address, engine.url), id_file)
    starting = asyncio.create_task(start_agent(settings))
    await asyncio.sleep(0.2)
    assert not starting.done()
    assert not (await registry_env.stub.ListNodes(rpb.ListNodesRequest())).nodes
    write_id(id_file, "decode-0-cccc")
    env = await starting
    try:
        await env.agent.lease.wait_registered()
        node = (await registry_env.stub.GetNode(rpb.GetNodeRequest(name=NODE))).node
        assert node.engine_id == "decode-0-cccc"
    finally:
        await env.stop()


async def test_the_pool_node_follows_the_engine_too(
    registry_env: RegistryEnv, engine: FakeEngineHttp, tmp_path: Path
) -> None:
    layout = PoolLayout(4, 64, 32 * 1024)
    side_channel = FakeSideChannel(zmq.asyncio.Context.instance(), engine_metadata(layout, engine_id="e-1"))
    id_file = tmp_path / "engine-id"
    write_id(id_file, "e-1")
    env = await start_agent(
        following(pooled_settings(registry_env.address, engine.url, side_channel.port), id_file)
    )
    try:
        agent = env.agent
        assert agent.engine_nixl is not None and agent.server is not None
        first_lease = agent.pool_lease
        assert first_lease is not None
        await first_lease.wait_registered()
        first_pool = (await env.registry_client.get_node(POOL_NODE)).node
        first_server = agent.server.engine_id

        # The new engine answers its side channel as e-2; the agent checks it before serving.
        side_channel.metadata = engine_metadata(layout, engine_id="e-2")
        write_id(id_file, "e-2")

        async def pool_registered_anew() -> bool:
            lease = agent.pool_lease
            if lease is None or not lease.state.registered or agent.server is None:
                return False
            node = (await env.registry_client.get_node(POOL_NODE)).node
            return node.engine_id == agent.server.engine_id != first_server

        await eventually(pool_registered_anew, what="the pool node registered beside the new engine")
        assert agent.engine_nixl is not None and agent.engine_nixl.metadata.engine_id == "e-2"
        second_pool = (await env.registry_client.get_node(POOL_NODE)).node
        assert second_pool.incarnation > first_pool.incarnation
        assert (await env.registry_client.get_node(NODE)).node.engine_id == "e-2"
        status = await env.client.get_status()
        assert status.engine.engine_id == "e-2" and status.pool.parked_retentions == 0
    finally:
        await env.stop()
        await side_channel.close()
