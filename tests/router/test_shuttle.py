"""The shuttle: parks and prefetches a replica's committed retentions in agents' pools, over the
registry's domain in process (its MoveRetention included) and a fake agent port."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from bench.fleet.inproc import InProcessPort
from prometheus_client import CollectorRegistry
from tests.router.shuttle_cluster import (
    BS,
    CONV,
    CPU,
    MODEL,
    POOL_PORT,
    PROFILES,
    Cluster,
    moves,
    shuttle,
    tick,
)

from kvshuttle.core.errors import FailedPrecondition, ResourceExhausted, Unavailable
from kvshuttle.core.nodes import NodeRole
from kvshuttle.router.config import RouterSettings
from kvshuttle.router.cost import CostModel
from kvshuttle.router.ledger import PlacementLedger
from kvshuttle.router.main import build_router, supervise_shuttle
from kvshuttle.router.model import (
    Decision,
    NodeInfo,
    PlanRequest,
    Reason,
    TurnEnd,
)
from kvshuttle.router.placement import choose_prefill
from kvshuttle.router.policy import ExtendPolicy, NextTurnPolicy, ParkingPolicy, RouterPolicy
from kvshuttle.router.router import Router


@pytest.fixture
async def cluster() -> Cluster:
    return await Cluster.prefill_and_decode()


async def test_an_idle_conversation_is_parked_and_its_next_turn_reads_from_the_pool(cluster: Cluster) -> None:
    router = cluster.router(park_after_idle_s=30)
    _, seq = await cluster.turn(router, cluster.tokens(1000))
    assert len(shuttle(router)) == 1
    cluster.clock.advance(29)
    assert await tick(router) == 0  # not idle long enough
    cluster.clock.advance(2)
    assert await tick(router) == 1
    [(kind, endpoint, name, source, ttl)] = cluster.agents.calls
    assert (kind, endpoint, name) == ("park", "d:7000", f"{CONV}/retentions/1")
    # The whole retention, addressed to its holder as registered.
    assert (source["remote_engine_id"], source["remote_port"]) == ("engine-d", 5600)
    assert source["remote_num_tokens"] == len(seq)
    assert len(source["remote_block_ids"][0]) == -(-len(seq) // BS)
    assert ttl == pytest.approx(600 - 31)
    stored = await cluster.registry.get_retention(f"{CONV}/retentions/1")
    assert stored.node == "nodes/d-pool" and stored.claim is None and stored.pin_expire_at is None
    assert stored.expire_at == pytest.approx(cluster.clock.now() + 600 - 31)
    assert moves(router, "park", "idle", "moved") == 1
    assert len(shuttle(router)) == 0

    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + cluster.tokens(50), conversation=CONV)
    )
    assert plan.decision is Decision.REUSE and plan.reusable_tokens == len(seq)
    params = plan.prefill_kv_transfer_params
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == (
        "pool-engine-d-pool",
        "127.0.0.2",
        POOL_PORT,
    )
    assert params["remote_block_ids"][0][0] == 9000  # type: ignore[index]
    metrics = shuttle(router)._metrics
    assert metrics.plan_holders.labels("pool")._value.get() == 1


async def test_a_pool_whose_agent_does_not_answer_is_not_read_and_keeps_its_retention(
    cluster: Cluster,
) -> None:
    router = cluster.router(park_after_idle_s=30)
    _, seq = await cluster.turn(router, cluster.tokens(400))
    cluster.clock.advance(31)
    assert await tick(router) == 1
    cluster.agents.dead.add("d:7000")  # killed: its pool node is still listed, its lease runs
    prompt = seq + cluster.tokens(50)
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV))
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, Reason.NODE_DOWN)
    assert cluster.agents.probes == ["d:7000"]
    stored = await cluster.registry.get_retention(f"{CONV}/retentions/1")
    assert stored.claim is None and stored.node == "nodes/d-pool"  # unclaimed: nothing consumed
    assert shuttle(router)._metrics.holders_not_serving._value.get() == 1
    cluster.agents.dead.clear()  # back: read from its pool again
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV))
    assert plan.decision is Decision.REUSE


async def test_a_retention_moved_by_another_replica_is_read_where_it_is_now(cluster: Cluster) -> None:
    router = cluster.router(park_after_idle_s=30)
    _, seq = await cluster.turn(router, cluster.tokens(700))
    # Another replica's shuttle moves it: this replica's hint still names the decode node.
    other = cluster.router(park_after_idle_s=30)
    shuttle(other).committed(
        CONV,
        (await router._committer._parts.port.get_conversation(CONV))[1],  # type: ignore[arg-type]
        kv_bytes=1,
        pin_expire_at=cluster.clock.now() + 450,
        prefill_node="nodes/p",
        expected_think_time_s=None,
    )
    cluster.clock.advance(31)
    await tick(other)
    assert moves(other, "park", "idle", "moved") == 1
    shuttle(router).forget(CONV)
    assert router.hints.get(CONV) is not None and router.hints.get(CONV).node == "nodes/d"  # type: ignore[union-attr]
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + cluster.tokens(10), conversation=CONV)
    )
    assert plan.decision is Decision.REUSE and plan.reusable_tokens == len(seq)
    assert plan.prefill_kv_transfer_params["remote_engine_id"] == "pool-engine-d-pool"


async def test_a_newer_commit_replaces_the_schedule_and_an_older_retention_is_not_moved(
    cluster: Cluster,
) -> None:
    router = cluster.router(park_after_idle_s=30)
    _, seq = await cluster.turn(router, cluster.tokens(300))
    cluster.clock.advance(20)
    await cluster.turn(router, seq + cluster.tokens(40))
    assert len(shuttle(router)) == 1
    cluster.clock.advance(11)
    assert await tick(router) == 0  # turn 1's due time passed: replaced
    cluster.clock.advance(20)
    await tick(router)
    assert [c[2] for c in cluster.agents.calls] == [f"{CONV}/retentions/2"]

    # A commit another replica made meanwhile: the scheduled one is gone, nothing is claimed.
    other = cluster.router()
    router2 = cluster.router(park_after_idle_s=30)
    _, seq = await cluster.turn(router2, cluster.tokens(300), conversation="tenants/acme/conversations/c2")
    await cluster.turn(other, seq + cluster.tokens(20), conversation="tenants/acme/conversations/c2")
    cluster.clock.advance(31)
    await tick(router2)
    assert moves(router2, "park", "idle", "skipped_replaced") == 1
    assert len(cluster.agents.calls) == 1


async def test_a_full_decode_node_parks_its_oldest_retentions_at_once(cluster: Cluster) -> None:
    router = cluster.router(park_after_idle_s=300, max_in_flight=1)
    for c in ("c1", "c2"):
        await cluster.turn(router, cluster.tokens(200), conversation=f"tenants/acme/conversations/{c}")
        cluster.clock.advance(1)
    assert await tick(router) == 0
    await cluster.load("nodes/d", kv_cache_usage=0.9)
    assert await tick(router) == 1
    assert [c[2] for c in cluster.agents.calls] == ["tenants/acme/conversations/c1/retentions/1"]
    assert moves(router, "park", "kv_usage", "moved") == 1
    assert len(shuttle(router)) == 1


async def teach_tool_gaps(
    cluster: Cluster, router: Router, *, conversations: int = 8, gap_s: float = 0.8
) -> None:
    """acme's agents: three turns each, every answer a tool call, back after gap_s; then parked."""
    for i in range(conversations):
        conversation = f"tenants/acme/conversations/taught{i}"
        _, seq = await cluster.turn(
            router, cluster.tokens(100), conversation=conversation, turn_end=TurnEnd.TOOL_CALL
        )
        for _ in range(2):
            cluster.clock.advance(gap_s)
            _, seq = await cluster.turn(router, seq + cluster.tokens(20), conversation=conversation,
                                        turn_end=TurnEnd.TOOL_CALL)  # fmt: skip
    cluster.clock.advance(3)
    await tick(router)
    for i in range(conversations):  # the first few were scheduled before anything was learnt
        shuttle(router).forget(f"tenants/acme/conversations/taught{i}")


async def test_a_tool_call_stays_on_decode_through_its_learnt_gap_and_a_stop_parks_at_once(
    cluster: Cluster,
) -> None:
    router = cluster.router(park_after_idle_s=30, next_turn=True)  # the timer, where nothing is learnt
    await teach_tool_gaps(cluster, router)
    moved = moves(router, "park", "next_turn", "moved")
    assert moved >= 5  # the taught conversations' last retentions, once learnt: the learnt time

    # A tool call: kept ~the taught gap (0.8 s), not the 30 s timer.
    await cluster.turn(router, cluster.tokens(300), turn_end=TurnEnd.TOOL_CALL)
    cluster.clock.advance(0.5)
    assert await tick(router) == 0
    cluster.clock.advance(0.6)
    assert await tick(router) == 1
    assert moves(router, "park", "next_turn", "moved") == moved + 1

    # acme's answers to people never came back here: a stop parks at once.
    for i in range(8):
        await cluster.turn(router, cluster.tokens(50), conversation=f"tenants/acme/conversations/gone{i}",
                           turn_end=TurnEnd.STOP)  # fmt: skip
        cluster.clock.advance(60)
        await tick(router)
    await cluster.turn(
        router, cluster.tokens(300), conversation="tenants/acme/conversations/s", turn_end=TurnEnd.STOP
    )
    assert await tick(router) == 1
    # Another tenant's conversation learns nothing from acme's: the timer.
    idle = moves(router, "park", "idle", "moved")
    await cluster.turn(router, cluster.tokens(300), conversation="tenants/globex/conversations/g",
                       turn_end=TurnEnd.TOOL_CALL)  # fmt: skip
    cluster.clock.advance(29)
    assert await tick(router) == 0
    cluster.clock.advance(2)
    assert await tick(router) == 1
    assert moves(router, "park", "idle", "moved") == idle + 1


async def test_a_full_decode_node_parks_what_is_least_likely_wanted_soon_first(cluster: Cluster) -> None:
    """Not the oldest: the retention whose conversation is past every gap its tenant's tool calls
    took goes before an older one nothing is known of."""
    router = cluster.router(park_after_idle_s=300, max_in_flight=1, next_turn=True)
    await teach_tool_gaps(cluster, router)
    older = "tenants/globex/conversations/g"
    await cluster.turn(router, cluster.tokens(200), conversation=older, turn_end=TurnEnd.TOOL_CALL)
    cluster.clock.advance(2)
    await cluster.turn(router, cluster.tokens(200), turn_end=TurnEnd.TOOL_CALL)
    cluster.clock.advance(2)  # CONV: 2 s idle, past every taught gap (0.8 s), its park due
    await cluster.load("nodes/d", kv_cache_usage=0.9)
    calls = len(cluster.agents.calls)
    assert await tick(router) == 1
    assert [c[2] for c in cluster.agents.calls[calls:]] == [f"{CONV}/retentions/1"]
    assert moves(router, "park", "kv_usage", "moved") == 1


async def test_with_the_next_turn_model_off_the_timer_decides(cluster: Cluster) -> None:
    router = cluster.router(park_after_idle_s=30)  # next_turn off
    await teach_tool_gaps(cluster, router)
    await cluster.turn(router, cluster.tokens(300), turn_end=TurnEnd.TOOL_CALL)
    cluster.clock.advance(5)
    assert await tick(router) == 0
    assert moves(router, "park", "next_turn", "moved") == 0


async def test_a_park_is_due_before_the_engines_pin_ends(cluster: Cluster) -> None:
    policy: dict[str, Any] = {"park_after_idle_s": 440, "max_idle_s": 900}
    router = cluster.router(**policy)  # pin: 480 - 30 = 450 s after the commit
    await cluster.turn(router, cluster.tokens(200))
    cluster.clock.advance(450 - 20 - 1)
    assert await tick(router) == 0
    cluster.clock.advance(1)
    assert await tick(router) == 1
    assert moves(router, "park", "pin_ending", "moved") == 1


async def test_nothing_is_claimed_without_a_live_pool() -> None:
    c = Cluster()
    await c.add_node("nodes/p", NodeRole.PREFILL)
    await c.add_node("nodes/d", NodeRole.DECODE, pool=False)
    router = c.router(park_after_idle_s=30)
    await c.turn(router, c.tokens(200))
    c.clock.advance(31)
    reads = c.port.calls["get_conversation"]
    await tick(router)
    assert moves(router, "park", "idle", "skipped_no_pool") == 1
    assert c.agents.calls == []
    # Known from the node list alone: the registry is not asked (parking is on by default, and
    # agents without a pool must not cost a read per commit).
    assert c.port.calls["get_conversation"] == reads
    stored = await c.registry.get_retention(f"{CONV}/retentions/1")
    assert stored.claim is None and stored.node == "nodes/d"


@pytest.mark.parametrize(
    ("error", "outcome", "left"),
    [
        (ResourceExhausted("pool full"), "failed_pool_full", "given_back"),
        (FailedPrecondition("no", reason="NODE_MISMATCH"), "failed_agent", "given_back"),
        (Unavailable("agent down"), "failed_agent_unavailable", "claimed"),
    ],
)
async def test_an_agent_failure_gives_the_claim_back_only_when_it_read_nothing(
    cluster: Cluster, error: Exception, outcome: str, left: str
) -> None:
    router = cluster.router(park_after_idle_s=30)
    await cluster.turn(router, cluster.tokens(200))
    cluster.agents.fail = error
    cluster.clock.advance(31)
    await tick(router)
    assert moves(router, "park", "idle", outcome) == 1
    name = f"{CONV}/retentions/1"
    if left == "given_back":  # unread: it stays on decode, as it was, for the next turn
        kept = await cluster.registry.get_retention(name)
        assert kept.claim is None and kept.node == "nodes/d"
    else:  # the agent may have read: the claim lapses, nobody reads the blocks meanwhile
        assert (await cluster.registry.get_retention(name)).claim is not None
    assert router.hints.get(CONV) is None


async def test_an_agent_answering_another_pool_node_moves_nothing(cluster: Cluster) -> None:
    router = cluster.router(park_after_idle_s=30)
    await cluster.turn(router, cluster.tokens(200))
    cluster.agents.answer_node = "nodes/p-pool"
    cluster.clock.advance(31)
    await tick(router)
    assert moves(router, "park", "idle", "failed_agent_answer") == 1
    stored = await cluster.registry.get_retention(f"{CONV}/retentions/1")
    assert stored.node == "nodes/d" and stored.claim is not None


async def test_a_conversation_idle_too_long_is_not_moved(cluster: Cluster) -> None:
    router = cluster.router(park_after_idle_s=30, max_idle_s=100, min_ttl_s=15)
    await cluster.turn(router, cluster.tokens(200))
    cluster.clock.advance(90)
    await tick(router)
    assert moves(router, "park", "idle", "skipped_idle_over") == 1
    assert cluster.agents.calls == []


async def test_a_claimed_retention_is_left_to_its_turn(cluster: Cluster) -> None:
    router = cluster.router(park_after_idle_s=30)
    _, seq = await cluster.turn(router, cluster.tokens(300))
    cluster.clock.advance(31)
    # The next turn's plan (no commit yet) claimed it.
    other = cluster.router()
    await other.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + cluster.tokens(9), conversation=CONV)
    )
    await tick(router)
    assert moves(router, "park", "idle", "skipped_claimed") == 1
    assert cluster.agents.calls == []


async def test_the_schedule_is_bounded(cluster: Cluster) -> None:
    router = cluster.router(park_after_idle_s=30, max_scheduled=2)
    for c in ("c1", "c2", "c3"):
        await cluster.turn(router, cluster.tokens(100), conversation=f"tenants/acme/conversations/{c}")
    assert len(shuttle(router)) == 2
    assert moves(router, "park", "idle", "skipped_schedule_full") == 1
    cluster.clock.advance(31)
    await tick(router)
    assert sorted(c[2] for c in cluster.agents.calls) == [
        "tenants/acme/conversations/c2/retentions/1",
        "tenants/acme/conversations/c3/retentions/1",
    ]


async def test_a_long_think_time_prefetches_to_the_next_prefill_nodes_pool(cluster: Cluster) -> None:
    router = cluster.router(enabled=False, prefetch_enabled=True)
    _, seq = await cluster.turn(router, cluster.tokens(500), expected_think_time_s=60.0)
    assert await tick(router) == 1
    [(kind, endpoint, _, source, _)] = cluster.agents.calls
    assert (kind, endpoint) == ("prefetch nodes/p", "p:7000")
    assert source["remote_engine_id"] == "engine-d"
    assert (await cluster.registry.get_retention(f"{CONV}/retentions/1")).node == "nodes/p-pool"
    assert moves(router, "prefetch", "think_time", "moved") == 1
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + cluster.tokens(5), conversation=CONV)
    )
    assert plan.decision is Decision.REUSE and plan.prefill.name == "nodes/p"
    assert plan.prefill_kv_transfer_params["remote_engine_id"] == "pool-engine-p-pool"


async def test_with_prefetch_on_the_learnt_park_time_moves_the_kv_to_the_next_prefill_nodes_pool(
    cluster: Cluster,
) -> None:
    router = cluster.router(park_after_idle_s=30, prefetch_enabled=True, next_turn=True)
    await teach_tool_gaps(cluster, router)
    before = moves(router, "prefetch", "next_turn", "moved")
    _, seq = await cluster.turn(router, cluster.tokens(500), turn_end=TurnEnd.TOOL_CALL)  # no hint
    cluster.clock.advance(0.5)
    assert await tick(router) == 0  # within the learnt gap: kept on decode
    calls = len(cluster.agents.calls)
    cluster.clock.advance(0.6)
    assert await tick(router) == 1
    [(kind, endpoint, name, _, _)] = cluster.agents.calls[calls:]
    assert (kind, endpoint, name) == ("prefetch nodes/p", "p:7000", f"{CONV}/retentions/1")
    assert moves(router, "prefetch", "next_turn", "moved") == before + 1
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + cluster.tokens(5), conversation=CONV)
    )
    assert plan.decision is Decision.REUSE and plan.prefill.name == "nodes/p"
    assert plan.prefill_kv_transfer_params["remote_engine_id"] == "pool-engine-p-pool"


async def test_a_turn_coming_back_while_its_kv_is_prefetched_waits_and_reads_it_where_it_landed(
    cluster: Cluster,
) -> None:
    router = cluster.router(enabled=False, prefetch_enabled=True)
    cluster.agents.gate = asyncio.Event()
    _, seq = await cluster.turn(router, cluster.tokens(500), expected_think_time_s=60.0)
    assert await shuttle(router).step() == 1  # the prefetch holds the retention's claim
    assert shuttle(router).move_in_flight(CONV) is not None
    plan = asyncio.ensure_future(
        router.plan_turn(
            PlanRequest(model=MODEL, prompt_token_ids=seq + cluster.tokens(5), conversation=CONV)
        )
    )
    await asyncio.sleep(0.05)
    assert not plan.done()  # waiting for the move, not recomputing on a lost claim
    cluster.agents.gate.set()
    got = await asyncio.wait_for(plan, 5)
    assert (got.decision, got.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)
    assert got.prefill_kv_transfer_params["remote_engine_id"] == "pool-engine-p-pool"
    assert shuttle(router).move_in_flight(CONV) is None


async def test_a_move_longer_than_move_wait_s_leaves_the_turn_to_recompute(cluster: Cluster) -> None:
    router = cluster.router(enabled=False, prefetch_enabled=True, move_wait_s=0.05)
    cluster.agents.gate = asyncio.Event()
    _, seq = await cluster.turn(router, cluster.tokens(500), expected_think_time_s=60.0)
    assert await shuttle(router).step() == 1
    plan = await asyncio.wait_for(
        router.plan_turn(
            PlanRequest(model=MODEL, prompt_token_ids=seq + cluster.tokens(5), conversation=CONV)
        ),
        5,
    )
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, Reason.CLAIM_LOST)
    cluster.agents.gate.set()
    await shuttle(router).drain()


@pytest.mark.parametrize(("computed", "prefetched"), [(100, False), (1000, True)])
async def test_with_extend_on_a_conversation_whose_next_turn_would_extend_keeps_its_kv_on_the_holder(
    cluster: Cluster, computed: int, prefetched: bool
) -> None:
    """A turn that computed 100 tokens: a next one like it extends on the holder (55 ms of
    prefill, within 250), so the KV stays there; 1,000 tokens (505 ms) would not: prefetch."""
    router = cluster.router(enabled=False, prefetch_enabled=True, extend=ExtendPolicy(enabled=True))
    await cluster.turn(router, cluster.tokens(computed), expected_think_time_s=60.0)
    assert await tick(router) == int(prefetched)
    holder = (await cluster.registry.get_retention(f"{CONV}/retentions/1")).node
    assert holder == ("nodes/p-pool" if prefetched else "nodes/d")


async def test_a_short_think_time_or_none_does_not_prefetch(cluster: Cluster) -> None:
    router = cluster.router(enabled=False, prefetch_enabled=True, prefetch_margin=1e6)
    await cluster.turn(router, cluster.tokens(500), expected_think_time_s=1.0)
    await cluster.turn(router, cluster.tokens(500), conversation="tenants/acme/conversations/c2")
    assert len(shuttle(router)) == 0
    assert await tick(router) == 0


async def test_a_prefetch_without_a_pool_falls_back_to_parking() -> None:
    c = Cluster()
    await c.add_node("nodes/p", NodeRole.PREFILL, pool=False)
    await c.add_node("nodes/d", NodeRole.DECODE)
    router = c.router(prefetch_enabled=True, park_after_idle_s=30)
    await c.turn(router, c.tokens(500), expected_think_time_s=60.0)
    await tick(router)
    assert moves(router, "prefetch", "think_time", "skipped_no_pool") == 1
    assert len(shuttle(router)) == 1
    c.clock.advance(31)
    await tick(router)
    assert [x[0] for x in c.agents.calls] == ["park"]


async def test_close_starts_nothing_more(cluster: Cluster) -> None:
    router = cluster.router(park_after_idle_s=30)
    await cluster.turn(router, cluster.tokens(100))
    await shuttle(router).close(1.0)
    cluster.clock.advance(31)
    assert await tick(router) == 0


def test_placement_prefers_the_prefill_node_whose_pool_holds_the_retention() -> None:
    def prefill(name: str) -> NodeInfo:
        return NodeInfo(name, NodeRole.PREFILL, f"e-{name}", "", MODEL, BS, 1, healthy=True)

    nodes = [prefill("nodes/a"), prefill("nodes/b")]
    kw: dict[str, Any] = {"model": MODEL, "prompt_tokens": 100, "local_hit_blocks": {}}
    kw |= {"cost": CostModel(CPU), "weights": RouterPolicy().weights, "ledger": PlacementLedger()}
    kw["rng"] = random.Random(0)
    assert choose_prefill(nodes, hint="nodes/a", **kw)[0].name == "nodes/a"
    chosen = choose_prefill(nodes, hint="nodes/a", prefer="nodes/b", **kw)
    assert chosen[0].name == "nodes/b"


@pytest.mark.parametrize(
    "parking",
    [
        {"park_after_idle_s": 0},
        {"park_kv_usage_above": 1.5},
        {"max_in_flight": 0},
        {"max_idle_s": 40, "park_after_idle_s": 30},
    ],
)
def test_settings_refuse_a_bad_parking_policy(parking: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="parking"):
        RouterSettings(profiles_file=PROFILES, policy=RouterPolicy(parking=ParkingPolicy(**parking)))


@pytest.mark.parametrize(
    "next_turn",
    [{"keep_max_s": 0}, {"min_return_p": 1.5}, {"keep_quantile": 1.0}, {"min_samples": 0},
     {"min_conversation_gaps": 1}, {"max_tenants": 0}],
)  # fmt: skip
def test_settings_refuse_a_bad_next_turn_policy(next_turn: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="next_turn"):
        RouterSettings(profiles_file=PROFILES, policy=RouterPolicy(next_turn=NextTurnPolicy(**next_turn)))


async def test_the_router_process_runs_the_shuttle_as_a_task(cluster: Cluster) -> None:
    settings = RouterSettings(
        profiles_file=PROFILES,
        policy=RouterPolicy(parking=ParkingPolicy(enabled=True, park_after_idle_s=1, tick_s=0.01)),
    )
    port = InProcessPort(cluster.registry)
    assert build_router(settings, port, cluster.clock, CollectorRegistry()).shuttle is None  # no agents
    router = build_router(
        settings, port, cluster.clock, CollectorRegistry(), model_profiles=[CPU], agents=cluster.agents
    )
    task = asyncio.create_task(supervise_shuttle(router))
    await cluster.turn(router, cluster.tokens(100))
    cluster.clock.advance(2)
    for _ in range(200):
        if cluster.agents.calls:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await shuttle(router).close(1.0)
    assert [c[0] for c in cluster.agents.calls] == ["park"]
    assert (await cluster.registry.get_retention(f"{CONV}/retentions/1")).node == "nodes/d-pool"
