"""configure_tracing: naming, the one global provider, and export on shutdown."""

from __future__ import annotations

from opentelemetry import trace
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
