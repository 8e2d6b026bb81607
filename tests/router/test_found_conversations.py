"""Turns that name only their tenant: the router finds the conversation a prompt continues by its
chain (never another tenant's, never under another salt), or starts one; a commit's transcript is
found again by its key. Over the registry's domain in process, on a fake clock. Continuing a
found conversation is the rule with forks not sharing (policy share_forks off); with them
sharing, every found turn forks from it (tests/router/test_fork_reads.py)."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import replace

import numpy as np
import pytest
from tests.router.domain_cluster import MODEL, Cluster, commit_answer

from kvshuttle.core.errors import InvalidArgument, NotFound
from kvshuttle.router.finding import NEW_CONVERSATION_PREFIX
from kvshuttle.router.model import (
    CommitRequest,
    Decision,
    Plan,
    PlanRequest,
    Reason,
    TranscriptSpec,
    TurnTimings,
)
from kvshuttle.router.router import Router

ACME, OTHER = "tenants/acme", "tenants/other"
KEY = hashlib.sha256(b"rendered prompt").digest()


async def turn(
    router: Router,
    cluster: Cluster,
    prompt: list[int],
    *,
    tenant: str = ACME,
    transcript: TranscriptSpec | None = None,
    **plan_kw: object,
) -> tuple[Plan, list[int]]:
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=prompt, tenant=tenant, **plan_kw)  # type: ignore[arg-type]
    )
    sequence = prompt + cluster.tokens(64)
    await router.commit_turn(
        CommitRequest(
            turn=plan.turn,
            token_ids=sequence,
            decode_kv_transfer_params=cluster.decode_params(plan, len(sequence)),
            timings=TurnTimings(ttft_ms=100.0, prefill_ms=90.0),
            transcript=transcript,
        )
    )
    return plan, sequence


async def test_a_prompt_continues_the_conversation_whose_retention_it_extends(cluster: Cluster) -> None:
    router = cluster.router(share_forks=False)
    first, seq = await turn(router, cluster, cluster.tokens(1000))
    assert first.conversation.startswith(f"{ACME}/conversations/{NEW_CONVERSATION_PREFIX}")
    assert (first.decision, first.reason) == (Decision.RECOMPUTE, Reason.NO_RETENTION)
    second, seq2 = await turn(router, cluster, seq + cluster.tokens(200))
    assert second.conversation == first.conversation
    assert (second.decision, second.generation) == (Decision.REUSE, 2)
    assert second.reusable_tokens >= len(seq) // 16 * 16
    # The third turn continues the second's retention, which replaced the first's.
    third, _ = await turn(router, cluster, seq2 + cluster.tokens(100))
    assert (third.conversation, third.decision, third.generation) == (first.conversation, Decision.REUSE, 3)
    # A new prompt starts a conversation of its own.
    other, _ = await turn(router, cluster, cluster.tokens(500))
    assert other.conversation != first.conversation
    assert other.reason is Reason.NO_RETENTION


async def test_no_tenant_finds_another_tenants_retention_by_its_prompt(cluster: Cluster) -> None:
    router = cluster.router()
    first, seq = await turn(router, cluster, cluster.tokens(1000))
    prompt = seq + cluster.tokens(200)
    theirs, _ = await turn(router, cluster, prompt, tenant=OTHER)
    assert theirs.conversation.startswith(f"{OTHER}/conversations/")
    assert (theirs.decision, theirs.reason, theirs.reusable_tokens) == (
        Decision.RECOMPUTE,
        Reason.NO_RETENTION,
        0,
    )
    # The same tenant under another cache salt finds nothing either: its KV is another salt's.
    salted, _ = await turn(router, cluster, prompt, cache_salt_sha256=hashlib.sha256(b"s").digest())
    assert salted.conversation != first.conversation
    assert salted.reusable_tokens == 0
    # The first retention was never claimed by either.
    mine = await cluster.registry.get_retention(f"{first.conversation}/retentions/1")
    assert mine.claim is None


async def test_an_edited_history_starts_a_new_conversation(cluster: Cluster) -> None:
    router = cluster.router()
    first, seq = await turn(router, cluster, cluster.tokens(1000))
    edited = list(seq)
    edited[500] += 1
    second, _ = await turn(router, cluster, edited + cluster.tokens(10))
    assert second.conversation != first.conversation
    assert second.reusable_tokens == 0


async def test_a_conversation_sent_wins(cluster: Cluster) -> None:
    router = cluster.router()
    _, seq = await turn(router, cluster, cluster.tokens(1000))
    port = cluster.port(router)
    finds = port.calls["find_by_chain"]
    mine = f"{ACME}/conversations/mine"
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=[*seq, 5], conversation=mine, tenant=ACME)
    )
    assert plan.conversation == mine
    assert port.calls["find_by_chain"] == finds
    with pytest.raises(InvalidArgument) as err:
        await router.plan_turn(
            PlanRequest(model=MODEL, prompt_token_ids=[1, 2], conversation=mine, tenant=OTHER)
        )
    assert err.value.field == "tenant"
    with pytest.raises(InvalidArgument) as err:
        await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=[1, 2], tenant="acme"))
    assert err.value.field == "tenant"
    # Neither: plain P->D, nothing looked up.
    plain = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=[1, 2]))
    assert (plain.conversation, plain.reason) == ("", Reason.NO_CONVERSATION)


async def test_a_transcript_is_found_by_its_key_within_its_tenant(cluster: Cluster) -> None:
    router = cluster.router()
    prompt = cluster.tokens(300)
    spec = TranscriptSpec(
        KEY, num_tokens=300 + 63, answer_sha256=hashlib.sha256(b"answer").digest(), answer_chars=6
    )
    first, seq = await turn(router, cluster, prompt, transcript=spec)
    found = await router.find_transcript(ACME, MODEL, KEY)
    assert found.conversation == first.conversation
    assert np.array_equal(found.transcript.token_ids, np.array(seq[:363], dtype=np.uint32))
    assert (found.transcript.answer_sha256, found.transcript.answer_chars) == (spec.answer_sha256, 6)
    with pytest.raises(NotFound):
        await router.find_transcript(OTHER, MODEL, KEY)
    for args, field in (((ACME, MODEL, b"short"), "lookup_key"), (("acme", MODEL, KEY), "tenant")):
        with pytest.raises(InvalidArgument) as err:
            await router.find_transcript(*args)
        assert err.value.field == field


async def test_a_bad_transcript_is_refused_naming_its_field_and_commits_nothing(cluster: Cluster) -> None:
    router = cluster.router()
    prompt = cluster.tokens(100)
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=prompt, tenant=ACME))
    sequence = prompt + cluster.tokens(10)
    good = TranscriptSpec(KEY, 110, hashlib.sha256(b"a").digest(), 1)
    for bad, field in (
        (TranscriptSpec(b"x" * 8, 110, good.answer_sha256, 1), "transcript.lookup_key"),
        (TranscriptSpec(KEY, 111, good.answer_sha256, 1), "transcript.num_tokens"),
        (TranscriptSpec(KEY, 0, good.answer_sha256, 1), "transcript.num_tokens"),
        (TranscriptSpec(KEY, 110, b"a", 1), "transcript.answer_sha256"),
    ):
        with pytest.raises(InvalidArgument) as err:
            await router.commit_turn(
                CommitRequest(
                    turn=plan.turn,
                    token_ids=sequence,
                    decode_kv_transfer_params=cluster.decode_params(plan, len(sequence)),
                    transcript=bad,
                )
            )
        assert err.value.field == field
    # Nothing was committed: the turn still commits, with its transcript.
    await router.commit_turn(
        CommitRequest(
            turn=plan.turn,
            token_ids=sequence,
            decode_kv_transfer_params=cluster.decode_params(plan, len(sequence)),
            transcript=good,
        )
    )
    assert (await router.find_transcript(ACME, MODEL, KEY)).conversation == plan.conversation


async def test_siblings_of_a_fork_each_get_a_conversation_of_their_own(cluster: Cluster) -> None:
    """Two requests continue one history at once (a fork's children): the first continues the
    parent's conversation, the second, finding its retention claimed, forks a conversation of its
    own (it recomputes: the retention is single use). Both commits are stored; each child's next
    turn finds its own."""
    router = cluster.router(share_forks=False)
    parent, seq = await turn(router, cluster, cluster.tokens(1000))
    one, two = seq + cluster.tokens(50), seq + cluster.tokens(50)
    first = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=one, tenant=ACME))
    second = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=two, tenant=ACME))
    assert (first.conversation, first.decision) == (parent.conversation, Decision.REUSE)
    assert second.conversation not in (parent.conversation, "")
    assert (second.decision, second.reason) == (Decision.RECOMPUTE, Reason.FORK_UNSAFE)
    seq1 = await commit_answer(router, cluster, first, one)
    seq2 = await commit_answer(router, cluster, second, two)
    assert (await cluster.registry.get_retention(f"{first.conversation}/retentions/2")).num_tokens == len(
        seq1
    )
    assert (await cluster.registry.get_retention(f"{second.conversation}/retentions/1")).num_tokens == len(
        seq2
    )
    for mine, sequence in ((first, seq1), (second, seq2)):
        nxt = await router.plan_turn(
            PlanRequest(model=MODEL, prompt_token_ids=sequence + cluster.tokens(20), tenant=ACME)
        )
        assert (nxt.conversation, nxt.decision) == (mine.conversation, Decision.REUSE)


async def test_a_sibling_that_loses_the_claim_forks_instead_of_recomputing_into_a_fenced_commit(
    cluster: Cluster,
) -> None:
    """Both siblings found the retention unclaimed; the second's claim loses: it plans again as
    a fork, and its commit is stored under its own conversation."""
    router = cluster.router(share_forks=False)
    parent, seq = await turn(router, cluster, cluster.tokens(1000))
    port = cluster.port(router)
    stale = port.find_by_chain
    first = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=seq + [1] * 40, tenant=ACME))
    assert first.decision == Decision.REUSE

    async def unclaimed(*args: object) -> object:
        found = await stale(*args)  # type: ignore[arg-type]  # as before the first sibling claimed
        return None if found is None else replace(found, claimed=False)

    port.find_by_chain = unclaimed  # type: ignore[method-assign, assignment]
    second = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=seq + [2] * 40, tenant=ACME))
    assert second.conversation not in (parent.conversation, "")
    assert (second.decision, second.reason) == (Decision.RECOMPUTE, Reason.FORK_UNSAFE)
    await commit_answer(router, cluster, second, seq + [2] * 40)
    assert (await cluster.registry.get_conversation(second.conversation)).retention is not None


async def test_a_prompt_that_repeats_the_previous_prompt_but_not_its_answer_continues_it(
    cluster: Cluster,
) -> None:
    """A chat re-tokenized from text (or whose answer was re-rendered: a tool call) repeats the
    previous prompt, not decode's answer ids: the conversation is still found, by the prompt's
    last full block, and the turn reuses the previous prompt."""
    router = cluster.router(share_forks=False)
    prompt = cluster.tokens(1000)
    first, _ = await turn(router, cluster, prompt)
    retokenized = prompt + cluster.tokens(80)  # another answer's ids, then the new message
    second = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=retokenized, tenant=ACME))
    assert (second.conversation, second.decision) == (first.conversation, Decision.REUSE)
    assert (1000 - 1) // 16 * 16 <= second.reusable_tokens <= 1000


async def test_a_retention_this_replica_is_moving_is_waited_for_not_forked_from(cluster: Cluster) -> None:
    """The claim on a found retention is this replica's own park: the turn continues the
    conversation (the plan waits for the move), where a sibling's claim would fork it."""
    router = cluster.router(share_forks=False)
    parent, seq = await turn(router, cluster, cluster.tokens(1000))
    port = cluster.port(router)
    real_find = port.find_by_chain

    async def claimed(*args: object) -> object:
        found = await real_find(*args)  # type: ignore[arg-type]
        return None if found is None else replace(found, claimed=True)

    port.find_by_chain = claimed  # type: ignore[method-assign, assignment]
    moved: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    moved.set_result(None)
    moving = {parent.conversation: moved}

    class Moves:  # this replica's moves in flight, as the shuttle answers them
        def move_in_flight(self, conversation: str) -> asyncio.Future[None] | None:
            return moving.get(conversation)

    finder = router._planner._finder
    finder._parts = replace(finder._parts, shuttle=Moves())  # type: ignore[arg-type]
    own = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=seq + [1] * 40, tenant=ACME))
    assert (own.conversation, own.decision) == (parent.conversation, Decision.REUSE)
    # A claim that is not this replica's move: a sibling's, and the turn forks.
    moving.clear()
    sibling = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=seq + [2] * 40, tenant=ACME))
    assert sibling.conversation not in (parent.conversation, "")


async def test_a_prompt_of_no_conversation_is_hashed_once(cluster: Cluster) -> None:
    """The chain the conversation was found by is the plan's: the prompt is hashed once."""
    router = cluster.router(share_forks=False)
    chains = router._parts.chains
    first, seq = await turn(router, cluster, cluster.tokens(1000))  # a new conversation
    assert chains.misses == 1  # the plan's and the commit's chains started from the finder's
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + cluster.tokens(50), tenant=ACME)
    )
    assert plan.conversation == first.conversation  # found: hashed once more, reused by the plan
    assert chains.misses == 2


async def test_a_prompt_shorter_than_a_block_starts_a_conversation(cluster: Cluster) -> None:
    router = cluster.router()
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=[5, 6, 7], tenant=ACME))
    assert plan.conversation.startswith(f"{ACME}/conversations/{NEW_CONVERSATION_PREFIX}")
    assert cluster.port(router).calls.get("find_by_chain", 0) == 0  # nothing to look up by
