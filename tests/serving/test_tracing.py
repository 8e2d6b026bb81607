"""configure_tracing: naming, the one global provider, and export on shutdown."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvshuttle.serving.settings import TelemetrySettings
from kvshuttle.serving.tracing import configure_tracing, shutdown_tracing


def test_service_name_comes_from_the_caller_unless_settings_override_it() -> None:
    default = configure_tracing(TelemetrySettings(), "kvshuttle-registry")
    override = configure_tracing(TelemetrySettings(service_name="registry-eu"), "kvshuttle-registry")

    assert default.resource.attributes["service.name"] == "kvshuttle-registry"
    assert override.resource.attributes["service.name"] == "registry-eu"


def test_every_call_gets_its_own_provider_and_the_global_one_stays() -> None:
    first = configure_tracing(TelemetrySettings(), "a")
    global_provider = trace.get_tracer_provider()

    second = configure_tracing(TelemetrySettings(), "b")

    assert second is not first
    assert trace.get_tracer_provider() is global_provider  # set once per process, never replaced


def test_spans_reach_the_given_exporter_and_shutdown_stops_export() -> None:
    exporter = InMemorySpanExporter()
    provider = configure_tracing(TelemetrySettings(), "t", exporter=exporter)

    with provider.get_tracer("test").start_as_current_span("plan"):
        pass
    shutdown_tracing(provider)
    with provider.get_tracer("test").start_as_current_span("after"):
        pass

    assert [span.name for span in exporter.get_finished_spans()] == ["plan"]


def test_without_an_exporter_spans_carry_ids_and_the_sampled_flag_and_record_nothing() -> None:
    provider = configure_tracing(TelemetrySettings(), "t")
    tracer = provider.get_tracer("test")

    with tracer.start_as_current_span("turn") as outer:
        inner = tracer.start_span("call")
    first, second = outer.get_span_context(), inner.get_span_context()

    assert not outer.is_recording() and not inner.is_recording()
    assert first.is_valid and first.trace_flags.sampled  # the SDK's default sampler: always on
    assert second.trace_id == first.trace_id and second.span_id != first.span_id
    remote = trace.SpanContext(7, 9, is_remote=True, trace_flags=trace.TraceFlags(trace.TraceFlags.DEFAULT))
    child = tracer.start_span("served", context=trace.set_span_in_context(trace.NonRecordingSpan(remote)))
    assert child.get_span_context().trace_id == 7
    assert not child.get_span_context().trace_flags.sampled  # the caller's decision stands


def test_a_processor_added_later_records_the_spans_of_tracers_made_before() -> None:
    provider = configure_tracing(TelemetrySettings(), "t")
    tracer = provider.get_tracer("test")
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    with tracer.start_as_current_span("plan") as span:
        assert span.is_recording()

    assert [s.name for s in exporter.get_finished_spans()] == ["plan"]
