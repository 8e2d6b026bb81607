"""The router's decisions, over the registry's domain in process, on a fake clock."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from bench.fleet.inproc import InProcessPort
from tests.router.domain_cluster import BS, CONV, CPU, MODEL, QWEN, Cluster, run_turn

from kvshuttle.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.core.kv_events import BlockStored, EventBatch
from kvshuttle.core.nodes import NodeLoad, NodeRole
from kvshuttle.router.committer import MAX_KNOWN_BLOCKS
from kvshuttle.router.cost import CostModel, LinkModel, PrefillModel
from kvshuttle.router.model import (
    CommitRequest,
    Decision,
    NewRetention,
    PlanRequest,
    Reason,
    TurnTimings,
)
from kvshuttle.router.verify import verify

CONV2 = "tenants/acme/conversations/c2"


async def test_first_turn_recomputes_then_the_next_reuses_the_verified_prefix(cluster: Cluster) -> None:
    router = cluster.router()
    first, seq = await run_turn(router, cluster, cluster.tokens(1000))
    assert (first.decision, first.reason) == (Decision.RECOMPUTE, Reason.NO_RETENTION)
    assert first.prefill_kv_transfer_params == {"do_remote_decode": True, "do_remote_prefill": False}
    assert (first.prefill.name, first.decode.name, first.generation) == ("nodes/p0", "nodes/d0", 1)
    stored = await cluster.registry.get_retention(f"{CONV}/retentions/1")
    assert stored.num_tokens == len(seq)
    assert list(stored.block_hashes) == chain_hashes(seq, BS)
    assert stored.pin_expire_at == cluster.clock.now() + 480 - 30

    prompt = seq + cluster.tokens(200)
    second = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV))
    assert (second.decision, second.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)
    full_blocks = len(seq) // BS
    # Token granular: the full blocks and the partly filled last one (its tail is on the hint).
    assert second.reusable_tokens == len(seq) > full_blocks * BS
    assert second.tokens_to_compute == len(prompt) - len(seq)
    params = second.prefill_kv_transfer_params
    assert params["remote_num_tokens"] == len(seq)
    assert len(params["remote_block_ids"][0]) == full_blocks + 1  # type: ignore[index]
    assert params["remote_engine_id"] == "engine-d0"
    assert (params["do_remote_decode"], params["do_remote_prefill"]) == (True, False)
    assert (await cluster.registry.get_retention(f"{CONV}/retentions/1")).claim is not None
    assert second.reuse_cost is not None
    assert second.reuse_cost.total_ms < second.recompute_cost.total_ms


def len_seq() -> int:
    return 1064  # a 1000-token prompt and 64 output tokens (run_turn)


def edited(seq: list[int], at: int, *, remove: int = 0, insert: list[int] | None = None) -> list[int]:
    return seq[:at] + (insert or []) + seq[at + remove :]


@pytest.mark.parametrize(
    ("case", "edit", "expected_tokens"),
    [
        ("edit at the start", lambda s, c: edited(s, 0, remove=1, insert=[7]), None),
        # An edit inside a full block: the cut is that block's start.
        ("edit in the middle", lambda s, c: edited(s, 500, remove=1, insert=[7]), 500 // BS * BS),
        # An edit in the retention's partly filled last block: the cut is the edit itself.
        (
            "edit at the end",
            lambda s, c: edited(s, len(s) - 3, remove=3, insert=[7, 7, 7]),
            len_seq() - 3,
        ),
        (
            "chat-template tail re-rendered",
            lambda s, c: [*s[:-5], 3, 9, 4, *c.tokens(40)],
            len_seq() - 5,
        ),
        # Departures in the answer's blocks (from the one holding the prompt's end, 992..): cut
        # at the departure, full blocks or not.
        ("reasoning stripped", lambda s, c: edited(s, 1010, remove=40) + c.tokens(30), 1010),
        ("tool call re-rendered", lambda s, c: edited(s, 1001, insert=[7, 7]), 1001),
        ("answer edited mid-block", lambda s, c: edited(s, 1030, remove=1, insert=[7]), 1030),
        ("history compacted", lambda s, c: c.tokens(300) + s[800:], None),
    ],
)
async def test_edited_history_reuses_only_the_verified_prefix(
    cluster: Cluster, case: str, edit: Any, expected_tokens: int | None
) -> None:
    router = cluster.router()
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    assert len(seq) == len_seq()
    prompt = edit(seq, cluster) + cluster.tokens(100)
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV))
    if expected_tokens is None:
        assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, Reason.PREFIX_MISMATCH), case
        return
    assert plan.decision is Decision.REUSE, case
    assert plan.reusable_tokens == expected_tokens, case
    # What prefill is told to read is exactly what verified: never a token past the edit (a
    # partly verified block is read whole; prefill computes from remote_num_tokens on).
    assert plan.prefill_kv_transfer_params["remote_num_tokens"] == expected_tokens
    blocks = -(-expected_tokens // BS)
    assert len(plan.prefill_kv_transfer_params["remote_block_ids"][0]) == blocks  # type: ignore[index]
    assert prompt[:expected_tokens] == seq[:expected_tokens]


async def test_a_hint_keeps_the_tokens_of_the_answers_last_blocks(cluster: Cluster) -> None:
    router = cluster.router()
    _, seq = await run_turn(router, cluster, cluster.tokens(200), output=80 * BS + 5)
    hint = router.hints.get(CONV)
    assert hint is not None and hint.num_tokens == len(seq)
    # The answer spans blocks 12..92; the hint keeps the last MAX_KNOWN_BLOCKS of them.
    first = -(-len(seq) // BS) - MAX_KNOWN_BLOCKS
    assert first > 200 // BS
    assert hint.known_from_block == first
    assert list(hint.known_tokens) == seq[first * BS :]
    # Its own copy (not a view of the commit's ids): the hint's byte bound counts what it holds.
    assert hint.known_tokens.base is None and hint.known_tokens.size <= MAX_KNOWN_BLOCKS * BS
    # A departure in a kept block is cut there; in an earlier one, at its block.
    for at, expected in [(first * BS + 5, first * BS + 5), (first * BS - 5, (first - 1) * BS)]:
        prompt = np.array(edited(seq, at, remove=1, insert=[7]), dtype=np.uint32)
        assert verify(chain_hashes(prompt, BS), prompt.size, hint, prompt=prompt).tokens == expected, at


async def test_block_granular_reuse_keeps_no_tokens(cluster: Cluster) -> None:
    router = cluster.router(token_granular_reuse=False)
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    hint = router.hints.get(CONV)
    assert hint is not None and hint.known_tokens.size == 0
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=edited(seq, 1030, remove=1, insert=[7]), conversation=CONV)
    )
    assert plan.reusable_tokens == 1030 // BS * BS


async def test_a_short_verified_prefix_is_below_the_floor(cluster: Cluster) -> None:
    router = cluster.router()
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=edited(seq, 40, remove=1, insert=[5]), conversation=CONV)
    )
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, Reason.BELOW_THRESHOLD)


async def test_a_slow_link_makes_recompute_cheaper(cluster: Cluster) -> None:
    slow = replace(CPU, link=LinkModel(bandwidth_gb_s=0.01, fixed_ms=50))
    router = cluster.router([slow])
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + [1] * 50, conversation=CONV)
    )
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, Reason.COST)
    assert plan.reuse_cost is not None
    assert plan.reuse_cost.total_ms > plan.recompute_cost.total_ms


async def test_a_retention_about_to_expire_is_not_read(cluster: Cluster) -> None:
    router = cluster.router()
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    cluster.clock.advance(450 - 5)  # 5 s left: inside the 6 s headroom
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + [1] * 50, conversation=CONV)
    )
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, Reason.EXPIRED)


async def test_expiry_between_lookup_and_claim_falls_back(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = cluster.router(claim_headroom_s=0.0)
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    router.hints.forget(CONV)  # as another replica would: read from the registry
    port = cluster.port(router)
    real_get = port.get_conversation

    async def get_then_expire(name: str) -> Any:
        found = await real_get(name)
        cluster.clock.advance(450)  # the lease lapses while the plan is being made
        return found

    monkeypatch.setattr(port, "get_conversation", get_then_expire)
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + [1] * 50, conversation=CONV)
    )
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, Reason.EXPIRED)


async def test_the_committing_replica_plans_the_next_turn_from_its_hint(cluster: Cluster) -> None:
    a, b = cluster.router(), cluster.router()
    _, seq = await run_turn(a, cluster, cluster.tokens(1000))
    assert len(a.hints) == 1 and a.hints.nbytes > 0
    port_a, port_b = cluster.port(a), cluster.port(b)
    assert isinstance(port_a, InProcessPort) and isinstance(port_b, InProcessPort)
    before = dict(port_a.calls)
    prompt = seq + cluster.tokens(100)
    plan = await a.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV))
    assert (plan.decision, plan.generation) == (Decision.REUSE, 2)
    # No registry read: the hint verified the prompt, and the claim confirmed the hint.
    # Nor a block lookup: no prefill node has indexed blocks.
    calls = {k: v - before.get(k, 0) for k, v in port_a.calls.items() if v != before.get(k, 0)}
    assert calls == {"claim": 1}
    assert len(a.hints) == 0  # consumed by the claim
    await a.abort_turn(plan.turn, "test")

    # Another replica has no hint: it reads the conversation.
    _, seq = await run_turn(a, cluster, cluster.tokens(1000), conversation=CONV2)
    plan = await b.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=seq + [7] * 80, conversation=CONV2))
    assert plan.decision == Decision.REUSE
    assert port_b.calls.get("get_conversation") == 1 and port_b.calls.get("claim") == 1


async def test_a_stale_hint_is_never_trusted(cluster: Cluster) -> None:
    a, b = cluster.router(), cluster.router()
    _, seq = await run_turn(a, cluster, cluster.tokens(1000))  # a's hint: generation 1
    _, seq = await run_turn(b, cluster, seq + cluster.tokens(100))  # b reused it and stored 2
    # a's claim of generation 1 is refused (replaced): it plans again on the registry's word.
    plan = await a.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + cluster.tokens(100), conversation=CONV)
    )
    assert (plan.decision, plan.reason, plan.generation) == (Decision.REUSE, Reason.REUSE_CHEAPER, 3)
    assert plan.claimed == f"{CONV}/retentions/2"
    await a.abort_turn(plan.turn, "test")

    # A hint that verifies nothing is checked with the registry too: another replica stored a
    # newer retention of a rewritten history, which this prompt continues.
    await run_turn(a, cluster, cluster.tokens(500), conversation=CONV2)  # a's hint: 1
    _, rewritten = await run_turn(b, cluster, cluster.tokens(600), conversation=CONV2)  # b: 2
    plan = await a.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=rewritten + [5] * 60, conversation=CONV2)
    )
    assert (plan.decision, plan.reason, plan.generation) == (Decision.REUSE, Reason.REUSE_CHEAPER, 3)
    assert plan.claimed == f"{CONV2}/retentions/2"


async def test_two_router_replicas_race_for_one_retention(cluster: Cluster) -> None:
    a, b = cluster.router(), cluster.router()
    _, seq = await run_turn(a, cluster, cluster.tokens(1000))
    prompt = seq + cluster.tokens(80)
    plans = await asyncio.gather(
        *(
            r.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV))
            for r in (a, b, a, b)
        )
    )
    assert sorted(p.reason for p in plans) == sorted([Reason.REUSE_CHEAPER] + [Reason.CLAIM_LOST] * 3)


async def test_dead_or_unhealthy_holder_means_recompute(cluster: Cluster) -> None:
    router = cluster.router(node_max_age_s=0.0)
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    await cluster.add_node("nodes/d1", NodeRole.DECODE)
    await cluster.add_node("nodes/d0", NodeRole.DECODE, healthy=False)  # same engine: retention kept
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + [1] * 50, conversation=CONV)
    )
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, Reason.NODE_DOWN)
    assert plan.decode.name == "nodes/d1"


async def test_reuse_can_be_disabled_per_request(cluster: Cluster) -> None:
    router = cluster.router()
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + [1] * 50, conversation=CONV, disable_reuse=True)
    )
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, Reason.DISABLED)


async def test_another_model_does_not_read_this_models_kv(cluster: Cluster) -> None:
    other = replace(CPU, model="other-model")
    await cluster.add_node("nodes/p1", NodeRole.PREFILL, model="other-model")
    await cluster.add_node("nodes/d1", NodeRole.DECODE, model="other-model")
    router = cluster.router([CPU, other])
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    plan = await router.plan_turn(
        PlanRequest(model="other-model", prompt_token_ids=seq + [1] * 50, conversation=CONV)
    )
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, Reason.MODEL_MISMATCH)
    assert plan.prefill.name == "nodes/p1"


@pytest.mark.parametrize(
    ("context", "published_recompute", "published_reuse"), [(2048, 158, 122), (24576, 778, 460)]
)
async def test_decisions_at_the_published_benchmark_points(
    cluster: Cluster, context: int, published_recompute: float, published_reuse: float
) -> None:
    """Qwen3-32B on H200 (vLLM's bidirectional benchmark): reuse wins at 2k and 24k, and the
    profile's estimates stay within 15 % of the published TTFTs."""
    await cluster.add_node("nodes/pq", NodeRole.PREFILL, model=QWEN.model)
    await cluster.add_node("nodes/dq", NodeRole.DECODE, model=QWEN.model)
    router = cluster.router()
    new = 256
    first = cluster.tokens(context - new - 64)
    plan = await router.plan_turn(PlanRequest(model=QWEN.model, prompt_token_ids=first, conversation=CONV))
    seq = first + cluster.tokens(64)
    await router.commit_turn(
        CommitRequest(
            turn=plan.turn, token_ids=seq, decode_kv_transfer_params=cluster.decode_params(plan, len(seq))
        )
    )
    prompt = seq + cluster.tokens(new)
    plan = await router.plan_turn(PlanRequest(model=QWEN.model, prompt_token_ids=prompt, conversation=CONV))
    assert plan.reuse_cost is not None
    assert plan.recompute_cost.total_ms == pytest.approx(published_recompute, rel=0.15)
    assert plan.reuse_cost.total_ms == pytest.approx(published_reuse, rel=0.15)
    assert (plan.decision, plan.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)


async def test_local_prefix_hits_on_prefill_count(cluster: Cluster) -> None:
    """With the prompt already in prefill's cache, reading it remotely buys nothing."""
    router = cluster.router(node_max_age_s=0.0)  # sees prefill's indexed blocks at once
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    p0 = await cluster.registry.get_node("nodes/p0")
    blocks = len(seq) // BS
    await cluster.registry.report_block_events(
        "nodes/p0",
        p0.incarnation,
        [
            EventBatch(
                0,
                0.0,
                (BlockStored(tuple(range(1, blocks + 1)), None, tuple(seq[: blocks * BS]), BS, None, "GPU"),),
            )
        ],
    )
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + [1] * 50, conversation=CONV)
    )
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, Reason.BELOW_THRESHOLD)
    assert plan.tokens_to_compute == len(seq) + 50 - blocks * BS


async def test_a_fork_may_read_its_parents_kv_once(cluster: Cluster) -> None:
    router = cluster.router()
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    prompt = seq + cluster.tokens(60)
    fork = await router.plan_turn(
        PlanRequest(
            model=MODEL, prompt_token_ids=prompt, conversation=f"{CONV}-fork", parent_conversation=CONV
        )
    )
    assert (fork.decision, fork.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)
    second = await router.plan_turn(
        PlanRequest(
            model=MODEL, prompt_token_ids=prompt, conversation=f"{CONV}-fork2", parent_conversation=CONV
        )
    )
    assert (second.decision, second.reason) == (Decision.RECOMPUTE, Reason.FORK_UNSAFE)
    with pytest.raises(InvalidArgument) as err:
        await router.plan_turn(
            PlanRequest(
                model=MODEL,
                prompt_token_ids=prompt,
                conversation=f"{CONV}-x",
                parent_conversation="tenants/other/conversations/c1",
            )
        )
    assert err.value.field == "hints.parent_conversation"


async def test_commit_and_abort_finish_a_turn_once(cluster: Cluster) -> None:
    router = cluster.router()
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + [1] * 50, conversation=CONV)
    )
    claimed = f"{CONV}/retentions/1"
    await router.abort_turn(plan.turn, "client went away")
    with pytest.raises(NotFound):
        await cluster.registry.get_retention(claimed)  # the claim was released (consumed)
    with pytest.raises(FailedPrecondition) as err:
        await router.abort_turn(plan.turn, "again")
    assert err.value.reason == "TURN_FINISHED"
    with pytest.raises(FailedPrecondition):
        await router.commit_turn(
            CommitRequest(turn=plan.turn, token_ids=seq + [1] * 50, decode_kv_transfer_params=None)
        )

    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + [1] * 50, conversation=CONV)
    )
    final = seq + [1] * 50 + [2] * 10
    commit = CommitRequest(
        turn=plan.turn, token_ids=final, decode_kv_transfer_params=cluster.decode_params(plan, 560)
    )
    await router.commit_turn(commit)
    with pytest.raises(FailedPrecondition) as err:
        await router.commit_turn(commit)
    assert err.value.reason == "TURN_FINISHED"
    other_replica = cluster.router()
    with pytest.raises(FailedPrecondition):  # the registry's fence knows, whichever replica asks
        await other_replica.abort_turn(plan.turn, "late")


async def test_a_stored_commit_consumes_the_claim_without_a_release(cluster: Cluster) -> None:
    router = cluster.router()
    port = cluster.port(router)
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    prompt = seq + cluster.tokens(50)
    plan, seq2 = await run_turn(router, cluster, prompt)
    assert plan.claimed == f"{CONV}/retentions/1"
    # The put of turn 2 replaced the claimed retention: one registry write, no release.
    assert "release" not in port.calls
    with pytest.raises(NotFound):
        await cluster.registry.get_retention(plan.claimed)
    await cluster.registry.get_retention(f"{CONV}/retentions/2")

    # Decode kept nothing: nothing is stored, so the consumed claim is released.
    prompt3 = seq2 + cluster.tokens(50)
    plan3 = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt3, conversation=CONV))
    assert plan3.claimed == f"{CONV}/retentions/2"
    await router.commit_turn(
        CommitRequest(turn=plan3.turn, token_ids=prompt3 + [1] * 10, decode_kv_transfer_params=None)
    )
    assert port.calls["release"] == 1
    with pytest.raises(NotFound):
        await cluster.registry.get_retention(plan3.claimed)


async def test_bad_commits_change_nothing(cluster: Cluster) -> None:
    router = cluster.router()
    prompt = cluster.tokens(500)
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV))
    good = cluster.decode_params(plan, 560)
    cases: list[tuple[str, CommitRequest]] = [
        (
            "token_ids",
            CommitRequest(turn=plan.turn, token_ids=cluster.tokens(560), decode_kv_transfer_params=good),
        ),
        ("token_ids", CommitRequest(turn=plan.turn, token_ids=prompt[:100], decode_kv_transfer_params=good)),
        (
            "timings.ttft",
            CommitRequest(
                turn=plan.turn,
                token_ids=prompt + [1] * 60,
                decode_kv_transfer_params=good,
                timings=TurnTimings(ttft_ms=-1.0),
            ),
        ),
    ]
    for field, req in cases:
        with pytest.raises(InvalidArgument) as err:
            await router.commit_turn(req)
        assert err.value.field == field
    # Decode's params name another engine or side channel than the planned decode node's.
    for key, value in (("remote_engine_id", "x"), ("remote_host", "203.0.113.9"), ("remote_port", 6666)):
        with pytest.raises(FailedPrecondition) as mismatch:
            await router.commit_turn(
                CommitRequest(
                    turn=plan.turn, token_ids=prompt + [1] * 60, decode_kv_transfer_params=good | {key: value}
                )
            )
        assert mismatch.value.reason == "NODE_MISMATCH"
        assert mismatch.value.metadata["field"] == f"decode_kv_transfer_params.{key}"
    with pytest.raises(NotFound):
        await cluster.registry.get_conversation(CONV)
    with pytest.raises(NotFound):
        await router.commit_turn(replace(cases[0][1], turn=plan.turn[:-4] + "AAAA"))  # forged signature
    cluster.clock.advance(601)
    with pytest.raises(FailedPrecondition) as expired:
        await router.commit_turn(
            CommitRequest(turn=plan.turn, token_ids=prompt + [1] * 60, decode_kv_transfer_params=good)
        )
    assert expired.value.reason == "TURN_EXPIRED"


@pytest.mark.parametrize(
    ("request_kw", "field"),
    [
        ({"model": ""}, "model"),
        ({"model": "nobody-serves-this"}, "model"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1] * 300_000}, "prompt_token_ids"),
        ({"prompt_token_ids": [-1]}, "prompt_token_ids"),
        ({"conversation": "conversations/c1"}, "conversation"),
        ({"request_id": "x" * 500}, "request_id"),
        ({"expected_think_time_s": -1.0}, "hints.expected_think_time"),
    ],
)
async def test_bad_plans_name_the_field_and_claim_nothing(
    cluster: Cluster, request_kw: dict[str, Any], field: str
) -> None:
    router = cluster.router()
    _, seq = await run_turn(router, cluster, cluster.tokens(300))
    req = PlanRequest(
        **({"model": MODEL, "prompt_token_ids": seq + [1] * 80, "conversation": CONV} | request_kw)
    )
    with pytest.raises(InvalidArgument) as err:
        await router.plan_turn(req)
    assert err.value.field == field
    assert (await cluster.registry.get_retention(f"{CONV}/retentions/1")).claim is None


async def test_measured_turns_calibrate_the_model_robustly(cluster: Cluster) -> None:
    cost = CostModel(CPU)
    router = cluster.router(costs=[cost, CostModel(QWEN)])
    prompts = [cluster.tokens(2000) for _ in range(9)]
    for i, prompt in enumerate(prompts):
        plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt))
        predicted = plan.recompute_cost.prefill_ms / cost.prefill_scale
        measured = predicted * (100.0 if i == 0 else 2.0)  # one wild outlier, then a steady 2x
        await router.commit_turn(
            CommitRequest(
                turn=plan.turn,
                token_ids=prompt,
                decode_kv_transfer_params=None,
                timings=TurnTimings(prefill_ms=measured),
            )
        )
    assert cost.prefill_scale == pytest.approx(2.0)
    for _ in range(4):
        cost.observe_transfer(nbytes=10**9, measured_ms=CPU.link.fixed_ms + 100)  # 10 GB/s measured
    assert cost.bandwidth_gb_s == pytest.approx(10.0)


async def test_prompt_chains_are_hashed_incrementally(cluster: Cluster) -> None:
    router = cluster.router()
    _, seq = await run_turn(router, cluster, cluster.tokens(1000))
    hits = router.chains.hits
    prompt = seq + cluster.tokens(100)
    await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV))
    assert router.chains.hits == hits + 1
    fresh = cluster.router()  # another replica: a miss, the same chain
    tokens = np.array(prompt, dtype=np.uint32)
    np.testing.assert_array_equal(fresh.chains.chain("k", tokens, BS), router.chains.chain(CONV, tokens, BS))


async def test_requests_without_a_conversation_are_plain_pd(cluster: Cluster) -> None:
    router = cluster.router()
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=cluster.tokens(100)))
    assert (plan.decision, plan.reason) == (Decision.RECOMPUTE, Reason.NO_CONVERSATION)
    result = await router.commit_turn(
        CommitRequest(
            turn=plan.turn,
            token_ids=cluster.tokens(100),
            decode_kv_transfer_params=cluster.decode_params(plan, 100),
        )
    )
    assert result.retention == ""


async def test_plan_is_idempotent_by_request_id(cluster: Cluster) -> None:
    router = cluster.router()
    prompt = cluster.tokens(200)
    a = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV, request_id="r1")
    )
    b = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV, request_id="r1")
    )
    assert a.turn == b.turn


async def test_placement_prefers_the_idle_prefill_node(cluster: Cluster) -> None:
    await cluster.add_node("nodes/p1", NodeRole.PREFILL)
    p0 = await cluster.registry.get_node("nodes/p0")
    await cluster.registry.heartbeat_node(
        "nodes/p0", p0.incarnation, 300, NodeLoad(running_requests=4, waiting_requests=3, engine_healthy=True)
    )
    router = cluster.router()
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=cluster.tokens(300)))
    assert plan.prefill.name == "nodes/p1"
    assert PrefillModel(1, 1).ms(2, 0) == 1 + 2  # the linear part alone


async def test_the_node_list_is_refreshed_in_the_background(cluster: Cluster) -> None:
    router = cluster.router(node_refresh_s=0.0, node_max_age_s=60.0)
    port = cluster.port(router)
    assert isinstance(port, InProcessPort)
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=cluster.tokens(100)))
    assert port.calls["list_nodes"] == 1  # nothing in hand: the plan waited for it
    await cluster.add_node("nodes/d1", NodeRole.DECODE)
    d0 = await cluster.registry.get_node("nodes/d0")
    await cluster.registry.deregister_node("nodes/d0", d0.incarnation)
    # The list in hand (d0) serves this plan while a background read picks up d1.
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=cluster.tokens(100)))
    assert plan.decode.name == "nodes/d0"
    for _ in range(10):
        await asyncio.sleep(0)
    assert port.calls["list_nodes"] == 2
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=cluster.tokens(100)))
    assert plan.decode.name == "nodes/d1"
    # Too old to trust: the plan reads the list itself.
    stale = cluster.router(node_max_age_s=0.0)
    await stale.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=cluster.tokens(100)))
    await stale.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=cluster.tokens(100)))
    stale_port = cluster.port(stale)
    assert isinstance(stale_port, InProcessPort) and stale_port.calls["list_nodes"] == 2


async def test_a_plan_waits_for_its_conversations_commit_in_flight(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Turn 2 reaching the router (through another gateway, say) while turn 1's commit is still
    being stored there plans once it is stored, and so reads it."""
    router = cluster.router()
    prompt = cluster.tokens(1000)
    first = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV))
    sequence = prompt + cluster.tokens(64)
    port = cluster.port(router)
    put_retention = port.put_retention
    entered, release = asyncio.Event(), asyncio.Event()

    async def held_put(new: NewRetention) -> Any:
        entered.set()
        await release.wait()
        return await put_retention(new)

    monkeypatch.setattr(port, "put_retention", held_put)
    commit = asyncio.create_task(
        router.commit_turn(
            CommitRequest(
                turn=first.turn,
                token_ids=sequence,
                decode_kv_transfer_params=cluster.decode_params(first, len(sequence)),
            )
        )
    )
    await entered.wait()
    plan = asyncio.create_task(
        router.plan_turn(
            PlanRequest(model=MODEL, prompt_token_ids=sequence + cluster.tokens(100), conversation=CONV)
        )
    )
    await asyncio.sleep(0.05)
    assert not plan.done()  # waiting for turn 1's retention
    release.set()
    assert (await commit).retention == f"{CONV}/retentions/1"
    second = await plan
    assert (second.decision, second.reason, second.generation) == (Decision.REUSE, Reason.REUSE_CHEAPER, 2)
    # Another conversation's plan does not wait for this one's commits.
    other = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=cluster.tokens(100), conversation=CONV2)
    )
    assert other.generation == 1
