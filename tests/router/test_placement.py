"""Placement that sees its own work: the ledger of what this replica placed that no report shows
yet, draws among near-ties, decode turns in flight, and prefill speed learnt without the queue."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from tests.router.domain_cluster import CPU, MODEL, Cluster
from tests.router.helpers import PROFILES, TIES_BY_NAME

from kvshuttle.core.nodes import NodeLoad, NodeRole
from kvshuttle.router.config import RouterSettings
from kvshuttle.router.cost import CostModel
from kvshuttle.router.ledger import PlacementLedger
from kvshuttle.router.model import CommitRequest, NodeInfo, PlanRequest
from kvshuttle.router.placement import choose_decode, choose_prefill, kv_pressure
from kvshuttle.router.policy import PlacementWeights, RouterPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def node(name: str, role: NodeRole = NodeRole.PREFILL, **load: Any) -> NodeInfo:
    return NodeInfo(name, role, f"e-{name}", f"http://{name[6:]}:8000", MODEL, 16, 1, healthy=True, **load)


PREFILLS = [node(f"nodes/p{i}") for i in range(4)]
DECODES = [node(f"nodes/d{i}", NodeRole.DECODE) for i in range(4)]


def prefill_on(nodes: list[NodeInfo], ledger: PlacementLedger, rng: random.Random, **kw: Any) -> str:
    chosen, _ = choose_prefill(
        nodes,
        model=MODEL,
        prompt_tokens=kw.pop("prompt_tokens", 1000),
        local_hit_blocks=kw.pop("hits", {}),
        cost=kw.pop("cost", CostModel(CPU)),
        weights=kw.pop("weights", PlacementWeights()),
        ledger=ledger,
        rng=rng,
        **kw,
    )
    return chosen.name


def test_a_burst_on_idle_reports_is_spread_by_the_ledger() -> None:
    """Twelve first turns planned inside one report interval: every node reports idle, and the
    placements the router made itself spread them three to a node (it piled them onto the first
    name before)."""
    clock, rng = Clock(), random.Random(1)
    ledger = PlacementLedger(monotonic=clock)
    cost = CostModel(CPU)
    got: Counter[str] = Counter()
    for _ in range(12):
        name = prefill_on(PREFILLS, ledger, rng, cost=cost)
        ledger.placed_prefill(name, cost.recompute(1000, 0).prefill_ms)
        got[name] += 1
    assert sorted(got.values()) == [3, 3, 3, 3]
    # The queue drains in time: once the work placed is done, every node is idle again.
    clock.now = 4 * cost.recompute(1000, 0).prefill_ms / 1e3
    assert all(ledger.queued_ms(n.name, 0, unknown_ms=1.0) == 0 for n in PREFILLS)


def test_a_finished_turn_takes_what_is_left_of_its_prefill_off_the_queue() -> None:
    """Three 1 s prefills queued on p0; the second is committed 0.5 s in (its estimate was
    long): the queue loses its whole second, not what the clock already drained."""
    clock = Clock()
    ledger = PlacementLedger(monotonic=clock)
    for turn in ("t1", "t2", "t3"):
        ledger.placed_prefill("nodes/p0", 1000.0, turn)
    clock.now = 0.5
    assert ledger.queued_ms("nodes/p0", 0, unknown_ms=0.0) == pytest.approx(2500.0)
    ledger.finished("t2")
    assert ledger.queued_ms("nodes/p0", 0, unknown_ms=0.0) == pytest.approx(1500.0)
    ledger.finished("t2")  # twice: once
    clock.now = 1.2  # t1 expected done at 1.0: finishing it now takes nothing off
    ledger.finished("t1")
    assert ledger.queued_ms("nodes/p0", 0, unknown_ms=0.0) == pytest.approx(800.0)
    ledger.finished("t3")
    assert ledger.queued_ms("nodes/p0", 0, unknown_ms=0.0) == 0


def test_near_ties_are_drawn_and_a_hint_wins_among_them() -> None:
    """Idle nodes tie: the first turn of each of 40 replicas lands all over, not on p0; the
    conversation's last node (hint) wins while within the margin, not past it."""
    firsts = Counter(prefill_on(PREFILLS, PlacementLedger(), random.Random(seed)) for seed in range(40))
    assert set(firsts) == {n.name for n in PREFILLS}
    assert prefill_on(PREFILLS, PlacementLedger(), random.Random(0), hint="nodes/p2") == "nodes/p2"
    busy = [node("nodes/p0"), node("nodes/p1", running_requests=2)]
    assert prefill_on(busy, PlacementLedger(), random.Random(0), hint="nodes/p1") == "nodes/p0"
    # No margin at all: no draw, exact ties to the first name.
    assert {
        prefill_on(PREFILLS, PlacementLedger(), random.Random(s), weights=TIES_BY_NAME) for s in range(8)
    } == {"nodes/p0"}


def test_reported_requests_weigh_by_the_typical_prefill_not_by_count() -> None:
    """Another replica's work shows only as the node's reported requests: each weighs what a
    typical prefill there costs, so one waiting long prompt outweighs hits a short one saves."""
    clock = Clock()
    ledger = PlacementLedger(monotonic=clock)
    ledger.placed_prefill("nodes/p0", 2000.0)  # this replica's typical prefill here: 2 s
    clock.now = 10.0  # long done
    nodes = [node("nodes/p0", waiting_requests=1), node("nodes/p1")]
    # p0 holds 900 of the 1,000 tokens (a 450 ms saving) but one 2 s prefill waits there.
    assert prefill_on(nodes, ledger, random.Random(0), hits={"nodes/p0": 900 // 16}) == "nodes/p1"
    # Its own work, not yet reported, counts once, not twice: the larger of the two views.
    ledger.placed_prefill("nodes/p1", 1000.0)
    assert ledger.queued_ms("nodes/p1", 1, unknown_ms=0.0) == pytest.approx(1000.0)


def test_decode_counts_its_own_turns_until_reports_can_show_them() -> None:
    """Turns placed in the last window add to the reported requests: a burst spreads before any
    report moves; a finished turn, or one older than the window (the reports show it by then,
    or it was committed on another replica), no longer counts."""
    clock = Clock()
    ledger = PlacementLedger(max_turns=4, window_s=5.0, monotonic=clock)
    weights, rng = PlacementWeights(), random.Random(0)
    chosen = []
    for turn in ("t1", "t2", "t3", "t4"):
        d = choose_decode(DECODES[:2], model=MODEL, weights=weights, ledger=ledger, rng=rng)
        ledger.placed_decode(turn, d.name)
        chosen.append(d.name)
    assert sorted(Counter(chosen).values()) == [2, 2]  # every report idle, the burst spread
    ledger.finished("t1")
    ledger.finished("t1")  # twice: once
    assert sum(ledger.unreported(d.name) for d in DECODES) == 3
    ledger.placed_decode("t5", "nodes/d3")
    ledger.placed_decode("t6", "nodes/d3")  # past max_turns: the oldest goes
    assert sum(ledger.unreported(d.name) for d in DECODES) == 4
    clock.now = 5.0  # past the window: the reports carry them
    assert sum(ledger.unreported(d.name) for d in DECODES) == 0
    # Reported requests and this replica's unreported ones add up.
    loaded = [node("nodes/d0", NodeRole.DECODE, running_requests=1), node("nodes/d1", NodeRole.DECODE)]
    ledger.placed_decode("t7", "nodes/d1")
    ledger.placed_decode("t8", "nodes/d1")
    assert choose_decode(loaded, model=MODEL, weights=weights, ledger=ledger, rng=rng).name == "nodes/d0"


def test_a_decode_running_out_of_blocks_weighs_as_a_long_queue() -> None:
    """Ten running answers on a cache a tenth full against none on one 95 % full: the full one
    would queue every answer it admits. Counted linearly it weighed 3.8 requests and won."""
    nodes = [
        node("nodes/d0", NodeRole.DECODE, kv_cache_usage=0.95),
        node("nodes/d1", NodeRole.DECODE, running_requests=10, kv_cache_usage=0.1),
    ]
    pick = choose_decode(
        nodes, model=MODEL, weights=TIES_BY_NAME, ledger=PlacementLedger(), rng=random.Random(0)
    )
    assert pick.name == "nodes/d1"
    assert kv_pressure(0.0) == 0 and kv_pressure(0.5) == pytest.approx(1.0)
    assert kv_pressure(1.0) == kv_pressure(2.0) == pytest.approx(99.0)  # bounded past full


def test_a_long_prefill_stays_off_the_short_lane() -> None:
    """Eight prefill nodes, p0-p2 with the least work queued and short turns placed on them: a
    4,000-token first turn (2 s here, past long_prefill_ms) goes to the least loaded of the
    other five, while a 100-token suffix still takes the idle p0. Without the lane, or with one
    node, the long turn takes the least loaded node as any turn does."""
    clock = Clock()
    ledger = PlacementLedger(monotonic=clock)
    nodes = [node(f"nodes/p{i}") for i in range(8)]
    for n in nodes[:3]:
        ledger.placed_prefill(n.name, 50.0, short=True)
    clock.now = 1.0  # the short turns are done
    for i, n in enumerate(nodes):
        if i:  # p0 idle, then 1 s, 2 s, ... of queued prefill
            ledger.placed_prefill(n.name, 1000.0 * i)
    lane = PlacementWeights(near_tie_ms=0.0, near_tie_fraction=0.0, near_tie_requests=0.0)
    assert int(8 * lane.short_lane_fraction) == 3
    rng = random.Random(0)
    assert prefill_on(nodes, ledger, rng, prompt_tokens=4000, weights=lane) == "nodes/p3"
    assert prefill_on(nodes, ledger, rng, prompt_tokens=100, weights=lane) == "nodes/p0"
    no_lane = PlacementWeights(near_tie_ms=0.0, near_tie_fraction=0.0, short_lane_fraction=0.0)
    assert prefill_on(nodes, ledger, rng, prompt_tokens=4000, weights=no_lane) == "nodes/p0"
    assert prefill_on(nodes[:1], ledger, rng, prompt_tokens=4000, weights=lane) == "nodes/p0"
    # Two nodes: the lane rounds down to none, the long turn is not left with no node.
    assert prefill_on(nodes[:2], ledger, rng, prompt_tokens=4000, weights=lane) == "nodes/p0"


def test_the_lane_keeps_only_the_nodes_short_turns_use() -> None:
    """p0 and p1 idle, only p1 took a short turn lately: a long turn may take p0, not p1; once
    p1's short turn is older than short_lane_window_s, p1 is open to it too."""
    clock = Clock()
    ledger = PlacementLedger(monotonic=clock)
    nodes = [node(f"nodes/p{i}") for i in range(8)]
    ledger.placed_prefill("nodes/p1", 50.0, short=True)
    clock.now = 0.1  # done: every node idle
    lane = PlacementWeights(near_tie_ms=0.0, near_tie_fraction=0.0, near_tie_requests=0.0)
    rng = random.Random(0)
    assert prefill_on(nodes, ledger, rng, prompt_tokens=4000, weights=lane) == "nodes/p0"
    assert prefill_on(nodes[1:], ledger, rng, prompt_tokens=4000, weights=lane) == "nodes/p2"
    clock.now = lane.short_lane_window_s + 1.0
    assert prefill_on(nodes[1:], ledger, rng, prompt_tokens=4000, weights=lane) == "nodes/p1"


def test_the_ledger_remembers_short_prefills_for_a_window() -> None:
    clock = Clock()
    ledger = PlacementLedger(monotonic=clock)
    ledger.placed_prefill("nodes/p0", 5000.0)
    assert not ledger.took_short_within("nodes/p0", 5.0)
    assert not ledger.took_short_within("nodes/unseen", 5.0)
    ledger.placed_prefill("nodes/p0", 50.0, short=True)
    clock.now = 5.0
    assert ledger.took_short_within("nodes/p0", 5.0)
    clock.now = 5.5
    assert not ledger.took_short_within("nodes/p0", 5.0)


@pytest.mark.parametrize(
    "lane",
    [
        {"short_lane_fraction": 1.0},
        {"short_lane_fraction": -0.1},
        {"long_prefill_ms": 0.0},
        {"short_lane_window_s": 0.0},
    ],
)
def test_settings_refuse_a_short_lane_that_leaves_long_turns_nowhere(lane: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"policy\.weights"):
        RouterSettings(profiles_file=PROFILES, policy=RouterPolicy(weights=PlacementWeights(**lane)))


def test_prefill_speed_is_learnt_from_turns_that_did_not_queue() -> None:
    """Measured prefills include the time queued behind others: learnt as a median, load would
    inflate every estimate. The low quantile learns the engine's speed; each node its own."""
    cost = CostModel(CPU)
    predicted = CPU.prefill.ms(1000, 0)
    for i in range(40):
        queued = 4.0 if i % 10 < 7 else 0.0  # 70 % of turns queued 4x their compute
        cost.observe_prefill(computed=1000, cached=0, measured_ms=predicted * (1 + queued), node="nodes/p0")
    assert cost.prefill_scale == pytest.approx(1.0)
    for _ in range(8):
        cost.observe_prefill(computed=1000, cached=0, measured_ms=predicted * 2, node="nodes/slow")
    assert cost.node_prefill_scale("nodes/slow") == pytest.approx(2.0)
    assert cost.node_prefill_scale("nodes/p0") == pytest.approx(1.0)
    assert cost.node_prefill_scale("nodes/new") == cost.prefill_scale  # unmeasured: across nodes
    assert cost.recompute(1000, 0, "nodes/slow").prefill_ms == pytest.approx(2 * predicted)


async def test_plans_feed_the_ledger_and_commits_take_their_turns_out(cluster: Cluster) -> None:
    """Through the router: a plan's decode counts on its node until its commit."""
    router = cluster.router()
    tokens = cluster.tokens(300)
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=tokens))
    ledger = router._parts.ledger
    assert ledger.unreported(plan.decode.name) == 1
    assert ledger.queued_ms(plan.prefill.name, 0, unknown_ms=0.0) > 0
    await router.commit_turn(CommitRequest(turn=plan.turn, token_ids=tokens, decode_kv_transfer_params=None))
    assert ledger.unreported(plan.decode.name) == 0


async def test_a_plan_marks_its_prefill_node_short_below_the_lanes_line(cluster: Cluster) -> None:
    """Through the router: the short lane forms where plans put prefills under long_prefill_ms,
    and a prefill at or past the line does not keep a node for short turns."""
    tokens = cluster.tokens(300)
    short = cluster.router()
    plan = await short.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=tokens))
    assert short._parts.ledger.took_short_within(plan.prefill.name, 5.0)
    long = cluster.router(weights=PlacementWeights(long_prefill_ms=1e-6))
    plan = await long.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=tokens))
    assert not long._parts.ledger.took_short_within(plan.prefill.name, 5.0)


async def test_the_prefill_node_reported_busy_is_avoided(cluster: Cluster) -> None:
    await cluster.add_node("nodes/p1", NodeRole.PREFILL)
    p0 = await cluster.registry.get_node("nodes/p0")
    await cluster.registry.heartbeat_node(
        "nodes/p0", p0.incarnation, 300, NodeLoad(running_requests=1, engine_healthy=True)
    )
    router = cluster.router()
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=cluster.tokens(300)))
    assert plan.prefill.name == "nodes/p1"
