"""RouterService over real gRPC servers on 127.0.0.1: a registry on a fake clock and router
replicas that reach it over gRPC, as deployed. What a gateway relies on: the decisions, the
params prefill gets, what lands in the registry, the codes and reasons of failures, and that a
rejected request changes nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from tests.router.grpc_cluster import OUTPUT, PROMPT, Cluster, cluster, fails, retention  # noqa: F401 (cluster: the `c` fixture)
from tests.router.helpers import (
    BS,
    CONV,
    MODEL,
    PROFILES,
    QWEN,
    RouterEnv,
    add_node,
    registry_state,
    retentions,
    seconds,
    settings,
    start_router,
)
from tests.serving.echo import JsonLog
from tests.support.clock import FakeClock
from tests.support.registry_env import start_registry

from kvshuttle.client import KvshuttleRpcError, RegistryClient, RouterClient
from kvshuttle.client.errors import CallRefused, domain_error
from kvshuttle.core.digest import log_digest, log_name
from kvshuttle.core.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.config import RouterSettings
from kvshuttle.router.cost import LinkModel, ModelProfile, PrefillModel
from kvshuttle.router.grpc import convert
from kvshuttle.router.grpc.registry_port import GrpcRegistryPort
from kvshuttle.router.main import build_router, build_server
from kvshuttle.router.main import profiles as router_profiles
from kvshuttle.router.model import Reason
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

# ---- the turn, end to end -----------------------------------------------------------------


async def test_first_turn_recomputes_its_commit_is_retained_and_the_next_turn_reuses(c: Cluster) -> None:
    prompt = c.tokens(PROMPT)
    first = await c.plan(prompt)
    assert (first.decision, first.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_NO_RETENTION)
    assert first.prefill_kv_transfer_params == KvTransferParams(
        do_remote_decode=True, do_remote_prefill=False
    )
    assert (first.prefill.node, first.decode.node, first.generation) == ("nodes/p0", "nodes/d0", 1)
    assert (first.decode.engine_id, first.decode.http_endpoint) == ("engine-d0", "http://d0:8000")
    assert (first.reusable_tokens, first.tokens_to_compute) == (0, PROMPT)
    assert not first.HasField("reuse_cost")
    assert first.recompute_cost.total.ToMilliseconds() > 0
    assert first.expire_time.seconds == int(c.registry.clock.now() + 600)

    sequence = prompt + c.tokens(OUTPUT)
    committed = await c.commit(first, sequence)
    assert committed.retention == f"{CONV}/retentions/1"
    stored = await retention(c)
    assert stored.state == reg_pb.RETENTION_STATE_ACTIVE
    assert (stored.node, stored.generation, stored.model, stored.block_size) == ("nodes/d0", 1, MODEL, BS)
    assert stored.num_tokens == len(sequence)
    assert list(stored.block_hashes) == chain_hashes(sequence, BS)
    assert stored.kv_bytes == len(sequence) * QWEN.kv_bytes_per_token
    # Decode keeps its blocks for decoder_kv_blocks_ttl (480 s); the lease ends 30 s earlier.
    assert stored.pin_expire_time.seconds == int(c.registry.clock.now() + 480 - 30)
    assert committed.expire_time == stored.expire_time
    assert stored.kv_transfer_params.remote_engine_id == "engine-d0"

    second = await c.plan(sequence + c.tokens(200))
    assert (second.decision, second.reason) == (pb.DECISION_REUSE, pb.DECISION_REASON_REUSE_CHEAPER)
    assert second.generation == 2
    # All 255 blocks decode holds, the last partly filled (its tokens verified one by one).
    assert second.reusable_tokens == len(sequence)
    assert second.tokens_to_compute == 200
    params = second.prefill_kv_transfer_params
    held = stored.kv_transfer_params.remote_block_ids[0].block_ids
    assert len(held) == len(sequence) // BS + 1
    assert list(params.remote_block_ids[0].block_ids) == list(held)
    assert params.remote_num_tokens == len(sequence)
    assert (params.do_remote_decode, params.do_remote_prefill) == (True, False)
    assert (params.remote_engine_id, params.remote_request_id, params.remote_port) == (
        "engine-d0",
        "cmpl-1",
        5600,
    )
    assert second.reuse_cost.total.ToNanoseconds() < second.recompute_cost.total.ToNanoseconds()
    assert second.reuse_cost.transfer.ToNanoseconds() > 0
    assert (await retention(c)).state == reg_pb.RETENTION_STATE_CLAIMED


async def test_an_edited_history_reuses_only_up_to_the_edit(c: Cluster) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT))
    edit = 3000
    prompt = [*sequence[:edit], 7, *sequence[edit + 1 :], *c.tokens(100)]
    plan = await c.plan(prompt)
    assert plan.decision == pb.DECISION_REUSE
    assert plan.reusable_tokens == (edit // BS) * BS
    held = (await retention(c)).kv_transfer_params.remote_block_ids[0].block_ids
    params = plan.prefill_kv_transfer_params
    assert list(params.remote_block_ids[0].block_ids) == list(held[: edit // BS])
    assert params.remote_num_tokens == (edit // BS) * BS


async def test_a_request_without_a_conversation_is_plain_p_to_d(c: Cluster) -> None:
    prompt = c.tokens(100)
    plan = await c.a.client.plan_turn(MODEL, prompt)
    assert (plan.decision, plan.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_NO_CONVERSATION)
    assert plan.generation == 1
    sequence = prompt + c.tokens(OUTPUT)
    committed = await c.commit(plan, sequence)  # decode's params too: nothing to keep them for
    assert committed.retention == ""
    assert not committed.HasField("expire_time")
    assert await retentions(c.registry) == []


# ---- replicas -----------------------------------------------------------------------------


async def test_two_replicas_planning_one_conversation_at_once_reuse_it_exactly_once(c: Cluster) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT))
    prompt = sequence + c.tokens(100)

    plans = await asyncio.gather(c.plan(prompt, on=c.a), c.plan(prompt, on=c.b))

    outcomes = sorted((p.decision, p.reason) for p in plans)
    assert outcomes == [
        (pb.DECISION_REUSE, pb.DECISION_REASON_REUSE_CHEAPER),
        (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_CLAIM_LOST),
    ]
    loser = next(p for p in plans if p.decision == pb.DECISION_RECOMPUTE)
    assert loser.prefill_kv_transfer_params == KvTransferParams(
        do_remote_decode=True, do_remote_prefill=False
    )
    assert loser.reusable_tokens == 0
    assert (await retention(c)).state == reg_pb.RETENTION_STATE_CLAIMED
    # Both planned generation 2: the first commit wins, the second is fenced off.
    first, second = plans
    await c.commit(first, prompt + c.tokens(10), on=c.a)
    err = await fails(c.commit(second, prompt + c.tokens(10), on=c.b))
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "TURN_FINISHED")
    assert [r.name for r in await retentions(c.registry)] == [f"{CONV}/retentions/2"]


async def test_a_turn_commits_on_another_replica_sharing_the_key(c: Cluster) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT), on=c.a)
    prompt = sequence + c.tokens(100)
    plan = await c.plan(prompt, on=c.a)
    assert plan.decision == pb.DECISION_REUSE
    longer = prompt + c.tokens(OUTPUT)
    committed = await c.commit(plan, longer, on=c.b)
    assert committed.retention == f"{CONV}/retentions/2"
    stored = await retention(c, 2)
    assert stored.num_tokens == len(longer)
    # The claimed retention of turn 1 was consumed (replaced, then released).
    assert [r.name for r in await retentions(c.registry)] == [f"{CONV}/retentions/2"]
    third = await c.plan(longer + c.tokens(50), on=c.b)
    assert (third.decision, third.generation) == (pb.DECISION_REUSE, 3)


async def test_a_replica_with_another_key_does_not_know_the_turn(c: Cluster) -> None:
    other = await c.router(key="another-key-of-32-bytes-length!!")
    plan = await c.plan(c.tokens(PROMPT))
    before = await registry_state(c.registry)
    err = await fails(c.commit(plan, c.tokens(PROMPT + 1), on=other))
    assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, "TURN_NOT_FOUND")
    err = await fails(other.client.abort_turn(plan.turn))
    assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, "TURN_NOT_FOUND")
    assert await registry_state(c.registry) == before


# ---- commit and abort ---------------------------------------------------------------------


async def test_a_second_commit_is_failed_precondition_and_changes_nothing(c: Cluster) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT))
    prompt = sequence + c.tokens(100)
    plan = await c.plan(prompt)
    longer = prompt + c.tokens(OUTPUT)
    await c.commit(plan, longer)
    before = await registry_state(c.registry)

    err = await fails(c.commit(plan, longer + c.tokens(5)))

    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "TURN_FINISHED")
    assert await registry_state(c.registry) == before
    err = await fails(c.a.client.abort_turn(plan.turn))
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "TURN_FINISHED")


async def test_abort_releases_the_claim_and_a_second_abort_fails(c: Cluster) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT))
    plan = await c.plan(sequence + c.tokens(100))
    assert plan.decision == pb.DECISION_REUSE
    assert (await retention(c)).state == reg_pb.RETENTION_STATE_CLAIMED

    await c.a.client.abort_turn(plan.turn, reason="client went away")

    # A claim is never given back: the holder may already have freed the blocks.
    assert await retentions(c.registry) == []
    err = await fails(c.a.client.abort_turn(plan.turn))
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "TURN_FINISHED")
    err = await fails(c.commit(plan, sequence + c.tokens(200)))
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "TURN_FINISHED")
    again = await c.plan(sequence + c.tokens(100))
    assert (again.decision, again.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_NO_RETENTION)


def _tamper(handle: str) -> str:
    body, _, sig = handle.partition(".")
    # Another valid base64 character in the signed body: decodes, but the HMAC no longer matches.
    flipped = "A" if body[-1] != "A" else "B"
    return f"{body[:-1]}{flipped}.{sig}"


@pytest.mark.parametrize(
    ("make", "code", "reason", "field_name"),
    [
        # Well formed and signed, but not by this deployment's key, or altered: NOT_FOUND (the
        # router never issued it).
        (_tamper, grpc.StatusCode.NOT_FOUND, "TURN_NOT_FOUND", None),
        # Not shaped like a turn handle (empty, no prefix, no signature, too long): INVALID_ARGUMENT.
        (lambda h: "", grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "turn"),
        (lambda h: h.removeprefix("turns/"), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "turn"),
        (lambda h: h.split(".")[0], grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "turn"),
        # Shaped like a handle: base64 decoding skips the junk, and nothing verifies.
        (lambda h: "turns/%%%.***", grpc.StatusCode.NOT_FOUND, "TURN_NOT_FOUND", None),
        (lambda h: h + "x" * 5000, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "turn"),
    ],
)
async def test_a_forged_or_garbled_turn_is_refused(
    c: Cluster, make: Any, code: grpc.StatusCode, reason: str, field_name: str | None
) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT))
    prompt = sequence + c.tokens(100)
    plan = await c.plan(prompt)
    before = await registry_state(c.registry)
    for call in (
        c.a.client.commit_turn(make(plan.turn), token_ids=prompt + c.tokens(OUTPUT)),
        c.a.client.abort_turn(make(plan.turn)),
    ):
        err = await fails(call)
        assert (err.code, err.reason, err.field) == (code, reason, field_name)
    assert await registry_state(c.registry) == before
    await c.commit(plan, prompt + c.tokens(OUTPUT))  # the real handle still works


# ---- bad input ----------------------------------------------------------------------------


def _negative(seconds_: int) -> Duration:
    return Duration(seconds=seconds_)


@pytest.mark.parametrize(
    ("request_fields", "field_name"),
    [
        ({"model": ""}, "model"),
        ({"model": "no/such-model"}, "model"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1] * 262_145}, "prompt_token_ids"),
        ({"conversation": "tenants/t/chats/c"}, "conversation"),
        ({"conversation": "tenants/t/conversations/bad id"}, "conversation"),
        ({"request_id": "not an id"}, "request_id"),
        ({"hints": pb.PlanHints(expected_think_time=_negative(-1))}, "hints.expected_think_time"),
        (
            {"hints": pb.PlanHints(parent_conversation="tenants/u/conversations/c")},
            "hints.parent_conversation",
        ),
        ({"hints": pb.PlanHints(decode_endpoints=["http://d0:8000"])}, "hints.decode_endpoints"),
        ({"hints": pb.PlanHints(decode_endpoints=["d0:8000", ""])}, "hints.decode_endpoints"),
        ({"hints": pb.PlanHints(decode_endpoints=["d0:99999"])}, "hints.decode_endpoints"),
        ({"hints": pb.PlanHints(decode_endpoints=["d" * 300 + ":8000"])}, "hints.decode_endpoints"),
        ({"hints": pb.PlanHints(decode_endpoints=["d0:8000"] * 4097)}, "hints.decode_endpoints"),
    ],
)
async def test_bad_plan_input_is_invalid_argument_and_changes_nothing(
    c: Cluster, request_fields: dict[str, Any], field_name: str
) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT))
    before = await registry_state(c.registry)
    fields: dict[str, Any] = {
        "model": MODEL,
        "prompt_token_ids": sequence + c.tokens(100),
        "conversation": CONV,
        "request_id": "r1",
        **request_fields,
    }

    err = await fails(c.a.client.plan_turn(fields.pop("model"), fields.pop("prompt_token_ids"), **fields))

    assert (err.code, err.reason, err.field) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        field_name,
    )
    assert err.domain == "router.kvshuttle"
    assert await registry_state(c.registry) == before
    assert (await retention(c)).state == reg_pb.RETENTION_STATE_ACTIVE


def _many_unknown_fields(params: KvTransferParams) -> KvTransferParams:
    params.extra.update({f"novel_{i}": i for i in range(33)})
    return params


def _large_unknown_field(params: KvTransferParams) -> KvTransferParams:
    params.extra.update({"novel": "x" * 5000})
    return params


def _huge(params: KvTransferParams) -> KvTransferParams:
    params.remote_block_ids[0].block_ids.extend(range(20_000, 50_000))
    return params


@pytest.mark.parametrize(
    ("change", "field_name"),
    [
        ({"timings": pb.TurnTimings(ttft=_negative(-1))}, "timings.ttft"),
        ({"timings": pb.TurnTimings(transfer=Duration(nanos=-5))}, "timings.transfer"),
        ({"params": _many_unknown_fields}, "decode_kv_transfer_params.extra"),
        ({"params": _large_unknown_field}, "decode_kv_transfer_params.extra"),
        ({"params": _huge}, "decode_kv_transfer_params"),
        ({"tokens": lambda s: s[:100]}, "token_ids"),
        ({"tokens": lambda s: [s[0] + 1, *s[1:]]}, "token_ids"),
        ({"tokens": lambda s: []}, "token_ids"),
        ({"request_id": "not an id"}, "request_id"),
        ({"turn_end": 99}, "turn_end"),
    ],
)
async def test_bad_commit_input_is_invalid_argument_and_changes_nothing(
    c: Cluster, change: dict[str, Any], field_name: str
) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT))
    prompt = sequence + c.tokens(100)
    plan = await c.plan(prompt)
    assert plan.decision == pb.DECISION_REUSE
    longer = prompt + c.tokens(OUTPUT)
    before = await registry_state(c.registry)
    params = c.tokens.decode_params(plan, len(longer))
    call = c.a.client.commit_turn(
        plan.turn,
        token_ids=change.get("tokens", lambda s: s)(longer),
        decode_kv_transfer_params=change.get("params", lambda p: p)(params),
        timings=change.get("timings"),
        request_id=change.get("request_id", "c1"),
        turn_end=change.get("turn_end", pb.TURN_END_TOOL_CALL),
    )

    err = await fails(call)

    assert (err.code, err.reason, err.field) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        field_name,
    )
    assert await registry_state(c.registry) == before
    assert (await retention(c)).state == reg_pb.RETENTION_STATE_CLAIMED
    # A refused commit does not finish the turn: the gateway can send it again, right.
    assert (await c.commit(plan, longer)).retention == f"{CONV}/retentions/2"


# ---- leases -------------------------------------------------------------------------------


async def test_a_retention_about_to_expire_is_recomputed(c: Cluster) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT))
    lease_end = (await retention(c)).expire_time.seconds
    # Nodes stay alive; the retention keeps 4 s, less than a read needs (vLLM declines a read
    # within 5 s of the deadline).
    for step in (200, lease_end - 4 - 200 - c.registry.clock.now()):
        c.registry.clock.advance(step)
        await c.beat("nodes/p0")
        await c.beat("nodes/d0")
    before = await registry_state(c.registry)

    plan = await c.plan(sequence + c.tokens(100))

    assert (plan.decision, plan.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_EXPIRED)
    assert plan.prefill_kv_transfer_params == KvTransferParams(do_remote_decode=True, do_remote_prefill=False)
    assert await registry_state(c.registry) == before  # not claimed


async def test_when_the_holders_lease_lapses_its_retention_goes_with_it(c: Cluster) -> None:
    await c.add("nodes/d1", reg_pb.NODE_ROLE_DECODE)
    _, sequence = await c.turn(c.tokens(PROMPT))
    assert (await retention(c)).node == "nodes/d0"
    c.registry.clock.advance(200)
    await c.beat("nodes/p0")
    await c.beat("nodes/d1")
    c.registry.clock.advance(101)  # d0 (300 s lease, no heartbeat) lapses; the retention has 149 s left
    await c.registry.registry.expire_due()

    plan = await c.plan(sequence + c.tokens(100))

    # The registry removed the retention with its node (a cascade, on its timer), so the router
    # finds none: NO_RETENTION, not NODE_DOWN. The fence survives: this is still turn 2.
    assert (plan.decision, plan.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_NO_RETENTION)
    assert (plan.decode.node, plan.generation) == ("nodes/d1", 2)
    assert await retentions(c.registry) == []


async def test_a_holder_whose_engine_is_unhealthy_is_node_down(c: Cluster) -> None:
    await c.add("nodes/d1", reg_pb.NODE_ROLE_DECODE)
    _, sequence = await c.turn(c.tokens(PROMPT))
    await c.beat("nodes/d0", healthy=False)  # the lease holds, /health fails
    before = await registry_state(c.registry)

    plan = await c.plan(sequence + c.tokens(100))

    assert (plan.decision, plan.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_NODE_DOWN)
    assert plan.decode.node == "nodes/d1"
    assert await registry_state(c.registry) == before


async def test_no_healthy_decode_node_is_unavailable(c: Cluster) -> None:
    await c.beat("nodes/d0", healthy=False)
    err = await fails(c.plan(c.tokens(100)))
    assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "NO_DECODE_NODE")


async def test_an_unreachable_registry_is_unavailable() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    config = settings(dead)
    client = RegistryClient.connect(config.registry.channel_options().target, initial_backoff=0.001)
    metrics = CollectorRegistry()
    router = build_router(config, GrpcRegistryPort(client), FakeClock(), metrics)
    server = build_server(config, router, metrics)
    port = await server.start()
    try:
        async with RouterClient.connect(f"127.0.0.1:{port}") as rc:
            err = await fails(rc.plan_turn(MODEL, [1] * 100, conversation=CONV, request_id=""))
        assert (err.code, err.reason, err.domain) == (
            grpc.StatusCode.UNAVAILABLE,
            "REGISTRY_UNAVAILABLE",
            "router.kvshuttle",
        )
    finally:
        await server.stop()
        await client.close()


# ---- observability ------------------------------------------------------------------------


async def test_decisions_are_counted_by_reason(c: Cluster) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT))
    await c.plan(sequence + c.tokens(100))

    def count(decision: str, reason: str) -> float | None:
        return c.a.metrics.get_sample_value(
            "kvshuttle_router_decisions_total", {"decision": decision, "reason": reason}
        )

    assert count("recompute", "no_retention") == 1
    assert count("reuse", "reuse_cheaper") == 1
    assert (
        c.b.metrics.get_sample_value(
            "kvshuttle_router_decisions_total", {"decision": "reuse", "reason": "reuse_cheaper"}
        )
        is None
    )  # each replica counts its own
    assert c.a.metrics.get_sample_value("kvshuttle_router_commits_total", {"outcome": "stored"}) == 1
    rpc = {"service": "kvshuttle.router.v1.RouterService", "method": "PlanTurn", "code": "OK"}
    assert c.a.metrics.get_sample_value("kvshuttle_rpc_total", rpc) == 2


async def test_retention_hints_are_counted_hit_miss_and_refused_per_replica(c: Cluster) -> None:
    def hints(env: RouterEnv) -> dict[str, float | None]:
        return {
            outcome: env.metrics.get_sample_value(
                "kvshuttle_router_retention_hints_total", {"outcome": outcome}
            )
            for outcome in ("hit", "miss", "refused")
        }

    _, sequence = await c.turn(c.tokens(PROMPT), on=c.a)  # turn 1: nothing stored yet, a miss
    prompt = sequence + c.tokens(100)
    await c.turn(prompt, on=c.a)  # turn 2 on the replica that stored turn 1: a hit
    assert hints(c.a) == {"hit": 1, "miss": 1, "refused": None}
    # Turn 3 on the other replica: it stored nothing for the conversation and reads the registry.
    third = await c.plan(prompt + c.tokens(OUTPUT) + c.tokens(50), on=c.b)
    assert third.decision == pb.DECISION_REUSE
    assert hints(c.b) == {"hit": None, "miss": 1, "refused": None}
    # Back on the first replica, its hint (turn 2's retention) was consumed by turn 3's claim:
    # refused, and planned again on the registry's word.
    await c.plan(prompt + c.tokens(OUTPUT) + c.tokens(60), on=c.a)
    assert hints(c.a) == {"hit": 1, "miss": 1, "refused": 1}


async def test_one_log_line_per_rpc_names_the_turn_by_digest() -> None:
    log = JsonLog()
    registry = await start_registry()
    router = await start_router(registry)
    try:
        await add_node(registry, "nodes/p0", reg_pb.NODE_ROLE_PREFILL)
        await add_node(registry, "nodes/d0", reg_pb.NODE_ROLE_DECODE)
        plan = await router.client.plan_turn(MODEL, list(range(1, 101)), conversation=CONV)
        await router.client.abort_turn(plan.turn, reason="test")
        planned = await log.done_once("PlanTurn")
        aborted = await log.done_once("AbortTurn")
    finally:
        await router.close()
        await registry.channel.close()
        registry.registry.close()
        await registry.server.stop()
        log.close()
    assert planned["code"] == "OK"
    assert planned["conversation"] == log_name(CONV)  # the conversation id only as its digest
    assert planned["turn"] == aborted["turn"] == log_digest(plan.turn)
    assert (planned["decision"], planned["reason"]) == ("recompute", "no_retention")
    assert planned["generation"] == 1 and "registry_ms" in planned
    text = "\n".join(str(e) for e in log.events())
    assert plan.turn not in text  # the handle is a credential
    assert CONV not in text


# ---- conversion -------------------------------------------------------------------------


def test_reasons_map_one_to_one_by_name() -> None:
    names = {v.name for v in pb.DecisionReason.DESCRIPTOR.values if v.number}
    assert {f"DECISION_REASON_{r.name}" for r in Reason} == names
    assert len(set(convert.REASON_TO_PB.values())) == len(Reason)


def test_unset_timings_are_not_measured_and_zero_is_zero() -> None:
    unset = convert.commit_request_from_pb(pb.CommitTurnRequest(turn="t", timings=pb.TurnTimings()))
    t = unset.timings
    assert (t.ttft_ms, t.prefill_ms, t.transfer_ms, t.decode_ms) == (None, None, None, None)
    assert (t.transfer_bytes, t.remote_cached_tokens) == (None, None)
    zero = convert.commit_request_from_pb(
        pb.CommitTurnRequest(
            timings=pb.TurnTimings(
                ttft=Duration(), transfer_bytes=0, remote_cached_tokens=0, prefill=seconds(0.25)
            )
        )
    ).timings
    assert (zero.ttft_ms, zero.transfer_bytes, zero.remote_cached_tokens, zero.prefill_ms) == (
        0.0,
        0,
        0,
        250.0,
    )
    assert convert.commit_request_from_pb(pb.CommitTurnRequest()).decode_kv_transfer_params is None


def test_a_negative_think_time_names_the_hint() -> None:
    with pytest.raises(InvalidArgument) as caught:
        convert.plan_request_from_pb(
            pb.PlanTurnRequest(hints=pb.PlanHints(expected_think_time=Duration(seconds=-3)))
        )
    assert caught.value.field == "hints.expected_think_time"
    hinted = convert.plan_request_from_pb(
        pb.PlanTurnRequest(hints=pb.PlanHints(expected_think_time=seconds(2.5)))
    )
    assert hinted.expected_think_time_s == 2.5
    assert convert.plan_request_from_pb(pb.PlanTurnRequest()).expected_think_time_s is None


# ---- request ids --------------------------------------------------------------------------

OTHER_TENANT = "tenants/u/conversations/c"


async def _two_tenants_at_turn_two(c: Cluster) -> tuple[list[int], list[int]]:
    """Both tenants' conversations have a retention; returns their next prompts."""
    prompts = []
    for conversation in (CONV, OTHER_TENANT):
        prompt = c.tokens(PROMPT)
        plan = await c.plan(prompt, conversation=conversation)
        sequence = prompt + c.tokens(OUTPUT)
        await c.commit(plan, sequence)
        prompts.append(sequence + c.tokens(50))
    return prompts[0], prompts[1]


async def test_two_tenants_sending_one_request_id_never_share_a_claim(c: Cluster) -> None:
    mine, theirs = await _two_tenants_at_turn_two(c)
    held = {
        r.name: list(r.kv_transfer_params.remote_block_ids[0].block_ids) for r in await retentions(c.registry)
    }
    held |= {
        r.name: list(r.kv_transfer_params.remote_block_ids[0].block_ids)
        for r in await retentions(c.registry, "tenants/u")
    }
    first = await c.a.client.plan_turn(MODEL, mine, conversation=CONV, request_id="same")
    # Another replica, so only the registry could mix them up (it deduplicates claims by id).
    second = await c.b.client.plan_turn(MODEL, theirs, conversation=OTHER_TENANT, request_id="same")

    assert first.decision == second.decision == pb.DECISION_REUSE
    for plan, conversation in ((first, CONV), (second, OTHER_TENANT)):
        ids = list(plan.prefill_kv_transfer_params.remote_block_ids[0].block_ids)
        assert ids == held[f"{conversation}/retentions/1"][: len(ids)]


async def test_one_replica_does_not_answer_a_request_id_with_another_tenants_plan(c: Cluster) -> None:
    mine, theirs = await _two_tenants_at_turn_two(c)
    first = await c.a.client.plan_turn(MODEL, mine, conversation=CONV, request_id="same")
    second = await c.a.client.plan_turn(MODEL, theirs, conversation=OTHER_TENANT, request_id="same")
    assert second.turn != first.turn
    assert second.prefill_kv_transfer_params != first.prefill_kv_transfer_params


async def test_a_plan_retried_under_its_request_id_returns_the_first_plan(c: Cluster) -> None:
    _, sequence = await c.turn(c.tokens(PROMPT))
    prompt = sequence + c.tokens(50)
    request_id = "r" * 128  # the longest the router accepts
    first = await c.a.client.plan_turn(MODEL, prompt, conversation=CONV, request_id=request_id)
    again = await c.a.client.plan_turn(MODEL, prompt, conversation=CONV, request_id=request_id)
    # Another replica does not know the plan and sees the retention claimed: it plans a
    # recompute (safe; the first plan's claim lapses unused).
    elsewhere = await c.b.client.plan_turn(MODEL, prompt, conversation=CONV, request_id=request_id)
    assert first.decision == pb.DECISION_REUSE
    assert again == first
    assert (elsewhere.decision, elsewhere.reason) == (pb.DECISION_RECOMPUTE, pb.DECISION_REASON_CLAIM_LOST)


async def test_a_commit_retried_under_its_request_id_returns_the_first_response(c: Cluster) -> None:
    prompt = c.tokens(PROMPT)
    plan = await c.plan(prompt)
    sequence = prompt + c.tokens(OUTPUT)
    params = c.tokens.decode_params(plan, len(sequence))
    first = await c.a.client.commit_turn(
        plan.turn, token_ids=sequence, decode_kv_transfer_params=params, request_id="commit-1"
    )
    again = await c.a.client.commit_turn(
        plan.turn, token_ids=sequence, decode_kv_transfer_params=params, request_id="commit-1"
    )
    assert again == first


# ---- configuration and the process --------------------------------------------------------


def test_settings_need_a_profile_and_a_long_enough_key(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("KVSHUTTLE_ROUTER_")]:
        monkeypatch.delenv(name)
    with pytest.raises(ValidationError, match="profiles_file or profiles"):
        RouterSettings()
    monkeypatch.setenv("KVSHUTTLE_ROUTER_PROFILES_FILE", str(PROFILES))
    monkeypatch.setenv("KVSHUTTLE_ROUTER_TURN_SIGNING_KEY", "short")
    with pytest.raises(ValidationError, match="at least 16 bytes"):
        RouterSettings()
    monkeypatch.setenv("KVSHUTTLE_ROUTER_TURN_SIGNING_KEY", "k" * 16)
    monkeypatch.setenv("KVSHUTTLE_ROUTER_SERVER__GRACE_SECONDS", "1")
    monkeypatch.setenv("KVSHUTTLE_ROUTER_POLICY__CLAIM_TTL_S", "12")
    monkeypatch.setenv("KVSHUTTLE_ROUTER_POLICY__WEIGHTS__NEAR_TIE_MS", "7")
    monkeypatch.setenv("KVSHUTTLE_ROUTER_REGISTRY__ADDRESS", "registry:50051")
    s = RouterSettings()
    # A partial override keeps the router's own listen address.
    assert (s.server.listen, s.server.grace_seconds) == ("127.0.0.1:50061", 1.0)
    assert (s.policy.claim_ttl_s, s.policy.weights.near_tie_ms, s.policy.turn_ttl_s) == (12.0, 7.0, 600.0)
    assert s.registry.channel_options().target == "registry:50051"
    assert s.model_dump(mode="json")["turn_signing_key"] == "**********"
    with pytest.raises(ValidationError):
        RouterSettings(no_such_setting=1)  # type: ignore[call-arg]


def test_profiles_come_from_the_file_and_inline_and_a_model_named_twice_is_refused() -> None:
    inline = ModelProfile("small", 4096, PrefillModel(1.0, 0.01), LinkModel(10.0, 1.0))
    both = RouterSettings(profiles_file=PROFILES, profiles=[inline])
    assert [p.model for p in router_profiles(both)] == [MODEL, "small"]
    twice = RouterSettings(profiles_file=PROFILES, profiles=[QWEN])
    with pytest.raises(ValueError, match="configured twice"):
        router_profiles(twice)


async def test_the_router_process_serves_until_sigterm(c: Cluster) -> None:
    secret = "process-signing-key-0123456789"
    env = {
        **os.environ,
        "KVSHUTTLE_ROUTER_SERVER__LISTEN": "127.0.0.1:0",
        "KVSHUTTLE_ROUTER_REGISTRY__ADDRESS": c.registry.address,
        "KVSHUTTLE_ROUTER_PROFILES_FILE": str(PROFILES),
        "KVSHUTTLE_ROUTER_TURN_SIGNING_KEY": secret,
        "KVSHUTTLE_ROUTER_TELEMETRY__LOG_FORMAT": "json",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvshuttle.router.main",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(30):
            while not any('"server.started"' in line for line in lines):
                line = (await proc.stdout.readline()).decode()
                assert line, "".join(lines)
                lines.append(line)
        started = json.loads(lines[-1])
        async with RouterClient.connect(f"127.0.0.1:{started['port']}") as client:
            plan = await client.plan_turn(MODEL, c.tokens(100), conversation=CONV)
        assert plan.decision == pb.DECISION_RECOMPUTE
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            rest, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    output = "".join(lines) + rest.decode()
    assert proc.returncode == 0, output
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    config = next(e for e in events if e["event"] == "router.config")
    assert config["turn_signing_key"] == "**********"
    assert config["registry"]["address"] == c.registry.address
    assert secret not in output
    assert "router.ephemeral_turn_signing_key" not in output
    assert [e["event"] for e in events if e["event"].startswith("server.")][-1] == "server.stopped"


@pytest.mark.parametrize(
    ("code", "reason", "expected", "expected_reason"),
    [
        (grpc.StatusCode.NOT_FOUND, "RETENTION_NOT_FOUND", NotFound, "RETENTION_NOT_FOUND"),
        (grpc.StatusCode.ABORTED, "RETENTION_ALREADY_CLAIMED", Aborted, "RETENTION_ALREADY_CLAIMED"),
        (grpc.StatusCode.FAILED_PRECONDITION, "RETENTION_EXPIRED", FailedPrecondition, "RETENTION_EXPIRED"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_EXCEEDED", ResourceExhausted, "CAPACITY_EXCEEDED"),
        (grpc.StatusCode.UNAVAILABLE, None, Unavailable, "REGISTRY_UNAVAILABLE"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, None, Unavailable, "REGISTRY_UNAVAILABLE"),
        # The router built the request: the registry refusing it is the router's bug -> INTERNAL.
        (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", CallRefused, None),
        (grpc.StatusCode.PERMISSION_DENIED, None, CallRefused, None),
    ],
)
def test_registry_errors_become_domain_errors_with_the_registrys_reason(
    code: grpc.StatusCode, reason: str | None, expected: type[Exception], expected_reason: str | None
) -> None:
    error = KvshuttleRpcError(code, "m", reason=reason, method="/kvshuttle.registry.v1.RegistryService/X")
    mapped = domain_error(error, "registry")
    assert type(mapped) is expected
    assert getattr(mapped, "reason", None) == expected_reason
