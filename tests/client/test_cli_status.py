"""`kvshuttle status` against real servers on port 0: a registry, an agent with a block pool (its
engine's HTTP and side channel are the agent tests' fakes), a gateway's metrics served over HTTP
by prometheus_client, and an agent that does not answer."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator

import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry, start_http_server
from tests.agent.engine_fakes import FakeEngineHttp, FakeSideChannel, engine_metadata
from tests.agent.helpers import NODE, AgentEnv, eventually, pooled_settings, start_agent
from tests.client.fake_registry import closed_port
from tests.support.cli_runner import arun_cli
from tests.support.registry_env import RegistryEnv
from tests.support.registry_messages import node, register, retention, seconds

from kvshuttle.agent.pool.blocks import PoolLayout
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.gateway.metrics import GatewayMetrics
from kvshuttle.registry.v1 import registry_service_pb2 as pb

LOST_AGENT_NODE = "nodes/lost"


@pytest.fixture
async def pooled_agent(registry_env: RegistryEnv) -> AsyncIterator[AgentEnv]:
    engine = FakeEngineHttp()
    await engine.start()
    side = FakeSideChannel(zmq.asyncio.Context.instance(), engine_metadata(PoolLayout(4, 64, 32 * 1024)))
    env = await start_agent(pooled_settings(registry_env.address, engine.url, side.port))
    yield env
    await env.stop()
    await side.close()
    await engine.stop()


@pytest.fixture
def gateway_metrics() -> Iterator[tuple[str, GatewayMetrics]]:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    yield f"127.0.0.1:{server.server_port}", metrics
    server.shutdown()
    server.server_close()
    thread.join()


async def _stack(registry_env: RegistryEnv, agent: AgentEnv) -> None:
    """A second node whose agent is gone, and three conversations' retentions, put a second
    apart on the registry's clock (c2 last)."""
    lost = node(LOST_AGENT_NODE, engine_id="engine-lost")
    lost.agent_endpoint = f"127.0.0.1:{closed_port()}"
    await register(registry_env, lost)

    async def healthy() -> bool:
        nodes = (await registry_env.stub.ListNodes(pb.ListNodesRequest())).nodes
        return any(n.name == NODE and n.load.engine_healthy for n in nodes)

    await eventually(healthy, what="the agent's node registered with its engine's load")
    for conversation, holder, generation, tokens in (
        ("c1", LOST_AGENT_NODE, 3, 96),
        ("c3", NODE, 1, 32),
        ("c2", NODE, 2, 64),
    ):
        held_by = (await registry_env.stub.GetNode(pb.GetNodeRequest(name=holder))).node
        kept = retention(generation, tokens)
        kept.node, kept.model, kept.block_size = holder, held_by.model, held_by.block_size
        kept.block_hashes[:] = chain_hashes(list(range(tokens)), held_by.block_size)
        params = kept.kv_transfer_params
        params.remote_engine_id, params.remote_port = held_by.engine_id, held_by.side_channel_port
        await registry_env.stub.PutRetention(
            pb.PutRetentionRequest(
                parent=f"tenants/acme/conversations/{conversation}", retention=kept, ttl=seconds(60)
            )
        )
        registry_env.clock.advance(1)


async def test_status_shows_nodes_pools_turns_and_last_turns(
    registry_env: RegistryEnv, pooled_agent: AgentEnv, gateway_metrics: tuple[str, GatewayMetrics]
) -> None:
    await _stack(registry_env, pooled_agent)
    pool = pooled_agent.agent.pool
    assert pool is not None
    pool.allocate("tenants/acme/conversations/c9/retentions/1", 3, expire_at=1e18)
    pool.seal("tenants/acme/conversations/c9/retentions/1")
    address, metrics = gateway_metrics
    metrics.turns.labels("recompute", "no_retention").inc(2)
    metrics.turns.labels("reuse", "reuse_cheaper").inc()
    metrics.reused_tokens.inc(498)
    metrics.commits.labels("stored").inc(3)

    argv = ["status", "--gateway-metrics", address, "--tenant", "acme", "--last", "2"]
    result = await arun_cli(argv, registry=registry_env.address)
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    sections = text.split("\n\n")
    nodes, pools, turns, last = sections
    assert nodes.startswith(f"NODES (registry {registry_env.address}): ")
    assert "3 retentions" in nodes.splitlines()[0]
    agent_row = next(line for line in nodes.splitlines() if line.startswith(f"{NODE} "))
    assert agent_row.split()[1:3] == ["decode", "healthy"]
    assert re.search(r"  2  +\S+ \S+  +127\.0\.0\.1:\d+$", agent_row)  # 2 retentions held, the agent
    lost_row = next(line for line in nodes.splitlines() if line.startswith(f"{LOST_AGENT_NODE} "))
    assert lost_row.split()[2] == "unhealthy"  # no agent reports its engine healthy
    assert pooled_agent.address in pools
    assert "384.0 KiB of 1.0 MiB (3/8 blocks)" in pools
    assert "1 parked, 0 filling" in pools
    assert re.search(rf"127\.0\.0\.1:\d+  {LOST_AGENT_NODE} +unreachable \(UNAVAILABLE\)", pools)
    assert re.search(r"recompute +no_retention +2", turns)
    assert re.search(r"reuse +reuse_cheaper +1", turns)
    assert "3 turns, 1 reused retained KV (33%), 498 prompt tokens reused; commits: 3 stored" in turns
    assert last.splitlines()[0] == "LAST TURNS (tenant acme; newest first)"
    rows = [line.split() for line in last.splitlines()[2:]]
    assert [r[:4] for r in rows] == [
        ["tenants/acme/conversations/c2", "2", "64", NODE],
        ["tenants/acme/conversations/c3", "1", "32", NODE],
    ]


async def test_status_json(
    registry_env: RegistryEnv, pooled_agent: AgentEnv, gateway_metrics: tuple[str, GatewayMetrics]
) -> None:
    await _stack(registry_env, pooled_agent)
    address, metrics = gateway_metrics
    metrics.turns.labels("reuse", "reuse_cheaper").inc(4)
    metrics.reuse_fallbacks.labels("reuse_prefill_timeout").inc()
    unreachable = f"127.0.0.1:{closed_port()}"
    argv = [
        "status",
        "--json",
        "--tenant",
        "acme",
        "--gateway-metrics",
        address,
        "--gateway-metrics",
        unreachable,
    ]
    doc = (await arun_cli(argv, registry=registry_env.address)).json()
    assert doc["registry"] == registry_env.address
    by_name = {n["name"]: n for n in doc["nodes"]}
    assert by_name[NODE]["retentions"] == 2
    assert by_name[NODE]["health"] == "healthy"
    assert by_name[LOST_AGENT_NODE]["health"] == "unhealthy"
    pools = {p["agent"]: p for p in doc["pools"]}
    assert pools[pooled_agent.address]["node"] == NODE
    assert pools[pooled_agent.address]["capacity_bytes"] == 1024 * 1024
    assert pools[by_name[LOST_AGENT_NODE]["agent"]]["error"] == "UNAVAILABLE"
    turns = doc["turns"]
    assert turns["decisions"] == [{"decision": "reuse", "reason": "reuse_cheaper", "turns": 4}]
    assert turns["reuse_fallbacks"] == {"reuse_prefill_timeout": 1}
    assert list(turns["errors"]) == [unreachable]  # the other gateway's counts still add up
    assert [(t["conversation"], t["turn"], t["holder"]) for t in doc["last_turns"]] == [
        ("tenants/acme/conversations/c2", 2, NODE),
        ("tenants/acme/conversations/c3", 1, NODE),
        ("tenants/acme/conversations/c1", 3, LOST_AGENT_NODE),
    ]


async def test_status_without_gateway_metrics_and_from_the_environment(
    registry_env: RegistryEnv, gateway_metrics: tuple[str, GatewayMetrics]
) -> None:
    await register(registry_env)
    plain = await arun_cli(["status"], registry=registry_env.address)
    assert plain.exit_code == 0, plain.stderr
    assert "TURNS: give --gateway-metrics HOST:PORT" in plain.stdout
    assert "LAST TURNS (tenant default; newest first)\n  no live retention" in plain.stdout
    assert "nodes/d0" in plain.stdout
    address, metrics = gateway_metrics
    metrics.turns.labels("recompute", "no_retention").inc()
    env = {"KVSHUTTLE_REGISTRY_ADDR": registry_env.address, "KVSHUTTLE_GATEWAY_METRICS_ADDR": address}
    doc = (await arun_cli(["status", "--json"], env=env)).json()
    assert doc["turns"]["total"] == 1


async def test_status_registry_unreachable_and_bad_options() -> None:
    down = f"127.0.0.1:{closed_port()}"
    result = await arun_cli(["status"], registry=down)
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: cannot reach the registry at {down} (UNAVAILABLE)"
    bad = await arun_cli(["status", "--gateway-metrics", "nohost"], registry=down)
    assert bad.exit_code == 2
    assert "--gateway-metrics: expected HOST:PORT" in bad.stderr
    assert (await arun_cli(["status", "--last", "0"], registry=down)).exit_code == 2
