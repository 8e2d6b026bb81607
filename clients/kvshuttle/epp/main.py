"""`kvshuttle-epp`: kvshuttle's endpoint picker for an Envoy-based gateway's InferencePool.

Builds its settings, logs them (secrets redacted), loads every model's tokenizer (a bad
directory fails here, before anything is bound), connects to the router and serves
envoy.service.ext_proc.v3.ExternalProcessor with gRPC health (`liveness`, `readiness` and the
ext_proc service's name, as the endpoint picker protocol names them; SERVING once started,
NOT_SERVING while stopping) until SIGTERM or SIGINT, then drains (server.grace_seconds).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import REGISTRY, CollectorRegistry

from kvshuttle.core.auth import Permission
from kvshuttle.epp.config import EppSettings
from kvshuttle.epp.metrics import EppMetrics
from kvshuttle.epp.picker import Picker
from kvshuttle.epp.servicer import SERVICE_NAME, ExternalProcessor
from kvshuttle.gateway.affinity import affinity_key
from kvshuttle.gateway.parsing import check_parsers
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.gateway.turns.background import BackgroundTasks
from kvshuttle.gateway.turns.router_port import GrpcRouterPort
from kvshuttle.serving.auth import MethodPolicy, Requirement, unknown_method
from kvshuttle.serving.logging import configure_logging
from kvshuttle.serving.server import GrpcServer, wait_for_signal
from kvshuttle.serving.tracing import configure_tracing, shutdown_tracing

__all__ = ["HEALTH_NAMES", "EppServer", "main"]

PROCESS_NAME = "kvshuttle-epp"
# The health services the endpoint picker protocol names, besides the ext_proc service's own.
HEALTH_NAMES = ("liveness", "readiness")

log = structlog.get_logger("kvshuttle.epp")


def _policy(tenant: str) -> MethodPolicy:
    """Envoy's identity plans turns for the pool's tenant, as a gateway does."""

    def requirement(method: str, request: object) -> Requirement:
        if method != "Process":
            raise unknown_method(method)
        return Requirement(Permission.TURNS, tenant=tenant)

    return requirement


class EppServer:
    """The picker's gRPC server. `start()` binds (port 0 picks one) and connects to the router,
    `stop()` drains; `serve_until_signal()` is both around SIGTERM/SIGINT. Without
    `tracer_provider` tracing is configured from the settings; `tokenizers` replaces loading
    them (tests)."""

    def __init__(
        self,
        settings: EppSettings,
        *,
        tracer_provider: TracerProvider | None = None,
        metrics_registry: CollectorRegistry | None = None,
        tokenizers: Mapping[str, ChatTokenizer] | None = None,
        max_plan_header_bytes: int | None = None,
    ) -> None:
        self.settings = settings
        # One provider for the server's spans, the picks' and the router calls'.
        self._owns_provider = tracer_provider is None
        provider = (
            configure_tracing(settings.telemetry, PROCESS_NAME)
            if tracer_provider is None
            else tracer_provider
        )
        self._provider = provider
        registry = REGISTRY if metrics_registry is None else metrics_registry
        self.metrics = EppMetrics(registry)
        loaded = (
            dict(tokenizers)
            if tokenizers is not None
            else {
                name: ChatTokenizer.load(
                    name,
                    model,
                    cache_bytes=settings.tokenizer_cache_bytes,
                    verify_fraction=settings.tokenizer_verify_fraction,
                )
                for name, model in settings.models.items()
            }
        )
        for name, m in settings.models.items():  # a parser whose tokens the model lacks: fail now
            check_parsers(m.tool_call_parser, m.reasoning_parser, loaded[name].tokenizer.token_to_id)
        key = None if settings.cache_salt_key is None else settings.cache_salt_key.get_secret_value().encode()
        self.router = GrpcRouterPort(
            settings.router,
            tracer_provider=provider,
            metrics=self.metrics,
            affinity_key=affinity_key(key),
        )
        self.background = BackgroundTasks()
        extra = {} if max_plan_header_bytes is None else {"max_plan_header_bytes": max_plan_header_bytes}
        self.picker = Picker(
            settings,
            tokenizers=loaded,
            router=self.router,
            metrics=self.metrics,
            tracer=provider.get_tracer("kvshuttle.epp"),
            background=self.background,
            **extra,
        )
        servicer = ExternalProcessor(self.picker, self.metrics, max_request_bytes=settings.max_request_bytes)
        self.server = GrpcServer(
            settings.server,
            settings.telemetry,
            service_name=PROCESS_NAME,
            domain="epp.kvshuttle",
            register=lambda server: ext_grpc.add_ExternalProcessorServicer_to_server(servicer, server),
            service_names=[SERVICE_NAME],
            health_names=HEALTH_NAMES,
            registry=registry,
            tracer_provider=provider,
            auth=settings.auth,
            policy=_policy(settings.tenant) if settings.auth.enabled else None,
        )

    async def start(self) -> int:
        self.router.connect()
        port = await self.server.start()
        log.info(
            "epp.started",
            port=port,
            router=self.settings.router.address,
            router_affinity="round_robin" if self.router.replicas is None else "conversation",
            models=sorted(self.settings.models),
            tenant=self.settings.tenant,
        )
        return port

    async def stop(self) -> None:
        await self.server.stop()
        # Aborts of plans not sent on may still be in flight.
        try:
            async with asyncio.timeout(self.settings.router.timeout + 1):
                await self.background.settle()
        except TimeoutError:
            log.warning("epp.background_left", tasks=len(self.background))
        await self.router.close()
        if self._owns_provider:
            await asyncio.to_thread(shutdown_tracing, self._provider)

    async def serve_until_signal(self) -> None:
        await self.start()
        try:
            log.info("epp.signal", signal=(await wait_for_signal()).name)
        finally:
            await self.stop()


def main() -> None:
    settings = EppSettings()
    configure_logging(settings.telemetry)
    log.info("epp.config", **settings.model_dump(mode="json"))  # SecretStr dumps as "**********"
    asyncio.run(EppServer(settings).serve_until_signal())


if __name__ == "__main__":
    main()
