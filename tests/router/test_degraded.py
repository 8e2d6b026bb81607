"""Degrade, never fail: the router with a registry that does not answer.

Over the registry's domain in process, behind a port that fails, when told to, as an unreachable
registry does through GrpcRegistryPort (Unavailable, REGISTRY_UNAVAILABLE), or never answers.
No sockets; the node list's age runs on a hand-moved clock where the test needs it.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
from bench.fleet.inproc import InProcessPort
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs
from tests.support.clock import FakeClock

from kvshuttle.core.errors import FailedPrecondition, Unavailable
from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.router.cost import CostModel, LinkModel, ModelProfile, PrefillModel
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.router.model import (
    ClaimInfo,
    CommitRequest,
    CommitResult,
    Decision,
    Hashes,
    NewRetention,
    NodeInfo,
    Plan,
    PlanRequest,
    Reason,
    RetentionInfo,
    TurnTimings,
)
from kvshuttle.router.node_directory import NodeDirectory
from kvshuttle.router.policy import RouterPolicy
from kvshuttle.router.router import Router
from kvshuttle.router.turns import TurnCodec

CPU = ModelProfile(
    model="m",
    kv_bytes_per_token=16_384,
    prefill=PrefillModel(fixed_ms=5, per_token_ms=0.5),
    link=LinkModel(bandwidth_gb_s=5, fixed_ms=5),
)
BS = 16
CONV = "tenants/acme/conversations/c1"
PLAIN_PD = {"do_remote_decode": True, "do_remote_prefill": False}


def unreachable() -> Unavailable:
    """What GrpcRegistryPort raises for UNAVAILABLE / DEADLINE_EXCEEDED (client.errors.as_domain)."""
    return Unavailable(
        "registry unavailable (UNAVAILABLE): failed to connect", reason=ErrorReason.REGISTRY_UNAVAILABLE
    )


class FlakyPort(InProcessPort):
    """The registry's domain in process; `down` names the calls that fail as unreachable (all
    of them: "*"), `hang` those that never answer."""

    def __init__(self, registry: Registry) -> None:
        super().__init__(registry)
        self.down: set[str] = set()
        self.hang: set[str] = set()
        self.attempts: list[str] = []

    async def _gate(self, name: str) -> None:
        self.attempts.append(name)
        if name in self.hang or "*" in self.hang:
            await asyncio.Event().wait()
        if name in self.down or "*" in self.down:
            raise unreachable()

    async def get_conversation(self, name: str) -> tuple[int, RetentionInfo | None]:
        await self._gate("get_conversation")
        return await super().get_conversation(name)

    async def list_nodes(self, model: str) -> list[NodeInfo]:
        await self._gate("list_nodes")
        return await super().list_nodes(model)

    async def lookup_blocks(self, chain: Hashes, model: str, role: NodeRole) -> dict[str, int]:
        await self._gate("lookup_blocks")
        return await super().lookup_blocks(chain, model, role)

    async def claim(
        self, name: str, *, holder: str, claim_ttl: float, request_id: str, shared: bool = False
    ) -> ClaimInfo:
        await self._gate("claim")
        return await super().claim(name, holder=holder, claim_ttl=claim_ttl, request_id=request_id)

    async def put_retention(self, new: NewRetention) -> RetentionInfo:
        await self._gate("put_retention")
        return await super().put_retention(new)

    async def release(self, name: str, *, claim_id: str, keep: bool = False) -> None:
        await self._gate("release")
        await super().release(name, claim_id=claim_id, keep=keep)


class Cluster:
    """A registry with one prefill and one decode node; routers over it through FlakyPorts."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.registry = self._registry()
        self.rng = random.Random(5)
        self.block_ids = iter(range(1, 10**9))

    def _registry(self) -> Registry:
        return Registry(InMemoryStore(), self.clock, BlockIndex(100_000), RegistryLimits())

    async def add_nodes(self) -> None:
        for name, role in (("nodes/p0", NodeRole.PREFILL), ("nodes/d0", NodeRole.DECODE)):
            node = await self.registry.register_node(
                NodeSpec(
                    name=name,
                    role=role,
                    engine_id=f"engine-{name[6:]}",
                    http_endpoint=f"http://{name[6:]}:8000",
                    side_channel_host="127.0.0.1",
                    side_channel_port=5600,
                    agent_endpoint="",
                    model=CPU.model,
                    block_size=BS,
                    kv_bytes_per_token=CPU.kv_bytes_per_token,
                ),
                ttl=300,
            )
            await self.registry.heartbeat_node(name, node.incarnation, 300, NodeLoad(engine_healthy=True))

    async def restart_registry(self, port: FlakyPort) -> None:
        """The in-memory registry restarted: everything it held is gone; the agents register again."""
        self.registry = port.registry = self._registry()
        await self.add_nodes()

    def router(self, **policy: Any) -> tuple[Router, FlakyPort, CollectorRegistry]:
        port = FlakyPort(self.registry)
        metrics = CollectorRegistry()
        router = Router(
            port,
            self.clock,
            [CostModel(CPU)],
            TurnCodec(b"k" * 32),
            RouterPolicy(**policy),
            RouterMetrics(metrics),
        )
        return router, port, metrics

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 150_000) for _ in range(n)]

    def decode_params(self, plan: Plan, total_tokens: int) -> dict[str, Any]:
        blocks = -(-total_tokens // BS)
        return {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_block_ids": [[next(self.block_ids) for _ in range(blocks)]],
            "remote_engine_id": plan.decode.engine_id,
            "remote_request_id": f"cmpl-{plan.generation}",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "remote_num_tokens": total_tokens,
        }

    async def plan(self, router: Router, prompt: list[int]) -> Plan:
        return await router.plan_turn(
            PlanRequest(model=CPU.model, prompt_token_ids=prompt, conversation=CONV)
        )

    async def commit(self, router: Router, plan: Plan, prompt: list[int]) -> tuple[CommitResult, list[int]]:
        sequence = prompt + self.tokens(48)
        result = await router.commit_turn(
            CommitRequest(
                turn=plan.turn,
                token_ids=sequence,
                decode_kv_transfer_params=self.decode_params(plan, len(sequence)),
                timings=TurnTimings(ttft_ms=100.0, prefill_ms=90.0),
            )
        )
        return result, sequence


@pytest.fixture
async def cluster() -> Cluster:
    c = Cluster()
    await c.add_nodes()
    return c


def commits(metrics: CollectorRegistry, outcome: str) -> float:
    return metrics.get_sample_value("kvshuttle_router_commits_total", {"outcome": outcome}) or 0.0


def decisions(metrics: CollectorRegistry, reason: Reason) -> float:
    labels = {"decision": "recompute", "reason": reason.value}
    return metrics.get_sample_value("kvshuttle_router_decisions_total", labels) or 0.0


async def test_a_registry_that_does_not_answer_gets_plain_pd_on_the_last_nodes_and_reuse_resumes(
    cluster: Cluster,
) -> None:
    # Every plan reads the node list (none is fresh enough), so the registry's absence shows at once.
    router, port, metrics = cluster.router(node_max_age_s=0.0)
    first = cluster.tokens(600)
    plan1 = await cluster.plan(router, first)
    stored1, seq1 = await cluster.commit(router, plan1, first)
    assert stored1.retention

    port.down = {"*"}
    prompt2 = seq1 + cluster.tokens(40)
    with capture_logs() as logs:
        plan2 = await cluster.plan(router, prompt2)
        result2, seq2 = await cluster.commit(router, plan2, prompt2)

    assert (plan2.decision, plan2.reason, plan2.claimed, plan2.reusable_tokens) == (
        Decision.RECOMPUTE,
        Reason.REGISTRY_UNAVAILABLE,
        "",
        0,
    )
    assert plan2.prefill_kv_transfer_params == PLAIN_PD  # decode still reads prefill's KV
    assert (plan2.prefill.name, plan2.decode.name) == ("nodes/p0", "nodes/d0")
    assert plan2.generation == 2  # the replica's hint knew the conversation's generation
    assert "claim" not in port.attempts
    # The commit succeeds with nothing stored, and says so.
    assert result2 == CommitResult("", None, not_stored="registry_unavailable")
    assert any(
        e["event"] == "commit.not_stored" and e["reason"] == ErrorReason.REGISTRY_UNAVAILABLE for e in logs
    )
    assert any(e["event"] == "plan.degraded" for e in logs)
    assert commits(metrics, "registry_unavailable") == 1
    assert decisions(metrics, Reason.REGISTRY_UNAVAILABLE) == 1

    # The registry answers again: the next turn reads the last stored retention (a verified
    # prefix of its prompt) without anyone telling the router.
    port.down = set()
    prompt3 = seq2 + cluster.tokens(40)
    plan3 = await cluster.plan(router, prompt3)
    assert (plan3.decision, plan3.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)
    assert plan3.reusable_tokens == len(seq1)  # turn 1's retention, to its last token
    stored3, _ = await cluster.commit(router, plan3, prompt3)
    assert stored3.retention.endswith("/retentions/2")  # the fence counts stored turns


async def test_after_a_registry_restart_the_first_commit_stores_and_the_next_turn_reuses(
    cluster: Cluster,
) -> None:
    router, port, _ = cluster.router(node_max_age_s=0.0)
    first = cluster.tokens(500)
    plan1 = await cluster.plan(router, first)
    _, seq1 = await cluster.commit(router, plan1, first)

    port.down = {"*"}
    prompt2 = seq1 + cluster.tokens(30)
    plan2 = await cluster.plan(router, prompt2)
    assert plan2.reason == Reason.REGISTRY_UNAVAILABLE
    await cluster.restart_registry(port)  # in memory: retentions and fences are gone
    port.down = set()
    # The degraded turn's commit lands on the restarted registry: stored (no fence there).
    stored2, seq2 = await cluster.commit(router, plan2, prompt2)
    assert stored2.retention.endswith("/retentions/2")

    prompt3 = seq2 + cluster.tokens(30)
    plan3 = await cluster.plan(router, prompt3)
    assert (plan3.decision, plan3.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)


async def test_a_degraded_commit_behind_a_newer_turn_stores_nothing_and_does_not_fail(
    cluster: Cluster,
) -> None:
    # Replica A commits turns 1 and 2; replica B, knowing nothing of the conversation, plans
    # turn 3 while the registry is away: its generation (1) is a guess.
    a, _, _ = cluster.router()
    b, port_b, _ = cluster.router(node_max_age_s=0.0)
    await cluster.plan(b, cluster.tokens(64))  # B has read the node list once
    first = cluster.tokens(300)
    plan1 = await cluster.plan(a, first)
    _, seq1 = await cluster.commit(a, plan1, first)
    prompt2 = seq1 + cluster.tokens(20)
    plan2 = await cluster.plan(a, prompt2)
    _, seq2 = await cluster.commit(a, plan2, prompt2)

    port_b.down = {"*"}
    prompt3 = seq2 + cluster.tokens(20)
    plan3 = await cluster.plan(b, prompt3)
    assert (plan3.reason, plan3.generation) == (Reason.REGISTRY_UNAVAILABLE, 1)
    port_b.down = set()
    with capture_logs() as logs:
        result, _ = await cluster.commit(b, plan3, prompt3)
    assert result.retention == ""
    assert any(
        e["event"] == "commit.not_stored" and e["reason"] == ErrorReason.FENCING_GENERATION_STALE
        for e in logs
    )
    # Turn 2's retention is still the conversation's.
    fence, retention = await port_b.get_conversation(CONV)
    assert fence == 2 and retention is not None and retention.generation == 2


async def test_a_claim_the_registry_does_not_answer_degrades_the_plan(cluster: Cluster) -> None:
    router, port, _ = cluster.router()
    first = cluster.tokens(600)
    plan1 = await cluster.plan(router, first)
    _, seq1 = await cluster.commit(router, plan1, first)
    assert router.hints.get(CONV) is not None

    port.down = {"claim"}
    plan2 = await cluster.plan(router, seq1 + cluster.tokens(40))

    assert (plan2.decision, plan2.reason, plan2.claimed) == (
        Decision.RECOMPUTE,
        Reason.REGISTRY_UNAVAILABLE,
        "",
    )
    assert plan2.prefill_kv_transfer_params == PLAIN_PD
    assert plan2.generation == 2
    # The claim may have landed: the hint is not offered again.
    assert router.hints.get(CONV) is None


async def test_without_a_node_list_young_enough_the_plan_is_unavailable(cluster: Cluster) -> None:
    # Never read: nothing to fall back on.
    router, port, _ = cluster.router()
    port.down = {"*"}
    with pytest.raises(Unavailable) as err:
        await cluster.plan(router, cluster.tokens(100))
    assert err.value.reason == ErrorReason.REGISTRY_UNAVAILABLE

    # Fallback off: the registry's error as it was.
    router, port, _ = cluster.router(node_max_age_s=0.0, degraded_nodes_max_age_s=0.0)
    await cluster.plan(router, cluster.tokens(100))
    port.down = {"*"}
    with pytest.raises(Unavailable) as err:
        await cluster.plan(router, cluster.tokens(100))
    assert err.value.reason == ErrorReason.REGISTRY_UNAVAILABLE


class Monotonic:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_the_last_known_list_serves_only_within_its_staleness_bound(cluster: Cluster) -> None:
    clock = Monotonic()
    port = FlakyPort(cluster.registry)
    nodes = NodeDirectory(port, refresh_s=1.0, max_age_s=5.0, degraded_max_age_s=60.0, monotonic=clock)
    assert nodes.last_known(CPU.model) is None  # never read
    listed = await nodes.nodes(CPU.model)
    port.down = {"*"}
    clock.now += 59.0
    with pytest.raises(Unavailable):
        await nodes.nodes(CPU.model)  # past max_age_s: the plan reads, and fails
    assert nodes.last_known(CPU.model) == (listed, 59.0)  # the failed read kept the last list
    clock.now += 1.0
    assert nodes.last_known(CPU.model) is None


async def test_a_commit_does_not_wait_long_for_a_registry_that_never_answers(cluster: Cluster) -> None:
    router, port, metrics = cluster.router(commit_registry_timeout_s=0.05)
    first = cluster.tokens(600)
    plan1 = await cluster.plan(router, first)
    _, seq1 = await cluster.commit(router, plan1, first)
    prompt2 = seq1 + cluster.tokens(40)
    plan2 = await cluster.plan(router, prompt2)
    assert plan2.claimed  # the commit releases it as well

    port.hang = {"put_retention", "release"}
    started = time.perf_counter()
    with capture_logs() as logs:
        result, _ = await cluster.commit(router, plan2, prompt2)
    assert time.perf_counter() - started < 1.0
    assert result.retention == ""
    events = {e["event"] for e in logs}
    assert {"commit.not_stored", "commit.release_failed"} <= events
    assert commits(metrics, "registry_unavailable") == 1


async def test_abort_succeeds_when_the_registry_is_away_and_the_claim_lapses_on_its_own(
    cluster: Cluster,
) -> None:
    router, port, _ = cluster.router(claim_ttl_s=30)
    first = cluster.tokens(600)
    plan1 = await cluster.plan(router, first)
    _, seq1 = await cluster.commit(router, plan1, first)
    plan2 = await cluster.plan(router, seq1 + cluster.tokens(40))
    assert plan2.claimed

    port.down = {"*"}
    with capture_logs() as logs:
        await router.abort_turn(plan2.turn, "engine failed")
    assert {"abort.fence_unknown", "abort.release_failed", "turn.aborted"} <= {e["event"] for e in logs}
    with pytest.raises(FailedPrecondition) as err:  # the turn is finished all the same
        await router.abort_turn(plan2.turn, "again")
    assert err.value.reason == ErrorReason.TURN_FINISHED

    # The claim was never released: it lapses on its TTL, and the retention with it.
    port.down = set()
    cluster.clock.advance(31)
    await cluster.registry.expire_due()
    plan3 = await cluster.plan(router, seq1 + cluster.tokens(40))
    assert (plan3.decision, plan3.reason) == (Decision.RECOMPUTE, Reason.NO_RETENTION)


async def test_a_degraded_turn_aborts_without_asking_the_registry(cluster: Cluster) -> None:
    router, port, _ = cluster.router(node_max_age_s=0.0)
    await cluster.plan(router, cluster.tokens(64))
    port.down = {"*"}
    plan = await cluster.plan(router, cluster.tokens(200))
    assert plan.reason == Reason.REGISTRY_UNAVAILABLE
    port.down, port.attempts = set(), []
    await router.abort_turn(plan.turn, "client disconnected")
    assert port.attempts == []
