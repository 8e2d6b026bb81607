"""The endpoint picker against the endpoint picker protocol v1.0.0 (docs/proposals/
004-endpoint-picker-protocol) and Envoy's ext_proc in FULL_DUPLEX_STREAMED mode, every message
type of both paths, with a real router and registry behind it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import grpc.aio
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.gateway.epp.envoy import (
    DECODE,
    PREFILL,
    Answers,
    EppCluster,
    body_chunks,
    chat,
    request_headers,
    response_headers,
)

from kvshuttle.gateway.pd_headers import PLAN_HEADER, PREFILLER_HOST_PORT_HEADER, PROMPT_HEADER, TURN_HEADER
from kvshuttle.router.v1 import router_service_pb2 as pb

BODY = json.dumps(chat("the first question of a conversation")).encode()


async def pick(c: EppCluster, body: bytes = BODY, cuts: tuple[int, ...] = (), **headers: str) -> Answers:
    return await c.envoy.exchange([request_headers(extra=headers), *body_chunks(body, cuts)])


async def test_a_chat_is_planned_and_its_decode_node_picked_once_the_body_has_ended(c: EppCluster) -> None:
    answers = await c.envoy.exchange(
        [request_headers(), *body_chunks(BODY, (5, 40))],
        [
            response_headers(DECODE[2]),
            ext.ProcessingRequest(response_body=ext.HttpBody(body=b'data: {"x": 1}\n\n')),
            ext.ProcessingRequest(response_body=ext.HttpBody(body=b"data: [DONE]\n\n")),
            ext.ProcessingRequest(response_trailers=ext.HttpTrailers()),
        ],
    )
    # Request path: the headers' answer (deferred: it needs the body) first, then the body.
    assert [r.WhichOneof("response") for r in answers.request] == ["request_headers", "request_body"]
    assert answers.endpoint == DECODE[2]
    headers = answers.set_headers
    assert headers[PREFILLER_HOST_PORT_HEADER] == PREFILL[2]
    plan = answers.plan
    assert headers[TURN_HEADER] == plan.turn and plan.turn.startswith("turns/")
    assert (plan.decode.node, plan.prefill.node) == (DECODE[0], PREFILL[0])
    assert plan.decision == pb.DECISION_RECOMPUTE
    assert headers["content-length"] == str(len(BODY))
    assert headers["traceparent"].startswith("00-")
    assert answers.removed == []
    assert answers.body() == BODY
    # Response path: headers answered unchanged, the body streamed back as it came, trailers.
    assert [r.WhichOneof("response") for r in answers.response] == [
        "response_headers",
        "response_body",
        "response_body",
        "response_trailers",
    ]
    assert not answers.response[0].response_headers.response.HasField("header_mutation")
    assert answers.body("response") == b'data: {"x": 1}\n\ndata: [DONE]\n\n'
    assert c.metric("kvshuttle_epp_served_total", match="picked") == 1
    assert c.metric("kvshuttle_epp_requests_total", outcome="planned", status="200") == 1
    # No conversation id: the router starts one for the request (nothing retained matches it).
    assert c.metric("kvshuttle_epp_picks_total", decision="recompute", reason="no_retention") == 1


async def test_body_split_anywhere_is_streamed_back_whole_and_picked_for_alike(c: EppCluster) -> None:
    """Property: wherever Envoy cuts the body (empty chunks too), the picker streams back the
    same bytes and plans the same prompt."""
    loop = asyncio.get_running_loop()
    body = json.dumps(chat("split me " * 40)).encode()
    plans: list[pb.PlanTurnResponse] = []

    @settings(
        max_examples=40,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(cuts=st.lists(st.integers(min_value=0, max_value=len(body)), max_size=12))
    def check(cuts: list[int]) -> None:
        answers = asyncio.run_coroutine_threadsafe(pick(c, body, tuple(cuts)), loop).result(60)
        assert answers.body() == body
        assert answers.endpoint == DECODE[2]
        plans.append(answers.plan)

    await asyncio.to_thread(check)
    assert len({p.tokens_to_compute for p in plans}) == 1


async def test_a_body_larger_than_a_chunk_comes_back_in_chunks_of_62000_bytes(c: EppCluster) -> None:
    body = json.dumps(chat("long " * 30_000)).encode()
    answers = await pick(c, body, (65_536, 131_072))
    assert answers.body() == body
    assert len([r for r in answers.request if r.HasField("request_body")]) == -(-len(body) // 62_000)


async def test_trailers_end_a_body_whose_last_chunk_did_not(c: EppCluster) -> None:
    answers = await c.envoy.exchange(
        [
            request_headers(),
            *body_chunks(BODY, (10,), end_of_stream=False),
            ext.ProcessingRequest(request_trailers=ext.HttpTrailers()),
        ]
    )
    kinds = [r.WhichOneof("response") for r in answers.request]
    assert kinds[0] == "request_headers" and kinds[-1] == "request_trailers"
    assert answers.endpoint == DECODE[2]
    assert answers.body() == BODY
    chunks = [r.request_body.response.body_mutation.streamed_response for r in answers.request[1:-1]]
    assert not any(chunk.end_of_stream for chunk in chunks)  # the trailers end the stream
    assert "content-length" not in answers.set_headers


async def test_a_bodyless_request_goes_to_a_ready_decode_node_without_a_plan(c: EppCluster) -> None:
    # Nothing planned yet: the router says which decode nodes are ready.
    answers = await c.envoy.exchange(
        [request_headers("/v1/models", method="GET", end_of_stream=True, extra={TURN_HEADER: "turns/x"})]
    )
    assert [r.WhichOneof("response") for r in answers.request] == ["request_headers"]
    assert answers.endpoint == DECODE[2]
    assert sorted(answers.removed) == sorted(
        [PREFILLER_HOST_PORT_HEADER, TURN_HEADER, PLAN_HEADER, PROMPT_HEADER]
    )
    assert c.metric("kvshuttle_epp_requests_total", outcome="plain", status="200") == 1


async def test_client_copies_of_the_sidecar_headers_are_overwritten(c: EppCluster) -> None:
    forged = {
        PREFILLER_HOST_PORT_HEADER: "169.254.169.254:80",
        TURN_HEADER: "turns/forged",
        PLAN_HEADER: "AAAA",
        "x-gateway-destination-endpoint": "10.9.9.9:8000",
    }
    answers = await c.envoy.exchange([request_headers(extra=forged), *body_chunks(BODY)])
    headers = answers.set_headers
    assert headers[PREFILLER_HOST_PORT_HEADER] == PREFILL[2]
    assert headers[TURN_HEADER] == answers.plan.turn != "turns/forged"
    assert answers.endpoint == DECODE[2]


async def test_response_bodies_are_acknowledged_unchanged_in_streamed_mode(c: EppCluster) -> None:
    first = request_headers()
    first.protocol_config.response_body_mode = processing_mode_pb2.ProcessingMode.STREAMED
    answers = await c.envoy.exchange(
        [first, *body_chunks(BODY)],
        [response_headers(DECODE[2]), ext.ProcessingRequest(response_body=ext.HttpBody(body=b"x"))],
    )
    body_answer = answers.response[1].response_body
    assert not body_answer.response.HasField("body_mutation")


async def test_a_request_body_mode_other_than_full_duplex_is_refused_naming_it(c: EppCluster) -> None:
    first = request_headers(protocol=processing_mode_pb2.ProcessingMode.BUFFERED)
    answers = await c.envoy.exchange([first, *body_chunks(BODY)])
    assert answers.immediate is not None
    assert (answers.immediate.status.code, answers.immediate.details) == (
        500,
        "kvshuttle_epp_request_body_mode",
    )
    assert "FULL_DUPLEX_STREAMED" in answers.error()["message"]


async def test_the_served_endpoint_is_read_back_from_metadata_or_header(c: EppCluster) -> None:
    """Endpoint picker protocol (Destination Endpoint Served): "For each HTTP response, the data
    plane MUST communicate to the EPP the endpoint that served the request as follows: [...]
    filterMetadata: {"envoy.lb": {"x-gateway-destination-endpoint-served": ip:port}}". The
    picker reads it there (or from a response header of that name) and compares it with its pick.
    """
    await c.envoy.exchange([request_headers(), *body_chunks(BODY)], [response_headers("10.0.0.9:8000")])
    await c.envoy.exchange(
        [request_headers(), *body_chunks(BODY)], [response_headers(DECODE[2], as_header=True)]
    )
    await c.envoy.exchange(
        [request_headers(), *body_chunks(BODY)], [response_headers(None, end_of_stream=True)]
    )
    assert c.metric("kvshuttle_epp_served_total", match="other") == 1
    assert c.metric("kvshuttle_epp_served_total", match="picked") == 1
    assert c.metric("kvshuttle_epp_served_total", match="unreported") == 1


async def test_messages_out_of_order_are_invalid_argument_naming_the_field(c: EppCluster) -> None:
    for messages, field in (
        (body_chunks(BODY), "request_body"),
        ([request_headers(), request_headers()], "request_headers"),
        ([response_headers(DECODE[2])], "response_headers"),
        ([ext.ProcessingRequest()], "request"),
    ):
        call = c.envoy.stub.Process()
        for message in messages:
            await call.write(message)
        await call.done_writing()
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            status = rpc_status.from_call(err)  # type: ignore[arg-type]
            assert status is not None
            info = error_details_pb2.ErrorInfo()
            status.details[0].Unpack(info)
            assert info.metadata["field"] == field, (field, info)
        else:
            raise AssertionError(f"{field}: the stream ended OK")


async def test_health_services_the_protocol_names_answer_on_both_ports(c: EppCluster) -> None:
    """Endpoint picker protocol (Health Checking): "The EPP MUST expose health check endpoints
    following the gRPC Health Checking Protocol." (`liveness`, `readiness` and
    `envoy.service.ext_proc.v3.ExternalProcessor`)."""
    for port in (c.epp.server.port, c.epp.server.health_port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub: Any = health_pb2_grpc.HealthStub(channel)  # typed for the sync stub only
            for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                got = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                assert got.status == health_pb2.HealthCheckResponse.SERVING, service
            try:
                await stub.Check(health_pb2.HealthCheckRequest(service="nonsense"))
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.NOT_FOUND
            else:
                raise AssertionError("an unknown service answered")
