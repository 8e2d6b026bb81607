"""Extend on the holder (Decision.EXTEND): the turn runs on the decode node holding its
conversation's KV, priced against reading that KV to a prefill node and against recomputing.

With the CPU-class profile (prefill 5 ms + 0.5 ms/token, KV 16 KiB/token over 5 GB/s + 5 ms), a
1,064-token history and 100 new tokens: reuse = 8.5 ms to read + 55 ms to prefill 100 tokens;
extend = 59 ms to prefill the 108 tokens past the holder's 1,056 full-block tokens, and nothing
moves."""

from __future__ import annotations

from typing import Any

import pytest
from tests.router.domain_cluster import BS, CONV, CPU, MODEL, Cluster, run_turn
from tests.router.helpers import PROFILES

from kvshuttle.core.nodes import NodeLoad, NodeRole
from kvshuttle.router.config import RouterSettings
from kvshuttle.router.cost import CostModel
from kvshuttle.router.grpc.convert import plan_to_pb
from kvshuttle.router.model import CommitRequest, Decision, Plan, PlanRequest, Reason, TurnTimings
from kvshuttle.router.policy import ExtendPolicy, RouterPolicy
from kvshuttle.router.router import Router
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.router.verify import extend_params

ON = ExtendPolicy(enabled=True)


async def second_turn(
    router: Router, cluster: Cluster, new_tokens: int = 100, conversation: str = CONV
) -> tuple[Plan, list[int]]:
    """Turn 1 (1,000 tokens, 64 answered) committed; turn 2's plan and prompt."""
    _, seq = await run_turn(router, cluster, cluster.tokens(1000), conversation=conversation)
    prompt = seq + cluster.tokens(new_tokens)
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=conversation)
    )
    return plan, prompt


async def load_decode(cluster: Cluster, running: int, kv_cache_usage: float = 0.0) -> None:
    """d0 reports `running` requests (a router made after this reads them)."""
    await report(cluster, "nodes/d0", NodeLoad(running, 0, kv_cache_usage, engine_healthy=True))


async def report(cluster: Cluster, name: str, load: NodeLoad) -> None:
    node = await cluster.registry.get_node(name)
    await cluster.registry.heartbeat_node(name, node.incarnation, 300, load)


async def test_a_short_turn_on_a_long_history_extends_on_its_holder_and_the_next_turn_still_reuses(
    cluster: Cluster,
) -> None:
    router = cluster.router(extend=ON)
    plan, prompt = await second_turn(router, cluster)
    history = 1064
    assert (plan.decision, plan.reason) == (Decision.EXTEND, Reason.EXTEND_CHEAPER)
    # The whole turn on the holder, which reads nothing: its prefix cache has the full blocks.
    assert plan.prefill.name == plan.decode.name == "nodes/d0"
    assert plan.prefill_kv_transfer_params == extend_params()
    assert plan.reusable_tokens == history // BS * BS
    assert plan.tokens_to_compute == len(prompt) - history // BS * BS
    assert plan.claimed == f"{CONV}/retentions/1"  # single use: no other turn reads it now
    assert plan.extend_cost is not None and plan.reuse_cost is not None
    assert plan.extend_cost.transfer_ms == 0 and plan.extend_cost.interference_ms == 0  # d0 idle
    assert plan.extend_cost.total_ms < plan.reuse_cost.total_ms < plan.recompute_cost.total_ms

    wire = plan_to_pb(plan)
    assert (wire.decision, wire.reason) == (pb.DECISION_EXTEND, pb.DECISION_REASON_EXTEND_CHEAPER)
    assert wire.prefill.node == wire.decode.node == "nodes/d0"
    assert wire.HasField("extend_cost") and wire.extend_cost.total.ToMilliseconds() > 0

    # Committed as any turn: the holder's new params are the conversation's next retention.
    sequence = prompt + cluster.tokens(64)
    await router.commit_turn(
        CommitRequest(
            turn=plan.turn,
            token_ids=sequence,
            decode_kv_transfer_params=cluster.decode_params(plan, len(sequence)),
            timings=TurnTimings(ttft_ms=80.0),
        )
    )
    stored = await cluster.registry.get_retention(f"{CONV}/retentions/2")
    assert (stored.node, stored.num_tokens) == ("nodes/d0", len(sequence))
    third = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=sequence + cluster.tokens(50), conversation=CONV)
    )
    assert third.decision in (Decision.EXTEND, Decision.REUSE) and third.claimed == stored.name


async def test_extend_is_off_unless_the_operator_turns_it_on(cluster: Cluster) -> None:
    plan, _ = await second_turn(cluster.router(), cluster)
    assert (plan.decision, plan.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)
    assert plan.extend_cost is None and plan.prefill.name == "nodes/p0"


async def test_a_busy_holder_pays_for_its_running_decodes_and_a_full_one_is_not_asked(
    cluster: Cluster,
) -> None:
    await load_decode(cluster, 40)
    plan, _ = await second_turn(cluster.router(extend=ON), cluster)
    # 59 ms of prefill delays 40 running decodes, each weighed at 0.1: 236 ms more.
    assert (plan.decision, plan.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)
    assert plan.extend_cost is not None
    assert plan.extend_cost.interference_ms == pytest.approx(plan.extend_cost.prefill_ms * 40 * 0.1)

    await load_decode(cluster, ON.max_batch)
    plan, _ = await second_turn(cluster.router(extend=ON), cluster, conversation=f"{CONV}-full")
    assert plan.decision is Decision.REUSE and plan.extend_cost is None


async def test_a_measured_hand_off_counts_for_extending(cluster: Cluster) -> None:
    """The busy holder lost above on the link model's hand-off alone (the KV decode reads past
    its held blocks). Turns that measured 300 ms from prefill's answer to decode's first token
    (decode's request and first step: the hop extending does not make) price it in."""
    await load_decode(cluster, 40)
    cost = CostModel(CPU)
    router = cluster.router(extend=ON, costs=[cost])
    for _ in range(4):
        prompt = cluster.tokens(200)
        plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt))
        timings = TurnTimings(prefill_ms=100.0, ttft_ms=100.0 + cost.transfer_ms(200) + 300.0)
        await router.commit_turn(CommitRequest(plan.turn, prompt, None, timings))
    assert cost.handoff_ms(0) == pytest.approx(300.0)
    plan, _ = await second_turn(router, cluster)
    assert (plan.decision, plan.reason) == (Decision.EXTEND, Reason.EXTEND_CHEAPER)


async def test_a_queue_on_prefill_counts_against_the_prefill_path(cluster: Cluster) -> None:
    """The holder's 40 running decodes price extending out (above); ten turns waiting on the
    only prefill node, each a typical prefill of seconds, price the prefill path out more."""
    await load_decode(cluster, 40)
    await report(cluster, "nodes/p0", NodeLoad(waiting_requests=10, engine_healthy=True))
    plan, _ = await second_turn(cluster.router(extend=ON), cluster)
    assert (plan.decision, plan.reason) == (Decision.EXTEND, Reason.EXTEND_CHEAPER)
    assert plan.extend_cost is not None and plan.extend_cost.interference_ms > 200


async def test_a_holder_whose_cache_is_filling_is_not_asked(cluster: Cluster) -> None:
    """A turn extended stays on its holder and grows there: past max_kv_usage the holder is
    not a candidate, however cheap."""
    await load_decode(cluster, 0, kv_cache_usage=ON.max_kv_usage + 0.01)
    plan, _ = await second_turn(cluster.router(extend=ON), cluster)
    assert plan.decision is Decision.REUSE and plan.extend_cost is None
    await load_decode(cluster, 0, kv_cache_usage=ON.max_kv_usage)
    plan, _ = await second_turn(cluster.router(extend=ON), cluster, conversation=f"{CONV}-room")
    assert plan.decision is Decision.EXTEND


async def test_a_long_new_input_goes_to_prefill_however_cheap_extending_looks(cluster: Cluster) -> None:
    # 1,000 new tokens: ~505 ms on the holder, past max_prefill_ms (its batch's longest stall).
    plan, _ = await second_turn(cluster.router(extend=ON), cluster, new_tokens=1000)
    assert plan.decision is Decision.REUSE
    assert plan.extend_cost is not None and plan.extend_cost.prefill_ms > ON.max_prefill_ms
    roomy = ExtendPolicy(enabled=True, max_prefill_ms=10_000)
    other = Cluster()
    await other.add_node("nodes/p0", NodeRole.PREFILL)
    await other.add_node("nodes/d0", NodeRole.DECODE)
    plan, _ = await second_turn(other.router(extend=roomy), other, new_tokens=1000)
    assert (plan.decision, plan.reason) == (Decision.EXTEND, Reason.EXTEND_CHEAPER)


async def test_where_reuse_loses_on_cost_extending_still_beats_recomputing(cluster: Cluster) -> None:
    # Below the reuse floor (a 60-token history): reuse is out, the holder still has 3 blocks.
    router = cluster.router(extend=ON)
    _, seq = await run_turn(router, cluster, cluster.tokens(40), output=20)
    prompt = seq + cluster.tokens(10)
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV))
    assert (plan.decision, plan.reason) == (Decision.EXTEND, Reason.EXTEND_CHEAPER)
    assert plan.reusable_tokens == len(seq) // BS * BS


@pytest.mark.parametrize(("another_decode", "decision"), [(True, Decision.EXTEND), (False, Decision.REUSE)])
async def test_extending_saves_decodes_read_of_the_prompt_from_prefill(
    cluster: Cluster, another_decode: bool, decision: Decision
) -> None:
    """With 2 running on the holder, extending costs 59 x 1.2 = 70.8 ms against reuse's 63.5 ms:
    but the prefill path's decode then reads the prompt's KV from prefill, 8.8 ms for all 1,164
    tokens on an idle other decode node, 5.4 ms for the 108 past the held blocks on the holder."""
    if another_decode:
        await cluster.add_node("nodes/d1", NodeRole.DECODE)
    router = cluster.router(extend=ON, node_max_age_s=0)  # every plan reads the nodes' load
    first, seq = await run_turn(router, cluster, cluster.tokens(1000))
    holder = first.decode.name
    node = await cluster.registry.get_node(holder)
    await cluster.registry.heartbeat_node(
        holder, node.incarnation, 300, NodeLoad(running_requests=2, engine_healthy=True)
    )
    prompt = seq + cluster.tokens(100)
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV))
    assert plan.decision is decision
    assert plan.extend_cost is not None and plan.reuse_cost is not None
    assert plan.extend_cost.total_ms == pytest.approx(70.8)
    assert plan.reuse_cost.total_ms == pytest.approx(63.5, abs=0.1)
    if decision is Decision.EXTEND:
        assert plan.decode.name == holder


@pytest.mark.parametrize(
    ("allowed", "decision", "decode"),
    [
        (("d1:8000",), Decision.REUSE, "nodes/d1"),
        (("d0", "d1:8000"), Decision.EXTEND, "nodes/d0"),
        ((), Decision.EXTEND, "nodes/d0"),
    ],
)
async def test_a_holder_outside_the_allowed_decode_endpoints_is_never_extended_on(
    cluster: Cluster, allowed: tuple[str, ...], decision: Decision, decode: str
) -> None:
    """hints.decode_endpoints (an endpoint picker's subset) without the holder: the turn's decode
    runs on an allowed node, and prefill still reads the holder's KV (REUSE); with the holder
    allowed (or no constraint), the same turn extends on it."""
    await cluster.add_node("nodes/d1", NodeRole.DECODE)
    router = cluster.router(extend=ON)
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    assert (await cluster.registry.get_retention(f"{CONV}/retentions/1")).node == "nodes/d0"

    plan = await router.plan_turn(
        PlanRequest(
            model=MODEL,
            prompt_token_ids=seq + cluster.tokens(100),
            conversation=CONV,
            decode_endpoints=allowed,
        )
    )

    assert (plan.decision, plan.decode.name) == (decision, decode)
    assert plan.claimed == f"{CONV}/retentions/1"
    if decision is Decision.REUSE:
        assert (plan.reason, plan.prefill.name) == (Reason.REUSE_CHEAPER, "nodes/p0")
        assert plan.extend_cost is None  # the holder could not run this turn
        assert plan.prefill_kv_transfer_params["remote_engine_id"] == "engine-d0"


@pytest.mark.parametrize("extend", [{"max_kv_usage": 1.5}, {"max_kv_usage": -0.1}, {"max_batch": 0}])
def test_settings_refuse_a_bad_extend_policy(extend: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"policy\.extend"):
        RouterSettings(profiles_file=PROFILES, policy=RouterPolicy(extend=ExtendPolicy(**extend)))
