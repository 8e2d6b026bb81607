"""OpenTelemetry for the services: their TracerProvider. Spans of calls come from the
services' own code: RpcInterceptor makes the server span, the client library the client
span (ChannelOptions.tracer_provider).

OTel lets a process set its global TracerProvider once (a second set_tracer_provider is
refused with a warning). So each configure_tracing call builds its own provider, makes the
first one global (what production runs, and what code using trace.get_tracer() reaches), and
the servers and clients take the provider explicitly. Tests therefore get a fresh provider with
their own exporter every time; spans they want to see must come from that provider, not from
the global one.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

from kvshuttle.serving.settings import TelemetrySettings


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


def shutdown_tracing(provider: TracerProvider) -> None:
    """Export what is buffered, then stop the provider's processors.

    Shutting the batch processor down exports its queue; a separate force_flush first would
    only try twice. With the collector unreachable this blocks for up to the exporter's timeout
    (10 s unless OTEL_EXPORTER_OTLP_TRACES_TIMEOUT says otherwise): from async code run it with
    asyncio.to_thread.
    """
    provider.shutdown()
