"""What the endpoint picker tests share: a cluster of a real registry and router (in process, over
gRPC) with prefill and decode nodes registered on IP endpoints, the picker in front, and a
client that speaks ext_proc to it as Envoy does with FULL_DUPLEX_STREAMED bodies: the request
headers, the body in chunks (without waiting for an answer per chunk), the trailers; once the
picker has answered the request path, the response headers (the served endpoint in the
`envoy.lb` metadata), the response body chunks and trailers."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from google.protobuf import struct_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from tests.router.helpers import MODEL, RouterEnv, heartbeat, node, seconds, start_router
from tests.support.registry_env import RegistryEnv, start_registry

from kvshuttle.epp.config import EppSettings
from kvshuttle.epp.main import EppServer
from kvshuttle.gateway.config import ModelSettings, RouterConnection
from kvshuttle.gateway.pd_headers import PLAN_HEADER, decode_plan
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.serving.settings import ServerSettings, TelemetrySettings
from kvshuttle.serving.tracing import configure_tracing, shutdown_tracing

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PREFILL = ("nodes/p0", "http://10.0.0.1:8000", "10.0.0.1:8000")
DECODE = ("nodes/d0", "http://10.0.0.2:8000", "10.0.0.2:8000")
D1 = ("nodes/d1", "http://10.0.0.3:8000", "10.0.0.3:8000")
# A prefill node and two decode nodes (`nodes` of start_epp).
TWO_DECODES = [
    (PREFILL[0], reg_pb.NODE_ROLE_PREFILL, PREFILL[1]),
    (DECODE[0], reg_pb.NODE_ROLE_DECODE, DECODE[1]),
    (D1[0], reg_pb.NODE_ROLE_DECODE, D1[1]),
]
CACHE_SALT_KEY = "epp-test-cache-salt-key"


def chat(content: str = "hello there", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **fields}


def struct(value: Mapping[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(value)
    return s


def request_headers(
    path: str = CHAT,
    *,
    method: str = "POST",
    end_of_stream: bool = False,
    extra: Mapping[str, str] | None = None,
    subset: Any = None,
    protocol: processing_mode_pb2.ProcessingMode.BodySendMode.ValueType | None = FULL_DUPLEX,
) -> ext.ProcessingRequest:
    """The first message of a stream, as Envoy sends it: pseudo-headers and lower-cased names as
    raw_value bytes, the subset hint in the metadata when given, the protocol configuration."""
    pairs = {
        ":method": method,
        ":path": path,
        ":authority": "inference-gateway",
        ":scheme": "http",
        "content-type": "application/json",
        **(extra or {}),
    }
    message = ext.ProcessingRequest(
        request_headers=ext.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode()) for k, v in pairs.items()]
            ),
            end_of_stream=end_of_stream,
        )
    )
    if subset is not None:
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(
            struct({"x-gateway-destination-endpoint-subset": subset})
        )
    if protocol is not None:
        message.protocol_config.CopyFrom(
            ext.ProtocolConfiguration(request_body_mode=protocol, response_body_mode=FULL_DUPLEX)
        )
    return message


def body_chunks(
    body: bytes, cuts: Sequence[int] = (), *, end_of_stream: bool = True
) -> list[ext.ProcessingRequest]:
    """`body` cut at `cuts` (offsets, any order; repeats make empty chunks), the last chunk
    carrying `end_of_stream`."""
    points = [0, *sorted(min(max(c, 0), len(body)) for c in cuts), len(body)]
    pieces = [body[a:b] for a, b in itertools.pairwise(points)]
    return [
        ext.ProcessingRequest(
            request_body=ext.HttpBody(body=piece, end_of_stream=end_of_stream and i == len(pieces) - 1)
        )
        for i, piece in enumerate(pieces)
    ]


def response_headers(
    served: str | None, *, status: str = "200", as_header: bool = False, end_of_stream: bool = False
) -> ext.ProcessingRequest:
    pairs = {":status": status, "content-type": "text/event-stream"}
    if served is not None and as_header:
        pairs["x-gateway-destination-endpoint-served"] = served
    message = ext.ProcessingRequest(
        response_headers=ext.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
            ),
            end_of_stream=end_of_stream,
        )
    )
    if served is not None and not as_header:
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(
            struct({"x-gateway-destination-endpoint-served": served})
        )
    return message


@dataclass
class Answers:
    """What the picker answered, by the phase of Envoy's message it answered."""

    request: list[ext.ProcessingResponse] = field(default_factory=list)
    response: list[ext.ProcessingResponse] = field(default_factory=list)

    @property
    def immediate(self) -> ext.ImmediateResponse | None:
        last = self.request[-1] if self.request else None
        return last.immediate_response if last is not None and last.HasField("immediate_response") else None

    def error(self) -> dict[str, Any]:
        assert self.immediate is not None, self.request
        body: dict[str, Any] = json.loads(self.immediate.body)
        return body["error"]  # type: ignore[no-any-return]

    @property
    def headers_answer(self) -> ext.ProcessingResponse:
        (answer,) = [r for r in self.request if r.HasField("request_headers")]
        return answer

    @property
    def set_headers(self) -> dict[str, str]:
        mutation = self.headers_answer.request_headers.response.header_mutation
        for option in mutation.set_headers:  # a client's copy is overwritten, never appended to
            assert option.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
        return {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}

    @property
    def removed(self) -> list[str]:
        return list(self.headers_answer.request_headers.response.header_mutation.remove_headers)

    @property
    def endpoint(self) -> str:
        """The pick, checked to be the same in the header and the dynamic metadata."""
        answer = self.headers_answer
        metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
        picked: str = metadata["x-gateway-destination-endpoint"].string_value
        assert self.set_headers["x-gateway-destination-endpoint"] == picked
        assert answer.request_headers.response.clear_route_cache
        return picked

    @property
    def plan(self) -> pb.PlanTurnResponse:
        return decode_plan(self.set_headers[PLAN_HEADER])

    def body(self, phase: str = "request") -> bytes:
        """The body streamed back, checked to be streamed_response chunks of at most 62,000
        bytes with end_of_stream on the last alone."""
        answers = [getattr(r, f"{phase}_body") for r in getattr(self, phase) if r.HasField(f"{phase}_body")]
        chunks = [a.response.body_mutation.streamed_response for a in answers]
        assert all(a.response.body_mutation.HasField("streamed_response") for a in answers)
        assert all(len(c.body) <= 62_000 for c in chunks)
        assert [c.end_of_stream for c in chunks[:-1]] == [False] * (len(chunks) - 1)
        return b"".join(c.body for c in chunks)


class Envoy:
    """An ext_proc client that speaks to the picker as Envoy's ext_proc filter does."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = ext_grpc.ExternalProcessorStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def exchange(
        self,
        request: Sequence[ext.ProcessingRequest],
        response: Sequence[ext.ProcessingRequest] = (),
    ) -> Answers:
        """Send the request path's messages without waiting; read the picker's answers until
        the request path is answered (headers, body through end_of_stream, trailers) or refused;
        then send the response path's messages and read their answers; then end the stream."""
        call = self.stub.Process()
        answers = Answers()
        for message in request:
            try:
                await call.write(message)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                break  # the picker ended the stream early (an ImmediateResponse): read it below
        wanted = _request_answers(request)
        while wanted:
            got = await call.read()
            assert got is not grpc.aio.EOF, f"the stream ended; still waiting for {wanted}"
            answers.request.append(got)
            if got.HasField("immediate_response"):
                await call.done_writing()
                assert await call.read() is grpc.aio.EOF
                return answers
            _answered(wanted, got)
        for message in response:
            await call.write(message)
            for _ in range(_response_answers(message)):
                got = await call.read()
                assert got is not grpc.aio.EOF
                answers.response.append(got)
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        return answers


def _request_answers(request: Sequence[ext.ProcessingRequest]) -> list[str]:
    """The answers the request path must get: the headers', the body's end, the trailers'."""
    wanted = ["request_headers"]
    if any(m.HasField("request_body") for m in request) or any(
        m.HasField("request_headers") and not m.request_headers.end_of_stream for m in request
    ):
        wanted.append("request_body_end")
    if any(m.HasField("request_trailers") for m in request):
        wanted.append("request_trailers")
    return wanted


def _answered(wanted: list[str], got: ext.ProcessingResponse) -> None:
    phase = got.WhichOneof("response")
    if phase == "request_headers":
        assert wanted[0] == "request_headers", (wanted, got)  # the headers' answer comes first
        wanted.pop(0)
    elif phase == "request_body":
        assert wanted and wanted[0] == "request_body_end", (wanted, got)
        if got.request_body.response.body_mutation.streamed_response.end_of_stream:
            wanted.pop(0)
    elif phase == "request_trailers":
        if wanted and wanted[0] == "request_body_end":  # the body ended without end_of_stream
            wanted.pop(0)
        assert wanted == ["request_trailers"], (wanted, got)
        wanted.pop(0)
    else:
        raise AssertionError(f"unexpected answer {phase} on the request path")


def _response_answers(message: ext.ProcessingRequest) -> int:
    if message.HasField("response_body"):
        return max(1, -(-len(message.response_body.body) // 62_000))
    return 1


# --- the cluster ------------------------------------------------------------------------------


@dataclass
class EppCluster:
    registry: RegistryEnv
    router: RouterEnv
    epp: EppServer
    envoy: Envoy
    address: str
    exporter: InMemorySpanExporter
    provider: TracerProvider
    metrics: CollectorRegistry

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.get_sample_value(name, labels) or 0.0


async def register(registry: RegistryEnv, name: str, role: reg_pb.NodeRole.ValueType, endpoint: str) -> int:
    spec = node(name, role)
    spec.http_endpoint = endpoint
    registered = await registry.stub.RegisterNode(reg_pb.RegisterNodeRequest(node=spec, ttl=seconds(300)))
    await heartbeat(registry, name, registered.node.incarnation)
    return registered.node.incarnation


async def beat(c: EppCluster, name: str, *, healthy: bool = True) -> None:
    """A heartbeat of node `name` (its lease renewed for 300 s), its engine `healthy` or not."""
    incarnation = (await c.registry.stub.GetNode(reg_pb.GetNodeRequest(name=name))).node.incarnation
    await heartbeat(c.registry, name, incarnation, healthy=healthy)


async def lapse(c: EppCluster, *, keep: Sequence[str] = ()) -> None:
    """Every node but `keep` stops heartbeating (its engine, sidecar and agent stopped): past its
    300 s lease the registry drops it (its expiry run on the registry's fake clock)."""
    c.registry.clock.advance(200)
    for name in keep:
        await beat(c, name)
    c.registry.clock.advance(101)
    await c.registry.registry.expire_due()


async def start_epp(
    model_dir: Path,
    tokenizer: ChatTokenizer,
    *,
    nodes: Sequence[tuple[str, reg_pb.NodeRole.ValueType, str]] | None = None,
    router_timeout: float = 5.0,
    router_address: str | None = None,
    max_plan_header_bytes: int | None = None,
    **overrides: Any,
) -> EppCluster:
    exporter = InMemorySpanExporter()
    provider = configure_tracing(TelemetrySettings(), "kvshuttle-epp-test", exporter=exporter)
    registry = await start_registry()
    router = await start_router(registry, tracer_provider=provider)
    if nodes is None:
        nodes = [
            (PREFILL[0], reg_pb.NODE_ROLE_PREFILL, PREFILL[1]),
            (DECODE[0], reg_pb.NODE_ROLE_DECODE, DECODE[1]),
        ]
    for name, role, endpoint in nodes:
        await register(registry, name, role, endpoint)
    settings = EppSettings(
        server=ServerSettings(listen="127.0.0.1:0", health_listen="127.0.0.1:0", grace_seconds=1),
        router=RouterConnection(
            address=router_address or f"127.0.0.1:{router.server.port}", timeout=router_timeout
        ),
        models={MODEL: ModelSettings(tokenizer=model_dir)},
        cache_salt_key=SecretStr(CACHE_SALT_KEY),
        **overrides,
    )
    metrics = CollectorRegistry()
    epp = EppServer(
        settings,
        tracer_provider=provider,
        metrics_registry=metrics,
        tokenizers={MODEL: tokenizer},
        max_plan_header_bytes=max_plan_header_bytes,
    )
    port = await epp.start()
    address = f"127.0.0.1:{port}"
    return EppCluster(registry, router, epp, Envoy(address), address, exporter, provider, metrics)


async def stop_epp(c: EppCluster) -> None:
    await c.envoy.close()
    await c.epp.stop()
    await c.router.close()
    await c.registry.channel.close()
    c.registry.registry.close()
    await c.registry.server.stop()
    shutdown_tracing(c.provider)


async def epp_fixture(model_dir: Path, tokenizer: ChatTokenizer, **kw: Any) -> AsyncIterator[EppCluster]:
    c = await start_epp(model_dir, tokenizer, **kw)
    try:
        yield c
    finally:
        await stop_epp(c)
