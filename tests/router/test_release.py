"""A turn that recomputes supersedes its conversation's retention: the plan claims it and hands
prefill release params (read none of it, notify the holder), so the holder frees its blocks at
once instead of pinning them until the engine's TTL. Nothing of it is ever read."""

from __future__ import annotations

from tests.router.domain_cluster import CONV, MODEL, Cluster, run_turn

from kvshuttle.router.model import CommitRequest, Decision, PlanRequest, Reason
from kvshuttle.router.router import Router


def released(router: Router) -> float:
    return float(router._parts.metrics.released._value.get())


async def test_an_edited_history_releases_the_retention_it_supersedes(cluster: Cluster) -> None:
    router = cluster.router()
    _, seq = await run_turn(router, cluster, cluster.tokens(600))
    held = await cluster.registry.get_retention(f"{CONV}/retentions/1")
    edited = [seq[0] + 1, *seq[1:], *cluster.tokens(50)]  # the first token changed

    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=edited, conversation=CONV))

    assert (plan.decision, plan.reason, plan.reusable_tokens) == (
        Decision.RECOMPUTE,
        Reason.PREFIX_MISMATCH,
        0,
    )
    assert plan.tokens_to_compute == len(edited)
    assert plan.claimed == held.name
    params = plan.prefill_kv_transfer_params
    # vLLM's pull scheduler matches min(remote_num_tokens, prompt) - local hits = 0 tokens: it
    # reads nothing, and with the holder's blocks named it notifies the holder to free them.
    assert params["remote_num_tokens"] == 0
    blocks: list[list[int]] = params["remote_block_ids"]  # type: ignore[assignment]
    assert len(blocks[0]) == -(-held.num_tokens // 16)  # all of its blocks
    assert (params["remote_engine_id"], params["do_remote_decode"]) == ("engine-d0", True)
    assert released(router) == 1
    sequence = edited + cluster.tokens(10)
    await router.commit_turn(
        CommitRequest(
            turn=plan.turn,
            token_ids=sequence,
            decode_kv_transfer_params=cluster.decode_params(plan, len(sequence)),
        )
    )
    assert (await cluster.registry.get_retention(f"{CONV}/retentions/2")).num_tokens == len(sequence)


async def test_a_claimed_retention_is_not_released_and_a_fork_never_releases_its_parent(
    cluster: Cluster,
) -> None:
    router = cluster.router()
    _, seq = await run_turn(router, cluster, cluster.tokens(600))
    reader = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + cluster.tokens(50), conversation=CONV)
    )
    assert reader.decision is Decision.REUSE
    edited = [seq[0] + 1, *seq[1:]]
    other = cluster.router()  # another replica: no hint, the registry says it is claimed
    plan = await other.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=edited, conversation=CONV))
    assert (plan.decision, plan.claimed, plan.reason) == (Decision.RECOMPUTE, "", Reason.CLAIM_LOST)
    assert "remote_num_tokens" not in plan.prefill_kv_transfer_params

    _, parent_seq = await run_turn(
        router, cluster, cluster.tokens(600), conversation="tenants/acme/conversations/p"
    )
    child = await router.plan_turn(
        PlanRequest(
            model=MODEL,
            prompt_token_ids=[parent_seq[0] + 1, *parent_seq[1:]],
            conversation="tenants/acme/conversations/child",
            parent_conversation="tenants/acme/conversations/p",
        )
    )
    assert (child.decision, child.claimed) == (Decision.RECOMPUTE, "")
    assert released(router) == 0


async def test_release_can_be_turned_off(cluster: Cluster) -> None:
    router = cluster.router(release_superseded=False)
    _, seq = await run_turn(router, cluster, cluster.tokens(600))
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=[seq[0] + 1, *seq[1:]], conversation=CONV)
    )
    assert (plan.reason, plan.claimed) == (Reason.PREFIX_MISMATCH, "")
    assert plan.prefill_kv_transfer_params == {"do_remote_decode": True, "do_remote_prefill": False}
