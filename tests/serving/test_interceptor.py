"""RpcInterceptor through a real server: what a client sees, the one log line, the span, the metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import grpc
import grpc.aio
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode as SpanStatusCode
from prometheus_client import CollectorRegistry
from tests.serving.echo import DOMAIN, SERVICE, EchoServicer, JsonLog, Request, register, unary

from kvshuttle.client.tracing import traced_attempt
from kvshuttle.serving.interceptor import INTERNAL_MESSAGE
from kvshuttle.serving.server import GrpcServer
from kvshuttle.serving.settings import ServerSettings, TelemetrySettings
from kvshuttle.serving.tracing import configure_tracing


@dataclass
class Harness:
    servicer: EchoServicer
    channel: grpc.aio.Channel
    spans: InMemorySpanExporter
    registry: CollectorRegistry
    log: JsonLog
    provider: TracerProvider

    async def unary(self, method: str, request: Any, deadline_s: float | None = None) -> Any:
        return await unary(self.channel, method)(request, timeout=deadline_s)

    def stream(self, request: Any, method: str = "Count") -> grpc.aio.UnaryStreamCall[Any, Any]:
        call = self.channel.unary_stream(
            f"/{SERVICE}/{method}",
            request_serializer=Request.SerializeToString,
            response_deserializer=Request.FromString,
        )
        return call(request)

    async def done_once(self, method: str) -> dict[str, Any]:
        return await self.log.done_once(method)

    def done(self, method: str) -> list[dict[str, Any]]:
        return self.log.done(method)

    async def server_span(self) -> ReadableSpan:
        """The one finished server span, waiting for it: on an error the client has its status
        once the server aborts, and the server's span ends only after that, as its task unwinds."""
        for _ in range(200):
            if found := [s for s in self.spans.get_finished_spans() if s.kind.name == "SERVER"]:
                (span,) = found
                return span
            await asyncio.sleep(0.01)
        raise AssertionError("no finished server span")

    def count(self, method: str, code: str) -> float | None:
        return self.registry.get_sample_value(
            "kvshuttle_rpc_total", {"service": SERVICE, "method": method, "code": code}
        )


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    spans = InMemorySpanExporter()
    provider = configure_tracing(TelemetrySettings(), "kvshuttle-test", exporter=spans)
    servicer = EchoServicer()
    registry = CollectorRegistry()
    log = JsonLog()
    server = GrpcServer(
        ServerSettings(listen="127.0.0.1:0", grace_seconds=1.0),
        TelemetrySettings(),
        service_name="kvshuttle-test",
        domain=DOMAIN,
        register=register(servicer),
        service_names=[SERVICE],
        registry=registry,
        tracer_provider=provider,
    )
    port = await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield Harness(servicer, channel, spans, registry, log, provider)
    servicer.release.set()
    await server.stop()
    log.close()


async def failure(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def error_info(err: grpc.aio.AioRpcError) -> Any:
    status = rpc_status.from_call(cast(grpc.Call, err))  # AioRpcError has the methods it reads
    assert status is not None, "no google.rpc.Status in the trailers"
    assert len(status.details) == 1
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info


async def test_ok_logs_one_line_with_ids_and_bound_fields(harness: Harness) -> None:
    response = await harness.unary("Echo", Request(request_id="req-1", serving_data="hello"))

    assert response.serving_data == "hello"
    line = await harness.done_once("Echo")
    assert line["code"] == "OK"
    assert line["level"] == "info"
    assert isinstance(line["ms"], float)
    assert line["rpc_service"] == SERVICE
    assert line["rpc_method"] == "Echo"
    assert line["request_id"] == "req-1"
    assert line["echoed"] == "hello"
    assert line["peer"].startswith("ipv4:127.0.0.1:")
    assert "reason" not in line
    assert harness.count("Echo", "OK") == 1.0


async def test_lines_follow_a_new_logging_configuration(harness: Harness) -> None:
    # The interceptor keeps its assembled logger between calls: it must not keep the old stream.
    await harness.unary("Echo", Request(request_id="req-1", serving_data="first"))
    await harness.done_once("Echo")
    later = JsonLog()
    try:
        await harness.unary("Echo", Request(request_id="req-2", serving_data="second"))
        line = await later.done_once("Echo")
    finally:
        later.close()
    assert line["request_id"] == "req-2"
    assert len(harness.log.done("Echo")) == 1


async def test_trace_ids_in_the_line_are_the_server_span(harness: Harness) -> None:
    # A traced caller, as the client library makes it: its span's context in the metadata.
    with traced_attempt(harness.provider.get_tracer("test"), f"/{SERVICE}/Echo") as (_, metadata):
        await unary(harness.channel, "Echo")(Request(request_id="req-2"), metadata=metadata)

    line = await harness.done_once("Echo")
    spans = {span.kind.name: span for span in harness.spans.get_finished_spans()}
    server_span, client_span = spans["SERVER"], spans["CLIENT"]
    assert server_span.name == f"/{SERVICE}/Echo"
    assert line["trace_id"] == f"{server_span.context.trace_id:032x}"
    assert line["span_id"] == f"{server_span.context.span_id:016x}"
    # One trace across the hop: the client's context reached the server.
    assert client_span.context.trace_id == server_span.context.trace_id


async def test_not_found_carries_error_info(harness: Harness) -> None:
    err = await failure(harness.unary("Missing", Request()))

    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details() == "no thing named x"
    info = error_info(err)
    assert (info.reason, info.domain, dict(info.metadata)) == ("THING_NOT_FOUND", DOMAIN, {"name": "x"})
    line = await harness.done_once("Missing")
    assert (line["code"], line["reason"], line["level"]) == ("NOT_FOUND", "THING_NOT_FOUND", "info")
    assert harness.count("Missing", "NOT_FOUND") == 1.0
    # The span has the code too (its status stays UNSET: by the semantic conventions a
    # NOT_FOUND is no server error).
    server_span = await harness.server_span()
    assert server_span.attributes is not None
    assert server_span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]


async def test_invalid_argument_names_the_field(harness: Harness) -> None:
    err = await failure(harness.unary("Invalid", Request()))

    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "a.b: too long"
    info = error_info(err)
    assert (info.reason, info.domain, dict(info.metadata)) == ("INVALID_ARGUMENT", DOMAIN, {"field": "a.b"})
    assert (await harness.done_once("Invalid"))["code"] == "INVALID_ARGUMENT"


async def test_unexpected_exception_is_internal_and_leaks_nothing(harness: Harness) -> None:
    err = await failure(harness.unary("Boom", Request()))

    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == INTERNAL_MESSAGE
    assert "hunter2" not in str(err.trailing_metadata())
    assert "hunter2" not in (err.debug_error_string() or "")
    line = await harness.done_once("Boom")
    assert (line["code"], line["level"]) == ("INTERNAL", "error")
    assert "RuntimeError: secret" in line["exception"]
    assert "Traceback" in line["exception"]
    server_span = await harness.server_span()
    assert server_span.status.status_code == SpanStatusCode.ERROR
    assert any(
        e.attributes and e.attributes.get("exception.type") == "RuntimeError" for e in server_span.events
    )
    assert harness.count("Boom", "INTERNAL") == 1.0


async def test_handlers_own_abort_is_kept(harness: Harness) -> None:
    err = await failure(harness.unary("Refuse", Request()))

    assert (err.code(), err.details()) == (grpc.StatusCode.PERMISSION_DENIED, "not yours")
    line = await harness.done_once("Refuse")
    assert (line["code"], line["details"]) == ("PERMISSION_DENIED", "not yours")


@pytest.mark.parametrize("how", ["call.cancel", "task.cancel"])
async def test_client_cancel_reaches_the_server(harness: Harness, how: str) -> None:
    call = unary(harness.channel, "Slow")(Request())
    task = asyncio.ensure_future(call)
    await harness.servicer.entered.wait()
    if how == "call.cancel":
        call.cancel()
    else:
        task.cancel()

    # The traced channel used to drop this on the floor: the server never heard of it.
    assert (await harness.done_once("Slow"))["code"] == "CANCELLED"
    assert harness.count("Slow", "CANCELLED") == 1.0
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_deadline_is_logged_as_deadline_exceeded(harness: Harness) -> None:
    err = await failure(harness.unary("Slow", Request(), deadline_s=0.1))

    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (await harness.done_once("Slow"))["code"] == "DEADLINE_EXCEEDED"


async def test_stream_logs_once_when_it_ends(harness: Harness) -> None:
    responses = [r.serving_data async for r in harness.stream(Request(request_id="s-1", serving_data="3"))]

    assert responses == ["0", "1", "2"]
    line = await harness.done_once("Count")
    assert (line["code"], line["request_id"]) == ("OK", "s-1")
    assert harness.count("Count", "OK") == 1.0


async def test_stream_failing_midway_carries_error_info(harness: Harness) -> None:
    call = harness.stream(Request(request_id="fail", serving_data="3"))
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for response in call:
            received.append(response.serving_data)

    assert received == ["0"]
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(caught.value).reason == "STREAM_GONE"
    line = await harness.done_once("Count")
    assert (line["code"], line["reason"]) == ("NOT_FOUND", "STREAM_GONE")


async def test_stream_cancelled_by_the_client_logs_cancelled(harness: Harness) -> None:
    call = harness.stream(Request(request_id="flood-1"), method="Flood")
    for _ in range(2):
        await call.read()

    # The server is blocked sending (flow control), not inside the handler: grpc closes the
    # generator rather than cancelling it, and the line must still come, with its ids.
    call.cancel()

    line = await harness.done_once("Flood")
    assert (line["code"], line["request_id"]) == ("CANCELLED", "flood-1")


async def test_one_line_per_rpc(harness: Harness) -> None:
    for _ in range(3):
        await harness.unary("Echo", Request())
    await failure(harness.unary("Missing", Request()))

    assert len(harness.done("Echo")) == 3
    assert len(harness.done("Missing")) == 1
    assert harness.count("Echo", "OK") == 3.0
    assert (
        harness.registry.get_sample_value(
            "kvshuttle_rpc_duration_seconds_count", {"service": SERVICE, "method": "Echo"}
        )
        == 3.0
    )


async def test_ids_do_not_leak_into_the_next_call(harness: Harness) -> None:
    await harness.unary("Echo", Request(request_id="first", serving_data="x"))
    await failure(harness.unary("Missing", Request()))

    line = await harness.done_once("Missing")
    assert "request_id" not in line
    assert "echoed" not in line


async def test_health_checks_are_logged_but_not_traced(harness: Harness) -> None:
    check = harness.channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    answer = await check(health_pb2.HealthCheckRequest(service=SERVICE))
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    line = await harness.done_once("Check")
    assert line["code"] == "OK" and "trace_id" not in line
    assert harness.spans.get_finished_spans() == ()


def raw_echo(harness: Harness) -> Any:
    """Echo with the request's bytes sent as they are (no client-side serialization)."""
    return harness.channel.unary_unary(
        f"/{SERVICE}/Echo", request_serializer=lambda b: b, response_deserializer=Request.FromString
    )


async def test_undecodable_request_is_invalid_argument_with_its_line(harness: Harness) -> None:
    err = await failure(raw_echo(harness)(b"\xff\xff\xff\xff garbage"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(err)
    assert (info.reason, info.domain, info.metadata["field"]) == ("INVALID_ARGUMENT", DOMAIN, "request")
    line = await harness.log.done_once("Echo")
    assert (line["code"], line["reason"]) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT")
    assert "echoed" not in line  # the servicer never saw it


async def test_oversized_request_is_resource_exhausted_with_error_info(harness: Harness) -> None:
    limit = ServerSettings().max_receive_message_bytes
    big = Request(request_id="r1", serving_data="x" * (limit + 10)).SerializeToString()
    err = await failure(raw_echo(harness)(big))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(err)
    assert (info.reason, info.metadata["limit"]) == ("MESSAGE_TOO_LARGE", str(limit))
    assert (await harness.log.done_once("Echo"))["code"] == "RESOURCE_EXHAUSTED"


async def test_bytes_on_the_wire_are_counted_per_method(harness: Harness) -> None:
    request = Request(request_id="b-1", serving_data="x" * 300)
    response = await harness.unary("Echo", request)
    await harness.unary("Echo", request)
    replies = [reply async for reply in harness.stream(Request(serving_data="3"))]

    labels = {"service": SERVICE, "method": "Echo"}
    sent = harness.registry.get_sample_value("kvshuttle_rpc_response_bytes_total", labels)
    received = harness.registry.get_sample_value("kvshuttle_rpc_request_bytes_total", labels)
    assert received == 2 * request.ByteSize()
    assert sent == 2 * response.ByteSize()
    count = {"service": SERVICE, "method": "Count"}
    streamed = Request(serving_data="3").ByteSize()
    assert harness.registry.get_sample_value("kvshuttle_rpc_request_bytes_total", count) == streamed
    assert harness.registry.get_sample_value("kvshuttle_rpc_response_bytes_total", count) == sum(
        reply.ByteSize() for reply in replies
    )
