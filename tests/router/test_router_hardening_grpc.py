"""Hostile and out-of-range input over real registry and router gRPC servers (issue 9, sections 2
and 5): prefill reads KV only from nodes the registry knows, and bad input never reaches
INTERNAL. Each case asserts the code, the ErrorInfo reason and field, and that the registry's
state did not change."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from tests.router.grpc_cluster import (  # noqa: F401 (cluster: the `c` fixture)
    OUTPUT,
    PROMPT,
    Cluster,
    cluster,
    fails,
    retention,
)
from tests.router.helpers import BS, CONV, MODEL, node, registry_state, seconds

from kvshuttle.core.hashing import chain_hashes
from kvshuttle.core.limits import MAX_GENERATION, MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import BlockIdList, KvTransferParams


async def registry_refuses(c: Cluster, call: Any, code: grpc.StatusCode, reason: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code
    assert reason in str(caught.value.trailing_metadata())


def _retention(generation: int, tokens: list[int], **params: Any) -> reg_pb.Retention:
    """A retention of `tokens` on nodes/d0, as a caller of the registry could put it directly."""
    blocks = len(tokens) // BS
    fields: dict[str, Any] = {
        "do_remote_decode": True,
        "remote_block_ids": [BlockIdList(block_ids=range(100, 100 + blocks + 1))],
        "remote_engine_id": "engine-d0",
        "remote_request_id": "cmpl-forged",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_num_tokens": len(tokens),
        **params,
    }
    return reg_pb.Retention(
        node="nodes/d0",
        generation=generation,
        model=MODEL,
        block_size=BS,
        num_tokens=len(tokens),
        block_hashes=chain_hashes(tokens, BS),
        kv_transfer_params=KvTransferParams(**fields),
        kv_bytes=len(tokens) * 1024,
    )


# ---- section 2: prefill reads only from nodes the registry knows ---------------------------


async def test_a_forged_retention_is_refused_and_prefill_is_never_sent_to_it(c: Cluster) -> None:
    """A caller puts a retention for the conversation whose params point at a host, port and
    engine of its choosing: the registry refuses it (NODE_MISMATCH), nothing is stored, and the
    next turn recomputes instead of reading from the attacker."""
    prompt = c.tokens(PROMPT)
    before = await registry_state(c.registry)
    forged = _retention(1, prompt, remote_engine_id="attacker", remote_host="203.0.113.9", remote_port=6666)
    await registry_refuses(
        c,
        c.registry.stub.PutRetention(
            reg_pb.PutRetentionRequest(parent=CONV, retention=forged, ttl=seconds(60))
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "NODE_MISMATCH",
    )
    assert await registry_state(c.registry) == before

    plan = await c.plan([*prompt, *c.tokens(100)])
    assert (plan.decision, plan.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_NO_RETENTION)
    assert plan.prefill_kv_transfer_params == KvTransferParams(do_remote_decode=True, do_remote_prefill=False)


async def test_prefill_reads_from_the_holders_registration_not_the_stored_params(c: Cluster) -> None:
    other = "tenants/t/conversations/other"
    sequences = {}
    for conversation in (CONV, other):  # both committed through router a, with d0's params
        prompt = c.tokens(PROMPT)
        plan = await c.plan(prompt, conversation=conversation)
        sequences[conversation] = [*prompt, *c.tokens(OUTPUT)]
        await c.commit(plan, sequences[conversation])
    stored = (await retention(c)).kv_transfer_params
    assert (stored.remote_host, stored.remote_port) == ("127.0.0.1", 5600)
    # The agent of d0 restarts on the same engine with its side channel elsewhere: the
    # retentions stay (same engine), and the node's registration is where prefill must read.
    moved = node("nodes/d0", reg_pb.NODE_ROLE_DECODE)
    moved.side_channel_host, moved.side_channel_port = "10.1.2.3", 7000
    registered = await c.registry.stub.RegisterNode(reg_pb.RegisterNodeRequest(node=moved, ttl=seconds(300)))
    c.incarnations["nodes/d0"] = registered.node.incarnation
    await c.beat("nodes/d0")
    assert (await retention(c)).kv_transfer_params == stored

    # Router a plans CONV on the hint its own commit left; router b plans the other on what the
    # registry stored. Both hand prefill the registration, never the stored host and port.
    for env, conversation in ((c.a, CONV), (c.b, other)):
        plan = await c.plan([*sequences[conversation], *c.tokens(100)], on=env, conversation=conversation)
        assert plan.decision == pb.DECISION_REUSE
        params = plan.prefill_kv_transfer_params
        assert (params.remote_engine_id, params.remote_host, params.remote_port) == (
            "engine-d0",
            "10.1.2.3",
            7000,
        )
        assert params.remote_request_id == "cmpl-1"  # the rest is decode's own answer


@pytest.mark.parametrize(
    ("key", "value"),
    [("remote_engine_id", "engine-p0"), ("remote_host", "203.0.113.9"), ("remote_port", 6666)],
)
async def test_a_commit_naming_another_node_is_node_mismatch_and_changes_nothing(
    c: Cluster, key: str, value: Any
) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT))
    prompt = [*sequence, *c.tokens(100)]
    plan = await c.plan(prompt)
    assert plan.decision == pb.DECISION_REUSE
    longer = [*prompt, *c.tokens(OUTPUT)]
    params = c.tokens.decode_params(plan, len(longer))
    setattr(params, key, value)
    before = await registry_state(c.registry)

    err = await fails(c.a.client.commit_turn(plan.turn, token_ids=longer, decode_kv_transfer_params=params))

    assert (err.code, err.reason, err.field) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "NODE_MISMATCH",
        f"decode_kv_transfer_params.{key}",
    )
    assert err.metadata["node"] == "nodes/d0"
    assert await registry_state(c.registry) == before
    assert (await retention(c)).state == reg_pb.RETENTION_STATE_CLAIMED  # the claim is still held
    assert (await c.commit(plan, longer)).retention == f"{CONV}/retentions/2"


# ---- section 5: integers that are incremented ----------------------------------------------


async def test_a_conversation_at_the_top_generation_still_plans_and_commits(c: Cluster) -> None:
    prompt = c.tokens(PROMPT)
    top = _retention(MAX_GENERATION, prompt)
    await c.registry.stub.PutRetention(
        reg_pb.PutRetentionRequest(parent=CONV, retention=top, ttl=seconds(300))
    )

    prompt = [*prompt, *c.tokens(100)]
    plan = await c.plan(prompt)

    assert plan.generation == 2**63
    committed = await c.commit(plan, [*prompt, *c.tokens(OUTPUT)])
    # The registry stores no later generation: the turn commits and retains nothing.
    assert committed.retention == ""
    fence = await c.registry.stub.GetConversation(reg_pb.GetConversationRequest(name=CONV))
    assert fence.conversation.fence_generation == MAX_GENERATION


# ---- section 5: a request id repeated with another body -----------------------------------


async def test_a_plan_request_id_with_another_prompt_is_refused(c: Cluster) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT))
    prompt = [*sequence, *c.tokens(100)]
    first = await c.a.client.plan_turn(MODEL, prompt, conversation=CONV, request_id="plan-2")
    assert first.decision == pb.DECISION_REUSE
    before = await registry_state(c.registry)

    err = await fails(
        c.a.client.plan_turn(MODEL, [*prompt, *c.tokens(5)], conversation=CONV, request_id="plan-2")
    )

    assert (err.code, err.reason, err.field) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "REQUEST_ID_REUSED",
        "request_id",
    )
    assert await registry_state(c.registry) == before
    assert await c.a.client.plan_turn(MODEL, prompt, conversation=CONV, request_id="plan-2") == first
    # Another replica, the same id, another prompt: a claim of its own, which it loses; it is
    # never handed the first plan's claim.
    other = await c.b.client.plan_turn(MODEL, [*prompt, *c.tokens(5)], conversation=CONV, request_id="plan-2")
    assert (other.decision, other.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_CLAIM_LOST)
    assert other.prefill_kv_transfer_params == KvTransferParams(
        do_remote_decode=True, do_remote_prefill=False
    )


async def test_a_commit_request_id_with_another_body_is_refused(c: Cluster) -> None:
    prompt = c.tokens(PROMPT)
    plan = await c.plan(prompt)
    sequence = [*prompt, *c.tokens(OUTPUT)]
    params = c.tokens.decode_params(plan, len(sequence))
    first = await c.a.client.commit_turn(
        plan.turn, token_ids=sequence, decode_kv_transfer_params=params, request_id="commit-1"
    )
    before = await registry_state(c.registry)

    err = await fails(
        c.a.client.commit_turn(
            plan.turn, token_ids=[*sequence, 7], decode_kv_transfer_params=params, request_id="commit-1"
        )
    )

    assert (err.code, err.reason, err.field) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "REQUEST_ID_REUSED",
        "request_id",
    )
    assert await registry_state(c.registry) == before
    again = await c.a.client.commit_turn(
        plan.turn, token_ids=sequence, decode_kv_transfer_params=params, request_id="commit-1"
    )
    assert again == first


# ---- section 5: one bound for prompts, one for what commits -------------------------------


async def test_a_prompt_at_plan_turns_bound_is_committable(c: Cluster) -> None:
    prompt = c.tokens(MAX_PROMPT_TOKENS)
    plan = await c.plan(prompt)
    assert plan.reason == pb.DECISION_REASON_NO_RETENTION
    sequence = [*prompt, *c.tokens(1000)]

    committed = await c.commit(plan, sequence)

    assert committed.retention == f"{CONV}/retentions/1"
    stored = await retention(c)
    assert stored.num_tokens == len(sequence)
    assert len(stored.block_hashes) == len(sequence) // BS


async def test_a_commit_past_prompt_and_output_bounds_is_invalid_argument(c: Cluster) -> None:
    prompt = c.tokens(100)
    plan = await c.plan(prompt)
    before = await registry_state(c.registry)
    too_long = [*prompt, *([5] * (MAX_PROMPT_TOKENS + MAX_OUTPUT_TOKENS + 1 - len(prompt)))]

    err = await fails(c.a.client.commit_turn(plan.turn, token_ids=too_long))

    assert (err.code, err.reason, err.field) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        "token_ids",
    )
    assert await registry_state(c.registry) == before


# ---- section 5: durations outside protobuf's range ----------------------------------------


@pytest.mark.parametrize(
    "duration", [Duration(seconds=2**62), Duration(seconds=1, nanos=-1), Duration(nanos=10**9)]
)
async def test_durations_outside_protobufs_range_are_invalid_argument(c: Cluster, duration: Duration) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT))
    prompt = [*sequence, *c.tokens(100)]
    before = await registry_state(c.registry)
    err = await fails(
        c.a.client.plan_turn(
            MODEL, prompt, conversation=CONV, hints=pb.PlanHints(expected_think_time=duration)
        )
    )
    assert (err.code, err.reason, err.field) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        "hints.expected_think_time",
    )
    assert await registry_state(c.registry) == before

    plan = await c.plan(prompt)
    before = await registry_state(c.registry)
    longer = [*prompt, *c.tokens(OUTPUT)]
    err = await fails(
        c.a.client.commit_turn(
            plan.turn,
            token_ids=longer,
            decode_kv_transfer_params=c.tokens.decode_params(plan, len(longer)),
            timings=pb.TurnTimings(prefill=duration),
        )
    )
    assert (err.code, err.reason, err.field) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        "timings.prefill",
    )
    assert await registry_state(c.registry) == before


# ---- CommitTurn's output alone (the prompt held by the replica that planned) ----------------


async def test_a_commit_of_the_output_alone_stores_what_the_whole_sequence_would(c: Cluster) -> None:
    prompt, output = c.tokens(PROMPT), c.tokens(OUTPUT)
    plan = await c.plan(prompt)
    sequence = [*prompt, *output]
    params = c.tokens.decode_params(plan, len(sequence))

    first = await c.a.client.commit_turn(
        plan.turn, output_token_ids=output, decode_kv_transfer_params=params, request_id="commit-1"
    )

    stored = await retention(c)
    assert stored.num_tokens == len(sequence)
    assert list(stored.block_hashes) == chain_hashes(sequence, BS)[: len(sequence) // BS]
    # A retry with the whole sequence is the same request (one fingerprint): the first answer.
    again = await c.a.client.commit_turn(
        plan.turn, token_ids=sequence, decode_kv_transfer_params=params, request_id="commit-1"
    )
    assert again == first
    next_plan = await c.plan([*sequence, *c.tokens(50)])
    assert next_plan.decision == pb.DECISION_REUSE


async def test_a_replica_that_did_not_plan_the_turn_refuses_its_output_alone(c: Cluster) -> None:
    prompt, output = c.tokens(PROMPT), c.tokens(OUTPUT)
    plan = await c.plan(prompt)  # on a
    sequence = [*prompt, *output]
    params = c.tokens.decode_params(plan, len(sequence))
    before = await registry_state(c.registry)

    err = await fails(
        c.b.client.commit_turn(plan.turn, output_token_ids=output, decode_kv_transfer_params=params)
    )

    assert (err.code, err.reason, err.field) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "PROMPT_NOT_HELD",
        "output_token_ids",
    )
    assert await registry_state(c.registry) == before
    # The whole sequence commits there.
    committed = await c.commit(plan, sequence, on=c.b)
    assert committed.retention == f"{CONV}/retentions/1"


async def test_a_finished_turns_prompt_is_let_go(c: Cluster) -> None:
    prompt, output = c.tokens(PROMPT), c.tokens(OUTPUT)
    plan = await c.plan(prompt)
    await c.a.client.abort_turn(plan.turn, reason="test")

    err = await fails(c.a.client.commit_turn(plan.turn, output_token_ids=output))

    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "PROMPT_NOT_HELD")
    err = await fails(c.a.client.commit_turn(plan.turn, token_ids=[*prompt, *output]))
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "TURN_FINISHED")


async def test_a_commit_with_both_the_sequence_and_the_output_alone_is_invalid_argument(c: Cluster) -> None:
    prompt, output = c.tokens(PROMPT), c.tokens(OUTPUT)
    plan = await c.plan(prompt)

    both = await fails(
        c.a.client.commit_turn(plan.turn, token_ids=[*prompt, *output], output_token_ids=output)
    )
    too_long = await fails(c.a.client.commit_turn(plan.turn, output_token_ids=[5] * (MAX_OUTPUT_TOKENS + 1)))

    assert (both.code, both.reason, both.field) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        "output_token_ids",
    )
    assert (too_long.code, too_long.field) == (grpc.StatusCode.INVALID_ARGUMENT, "output_token_ids.token_ids")
    # Refused before anything changed: the turn still commits its output alone.
    committed = await c.a.client.commit_turn(
        plan.turn,
        output_token_ids=output,
        decode_kv_transfer_params=c.tokens.decode_params(plan, len(prompt) + len(output)),
    )
    assert committed.retention
