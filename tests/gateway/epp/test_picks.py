"""What the endpoint picker picks, with a real router and registry behind it: plans that reuse a
conversation's KV (the conversation from the body, X-Conversation-ID or x-session-id), the subset
hint honoured, IPv6 endpoints, the client's errors, the router gone, load shed, and the request's
one log line and trace."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from pydantic import SecretStr
from structlog.testing import capture_logs
from tests.gateway.epp.envoy import (
    COMPLETIONS,
    D1,
    DECODE,
    PREFILL,
    Answers,
    EppCluster,
    beat,
    body_chunks,
    chat,
    epp_fixture,
    lapse,
    request_headers,
    response_headers,
    start_epp,
    stop_epp,
)
from tests.router.helpers import MODEL, Tokens
from tests.serving.echo import JsonLog

from kvshuttle.core.auth import Role
from kvshuttle.gateway.pd_headers import PLAN_HEADER, PREFILLER_HOST_PORT_HEADER, PROMPT_HEADER, TURN_HEADER
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.serving.settings import AuthSettings, Grant
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams


async def send(
    c: EppCluster, body: dict[str, Any] | bytes, path: str = COMPLETIONS, subset: Any = None, **headers: str
) -> Answers:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await c.envoy.exchange([request_headers(path, extra=headers, subset=subset), *body_chunks(raw)])


def ids(n: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 150_000) for _ in range(n)]


async def commit(c: EppCluster, plan: pb.PlanTurnResponse, sequence: list[int]) -> None:
    """The sidecar's part: decode answered and retains the whole sequence."""
    params = Tokens().decode_params(plan, len(sequence))
    await c.router.client.commit_turn(
        plan.turn, token_ids=sequence, decode_kv_transfer_params=params, timings=pb.TurnTimings()
    )


# --- plans ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["body", "X-Conversation-ID", "x-session-id"])
async def test_the_next_turn_of_a_conversation_reuses_its_kv(c: EppCluster, where: str) -> None:
    first = ids(4000)  # long enough that reading the KV beats recomputing it
    body: dict[str, Any] = {"model": MODEL, "prompt": first, "max_tokens": 8}
    headers: dict[str, str] = {}
    if where == "body":
        body["conversation_id"] = "conv-7"
    else:
        headers[where] = "conv-7"
    turn1 = await send(c, body, **headers)
    assert turn1.plan.decision == pb.DECISION_RECOMPUTE
    assert turn1.plan.reason == pb.DECISION_REASON_NO_RETENTION
    sequence = first + ids(40, seed=8)
    await commit(c, turn1.plan, sequence)

    turn2 = await send(c, {**body, "prompt": sequence + ids(30, seed=9)}, **headers)
    plan = turn2.plan
    assert plan.decision == pb.DECISION_REUSE, pb.DecisionReason.Name(plan.reason)
    assert plan.reusable_tokens > 3900
    assert turn2.set_headers[TURN_HEADER] == plan.turn != turn1.plan.turn
    assert turn2.set_headers[PREFILLER_HOST_PORT_HEADER] == PREFILL[2]
    assert turn2.endpoint == DECODE[2]
    # Prefill reads decode's retained blocks: the plan's params name them.
    params = plan.prefill_kv_transfer_params
    assert params.remote_engine_id == turn1.plan.decode.engine_id and params.remote_block_ids


async def test_a_chat_plans_the_prompt_the_gateway_would_tokenize(
    c: EppCluster, chat_tokenizer: ChatTokenizer
) -> None:
    body = chat("what does a chat plan hold", conversation_id="c-1")
    answers = await send(c, body, path="/v1/chat/completions")
    expected = chat_tokenizer.encode_exact(
        chat_tokenizer.render(body["messages"], add_generation_prompt=True), add_special_tokens=False
    )
    assert answers.plan.tokens_to_compute == len(expected)


# --- the subset hint ----------------------------------------------------------------------------


async def test_a_subset_with_the_planned_decode_node_is_honoured_in_both_shapes(c: EppCluster) -> None:
    body = {"model": MODEL, "prompt": ids(64)}
    for subset in ([DECODE[2], "10.0.0.77:8000"], f"10.0.0.77:8000, {DECODE[2]}", ["10.0.0.2"]):
        answers = await send(c, body, subset=subset)
        assert answers.endpoint == DECODE[2], subset
        assert answers.set_headers[TURN_HEADER]


async def test_a_subset_without_an_eligible_decode_node_is_503_and_claims_nothing(c: EppCluster) -> None:
    first = ids(4000)  # long enough that reading the KV beats recomputing it
    body = {"model": MODEL, "prompt": first, "conversation_id": "conv-s"}
    turn1 = await send(c, body)
    sequence = first + ids(40, seed=8)
    await commit(c, turn1.plan, sequence)
    turn2 = {**body, "prompt": sequence + ids(20, seed=3)}

    listed = reg_pb.ListRetentionsRequest(parent="tenants/default", page_size=10)
    before = list((await c.registry.stub.ListRetentions(listed)).retentions)
    assert [r.state for r in before] == [reg_pb.RETENTION_STATE_ACTIVE]
    for subset in (["10.0.0.77:8000"], [PREFILL[2]], [], "", ["not an endpoint"]):
        refused = await send(c, turn2, subset=subset)
        assert refused.immediate is not None, subset
        assert refused.immediate.status.code == 503
        assert refused.error()["code"] == "no_eligible_endpoint"
    await c.epp.background.settle()

    # The router planned nothing it could not place (nor did the picker for an empty subset):
    # the conversation's KV is untouched, and its next turn on an eligible node reuses it.
    assert list((await c.registry.stub.ListRetentions(listed)).retentions) == before
    assert c.metric("kvshuttle_epp_requests_total", outcome="refused", status="503") == 5
    reused = await send(c, turn2, subset=[DECODE[2]])
    assert reused.plan.decision == pb.DECISION_REUSE and reused.endpoint == DECODE[2]


async def test_with_the_router_gone_the_fallback_stays_inside_the_subset(two: EppCluster) -> None:
    c = two
    body = {"model": MODEL, "prompt": ids(64)}
    assert (await send(c, body)).endpoint == DECODE[2]
    assert (await send(c, body, subset=[D1[2]])).endpoint == D1[2]  # d1 is remembered too
    await c.router.server.stop()

    for subset, endpoint in (([DECODE[2]], DECODE[2]), ([D1[2], "10.0.0.77:8000"], D1[2])):
        fallback = await send(c, body, subset=subset)
        assert fallback.endpoint == endpoint, subset
        assert fallback.set_headers[PREFILLER_HOST_PORT_HEADER] == PREFILL[2]
        assert not fallback.plan.turn and TURN_HEADER in fallback.removed
        models = await c.envoy.exchange(
            [request_headers("/v1/models", method="GET", end_of_stream=True, subset=subset)]
        )
        assert models.endpoint == endpoint, subset
    refused = await send(c, body, subset=["10.0.0.77:8000"])
    assert refused.immediate is not None and refused.immediate.status.code == 503
    assert refused.error()["code"] == "no_eligible_endpoint"
    assert c.metric("kvshuttle_epp_picks_total", decision="recompute", reason="router_unavailable") == 2


async def test_a_decode_node_the_router_said_is_gone_is_not_the_fallback_when_the_router_goes(
    two: EppCluster,
) -> None:
    c = two
    body = {"model": MODEL, "prompt": ids(64)}
    assert (await send(c, body)).endpoint == DECODE[2]
    assert (await send(c, body, subset=[D1[2]])).endpoint == D1[2]
    await beat(c, DECODE[0], healthy=False)
    refused = await send(c, body, subset=[DECODE[2]])  # NO_DECODE_NODE: d0 is forgotten
    assert refused.immediate is not None and refused.error()["code"] == "no_eligible_endpoint"
    await c.router.server.stop()

    for subset in (None, [DECODE[2], D1[2]]):
        assert (await send(c, body, subset=subset)).endpoint == D1[2], subset
    gone = await send(c, body, subset=[DECODE[2]])
    assert gone.immediate is not None and gone.immediate.status.code == 503


async def test_with_no_prefill_node_the_decode_pod_runs_the_request_on_a_ready_decode_node(
    two: EppCluster,
) -> None:
    c = two
    body = {"model": MODEL, "prompt": ids(64), "conversation_id": "conv-p"}
    assert (await send(c, body)).endpoint == DECODE[2]
    await lapse(c, keep=(DECODE[0], D1[0]))  # the prefill node's lease lapses
    await beat(c, D1[0], healthy=False)

    local = await send(c, body, **{TURN_HEADER: "turns/forged"})
    # No prefill to send the sidecar to: no sidecar headers (a client's copies removed), so the
    # decode pod serves the request alone; never the dead prefill the last plan named.
    assert local.endpoint == DECODE[2]
    assert sorted(local.removed) == sorted(
        [PREFILLER_HOST_PORT_HEADER, TURN_HEADER, PLAN_HEADER, PROMPT_HEADER]
    )
    assert c.metric("kvshuttle_epp_picks_total", decision="", reason="no_prefill_node") == 1
    refused = await send(c, body, subset=[D1[2]])  # registered, its engine unhealthy
    assert refused.immediate is not None and refused.immediate.status.code == 503
    assert refused.error()["code"] == "no_eligible_endpoint"


async def test_the_ready_list_serves_plain_picks_for_ready_cache_s_and_no_decode_node_ends_it(
    model_dir: Path, chat_tokenizer: ChatTokenizer
) -> None:
    c = await start_epp(model_dir, chat_tokenizer, ready_cache_s=60.0)
    try:
        models = [request_headers("/v1/models", method="GET", end_of_stream=True)]
        assert (await c.envoy.exchange(models)).endpoint == DECODE[2]
        await lapse(c, keep=(PREFILL[0],))
        # Within ready_cache_s the router is not asked again (the bound the docs state)...
        assert (await c.envoy.exchange(models)).endpoint == DECODE[2]
        # ...until a plan hears from it that no decode node is ready: then nothing is picked.
        refused = await send(c, {"model": MODEL, "prompt": ids(64)})
        assert refused.immediate is not None and refused.error()["code"] == "no_ready_endpoint"
        gone = await c.envoy.exchange(models)
        assert gone.immediate is not None and gone.immediate.status.code == 503
    finally:
        await stop_epp(c)


@pytest.fixture
async def v6(model_dir: Path, chat_tokenizer: ChatTokenizer) -> AsyncIterator[EppCluster]:
    nodes = [
        ("nodes/p0", reg_pb.NODE_ROLE_PREFILL, "http://[fd00::1]:8000"),
        ("nodes/d0", reg_pb.NODE_ROLE_DECODE, "http://[FD00:0::2]:8000"),
    ]
    async for cluster in epp_fixture(model_dir, chat_tokenizer, nodes=nodes):
        yield cluster


async def test_ipv6_endpoints_are_bracketed_and_match_subsets(v6: EppCluster) -> None:
    body = {"model": MODEL, "prompt": ids(64)}
    for subset in (None, ["[fd00::2]:8000"], ["fd00::2"], "[fd00:0:0::2]:8000"):
        answers = await send(v6, body, subset=subset)
        assert answers.endpoint == "[fd00::2]:8000", subset
        assert answers.set_headers[PREFILLER_HOST_PORT_HEADER] == "[fd00::1]:8000"
    refused = await send(v6, body, subset=["[fd00::3]:8000"])
    assert refused.immediate is not None and refused.immediate.status.code == 503


# --- the client's errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "headers", "status", "param", "code"),
    [
        (b"{not json", {}, 400, "body", "invalid_request"),
        (b"[1, 2]", {}, 400, None, "invalid_request"),
        (json.dumps({"prompt": [1, 2]}).encode(), {}, 400, "model", "invalid_request"),
        (json.dumps({"model": "gpt-9", "prompt": [1]}).encode(), {}, 404, "model", "model_not_found"),
        (json.dumps({"model": MODEL, "prompt": 5}).encode(), {}, 400, "prompt", "invalid_request"),
        (json.dumps({"model": MODEL, "prompt": [1], "n": 3}).encode(), {}, 400, "n", "invalid_request"),
        (
            json.dumps({"model": MODEL, "prompt": [1], "kv_transfer_params": {}}).encode(),
            {},
            400,
            "kv_transfer_params",
            "invalid_request",
        ),
        (
            json.dumps({"model": MODEL, "prompt": [1], "conversation_id": "a/b"}).encode(),
            {},
            400,
            "conversation_id",
            "invalid_conversation_id",
        ),
        (
            json.dumps({"model": MODEL, "prompt": [1]}).encode(),
            {"x-session-id": "bad id!"},
            400,
            "session_id",
            "invalid_conversation_id",
        ),
        (
            json.dumps({"model": MODEL, "prompt": [1]}).encode(),
            {"x-kvshuttle-expected-think-time": "soon"},
            400,
            "X-Kvshuttle-Expected-Think-Time",
            "invalid_request",
        ),
        (json.dumps({"model": MODEL, "prompt": "x" * 2048}).encode(), {}, 413, None, "request_too_large"),
    ],
)
async def test_a_malformed_request_is_an_immediate_response_naming_the_field(
    model_dir: Path,
    chat_tokenizer: ChatTokenizer,
    body: bytes,
    headers: dict[str, str],
    status: int,
    param: str | None,
    code: str,
) -> None:
    c = await start_epp(model_dir, chat_tokenizer, max_request_bytes=1024)
    try:
        answers = await send(c, body, **headers)
        assert answers.immediate is not None
        assert answers.immediate.status.code == status
        assert answers.immediate.details == f"kvshuttle_epp_{code}"
        assert dict((h.header.key, h.header.raw_value) for h in answers.immediate.headers.set_headers) == {
            "content-type": b"application/json"
        }
        error = answers.error()
        assert (error["param"], error["code"]) == (param, code), error
        assert c.metric("kvshuttle_epp_requests_total", outcome="refused", status=str(status)) == 1
    finally:
        await stop_epp(c)


# --- the router gone, load shed ----------------------------------------------------------------


async def test_with_the_router_gone_a_known_model_is_picked_plain_pd(c: EppCluster) -> None:
    body = {"model": MODEL, "prompt": ids(64), "conversation_id": "conv-r"}
    await send(c, body)
    await c.router.server.stop()
    with capture_logs() as logs:
        answers = await send(c, body)
    assert answers.endpoint == DECODE[2]
    assert answers.set_headers[PREFILLER_HOST_PORT_HEADER] == PREFILL[2]
    assert TURN_HEADER in answers.removed
    plan = answers.plan
    assert (plan.turn, plan.decision) == ("", pb.DECISION_RECOMPUTE)
    assert plan.prefill_kv_transfer_params == KvTransferParams(do_remote_decode=True, do_remote_prefill=False)
    assert c.metric("kvshuttle_epp_picks_total", decision="recompute", reason="router_unavailable") == 1
    (warning,) = [e for e in logs if e["event"] == "pick.without_router"]
    assert warning["code"] == "UNAVAILABLE"


async def test_with_the_router_gone_and_nothing_planned_yet_it_is_503(c: EppCluster) -> None:
    await c.router.server.stop()
    answers = await send(c, {"model": MODEL, "prompt": ids(64)})
    assert answers.immediate is not None and answers.immediate.status.code == 503
    assert answers.error()["type"] == "server_error"


async def test_more_picks_in_flight_than_allowed_are_shed_with_429(
    model_dir: Path, chat_tokenizer: ChatTokenizer
) -> None:
    """Endpoint picker protocol (Destination Endpoint, constraints): "If the EPP did not
    communicate the server endpoint via these two methods, it MUST return an error as follows:
    [...] ImmediateResponse with 429 (Too Many Requests) HTTP status code if the request should
    be dropped (e.g., a Sheddable request, and the servers under heavy load)."
    """
    # A "router" that accepts connections and never answers: a pick waits out router.timeout.
    # The picker's channel connects on its first call (channels start idle): a pick is then in
    # flight.
    called = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        called.set()
        await reader.read()
        writer.close()

    listener = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    c = await start_epp(
        model_dir,
        chat_tokenizer,
        router_address=f"127.0.0.1:{port}",
        router_timeout=2.0,
        max_concurrent_picks=1,
    )
    try:
        body = {"model": MODEL, "prompt": ids(64)}
        waiting = asyncio.create_task(send(c, body))
        await called.wait()
        assert c.metric("kvshuttle_epp_picks_in_flight") == 1
        shed = await send(c, body)
        assert shed.immediate is not None and shed.immediate.status.code == 429
        assert shed.error()["code"] == "too_many_picks"
        first = await waiting
        assert first.immediate is not None and first.immediate.status.code in (503, 504)
        assert c.metric("kvshuttle_epp_picks_in_flight") == 0
    finally:
        await stop_epp(c)
        listener.close()
        await listener.wait_closed()


async def test_a_plan_too_large_for_a_header_is_aborted_and_run_plain(
    model_dir: Path, chat_tokenizer: ChatTokenizer
) -> None:
    c = await start_epp(model_dir, chat_tokenizer, max_plan_header_bytes=64)
    try:
        answers = await send(c, {"model": MODEL, "prompt": ids(64)})
        assert answers.endpoint == DECODE[2]
        assert TURN_HEADER in answers.removed and not answers.plan.turn
        assert c.metric("kvshuttle_epp_picks_total", decision="recompute", reason="plan_too_large") == 1
    finally:
        await stop_epp(c)


async def test_the_picker_down_fails_the_stream_as_envoy_sees_it(c: EppCluster) -> None:
    """What the InferencePool's failureMode acts on: the ext_proc stream cannot be opened."""
    await c.epp.stop()
    try:
        await c.envoy.exchange([request_headers(), *body_chunks(b"{}")])
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    else:
        raise AssertionError("a stopped picker answered")


# --- the line and the trace ----------------------------------------------------------------------


async def test_one_line_per_request_with_the_pick_and_no_raw_conversation(c: EppCluster) -> None:
    body = {"model": MODEL, "prompt": ids(64), "conversation_id": "secret-conversation-42"}
    log = JsonLog()
    try:
        await c.envoy.exchange(
            [
                request_headers(COMPLETIONS, extra={"x-session-id": "other"}),
                *body_chunks(json.dumps(body).encode()),
            ],
            [response_headers(DECODE[2])],
        )
        line = await log.done_once("Process")
        everything = json.dumps(log.events())
    finally:
        log.close()
    assert line["code"] == "OK"
    for key, value in {
        "outcome": "planned",
        "status": 200,
        "picked": DECODE[2],
        "prefill": PREFILL[2],
        "served": DECODE[2],
        "served_match": "picked",
        "upstream_status": "200",
        "decision": "recompute",
        "reason": "no_retention",
        "model": MODEL,
        "prompt_tokens": 64,
        "http_method": "POST",
        "path": COMPLETIONS,
    }.items():
        assert line.get(key) == value, (key, line)
    assert len(line["conversation"]) == 16 and line["pick_ms"] > 0 and line["trace_id"]
    assert "secret-conversation-42" not in everything


async def test_the_pick_is_a_span_whose_context_the_sidecar_gets(c: EppCluster) -> None:
    answers = await send(c, {"model": MODEL, "prompt": ids(64)})
    spans = {s.name: s for s in c.exporter.get_finished_spans()}
    pick, server = spans["pick"], spans["/envoy.service.ext_proc.v3.ExternalProcessor/Process"]
    assert pick.parent is not None and pick.parent.span_id == server.context.span_id
    assert pick.attributes is not None and pick.attributes["kvshuttle.decision"] == "recompute"
    _, trace_id, span_id, _ = answers.set_headers["traceparent"].split("-")
    assert (int(trace_id, 16), int(span_id, 16)) == (pick.context.trace_id, pick.context.span_id)
    planned = spans["/kvshuttle.router.v1.RouterService/PlanTurn"]
    assert planned.context.trace_id == pick.context.trace_id
    assert PLAN_HEADER in answers.set_headers


async def test_with_identities_only_a_gateway_of_the_tenant_may_call(
    model_dir: Path, chat_tokenizer: ChatTokenizer
) -> None:
    auth = AuthSettings(
        identities={
            "envoy": Grant(role=Role.GATEWAY, tenants=["default"]),
            "other-tenant": Grant(role=Role.GATEWAY, tenants=["acme"]),
        },
        tokens={
            "envoy": SecretStr("envoy-token-0123456789"),
            "other-tenant": SecretStr("acme-token-0123456789"),
        },
    )
    c = await start_epp(model_dir, chat_tokenizer, auth=auth)
    try:
        messages = [
            request_headers(COMPLETIONS),
            *body_chunks(json.dumps({"model": MODEL, "prompt": ids(8)}).encode()),
        ]
        for token, code in (
            (None, grpc.StatusCode.UNAUTHENTICATED),
            ("acme-token-0123456789", grpc.StatusCode.PERMISSION_DENIED),
        ):
            metadata = () if token is None else (("authorization", f"Bearer {token}"),)
            # Refused before any message is read: the caller learns it on its first read.
            call = c.envoy.stub.Process(metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            assert refused.value.code() == code
        call = c.envoy.stub.Process(metadata=(("authorization", "Bearer envoy-token-0123456789"),))
        for message in messages:
            await call.write(message)
        await call.done_writing()
        answers = [a async for a in call]
        assert answers[0].HasField("request_headers")
    finally:
        await stop_epp(c)
