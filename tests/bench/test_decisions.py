"""bench/decisions: where reuse, recompute and extend win under the Qwen3-32B H200 TP2 profile,
and that its pricing is the router's: the same turns planned by a router over an in-process
registry decide the same."""

from __future__ import annotations

from dataclasses import replace

import pytest
from bench.decisions import DEFAULT_PROFILE, cell, decision_map
from tests.router.domain_cluster import CONV, MODEL, Cluster, run_turn

from kvshuttle.core.nodes import NodeLoad, NodeRole
from kvshuttle.router.cost import CostModel, load_profiles
from kvshuttle.router.model import PlanRequest
from kvshuttle.router.policy import ExtendPolicy

(QWEN_TP2,) = load_profiles(DEFAULT_PROFILE)
ON = ExtendPolicy(enabled=True)


def test_short_inputs_on_long_histories_extend_long_inputs_read_and_a_busy_holder_extends_less() -> None:
    cells = {(c.running, c.history, c.new_tokens): c for c in decision_map(QWEN_TP2)}
    long_idle = cells[0, 100_000, 700]
    assert long_idle.decision == "extend"
    # Extending computes 700 tokens; reading 100k tokens (26 GB at 59 GB/s) costs more alone.
    assert long_idle.reuse_ms is not None and long_idle.extend_ms < long_idle.reuse_ms / 4
    assert cells[0, 100_000, 8192].decision == "reuse"  # its prefill would stall the batch too long
    assert cells[0, 100_000, 8192].extend_out == "max_prefill_ms"
    assert cells[32, 8192, 700].decision == "reuse" and cells[32, 8192, 700].extend_out == "cost"
    assert cells[32, 8192, 100].decision == "extend"
    assert {c.decision for c in cells.values()} <= {"extend", "reuse", "recompute"}


@pytest.mark.parametrize(("history", "new", "running"), [(8192, 100, 0), (8192, 8192, 0), (2048, 700, 32)])
async def test_the_router_decides_as_the_map_says(history: int, new: int, running: int) -> None:
    profile = replace(QWEN_TP2, model=MODEL)
    cluster = Cluster()
    await cluster.add_node("nodes/p0", NodeRole.PREFILL)
    await cluster.add_node("nodes/d0", NodeRole.DECODE)
    node = await cluster.registry.get_node("nodes/d0")
    await cluster.registry.heartbeat_node(
        "nodes/d0", node.incarnation, 300, NodeLoad(running_requests=running, engine_healthy=True)
    )
    router = cluster.router([profile], extend=ON)
    _, seq = await run_turn(router, cluster, cluster.tokens(history - 64), output=64)
    assert len(seq) == history
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + cluster.tokens(new), conversation=CONV)
    )
    # One decode node: the prefill path's decode is the holder.
    expected = cell(CostModel(profile), ON, history, new, running, decode_is_holder=True)
    assert plan.decision.value == expected.decision
