"""A node that (re)joins while the router holds a list without it: an agent back after its
lease lapsed, an engine reported healthy again. Over the registry's domain in process, with the
background refresh an hour away, so only the reread on a miss can show the node."""

from __future__ import annotations

from typing import Any

import pytest
from bench.fleet.inproc import InProcessPort
from tests.router.domain_cluster import CONV, MODEL, Cluster, run_turn

from kvshuttle.core.errors import Unavailable
from kvshuttle.core.nodes import NodeLoad, NodeRole
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.router.model import CommitRequest, PlanRequest, TurnTimings
from kvshuttle.router.router import Router


def unrefreshed(cluster: Cluster, *, miss_refresh_s: float = 0.0) -> Router:
    """No background refresh within a test: the list in hand is trusted for an hour."""
    return cluster.router(node_refresh_s=3600.0, node_max_age_s=3600.0, node_miss_refresh_s=miss_refresh_s)


def list_reads(cluster: Cluster, router: Router) -> int:
    port = cluster.port(router)
    assert isinstance(port, InProcessPort)
    return port.calls["list_nodes"]


@pytest.fixture
async def prefill_only() -> Cluster:
    c = Cluster()
    await c.add_node("nodes/p0", NodeRole.PREFILL)
    return c


async def plan(router: Router, cluster: Cluster, **kw: Any) -> Any:
    return await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=cluster.tokens(300), **kw))


async def test_a_decode_node_registered_after_a_plan_found_none_serves_the_next_plan(
    prefill_only: Cluster,
) -> None:
    cluster = prefill_only
    router = unrefreshed(cluster)
    with pytest.raises(Unavailable) as err:
        await plan(router, cluster)
    assert err.value.reason == ErrorReason.NO_DECODE_NODE
    await cluster.add_node("nodes/d0", NodeRole.DECODE)
    placed = await plan(router, cluster)
    assert (placed.prefill.name, placed.decode.name) == ("nodes/p0", "nodes/d0")
    # The list it read stays in hand: the plans after it make no round trip for the nodes.
    reads = list_reads(cluster, router)
    assert (await plan(router, cluster)).decode.name == "nodes/d0"
    assert list_reads(cluster, router) == reads


async def test_a_node_whose_engine_is_reported_healthy_again_serves_the_next_plan(
    prefill_only: Cluster,
) -> None:
    cluster = prefill_only
    await cluster.add_node("nodes/d0", NodeRole.DECODE, healthy=False)  # registered, first heartbeat
    router = unrefreshed(cluster)
    with pytest.raises(Unavailable):
        await plan(router, cluster)
    d0 = await cluster.registry.get_node("nodes/d0")
    await cluster.registry.heartbeat_node("nodes/d0", d0.incarnation, 300, NodeLoad(engine_healthy=True))
    assert (await plan(router, cluster)).decode.name == "nodes/d0"


async def test_plans_that_find_a_role_missing_ask_the_registry_at_most_once_per_interval(
    prefill_only: Cluster,
) -> None:
    cluster = prefill_only
    router = unrefreshed(cluster, miss_refresh_s=3600.0)
    for _ in range(5):
        with pytest.raises(Unavailable):
            await plan(router, cluster)
    assert list_reads(cluster, router) == 1  # the first plan's read; no reread within the hour


async def test_a_commit_on_a_replica_whose_list_lacks_the_decode_node_still_stores_the_retention(
    prefill_only: Cluster,
) -> None:
    """Another replica planned on a newer list (a decode node that just joined): this replica
    rereads rather than dropping the retention as if the node were gone."""
    cluster = prefill_only
    await cluster.add_node("nodes/d0", NodeRole.DECODE)
    stale = unrefreshed(cluster)
    await plan(stale, cluster)  # holds [p0, d0] for the hour
    d0 = await cluster.registry.get_node("nodes/d0")
    await cluster.registry.deregister_node("nodes/d0", d0.incarnation)
    await cluster.add_node("nodes/d1", NodeRole.DECODE)
    fresh = unrefreshed(cluster, miss_refresh_s=0.1)
    prompt = cluster.tokens(1000)
    planned = await fresh.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV))
    assert planned.decode.name == "nodes/d1"
    sequence = prompt + cluster.tokens(64)
    committed = await stale.commit_turn(
        CommitRequest(
            turn=planned.turn,
            token_ids=sequence,
            decode_kv_transfer_params=cluster.decode_params(planned, len(sequence)),
            timings=TurnTimings(ttft_ms=100.0, prefill_ms=90.0),
        )
    )
    assert committed.retention == f"{CONV}/retentions/1"
    assert (await cluster.registry.get_retention(committed.retention)).node == "nodes/d1"
    # And the stale replica now plans on d1 too.
    second, _ = await run_turn(stale, cluster, sequence + cluster.tokens(100))
    assert second.decode.name == "nodes/d1"
