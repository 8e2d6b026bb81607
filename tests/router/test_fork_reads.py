"""Forks that share (kvshuttle.router.fork_reads): several conversations read one retention. A
pool-held one is read under shared claims, each fork naming the pool's read with its own suffix;
a decode-held one is parked first. Over the registry's domain in process and fake agents."""

from __future__ import annotations

import asyncio

import pytest
from tests.router.domain_cluster import commit_answer
from tests.router.shuttle_cluster import CONV, MODEL, POOL_PORT, Cluster, moves, pool_params, shuttle, tick

from kvshuttle.core.errors import NotFound
from kvshuttle.core.nodes import NodeRole
from kvshuttle.registry.model import Holder, Move
from kvshuttle.router.model import Decision, Plan, PlanRequest, Reason
from kvshuttle.router.router import Router
from kvshuttle.vllm.kv_transfer_params import from_vllm, to_vllm
from kvshuttle.vllm.shared_reads import read_of
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

PARENT = f"{CONV}/retentions/1"


@pytest.fixture
async def cluster() -> Cluster:
    return await Cluster.prefill_and_decode()


async def parked_parent(cluster: Cluster, router: Router) -> list[int]:
    _, seq = await cluster.turn(router, cluster.tokens(1000))
    cluster.clock.advance(31)
    assert await tick(router) == 1
    assert (await cluster.registry.get_retention(PARENT)).node == "nodes/d-pool"
    return seq


async def test_named_forks_of_a_pooled_retention_all_read_it(cluster: Cluster) -> None:
    router = cluster.router(park_after_idle_s=30)
    seq = await parked_parent(cluster, router)
    children: list[tuple[Plan, list[int]]] = []
    for i in range(3):  # all planned before any commits: they read at once
        prompt = seq + cluster.tokens(40)
        plan = await router.plan_turn(
            PlanRequest(
                model=MODEL,
                prompt_token_ids=prompt,
                conversation=f"tenants/acme/conversations/child-{i}",
                parent_conversation=CONV,
            )
        )
        assert (plan.decision, plan.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)
        assert plan.reusable_tokens == len(seq)
        children.append((plan, prompt))
    read_ids = [str(p.prefill_kv_transfer_params["remote_request_id"]) for p, _ in children]
    # One publication (the pool's read id), read by each child under its own suffix.
    assert {read_of(r) for r in read_ids} == {("read-d-pool", True)}
    assert len(set(read_ids)) == 3
    held = await cluster.registry.get_retention(PARENT)
    assert len(held.shared) == 3 and held.claim is None
    # The parent's own next turn would consume it: it waits for a recompute instead.
    own = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=seq + [7] * 40, conversation=CONV))
    assert (own.decision, own.reason) == (Decision.RECOMPUTE, Reason.CLAIM_LOST)
    await router.abort_turn(own.turn, reason="test")
    for plan, prompt in children:
        await commit_answer(router, cluster, plan, prompt)
        stored = await cluster.registry.get_conversation(plan.conversation)
        assert stored.retention is not None and stored.retention.generation == 1
    after = await cluster.registry.get_retention(PARENT)  # the next fork's to read
    assert after.shared == () and after.claim is None and after.node == "nodes/d-pool"


async def test_a_fork_of_a_decode_held_retention_parks_it_first(cluster: Cluster) -> None:
    """Turns that name only their tenant, continuing one history at once: the first parks the
    history's retention (decode would free it at the first read) and every turn reads it from
    the pool, each in a conversation of its own."""
    router = cluster.router(park_after_idle_s=300)
    _, seq = await cluster.turn(router, cluster.tokens(1000))
    assert (await cluster.registry.get_retention(PARENT)).node == "nodes/d"
    plans = []
    for i in range(4):
        prompt = seq + [100 + i] * 40
        plan = await router.plan_turn(
            PlanRequest(model=MODEL, prompt_token_ids=prompt, tenant="tenants/acme")
        )
        assert (plan.decision, plan.reusable_tokens) == (Decision.REUSE, len(seq)), i
        assert plan.conversation not in (CONV, "")
        assert plan.prefill_kv_transfer_params["remote_engine_id"] == "pool-engine-d-pool"
        plans.append((plan, prompt))
    assert [c[0] for c in cluster.agents.calls] == ["park"]  # parked once, for all of them
    assert moves(router, "park", "fork", "moved") == 1
    assert len({p.conversation for p, _ in plans}) == 4
    for plan, prompt in plans:
        sequence = await commit_answer(router, cluster, plan, prompt)
        # Each child's next turn finds its own history (the longest prefix), and reads it.
        nxt = await router.plan_turn(
            PlanRequest(model=MODEL, prompt_token_ids=sequence + cluster.tokens(20), tenant="tenants/acme")
        )
        assert (nxt.decision, nxt.reusable_tokens) == (Decision.REUSE, len(sequence))
        await router.abort_turn(nxt.turn, reason="test")
    parent = await cluster.registry.get_retention(PARENT)
    assert parent.shared == () and parent.node == "nodes/d-pool"


async def test_without_sharing_the_first_fork_consumes_it(cluster: Cluster) -> None:
    router = cluster.router(park_after_idle_s=30, share_forks=False)
    seq = await parked_parent(cluster, router)
    first, second = [
        await router.plan_turn(
            PlanRequest(
                model=MODEL,
                prompt_token_ids=seq + [i] * 40,
                conversation=f"tenants/acme/conversations/child-{i}",
                parent_conversation=CONV,
            )
        )
        for i in range(2)
    ]
    assert first.decision is Decision.REUSE
    assert not read_of(str(first.prefill_kv_transfer_params["remote_request_id"]))[1]
    assert (second.decision, second.reason) == (Decision.RECOMPUTE, Reason.FORK_UNSAFE)


async def test_with_no_pool_to_park_in_the_first_fork_reads_decode_s_copy() -> None:
    cluster = Cluster()
    await cluster.add_node("nodes/p", NodeRole.PREFILL)
    await cluster.add_node("nodes/d", NodeRole.DECODE, pool=False)
    router = cluster.router(park_after_idle_s=300)
    _, seq = await cluster.turn(router, cluster.tokens(1000))
    first, second = [
        await router.plan_turn(
            PlanRequest(model=MODEL, prompt_token_ids=seq + [i] * 40, tenant="tenants/acme")
        )
        for i in range(2)
    ]
    assert cluster.agents.calls == []
    assert first.decision is Decision.REUSE
    assert first.prefill_kv_transfer_params["remote_engine_id"] == "engine-d"
    assert (second.decision, second.reason) == (Decision.RECOMPUTE, Reason.FORK_UNSAFE)
    assert shuttle(router).in_flight == 0


async def test_a_found_history_is_parked_for_the_fork_window_a_named_one_for_its_idle_lease(
    cluster: Cluster,
) -> None:
    router = cluster.router(park_after_idle_s=300)
    _, seq = await cluster.turn(router, cluster.tokens(1000))
    found = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + [1] * 40, tenant="tenants/acme")
    )
    assert found.decision is Decision.REUSE
    [(_, _, _, _, ttl)] = cluster.agents.calls
    assert ttl == router._parts.policy.found_fork_window_s == 120.0
    other = "tenants/acme/conversations/c2"
    _, seq2 = await cluster.turn(router, cluster.tokens(1000), conversation=other)
    named = await router.plan_turn(
        PlanRequest(
            model=MODEL,
            prompt_token_ids=seq2 + [1] * 40,
            conversation="tenants/acme/conversations/child",
            parent_conversation=other,
        )
    )
    assert named.decision is Decision.REUSE
    assert cluster.agents.calls[-1][4] == pytest.approx(600.0)  # parking.max_idle_s since its commit


async def test_a_turn_waits_for_another_replica_s_move_of_its_retention(cluster: Cluster) -> None:
    """Another router replica's shuttle holds the claim while it moves the retention: the turn
    reads the registry again until the move lands, then reads where it landed."""
    router = cluster.router(park_after_idle_s=300)
    _, seq = await cluster.turn(router, cluster.tokens(1000))
    claim = await cluster.registry.claim_retention(
        request_id="", name=PARENT, holder="router:shuttle:park", claim_ttl=30
    )
    assert claim.claim is not None

    async def move_lands() -> None:
        await asyncio.sleep(0.2)
        await cluster.registry.move_retention(
            request_id="",
            move=Move(
                name=PARENT,
                claim_id=claim.claim.claim_id,  # type: ignore[union-attr]
                node="nodes/d-pool",
                kv_transfer_params=from_vllm(
                    pool_params("nodes/d-pool", claim_source(claim))
                ).SerializeToString(),
                kv_bytes=1,
                holder=Holder("pool-engine-d-pool", "127.0.0.2", POOL_PORT),
            ),
            ttl=300,
        )

    router.hints.forget(CONV)  # this replica's hint would name decode: read the registry
    landing = asyncio.create_task(move_lands())
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + [1] * 40, conversation=CONV)
    )
    await landing
    assert plan.decision is Decision.REUSE
    assert plan.prefill_kv_transfer_params["remote_engine_id"] == "pool-engine-d-pool"
    # No move lands within move_wait_s: the turn recomputes, as a lost claim.
    _, seq = await cluster.turn(router, cluster.tokens(1000), conversation="tenants/acme/conversations/c3")
    name = "tenants/acme/conversations/c3/retentions/1"
    await cluster.registry.claim_retention(
        request_id="", name=name, holder="router:shuttle:park", claim_ttl=30
    )
    router.hints.forget("tenants/acme/conversations/c3")
    stuck = await router.plan_turn(
        PlanRequest(
            model=MODEL, prompt_token_ids=seq + [1] * 40, conversation="tenants/acme/conversations/c3"
        )
    )
    assert (stuck.decision, stuck.reason) == (Decision.RECOMPUTE, Reason.CLAIM_LOST)


def claim_source(retention: object) -> dict[str, object]:
    params = to_vllm(KvTransferParams.FromString(retention.kv_transfer_params))  # type: ignore[attr-defined]
    return {**params, "remote_num_tokens": retention.num_tokens}  # type: ignore[attr-defined]


async def test_a_found_history_the_router_started_goes_with_the_last_fork_s_commit(cluster: Cluster) -> None:
    """Turns of no conversation: each forks from the history it continues, which the router
    started. Once the last fork reading it stored its own, it is removed (its forks continue it);
    a conversation a client named stays for its own next turn (the test above)."""
    router = cluster.router(park_after_idle_s=300)
    prompt = cluster.tokens(1000)
    first = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, tenant="tenants/acme"))
    seq = await commit_answer(router, cluster, first, prompt)
    parent = f"{first.conversation}/retentions/1"
    forks = []
    for i in range(3):
        child = seq + [200 + i] * 40
        plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=child, tenant="tenants/acme"))
        assert (plan.decision, plan.reusable_tokens) == (Decision.REUSE, len(seq))
        forks.append((plan, child))
    for plan, child in forks[:2]:
        await commit_answer(router, cluster, plan, child)
        assert (await cluster.registry.get_retention(parent)).shared  # the last fork still reads it
    await commit_answer(router, cluster, *forks[2])
    with pytest.raises(NotFound):
        await cluster.registry.get_retention(parent)
    for plan, _ in forks:  # each fork's own history stays
        assert (await cluster.registry.get_conversation(plan.conversation)).retention is not None
