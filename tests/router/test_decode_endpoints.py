"""PlanHints.decode_endpoints and ListReadyDecodes over real gRPC servers (a registry on a fake
clock, routers that reach it over gRPC): a plan places decode only on a healthy decode node whose
endpoint the caller allows, in any spelling; none: UNAVAILABLE NO_DECODE_NODE and nothing
claimed; reading retained KV from a holder outside them stays allowed; ListReadyDecodes names the
decode nodes a plan could use now."""

from __future__ import annotations

import grpc
import pytest
from tests.router.grpc_cluster import PROMPT, Cluster, cluster, fails, retention  # noqa: F401 (cluster: the `c` fixture)
from tests.router.helpers import CONV, MODEL, registry_state, seconds

from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.v1 import router_service_pb2 as pb


async def plan_on(
    c: Cluster, prompt: list[int], *allowed: str, conversation: str = CONV
) -> pb.PlanTurnResponse:
    return await c.a.client.plan_turn(
        MODEL, prompt, conversation=conversation, hints=pb.PlanHints(decode_endpoints=allowed)
    )


async def test_decode_is_placed_only_on_an_allowed_endpoint_in_any_spelling(c: Cluster) -> None:
    await c.add("nodes/d1", reg_pb.NODE_ROLE_DECODE)
    # Unconstrained, the tie between two idle decode nodes goes to d0 (by name).
    assert (await c.plan(c.tokens(64), conversation="")).decode.node == "nodes/d0"
    for allowed in (["d1:8000"], ["D1.:8000"], ["d1"], [" d1:8000 ", "10.9.9.9:8000"], ["[fd00::9]", "d1"]):
        plan = await plan_on(c, c.tokens(64), *allowed, conversation="")
        assert plan.decode.node == "nodes/d1", allowed
        assert plan.turn  # a plan like any other: committed or aborted by its caller
    both = await plan_on(c, c.tokens(64), "d0:8000", "d1:8000", conversation="")
    assert both.decode.node == "nodes/d0"


@pytest.mark.parametrize(
    "allowed",
    [
        ["d0:9000"],  # another port
        ["10.0.0.2:8000"],  # a name is not an address
        ["p0:8000"],  # a prefill node is no decode node
        ["d1:8000"],  # registered, engine unhealthy
    ],
)
async def test_no_healthy_decode_node_allowed_is_no_decode_node_and_claims_nothing(
    c: Cluster, allowed: list[str]
) -> None:
    await c.add("nodes/d1", reg_pb.NODE_ROLE_DECODE)
    await c.beat("nodes/d1", healthy=False)
    _, sequence = await c.turn(c.tokens(PROMPT))
    before = await registry_state(c.registry)

    err = await fails(plan_on(c, sequence + c.tokens(100), *allowed))

    assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "NO_DECODE_NODE")
    assert err.metadata["decode_endpoints"] == "1"
    assert await registry_state(c.registry) == before
    assert (await retention(c)).state == reg_pb.RETENTION_STATE_ACTIVE
    # The conversation's KV is still there for a turn that may use d0.
    assert (await c.plan(sequence + c.tokens(100))).decision == pb.DECISION_REUSE


async def test_a_lapsed_decode_node_is_not_placed_on_though_allowed(c: Cluster) -> None:
    await c.add("nodes/d1", reg_pb.NODE_ROLE_DECODE)
    c.registry.clock.advance(200)
    await c.beat("nodes/p0")
    await c.beat("nodes/d0")
    c.registry.clock.advance(101)  # d1 (300 s lease, no heartbeat) lapses
    await c.registry.registry.expire_due()

    err = await fails(plan_on(c, c.tokens(64), "d1:8000"))
    assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "NO_DECODE_NODE")
    assert (await plan_on(c, c.tokens(64), "d0:8000", "d1:8000")).decode.node == "nodes/d0"


async def test_reuse_reads_from_a_holder_outside_the_allowed_endpoints_onto_a_decode_inside(
    c: Cluster,
) -> None:
    await c.add("nodes/d1", reg_pb.NODE_ROLE_DECODE)
    first, sequence = await c.turn(c.tokens(PROMPT))
    assert first.decode.node == "nodes/d0"

    plan = await plan_on(c, sequence + c.tokens(100), "d1:8000")

    assert (plan.decision, plan.reason) == (pb.DECISION_REUSE, pb.DECISION_REASON_REUSE_CHEAPER)
    assert (plan.prefill.node, plan.decode.node) == ("nodes/p0", "nodes/d1")
    # Prefill reads the verified prefix from d0, which holds it; decode then reads prefill's KV.
    params = plan.prefill_kv_transfer_params
    assert (params.remote_engine_id, params.remote_num_tokens) == ("engine-d0", len(sequence))
    assert (await retention(c)).state == reg_pb.RETENTION_STATE_CLAIMED


async def test_a_retry_with_other_decode_endpoints_is_request_id_reused(c: Cluster) -> None:
    await c.add("nodes/d1", reg_pb.NODE_ROLE_DECODE)
    prompt = c.tokens(64)
    hints = pb.PlanHints(decode_endpoints=["d1:8000"])
    first = await c.a.client.plan_turn(MODEL, prompt, conversation=CONV, hints=hints, request_id="r-1")
    again = await c.a.client.plan_turn(MODEL, prompt, conversation=CONV, hints=hints, request_id="r-1")
    assert again == first and first.decode.node == "nodes/d1"
    other = pb.PlanHints(decode_endpoints=["d0:8000"])
    err = await fails(c.a.client.plan_turn(MODEL, prompt, conversation=CONV, hints=other, request_id="r-1"))
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_REUSED")


# ---- ListReadyDecodes ---------------------------------------------------------------------


async def ready(c: Cluster) -> list[tuple[str, str]]:
    answer = await c.a.client.list_ready_decodes(MODEL)
    return [(d.node, d.http_endpoint) for d in answer.decodes]


async def test_ready_decodes_are_the_live_healthy_decode_nodes_least_loaded_first(c: Cluster) -> None:
    await c.add("nodes/d1", reg_pb.NODE_ROLE_DECODE)
    await c.add("nodes/d2", reg_pb.NODE_ROLE_DECODE)
    await c.registry.stub.HeartbeatNode(
        reg_pb.HeartbeatNodeRequest(
            name="nodes/d0",
            incarnation=c.incarnations["nodes/d0"],
            ttl=seconds(300),
            load=reg_pb.NodeLoad(engine_healthy=True, running_requests=5),
        )
    )
    assert await ready(c) == [
        ("nodes/d1", "http://d1:8000"),
        ("nodes/d2", "http://d2:8000"),
        ("nodes/d0", "http://d0:8000"),
    ]
    await c.beat("nodes/d1", healthy=False)
    assert [n for n, _ in await ready(c)] == ["nodes/d2", "nodes/d0"]
    # Every decode node's lease lapses; prefill stays.
    c.registry.clock.advance(200)
    await c.beat("nodes/p0")
    c.registry.clock.advance(101)
    await c.registry.registry.expire_due()
    assert await ready(c) == []
    err = await fails(c.plan(c.tokens(64)))
    assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "NO_DECODE_NODE")


async def test_ready_decodes_of_an_unknown_model_is_invalid_argument(c: Cluster) -> None:
    err = await fails(c.a.client.list_ready_decodes("no/such-model"))
    assert (err.code, err.reason, err.field) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        "model",
    )


async def test_ready_decodes_with_the_registry_down_answer_from_its_last_list(c: Cluster) -> None:
    env = await c.router(degraded_nodes_max_age_s=3600.0)
    assert [d.node for d in (await env.client.list_ready_decodes(MODEL)).decodes] == ["nodes/d0"]
    await c.registry.server.stop()
    assert [d.node for d in (await env.client.list_ready_decodes(MODEL)).decodes] == ["nodes/d0"]
    never = await c.router(degraded_nodes_max_age_s=0.0)
    err = await fails(never.client.list_ready_decodes(MODEL, timeout=30))
    assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "REGISTRY_UNAVAILABLE")
