"""GrpcRouterPort over three real router servers (in process, over gRPC, one registry):
each conversation's plans and commits go to its rendezvous replica, which then plans the next
turn on its own hint; a replica that stops moves only its conversations, to their next-ranked
replica, and a router's refusal is the answer, not a failover."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from tests.router.helpers import MODEL, RouterEnv, Tokens, add_node, start_router
from tests.support.registry_env import RegistryEnv, start_registry

from kvshuttle.gateway.config import RouterConnection
from kvshuttle.gateway.errors import RouterFailure
from kvshuttle.gateway.metrics import GatewayMetrics
from kvshuttle.gateway.turns.router_port import GrpcRouterPort
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.v1 import router_service_pb2 as pb

PROMPT = 4000  # long enough that reuse beats recompute under the Qwen3-32B profile
CONVERSATIONS = [f"tenants/t/conversations/c{i}" for i in range(12)]


@dataclass
class Env:
    registry: RegistryEnv
    routers: dict[str, RouterEnv]
    port: GrpcRouterPort
    metrics: CollectorRegistry
    tokens: Tokens = field(default_factory=Tokens)

    async def turn(self, conversation: str, prompt: list[int]) -> tuple[pb.PlanTurnResponse, list[int]]:
        plan = await self.port.plan_turn(
            MODEL, prompt, conversation=conversation, request_id=f"r{len(prompt)}", cache_salt_sha256=b""
        )
        output = self.tokens(70)
        sequence = prompt + output
        await self.port.commit_turn(
            plan.turn,
            conversation=conversation,
            prompt_token_ids=prompt,
            output_token_ids=output,
            decode_kv_transfer_params=self.tokens.decode_params(plan, len(sequence)),
            timings=pb.TurnTimings(),
        )
        return plan, sequence

    def count(self, name: str, replica: str) -> float:
        return self.metrics.get_sample_value(name, {"replica": replica}) or 0.0

    def hints(self, replica: str, outcome: str) -> float:
        value = self.routers[replica].metrics.get_sample_value(
            "kvshuttle_router_retention_hints_total", {"outcome": outcome}
        )
        return value or 0.0


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    registry = await start_registry()
    await add_node(registry, "nodes/p0", reg_pb.NODE_ROLE_PREFILL)
    await add_node(registry, "nodes/d0", reg_pb.NODE_ROLE_DECODE)
    routers = [await start_router(registry) for _ in range(3)]
    by_address = {f"127.0.0.1:{r.server.port}": r for r in routers}
    metrics = CollectorRegistry()
    connection = RouterConnection(
        address=",".join(by_address), timeout=5, failover_backoff_s=60, failover_max_backoff_s=60
    )
    port = GrpcRouterPort(
        connection,
        tracer_provider=TracerProvider(),
        metrics=GatewayMetrics(metrics),
        affinity_key=b"test-affinity-key",
    )
    port.connect()
    yield Env(registry, by_address, port, metrics)
    await port.close()
    for router in routers:
        await router.close()
    await registry.channel.close()
    registry.registry.close()
    await registry.server.stop()


async def test_a_conversations_turns_go_to_its_replica_which_plans_on_its_hint(env: Env) -> None:
    assert env.port.replicas is not None
    home = {c: env.port.replicas.ranked(c)[0] for c in CONVERSATIONS}
    assert len(set(home.values())) > 1  # 12 conversations spread over the replicas
    for conversation in CONVERSATIONS:
        _, sequence = await env.turn(conversation, env.tokens(PROMPT))
        second, _ = await env.turn(conversation, sequence + env.tokens(50))
        assert second.decision == pb.DECISION_REUSE
    for replica in env.routers:
        mine = sum(1 for c in CONVERSATIONS if home[c] == replica)
        # Two plans and two commits per conversation, all on its replica; each second turn
        # claimed on the hint its first commit left there.
        assert env.count("kvshuttle_gateway_router_picks_total", replica) == 4 * mine
        assert env.hints(replica, "hit") == mine
        assert env.hints(replica, "refused") == 0


async def test_a_replica_that_stops_moves_only_its_conversations(env: Env) -> None:
    assert env.port.replicas is not None
    sequences = {}
    for conversation in CONVERSATIONS:
        _, sequences[conversation] = await env.turn(conversation, env.tokens(PROMPT))
    ranked = {c: env.port.replicas.ranked(c) for c in CONVERSATIONS}
    lost = ranked[CONVERSATIONS[0]][0]
    await env.routers[lost].server.stop()
    picks = {r: env.count("kvshuttle_gateway_router_picks_total", r) for r in env.routers}

    for conversation in CONVERSATIONS:
        plan, _ = await env.turn(conversation, sequences[conversation] + env.tokens(50))
        # The next replica reads the retention from the registry: the turn still reuses.
        assert plan.decision == pb.DECISION_REUSE

    moved = [c for c in CONVERSATIONS if ranked[c][0] == lost]
    for replica in env.routers:
        expected = 2 * sum(1 for c in CONVERSATIONS if ranked[c][0] == replica)
        expected += 2 * sum(1 for c in moved if ranked[c][1] == replica)
        got = env.count("kvshuttle_gateway_router_picks_total", replica) - picks[replica]
        assert got == (0 if replica == lost else expected), replica
    # Tried once, then passed over for its backoff (60 s here): one failover, not one per call.
    assert env.count("kvshuttle_gateway_router_failovers_total", lost) == 1
    assert sum(env.hints(ranked[c][1], "miss") for c in moved) >= len(moved)


async def test_a_routers_refusal_is_its_answer_not_a_failover(env: Env) -> None:
    with pytest.raises(RouterFailure) as refused:
        await env.port.plan_turn(
            "no-such-model", [1, 2, 3], conversation=CONVERSATIONS[0], request_id="r", cache_salt_sha256=b""
        )
    assert refused.value.code in {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION"}
    assert all(env.count("kvshuttle_gateway_router_failovers_total", r) == 0 for r in env.routers)


async def test_with_every_replica_down_the_turn_gets_unavailable(env: Env) -> None:
    for router in env.routers.values():
        await router.server.stop()
    with pytest.raises(RouterFailure) as failed:
        await env.port.plan_turn(
            MODEL, env.tokens(100), conversation=CONVERSATIONS[0], request_id="r", cache_salt_sha256=b""
        )
    # What the turn runner degrades on: plain P->D on the model's last placement.
    assert failed.value.code == "UNAVAILABLE" and failed.value.reason is None
    assert all(env.count("kvshuttle_gateway_router_failovers_total", r) == 1 for r in env.routers)


async def test_a_commit_that_lands_on_another_replica_is_sent_again_whole(env: Env) -> None:
    assert env.port.replicas is not None
    conversation = CONVERSATIONS[0]
    prompt = env.tokens(PROMPT)
    plan = await env.port.plan_turn(
        MODEL, prompt, conversation=conversation, request_id="r1", cache_salt_sha256=b""
    )
    home, nxt = env.port.replicas.ranked(conversation)[:2]
    await env.routers[home].server.stop()  # the replica that planned, and holds the prompt
    output = env.tokens(70)
    sequence = prompt + output

    result = await env.port.commit_turn(
        plan.turn,
        conversation=conversation,
        prompt_token_ids=prompt,
        output_token_ids=output,
        decode_kv_transfer_params=env.tokens.decode_params(plan, len(sequence)),
        timings=pb.TurnTimings(),
    )

    # The next replica refused the output alone (PROMPT_NOT_HELD) and stored the whole sequence.
    assert result.retention
    assert env.metrics.get_sample_value("kvshuttle_gateway_commits_resent_total") == 1.0
    second = await env.port.plan_turn(
        MODEL, sequence + env.tokens(50), conversation=conversation, request_id="r2", cache_salt_sha256=b""
    )
    assert second.decision == pb.DECISION_REUSE
    assert env.count("kvshuttle_gateway_router_picks_total", nxt) == 2


async def test_a_commit_on_the_replica_that_planned_sends_the_output_alone(env: Env) -> None:
    assert env.port.replicas is not None
    _, sequence = await env.turn(CONVERSATIONS[1], env.tokens(PROMPT))
    second, _ = await env.turn(CONVERSATIONS[1], sequence + env.tokens(50))

    assert second.decision == pb.DECISION_REUSE
    assert env.metrics.get_sample_value("kvshuttle_gateway_commits_resent_total") == 0.0
    home = env.routers[env.port.replicas.ranked(CONVERSATIONS[1])[0]].metrics

    def received(method: str) -> float:
        labels = {"service": "kvshuttle.router.v1.RouterService", "method": method}
        return home.get_sample_value("kvshuttle_rpc_request_bytes_total", labels) or 0.0

    # Two prompts of 4,000+ tokens planned (2-3 bytes an id); two outputs of 70 committed, with
    # decode's params (block ids): far less than a prompt sent again.
    assert received("PlanTurn") > 2 * 2 * PROMPT
    assert received("CommitTurn") < 2 * PROMPT
