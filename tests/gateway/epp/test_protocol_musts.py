"""Every MUST of the endpoint picker protocol, one test each, the protocol's words quoted in the
test's docstring, driven as Envoy drives ext_proc (tests/gateway/epp/envoy.py) against a real
router and registry.

The document: kubernetes-sigs/gateway-api-inference-extension,
docs/proposals/004-endpoint-picker-protocol/README.md at 84436a96b9e6ce2b59ddacd3d04c31b4fbd442de
(2026-08-18), whose version history's latest is v1.0.0 (2025-07-29); the sentences on streaming
mode, health checking and retries across backends were added to it after the v1.0.0 tag, with no
new version. Its sentences with MUST, in the document's order, and the test that holds each:

 1. "The EPP MUST implement the Envoy external processing service protocol."
    -> test_m01_the_epp_speaks_ext_proc
 2. "The EPP MUST support streaming mode for inference requests and responses."
    -> test_m02_request_and_response_bodies_stream_both_ways
 3. "the data plane CAN communicate the subset of endpoints the EPP MUST pick from by setting an
    unstructured entry in the filter metadata field of the ext-proc request."
    -> test_m03_the_subset_the_data_plane_sets_is_picked_from_in_each_shape
 4. "The metadata entry for the subset list MUST be wrapped with an outer key (which represents
    the metadata namespace) with a default of `envoy.lb.subset_hint`."
    -> test_m04_the_subset_is_read_from_the_envoy_lb_subset_hint_namespace
 5. "If the key `x-gateway-destination-endpoint-subset` is set, the EPP MUST only select endpoints
    from the specified list." -> test_m05_any_eligible_member_of_the_subset_is_selected_and_only_one
 6. "If none of the endpoints in the list is eligible or the list is empty, then the EPP MUST
    return a ImmediateResponse with 503 (Service Unavailable) HTTP status code."
    -> test_m06_no_eligible_member_or_an_empty_list_is_503
 7. "If the key `x-gateway-destination-endpoint-subset` is not set, then the EPP MUST select from
    the set defined by the `InferencePool` selector."
    -> test_m07_without_a_subset_the_pick_is_a_ready_decode_node_of_the_pool
 8. "For each HTTP request, the EPP MUST communicate to the data plane one or more selected model
    server endpoints via: [the header and the dynamic_metadata]"
    -> test_m08_every_request_gets_the_pick_as_header_and_as_metadata
 9. "The metadata entry for the picked endpoints MUST be wrapped with an outer key (which
    represents the metadata namespace) with a default of `envoy.lb`."
    -> test_m09_the_picks_metadata_is_in_the_envoy_lb_namespace
10. "The primary endpoint MUST be set using the key `x-gateway-destination-endpoint`"
    -> test_m10_the_primary_endpoint_key_is_x_gateway_destination_endpoint
11. "The value of the header or metadata entry MUST contain at least one endpoint in `<ip:port>`
    format or multiple endpoints in `<ip:port>,<ip:port>,...` format."
    -> test_m11_the_value_is_an_ip_port_endpoint_ipv6_bracketed
12. "If a retry remains on the same backend, the data plane MUST continue through that backend's
    endpoint list in order." (the data plane's) -> test_m12_the_ordered_list_is_the_one_planned_endpoint
13. "If route-level retry or failover selects a different `InferencePool` backend, the data plane
    MUST invoke the EPP associated with the newly selected backend and MUST NOT reuse endpoints
    returned for the previous backend." (the data plane's)
    -> test_m13_each_invocation_is_picked_afresh_on_what_is_ready_now
14. "If the EPP did not communicate the server endpoint via these two methods, it MUST return an
    error as follows: ImmediateResponse with 503 (Serivce Unavailable) HTTP status code if there
    are no ready endpoints." -> test_m14_no_ready_endpoint_is_503_never_a_dead_endpoint
15. "[...] ImmediateResponse with 429 (Too Many Requests) HTTP status code if the request should
    be dropped" -> test_picks.py::test_more_picks_in_flight_than_allowed_are_shed_with_429
16. "The EPP MUST not set two different values in the header and the inner response metadata
    value." -> test_m16_header_and_metadata_never_differ
17. "For each HTTP response, the data plane MUST communicate to the EPP the endpoint that served
    the request" -> test_protocol.py::test_the_served_endpoint_is_read_back_from_metadata_or_header
18. "If route-level retry or failover selects a different `InferencePool` backend,
    `x-gateway-destination-endpoint-served` MUST be reported to the EPP associated with the
    backend that produced the terminal response." (the data plane's)
    -> test_m18_a_served_endpoint_other_than_the_pick_is_taken_as_reported
19. "The EPP MUST expose health check endpoints following the gRPC Health Checking Protocol."
    -> test_protocol.py::test_health_services_the_protocol_names_answer_on_both_ports

Eligible (5, 6) and ready (7, 14) mean, for kvshuttle's pool of decode pods: a decode node of the
model, registered with the registry, its lease not lapsed, its engine reported healthy, as the
router's node list has it (what PlanTurn places on and ListReadyDecodes names).
"""

from __future__ import annotations

import ipaddress
import json
import random
from pathlib import Path
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from google.protobuf import struct_pb2
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
    lapse,
    register,
    request_headers,
    response_headers,
    start_epp,
    stop_epp,
)
from tests.router.helpers import MODEL, Tokens

from kvshuttle.epp.protocol import (
    DESTINATION_ENDPOINT,
    DESTINATION_NAMESPACE,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from kvshuttle.gateway.pd_headers import PLAN_HEADER, PREFILLER_HOST_PORT_HEADER, TURN_HEADER
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.v1 import router_service_pb2 as pb

CHAT_PATH = "/v1/chat/completions"
UNKNOWN = "10.0.0.77:8000"  # no node of the pool


def ids(n: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 150_000) for _ in range(n)]


async def post(
    c: EppCluster, body: dict[str, Any], *, path: str = COMPLETIONS, subset: Any = None
) -> Answers:
    """A completion (or chat) request as Envoy streams it: headers, then the body in two chunks."""
    raw = json.dumps(body).encode()
    return await c.envoy.exchange([request_headers(path, subset=subset), *body_chunks(raw, (len(raw) // 2,))])


async def models(c: EppCluster, subset: Any = None) -> Answers:
    """`GET /v1/models`: a bodyless request, needing no plan."""
    return await c.envoy.exchange(
        [request_headers("/v1/models", method="GET", end_of_stream=True, subset=subset)]
    )


def completion(n: int = 64, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": ids(n), "max_tokens": 8, **fields}


def refused(answers: Answers, status: int, code: str) -> None:
    """An ImmediateResponse and nothing else: no destination was communicated."""
    assert [r.WhichOneof("response") for r in answers.request] == ["immediate_response"], answers.request
    assert answers.immediate is not None
    assert answers.immediate.status.code == status
    assert answers.error()["code"] == code


def destination(answers: Answers) -> tuple[str, str]:
    """(the header's value, the metadata's value) of the pick, read apart."""
    answer = answers.headers_answer
    headers = {
        o.header.key: o.header.raw_value.decode()
        for o in answer.request_headers.response.header_mutation.set_headers
    }
    metadata = answer.dynamic_metadata.fields[DESTINATION_NAMESPACE].struct_value.fields
    return headers[DESTINATION_ENDPOINT], metadata[DESTINATION_ENDPOINT].string_value


async def commit(c: EppCluster, plan: pb.PlanTurnResponse, sequence: list[int]) -> None:
    """The decode pod's sidecar commits the turn: decode retains the whole sequence."""
    params = Tokens().decode_params(plan, len(sequence))
    await c.router.client.commit_turn(
        plan.turn, token_ids=sequence, decode_kv_transfer_params=params, timings=pb.TurnTimings()
    )


async def test_m01_the_epp_speaks_ext_proc(c: EppCluster) -> None:
    """ "The EPP MUST implement the Envoy external processing service protocol."

    One `envoy.service.ext_proc.v3.ExternalProcessor/Process` stream per HTTP request: each
    message of each phase is answered with the response of that phase (the request headers'
    answer deferred until the body has ended), and the stream ends OK when Envoy ends it."""
    raw = json.dumps(chat("which phase answers which")).encode()
    answers = await c.envoy.exchange(
        [
            request_headers(CHAT_PATH),
            *body_chunks(raw, (7,), end_of_stream=False),
            ext.ProcessingRequest(request_trailers=ext.HttpTrailers()),
        ],
        [
            response_headers(DECODE[2]),
            ext.ProcessingRequest(response_body=ext.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True)),
            ext.ProcessingRequest(response_trailers=ext.HttpTrailers()),
        ],
    )
    phases = [r.WhichOneof("response") for r in answers.request]
    assert phases[0] == "request_headers" and phases[-1] == "request_trailers"
    assert set(phases[1:-1]) == {"request_body"}
    assert [r.WhichOneof("response") for r in answers.response] == [
        "response_headers",
        "response_body",
        "response_trailers",
    ]
    assert answers.endpoint == DECODE[2] and answers.body() == raw


async def test_m02_request_and_response_bodies_stream_both_ways(c: EppCluster) -> None:
    """ "The EPP MUST support streaming mode for inference requests and responses. Streaming
    mode enables full-duplex communication between the Gateway (Envoy), EPP, and model servers,
    allowing real-time token-by-token response delivery for AI inference workloads."

    FULL_DUPLEX_STREAMED: the request body arrives in chunks without an answer each and goes back
    as streamed_response chunks; each response chunk (a token's server-sent event) is answered
    before Envoy sends the next one."""
    raw = json.dumps(chat("stream me " * 50)).encode()
    tokens = [f'data: {{"choices": [{{"text": "t{i}"}}]}}\n\n'.encode() for i in range(5)]
    answers = await c.envoy.exchange(
        [request_headers(CHAT_PATH), *body_chunks(raw, (1, 100, 101, 300))],
        [
            response_headers(DECODE[2]),
            *(
                ext.ProcessingRequest(response_body=ext.HttpBody(body=t, end_of_stream=i == len(tokens) - 1))
                for i, t in enumerate(tokens)
            ),
        ],
    )
    assert answers.body() == raw
    streamed = [r.response_body.response.body_mutation.streamed_response for r in answers.response[1:]]
    # One answer per token, in order, each carrying that token: nothing was buffered.
    assert [s.body for s in streamed] == tokens
    assert [s.end_of_stream for s in streamed] == [False] * 4 + [True]


async def test_m03_the_subset_the_data_plane_sets_is_picked_from_in_each_shape(two: EppCluster) -> None:
    """ "For each HTTP request, the data plane CAN communicate the subset of endpoints the EPP
    MUST pick from by setting an unstructured entry in the filter metadata field of the ext-proc
    request." (`"x-gateway-destination-endpoint-subset": [<ip:port>, <ip:port>, ...]`)

    The list of the document's example, a comma-separated string, and list items that are
    themselves comma-separated: each is the set picked from."""
    for subset in ([UNKNOWN, D1[2]], f"{UNKNOWN},{D1[2]}", [f"{UNKNOWN}, {D1[2]}"]):
        answers = await post(two, completion(), subset=subset)
        assert answers.endpoint == D1[2], subset
        assert answers.plan.decode.node == D1[0] and answers.plan.turn


async def test_m04_the_subset_is_read_from_the_envoy_lb_subset_hint_namespace(two: EppCluster) -> None:
    """ "The metadata entry for the subset list MUST be wrapped with an outer key (which
    represents the metadata namespace) with a default of `envoy.lb.subset_hint`."

    The key under `envoy.lb.subset_hint` restricts the pick; the same key under another
    namespace is no subset hint (the router's own choice, d0, is picked)."""
    raw = json.dumps(completion()).encode()
    for namespace, endpoint in ((SUBSET_NAMESPACE, D1[2]), ("envoy.lb", DECODE[2]), ("other", DECODE[2])):
        first = request_headers(COMPLETIONS)
        entry = struct_pb2.Struct()
        entry.update({SUBSET_KEY: [D1[2]]})
        first.metadata_context.filter_metadata[namespace].CopyFrom(entry)
        answers = await two.envoy.exchange([first, *body_chunks(raw)])
        assert answers.endpoint == endpoint, namespace


async def test_m05_any_eligible_member_of_the_subset_is_selected_and_only_one(two: EppCluster) -> None:
    """ "If the key `x-gateway-destination-endpoint-subset` is set, the EPP MUST only select
    endpoints from the specified list."

    Two registered, healthy decode nodes; left to itself the router places on d0. A subset of
    d1 alone, or of an unknown address and d1, selects d1 on the first request the picker ever
    sees (whatever earlier requests did or did not plan), as a real plan; so does a request that
    needs no plan; and a conversation whose KV d0 holds is planned onto d1, prefill reading the
    KV from d0 (decode runs inside the subset; no KV is served but the verified prefix)."""
    for subset in ([D1[2]], [UNKNOWN, D1[2]], ["10.0.0.3"]):
        answers = await post(two, completion(), subset=subset)
        assert answers.endpoint == D1[2], subset
        assert answers.set_headers[TURN_HEADER] == answers.plan.turn
        assert answers.plan.decode.node == D1[0]
    assert (await models(two, [UNKNOWN, D1[2]])).endpoint == D1[2]
    assert (await post(two, completion())).endpoint == DECODE[2]  # unconstrained: d0

    first = ids(4000)  # long enough that reading the KV beats recomputing it
    turn1 = await post(
        two, {"model": MODEL, "prompt": first, "conversation_id": "conv-m5"}, subset=[DECODE[2]]
    )
    sequence = first + ids(40, seed=8)
    await commit(two, turn1.plan, sequence)
    turn2 = await post(
        two,
        {"model": MODEL, "prompt": sequence + ids(30, seed=9), "conversation_id": "conv-m5"},
        subset=[D1[2]],
    )
    assert turn2.endpoint == D1[2]
    plan = turn2.plan
    assert (plan.decision, plan.decode.node) == (pb.DECISION_REUSE, D1[0])
    assert plan.prefill_kv_transfer_params.remote_engine_id == turn1.plan.decode.engine_id == "engine-d0"
    assert plan.reusable_tokens > 3900


async def test_m06_no_eligible_member_or_an_empty_list_is_503(two: EppCluster) -> None:
    """ "If none of the endpoints in the list is eligible or the list is empty, then the EPP MUST
    return a ImmediateResponse with 503 (Service Unavailable) HTTP status code."

    Empty (a list, a string, entries that are no endpoint), an address of no node, the prefill
    pod (no decode node), a decode node whose engine is unhealthy, one whose lease lapsed: 503
    for a completion and for a request needing no plan, and the conversation's retained KV is
    left as it was (nothing claimed)."""
    first = ids(4000)
    body = {"model": MODEL, "prompt": first, "conversation_id": "conv-m6"}
    turn1 = await post(two, body, subset=[DECODE[2]])
    sequence = first + ids(40, seed=8)
    await commit(two, turn1.plan, sequence)
    turn2 = {**body, "prompt": sequence + ids(20, seed=3)}
    listed = reg_pb.ListRetentionsRequest(parent="tenants/default", page_size=10)
    before = list((await two.registry.stub.ListRetentions(listed)).retentions)

    await beat(two, D1[0], healthy=False)
    for subset in ([], "", ["not an endpoint", "http://10.0.0.3:8000/"], [UNKNOWN], [PREFILL[2]], [D1[2]]):
        refused(await post(two, turn2, subset=subset), 503, "no_eligible_endpoint")
        refused(await models(two, subset), 503, "no_eligible_endpoint")
    await lapse(two, keep=(PREFILL[0], DECODE[0]))  # d1's lease lapses
    refused(await post(two, turn2, subset=[D1[2]]), 503, "no_eligible_endpoint")
    refused(await models(two, [D1[2]]), 503, "no_eligible_endpoint")

    await two.epp.background.settle()
    assert list((await two.registry.stub.ListRetentions(listed)).retentions) == before


async def test_m07_without_a_subset_the_pick_is_a_ready_decode_node_of_the_pool(two: EppCluster) -> None:
    """ "If the key `x-gateway-destination-endpoint-subset` is not set, then the EPP MUST select
    from the set defined by the `InferencePool` selector."

    The pool is the decode pods; the picks are ready ones: with d1's engine unhealthy, every
    request goes to d0 (never to the prefill pod); once d0 is the unhealthy one, every request
    goes to d1, though d0 is where the picker sent the earlier ones."""
    await beat(two, D1[0], healthy=False)
    for _ in range(3):
        assert (await post(two, completion())).endpoint == DECODE[2]
        assert (await post(two, chat("hi"), path=CHAT_PATH)).endpoint == DECODE[2]
        assert (await models(two)).endpoint == DECODE[2]
    await beat(two, D1[0])
    await beat(two, DECODE[0], healthy=False)
    for _ in range(3):
        assert (await models(two)).endpoint == D1[2]
        assert (await post(two, completion())).endpoint == D1[2]


async def test_m08_every_request_gets_the_pick_as_header_and_as_metadata(c: EppCluster) -> None:
    """ "For each HTTP request, the EPP MUST communicate to the data plane one or more selected
    model server endpoints via: 1. Setting the `x-gateway-destination-endpoint` HTTP header to
    one or more selected endpoints. 2. Set an unstructured entry in the dynamic_metadata field of
    the ext-proc response."

    A chat, a completion, a body ended by trailers, a bodyless request, and a request picked
    while the router is down: each answer carries both."""
    raw = json.dumps(chat("both ways")).encode()
    exchanges = [
        await post(c, chat("a chat"), path=CHAT_PATH),
        await post(c, completion()),
        await c.envoy.exchange(
            [
                request_headers(CHAT_PATH),
                *body_chunks(raw, end_of_stream=False),
                ext.ProcessingRequest(request_trailers=ext.HttpTrailers()),
            ]
        ),
        await models(c),
    ]
    await c.router.server.stop()
    exchanges.append(await post(c, completion()))
    for answers in exchanges:
        header, metadata = destination(answers)
        assert header == metadata == DECODE[2]


async def test_m09_the_picks_metadata_is_in_the_envoy_lb_namespace(c: EppCluster) -> None:
    """ "The metadata entry for the picked endpoints MUST be wrapped with an outer key (which
    represents the metadata namespace) with a default of `envoy.lb`."
    """
    for answers in (await post(c, completion()), await models(c)):
        metadata = answers.headers_answer.dynamic_metadata
        assert list(metadata.fields) == ["envoy.lb"]
        assert metadata.fields["envoy.lb"].WhichOneof("kind") == "struct_value"


async def test_m10_the_primary_endpoint_key_is_x_gateway_destination_endpoint(c: EppCluster) -> None:
    """ "The primary endpoint MUST be set using the key `x-gateway-destination-endpoint`"
    (`dynamicMetadata: {"envoy.lb": {"x-gateway-destination-endpoint": <ip:port>}}`)."""
    answers = await post(c, completion())
    inner = answers.headers_answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert list(inner) == ["x-gateway-destination-endpoint"]
    assert inner["x-gateway-destination-endpoint"].string_value == DECODE[2]
    mutation = answers.headers_answer.request_headers.response.header_mutation
    assert [o.header.key for o in mutation.set_headers].count("x-gateway-destination-endpoint") == 1


async def test_m11_the_value_is_an_ip_port_endpoint_ipv6_bracketed(
    c: EppCluster, model_dir: Path, chat_tokenizer: ChatTokenizer
) -> None:
    """ "The value of the header or metadata entry MUST contain at least one endpoint in
    `<ip:port>` format or multiple endpoints in `<ip:port>,<ip:port>,...` format."

    An IPv4 pool and an IPv6 one (registered as `http://[FD00:0::2]:8000`): the value is the
    address and port, IPv6 in brackets, for a plan and for a request needing no plan."""
    v6 = await start_epp(
        model_dir,
        chat_tokenizer,
        nodes=[
            ("nodes/p0", reg_pb.NODE_ROLE_PREFILL, "http://[fd00::1]:8000"),
            ("nodes/d0", reg_pb.NODE_ROLE_DECODE, "http://[FD00:0::2]:8000"),
        ],
    )
    try:
        for cluster, version in ((c, 4), (v6, 6)):
            for answers in (await post(cluster, completion()), await models(cluster)):
                for value in destination(answers):
                    host, _, port = value.rpartition(":")
                    address = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
                    assert address.version == version and 0 < int(port) < 65536, value
                    assert host.startswith("[") == (version == 6), value
    finally:
        await stop_epp(v6)


async def test_m12_the_ordered_list_is_the_one_planned_endpoint(two: EppCluster) -> None:
    """The data plane's: "If a retry remains on the same backend, the data plane MUST continue
    through that backend's endpoint list in order."

    The picker's side of it: the list it returns is one endpoint, the decode node the turn was
    planned around (the plan the sidecar gets names it), so a retry on this backend has that one
    endpoint to go through; a fallback list would send the planned turn to a pod it was not
    planned for (the sidecar would serve it plain). Every shape of answer lists exactly one."""
    for answers in (
        await post(two, completion()),
        await post(two, completion(), subset=[D1[2], DECODE[2]]),
        await models(two, [DECODE[2], D1[2]]),
    ):
        header, metadata = destination(answers)
        assert "," not in header and header == metadata
        if PLAN_HEADER in answers.set_headers:
            planned = answers.plan.decode.http_endpoint.removeprefix("http://")
            assert header == planned


async def test_m13_each_invocation_is_picked_afresh_on_what_is_ready_now(two: EppCluster) -> None:
    """The data plane's: "If route-level retry or failover selects a different `InferencePool`
    backend, the data plane MUST invoke the EPP associated with the newly selected backend and
    MUST NOT reuse endpoints returned for the previous backend."

    The picker's side of it: every invocation (one ext_proc stream) is picked on its own, from
    the pool's nodes ready at that moment, never by replaying an endpoint an earlier invocation
    returned: the same request sent again after its pod failed is picked onto the other one,
    with a plan of its own."""
    body = completion(conversation_id="conv-m13")
    first = await post(two, body)
    assert first.endpoint == DECODE[2]
    await beat(two, DECODE[0], healthy=False)  # the pod the first invocation got fails
    again = await post(two, body)
    assert again.endpoint == D1[2]
    assert again.plan.turn != first.plan.turn and again.plan.decode.node == D1[0]


async def test_m14_no_ready_endpoint_is_503_never_a_dead_endpoint(two: EppCluster) -> None:
    """ "If the EPP did not communicate the server endpoint via these two methods, it MUST return
    an error as follows: ImmediateResponse with 503 (Serivce Unavailable) HTTP status code if
    there are no ready endpoints."

    Requests picked onto d0 and d1 (so the picker has endpoints to remember); then every decode
    engine, sidecar and agent stops and their leases lapse (the router answers NO_DECODE_NODE):
    a chat, a completion, `GET /v1/models`, and subsets naming only a dead endpoint all get 503
    and no destination; the prefill gone too, the same. A decode node registered again is picked
    again."""
    assert (await post(two, chat("first"), path=CHAT_PATH)).endpoint == DECODE[2]
    assert (await post(two, completion(), subset=[D1[2]])).endpoint == D1[2]
    assert (await models(two)).endpoint == DECODE[2]

    await lapse(two, keep=(PREFILL[0],))
    for _ in range(2):
        refused(await post(two, chat("after"), path=CHAT_PATH), 503, "no_ready_endpoint")
        refused(await post(two, completion()), 503, "no_ready_endpoint")
        refused(await models(two), 503, "no_ready_endpoint")
        refused(await post(two, completion(), subset=[DECODE[2]]), 503, "no_eligible_endpoint")
        refused(await models(two, [D1[2]]), 503, "no_eligible_endpoint")
    await lapse(two)  # and the prefill node
    refused(await post(two, completion()), 503, "no_ready_endpoint")
    refused(await models(two), 503, "no_ready_endpoint")
    assert two.metric("kvshuttle_epp_requests_total", outcome="refused", status="503") == 12

    await register(two.registry, D1[0], reg_pb.NODE_ROLE_DECODE, D1[1])
    assert (await models(two)).endpoint == D1[2]


async def test_m16_header_and_metadata_never_differ(two: EppCluster) -> None:
    """ "The EPP MUST not set two different values in the header and the inner response metadata
    value."

    Every kind of pick: planned (with and without a subset), needing no plan, the decode pod
    running a request alone (no prefill node), and the fallback while the router is down."""
    answers = [
        await post(two, completion()),
        await post(two, completion(), subset=[UNKNOWN, D1[2]]),
        await models(two, [D1[2]]),
    ]
    await lapse(two, keep=(DECODE[0], D1[0]))  # no prefill node: the decode pod runs it alone
    local = await post(two, completion())
    assert PREFILLER_HOST_PORT_HEADER in local.removed
    answers.append(local)
    await register(two.registry, PREFILL[0], reg_pb.NODE_ROLE_PREFILL, PREFILL[1])
    answers.append(await post(two, completion()))
    await two.router.server.stop()
    answers.append(await post(two, completion(), subset=[D1[2]]))
    for a in answers:
        header, metadata = destination(a)
        assert header == metadata and header in (DECODE[2], D1[2])


async def test_m18_a_served_endpoint_other_than_the_pick_is_taken_as_reported(c: EppCluster) -> None:
    """The data plane's: "If route-level retry or failover selects a different `InferencePool`
    backend, `x-gateway-destination-endpoint-served` MUST be reported to the EPP associated with
    the backend that produced the terminal response."

    The picker's side of it: a served endpoint that is not its pick (another backend's pod, as
    reported) is read as reported, counted apart (`served_total{match="other"}`), and the
    response passes unchanged."""
    answers = await c.envoy.exchange(
        [request_headers(COMPLETIONS), *body_chunks(json.dumps(completion()).encode())],
        [response_headers("10.1.0.9:8000"), ext.ProcessingRequest(response_trailers=ext.HttpTrailers())],
    )
    assert answers.endpoint == DECODE[2]
    assert not answers.response[0].response_headers.response.HasField("header_mutation")
    assert c.metric("kvshuttle_epp_served_total", match="other") == 1
    assert c.metric("kvshuttle_epp_served_total", match="picked") == 0


def test_every_must_listed_names_a_test_that_exists() -> None:
    """The list above names a test for every MUST, and every test it names exists (a MUST held
    elsewhere is named with its file)."""
    here = Path(__file__)
    names = {line.split("-> ", 1)[1].strip() for line in (__doc__ or "").splitlines() if "-> " in line}
    assert len(names) == 19
    for name in names:
        file, _, test = name.rpartition("::")
        source = (here.parent / file).read_text() if file else here.read_text()
        assert f"async def {test}(" in source, name
