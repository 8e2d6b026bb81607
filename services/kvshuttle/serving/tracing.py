"""OpenTelemetry for the services: a TracerProvider and the client interceptors built on it
(the server span is RpcInterceptor's).

OTel lets a process set its global TracerProvider once (a second set_tracer_provider is
refused with a warning). So each configure_tracing call builds its own provider, makes the
first one global (what production runs, and what code using trace.get_tracer() reaches), and
the gRPC interceptors take the provider explicitly. Tests therefore get a fresh provider with
their own exporter every time; spans they want to see must come from that provider (through
these interceptors or provider.get_tracer()), not from the global one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc.aio
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.grpc import aio_client_interceptors
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

from kvshuttle.serving.settings import TelemetrySettings

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


def configure_tracing(
    settings: TelemetrySettings, service_name: str, *, exporter: SpanExporter | None = None
) -> TracerProvider:
    """A provider named settings.service_name or `service_name`, exporting to the OTLP endpoint
    when one is set (batched) and to `exporter` when given (synchronously: tests read it at once)."""
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: settings.service_name or service_name}))
    if settings.otlp_endpoint:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        trace.set_tracer_provider(provider)
    return provider


def client_tracing_interceptors(provider: TracerProvider) -> list[grpc.aio.ClientInterceptor]:
    """The client span of each outgoing RPC, with the trace context propagated in its metadata.

    Pass them as `interceptors=` when opening a grpc.aio channel (they must stay in this order).
    """
    interceptors: list[grpc.aio.ClientInterceptor] = aio_client_interceptors(  # type: ignore[no-untyped-call]
        tracer_provider=provider
    )
    return [*interceptors, _CancelUnaryCall()]


class _CancelUnaryCall(grpc.aio.UnaryUnaryClientInterceptor):
    """Makes cancelling a traced unary call cancel the RPC.

    The instrumentation's unary interceptor waits on call.code(), and a cancellation abandons
    that wait but not the RPC (opentelemetry-python-contrib#3271): call.cancel(), task.cancel()
    or asyncio.wait_for would leave the server working for nobody (a grpc timeout= still works).
    Placed inside it, this one waits on the call itself, which grpc cancels along with the task.
    """

    async def intercept_unary_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, _Request], Awaitable[grpc.aio.UnaryUnaryCall[_Request, _Response]]
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request: _Request,
    ) -> grpc.aio.UnaryUnaryCall[_Request, _Response]:
        call = await continuation(client_call_details, request)
        # A failed call keeps its status; the caller (and the instrumentation) read it from the call.
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call
        return call


def shutdown_tracing(provider: TracerProvider) -> None:
    """Export what is buffered, then stop the provider's processors.

    Shutting the batch processor down exports its queue; a separate force_flush first would
    only try twice. With the collector unreachable this blocks for up to the exporter's timeout
    (10 s unless OTEL_EXPORTER_OTLP_TRACES_TIMEOUT says otherwise): from async code run it with
    asyncio.to_thread.
    """
    provider.shutdown()
