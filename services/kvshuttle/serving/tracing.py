"""OpenTelemetry for the services: their TracerProvider. Spans of calls come from the
services' own code: RpcInterceptor makes the server span, the client library the client
span (ChannelOptions.tracer_provider).

OTel lets a process set its global TracerProvider once (a second set_tracer_provider is
refused with a warning). So each configure_tracing call builds its own provider, makes the
first one global (what production runs, and what code using trace.get_tracer() reaches), and
the servers and clients take the provider explicitly. Tests therefore get a fresh provider with
their own exporter every time; spans they want to see must come from that provider, not from
the global one.

A provider with no span processor (no OTLP endpoint, no exporter: nothing is exported) gives
spans that record nothing: each still gets the ids and the sampled flag the SDK would give it
(its log lines carry them, the calls made under it pass them on), without the attributes,
events and timing no one would read (issue 21: ~20 µs a span, about a dozen spans a turn).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import SpanKind, TraceFlags
from opentelemetry.util.types import Attributes

from kvshuttle.serving.settings import TelemetrySettings


def configure_tracing(
    settings: TelemetrySettings, service_name: str, *, exporter: SpanExporter | None = None
) -> TracerProvider:
    """A provider named settings.service_name or `service_name`, exporting to the OTLP endpoint
    when one is set (batched) and to `exporter` when given (synchronously: tests read it at once)."""
    provider = _Provider(resource=Resource.create({SERVICE_NAME: settings.service_name or service_name}))
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


class _Provider(TracerProvider):
    """The SDK's provider, whose tracers record spans only once a span processor is added."""

    exports = False

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        self.exports = True

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Attributes | None = None,
    ) -> trace.Tracer:
        sdk = super().get_tracer(
            instrumenting_module_name, instrumenting_library_version, schema_url, attributes
        )
        return _UnexportedTracer(self, sdk)


class _UnexportedTracer(trace.Tracer):
    """Spans of ids only while the provider exports nothing; the SDK's spans once it does."""

    def __init__(self, provider: _Provider, sdk: trace.Tracer) -> None:
        self._provider = provider
        self._sdk = sdk

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[trace.Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        provider = self._provider
        if provider.exports:
            return self._sdk.start_span(
                name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception
            )
        # As the SDK's tracer: the parent's trace or a new one, the sampler's flag and state.
        parent = trace.get_current_span(context).get_span_context()
        trace_id = parent.trace_id if parent.is_valid else provider.id_generator.generate_trace_id()
        sampling = provider.sampler.should_sample(context, trace_id, name, kind, attributes, links)
        flags = TraceFlags(
            TraceFlags.SAMPLED if sampling.decision == Decision.RECORD_AND_SAMPLE else TraceFlags.DEFAULT
        )
        span_id = provider.id_generator.generate_span_id()
        return trace.NonRecordingSpan(
            trace.SpanContext(trace_id, span_id, False, flags, sampling.trace_state)
        )

    @contextmanager
    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[trace.Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        span = self.start_span(
            name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception
        )
        with trace.use_span(span, end_on_exit, record_exception, set_status_on_exception) as current:
            yield current
