"""The lifecycle of one service's grpc.aio server, the same for every service: interceptors,
health (also on a plaintext health-only port when asked), reflection, TLS (its files re-read
once they change: kvshuttle.serving.server_tls), the Prometheus endpoint, and a graceful stop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Sequence

import grpc
import grpc.aio
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from kvshuttle.serving.auth import Authorizer, MethodPolicy
from kvshuttle.serving.health_port import ServiceHealth, health_only_server
from kvshuttle.serving.interceptor import RpcInterceptor
from kvshuttle.serving.metrics import RpcMetrics
from kvshuttle.serving.server_tls import ReloadingServerCertificates
from kvshuttle.serving.settings import AuthSettings, ServerSettings, TelemetrySettings
from kvshuttle.serving.telemetry import Telemetry

_log = structlog.get_logger("kvshuttle.serving")


class GrpcServer:
    """One service's server. Typical main(): configure_logging, then
    `asyncio.run(GrpcServer(...).serve_until_signal())`.

    `register` adds the service's servicers; `service_names` (fully qualified, e.g.
    "kvshuttle.registry.v1.RegistryService") are what health reports on and reflection lists;
    `health_names` are further names health alone reports on, with the same status (a protocol's
    own probe names, such as the endpoint picker's "liveness" and "readiness").
    Without `tracer_provider` the server configures tracing from `telemetry` itself and shuts
    that provider down on stop; a provider passed in is only flushed. Without `registry` the
    metrics go to prometheus_client's default registry (so one GrpcServer per process then).
    `on_stopping` runs once health reports NOT_SERVING, before in-flight RPCs are drained.
    With `settings.health_listen`, a second, plaintext listener serves health alone from the
    same state (NOT_SERVING there too while stopping); it starts and stops with the server.

    `auth` with identities: every call is authenticated and authorized by `policy` (required
    then). Without identities, or without TLS, the server binds only a loopback address unless
    `auth.insecure` is set (warned at every start).
    """

    def __init__(
        self,
        settings: ServerSettings,
        telemetry: TelemetrySettings,
        *,
        service_name: str,
        domain: str,
        register: Callable[[grpc.aio.Server], None],
        service_names: Sequence[str],
        health_names: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
        tracer_provider: TracerProvider | None = None,
        on_stopping: Callable[[], None] | None = None,
        auth: AuthSettings | None = None,
        policy: MethodPolicy | None = None,
    ) -> None:
        self._settings = settings
        self._auth = auth or AuthSettings()
        if self._auth.enabled and policy is None:
            raise ValueError("a server with identities needs the service's policy")
        self._authorizer = Authorizer(self._auth, policy) if self._auth.enabled and policy else None
        self._domain = domain
        self._register = register
        self._on_stopping = on_stopping
        self._service_names = tuple(service_names)
        self._telemetry = Telemetry(
            telemetry, service_name, registry=registry, tracer_provider=tracer_provider
        )
        self._metrics = RpcMetrics(self._telemetry.registry)
        self._server: grpc.aio.Server | None = None
        self._health_names = (health.OVERALL_HEALTH, *self._service_names, *health_names)
        self._health = ServiceHealth(self._health_names)
        self._port: int | None = None
        self._health_server: grpc.aio.Server | None = None
        self._health_port: int | None = None
        # The main port's certificate files, when it serves TLS (set at start).
        self.tls_files: ReloadingServerCertificates | None = None

    @property
    def port(self) -> int | None:
        """The bound gRPC port once started (useful with listen port 0)."""
        return self._port

    @property
    def health_port(self) -> int | None:
        """The bound health-only port once started, None when health_listen is off."""
        return self._health_port

    @property
    def metrics_port(self) -> int | None:
        """The bound /metrics port once started, None when metrics_listen is off."""
        return self._telemetry.metrics_port

    async def start(self) -> int:
        """Bind, start serving, report SERVING; returns the bound port."""
        self._check_exposure()
        # Created here, not in __init__: a grpc.aio server belongs to the loop it is made on.
        server = grpc.aio.server(
            interceptors=[
                RpcInterceptor(
                    self._domain,
                    self._metrics,
                    tracer_provider=self._telemetry.provider,
                    probes=frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME}),
                    authorizer=self._authorizer,
                    max_request_bytes=self._settings.max_receive_message_bytes,
                )
            ],
            options=[
                # The interceptor refuses what is over the limit with an ErrorInfo; grpc's own
                # refusal (none) only past twice that, which bounds the memory of one request.
                ("grpc.max_receive_message_length", 2 * self._settings.max_receive_message_bytes),
                # grpc sets SO_REUSEPORT by default, which lets a second server bind a port that is
                # in use and silently share its traffic; fail loudly instead.
                ("grpc.so_reuseport", 0),
            ],
        )
        self._register(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        port = self._bind(server)
        health_server, health_port = None, None
        if self._settings.health_listen is not None:
            # Plaintext beyond loopback whatever the main port's TLS and auth (_check_exposure
            # guards the main port): health carries no data (health_port.health_only_server).
            health_server, health_port = health_only_server(self._health, self._settings.health_listen)
        self._telemetry.start_metrics()
        await server.start()
        if health_server is not None:
            await health_server.start()
        self._server, self._port = server, port
        self._health_server, self._health_port = health_server, health_port
        for name in self._health_names:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        _log.info(
            "server.started",
            listen=self._settings.listen,
            port=port,
            tls=self._settings.tls,
            mtls=self._settings.tls_client_ca_file is not None,
            auth=self._authorizer is not None,
            metrics_port=self.metrics_port,
            health_listen=self._settings.health_listen,
            health_port=health_port,
        )
        return port

    def _check_exposure(self) -> None:
        """Refuse to serve beyond loopback without identities and TLS client certificates, unless
        told to; say so at every start when running without authentication."""
        settings, auth = self._settings, self._auth
        protected = auth.enabled and settings.tls  # identities, and their tokens never in clear
        if not settings.loopback and not protected and not auth.insecure:
            raise ValueError(
                f"refusing to listen on {settings.listen} without TLS and configured identities "
                "(set auth.identities and tls_*_file, or auth.insecure to accept the risk)"
            )
        if auth.insecure:
            _log.warning("server.insecure", listen=settings.listen, auth=auth.enabled, tls=settings.tls)
        elif not auth.enabled:
            _log.warning("server.auth_off", listen=settings.listen, reason="no identities configured")

    def _bind(self, server: grpc.aio.Server) -> int:
        settings = self._settings
        if settings.tls_cert_file is None or settings.tls_key_file is None:
            return server.add_insecure_port(settings.listen)
        # Re-read at handshakes once changed: a renewed certificate is served without a restart.
        self.tls_files = ReloadingServerCertificates(
            settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file
        )
        return server.add_secure_port(settings.listen, self.tls_files.credentials())

    async def stop(self) -> None:
        """Report NOT_SERVING, refuse new RPCs and give in-flight ones grace_seconds to finish
        (then cancel them), then flush the spans. Does nothing when not started."""
        server, self._server = self._server, None
        if server is None:
            return
        _log.info("server.stopping", grace_seconds=self._settings.grace_seconds)
        await self._health.enter_graceful_shutdown()
        if self._on_stopping is not None:
            # Ends what would otherwise hold the grace period open (e.g. watch streams).
            self._on_stopping()
        health_server, self._health_server = self._health_server, None
        try:
            await server.stop(self._settings.grace_seconds)
        finally:
            if health_server is not None:
                # Only now: probes see NOT_SERVING, not a refused connection, while RPCs drain.
                # No grace: what is left are probes and Watch streams, which would hold it open.
                await health_server.stop(0)
        await self._telemetry.close()
        _log.info("server.stopped")

    async def serve_until_signal(self) -> None:
        """Start, serve until SIGTERM or SIGINT, then stop gracefully."""
        await self.start()
        try:
            _log.info("server.signal", signal=(await wait_for_signal()).name)
        finally:
            await self.stop()


async def wait_for_signal() -> signal.Signals:
    """The first SIGTERM or SIGINT. Its handlers are removed as it arrives, so a second signal
    ends the process at once (the default action) while a graceful stop runs."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[signal.Signals] = loop.create_future()

    def on_signal(sig: signal.Signals) -> None:
        if not received.done():
            received.set_result(sig)

    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await received
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
