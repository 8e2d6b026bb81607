"""What a service process exports besides its API: its tracer provider and its /metrics endpoint,
started and stopped the same way by every server (the gRPC services and the HTTP gateway)."""

from __future__ import annotations

import asyncio
import threading
from wsgiref.simple_server import WSGIServer

from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from kvshuttle.serving.settings import TelemetrySettings
from kvshuttle.serving.tracing import configure_tracing, shutdown_tracing


class Telemetry:
    """Without `tracer_provider`, tracing is configured from `settings` and shut down by close();
    a provider passed in (tests) is only flushed. Without `registry` the metrics are
    prometheus_client's default registry."""

    def __init__(
        self,
        settings: TelemetrySettings,
        service_name: str,
        *,
        registry: CollectorRegistry | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self._settings = settings
        self.registry = REGISTRY if registry is None else registry
        self._owns_provider = tracer_provider is None
        self.provider = (
            configure_tracing(settings, service_name) if tracer_provider is None else tracer_provider
        )
        self._metrics_http: tuple[WSGIServer, threading.Thread] | None = None

    @property
    def metrics_port(self) -> int | None:
        """The bound /metrics port once started, None when metrics_listen is off."""
        return None if self._metrics_http is None else int(self._metrics_http[0].server_port)

    def start_metrics(self) -> None:
        """Serve /metrics on settings.metrics_listen, when it is set."""
        if self._settings.metrics_listen:
            host, _, port = self._settings.metrics_listen.rpartition(":")
            self._metrics_http = start_http_server(int(port), host.strip("[]"), self.registry)

    async def close(self) -> None:
        """Stop /metrics, then export (or flush) the buffered spans."""
        if self._metrics_http is not None:
            httpd, thread = self._metrics_http
            self._metrics_http = None
            await asyncio.to_thread(httpd.shutdown)  # waits for its poll loop (up to 0.5 s)
            httpd.server_close()
            thread.join()
        if self._owns_provider:
            await asyncio.to_thread(shutdown_tracing, self.provider)
        else:
            await asyncio.to_thread(self.provider.force_flush)
