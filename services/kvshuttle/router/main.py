"""`kvshuttle-router`: the router service process.

Builds its settings, logs them (the signing key redacted), loads the model profiles, connects
to the registry (client spans join each turn's trace), and serves RouterService until SIGTERM
or SIGINT. With policy.parking on, the shuttle runs beside it as a supervised task (restarted
after a crash), and its moves in flight get the server's grace to finish at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Sequence

import grpc
import structlog
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import REGISTRY, CollectorRegistry

from kvshuttle.client.registry import RegistryClient
from kvshuttle.core.clock import Clock, SystemClock
from kvshuttle.router.config import RouterSettings
from kvshuttle.router.cost import CostModel, ModelProfile, load_profiles
from kvshuttle.router.grpc.agent_port import GrpcAgentPort
from kvshuttle.router.grpc.authz import turn_policy
from kvshuttle.router.grpc.registry_port import GrpcRegistryPort
from kvshuttle.router.grpc.servicer import RouterServicer
from kvshuttle.router.metrics import RouterMetrics
from kvshuttle.router.ports import AgentPort, RegistryPort
from kvshuttle.router.router import Router
from kvshuttle.router.turns import TurnCodec
from kvshuttle.router.v1 import router_service_pb2, router_service_pb2_grpc
from kvshuttle.serving.logging import configure_logging
from kvshuttle.serving.server import GrpcServer
from kvshuttle.serving.tracing import configure_tracing, shutdown_tracing

SERVICE = router_service_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
ERROR_DOMAIN = "router.kvshuttle"
SERVICE_NAME = "kvshuttle-router"

log = structlog.get_logger("kvshuttle.router")


def profiles(settings: RouterSettings) -> list[ModelProfile]:
    """The file's profiles, then the inline ones; ValueError when a model is named twice."""
    found = [*(load_profiles(settings.profiles_file) if settings.profiles_file else ()), *settings.profiles]
    seen: set[str] = set()
    for profile in found:
        if profile.model in seen:
            raise ValueError(f"model profile {profile.model!r} is configured twice")
        seen.add(profile.model)
    return found


def signing_key(settings: RouterSettings) -> bytes:
    if settings.turn_signing_key is not None:
        return settings.turn_signing_key.get_secret_value().encode()
    log.warning(
        "router.ephemeral_turn_signing_key",
        detail="no turn_signing_key set: turn handles are signed with a random per-process key; "
        "several replicas need one shared key (KVSHUTTLE_ROUTER_TURN_SIGNING_KEY), or a turn "
        "committed on another replica than its plan's is NOT_FOUND",
    )
    return secrets.token_bytes(32)


def connect_registry(settings: RouterSettings, tracer_provider: TracerProvider) -> RegistryClient:
    """A registry client whose calls carry the current span (a turn's registry calls join it)."""
    options = settings.registry.channel_options()
    return RegistryClient.connect(options, tracer_provider=tracer_provider)


def build_router(
    settings: RouterSettings,
    port: RegistryPort,
    clock: Clock,
    metrics_registry: CollectorRegistry = REGISTRY,
    *,
    tracer_provider: TracerProvider | None = None,
    model_profiles: Sequence[ModelProfile] | None = None,
    agents: AgentPort | None = None,
) -> Router:
    """The router domain object. `model_profiles` replaces the settings' profiles (tests)."""
    return Router(
        port,
        clock,
        [CostModel(p) for p in (profiles(settings) if model_profiles is None else model_profiles)],
        TurnCodec(signing_key(settings)),
        settings.policy,
        RouterMetrics(metrics_registry),
        tracer_provider=tracer_provider,
        agents=agents,
    )


def wants_agents(settings: RouterSettings) -> bool:
    """Whether the router calls agents: parking or prefetch is on."""
    parking = settings.policy.parking
    return parking.enabled or parking.prefetch_enabled


async def supervise_shuttle(router: Router, *, restart_s: float = 1.0) -> None:
    """The shuttle's loop, restarted after a crash (logged) until cancelled."""
    while True:
        try:
            await router.run_shuttle()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("router.shuttle_crashed", restart_in=restart_s)
            await asyncio.sleep(restart_s)


def build_server(
    settings: RouterSettings,
    router: Router,
    prometheus: CollectorRegistry = REGISTRY,
    *,
    tracer_provider: TracerProvider | None = None,
) -> GrpcServer:
    def register(server: grpc.aio.Server) -> None:
        router_service_pb2_grpc.add_RouterServiceServicer_to_server(RouterServicer(router), server)

    return GrpcServer(
        settings.server,
        settings.telemetry,
        service_name=SERVICE_NAME,
        domain=ERROR_DOMAIN,
        register=register,
        service_names=[SERVICE],
        registry=prometheus,
        tracer_provider=tracer_provider,
        auth=settings.auth,
        policy=turn_policy(router.codec),
    )


async def serve(settings: RouterSettings) -> None:
    model_profiles = profiles(settings)  # a bad file fails here, before anything is bound
    log.info("router.profiles", models=[p.model for p in model_profiles])
    # One provider for the server's spans, the domain's and the registry calls'.
    provider = configure_tracing(settings.telemetry, SERVICE_NAME)
    client = connect_registry(settings, provider)
    agents = GrpcAgentPort(settings.agents, tracer_provider=provider) if wants_agents(settings) else None
    shuttle: asyncio.Task[None] | None = None
    router: Router | None = None
    try:
        router = build_router(
            settings,
            GrpcRegistryPort(client),
            SystemClock(),
            tracer_provider=provider,
            model_profiles=model_profiles,
            agents=agents,
        )
        if router.shuttle is not None:
            shuttle = asyncio.create_task(supervise_shuttle(router), name="router.shuttle")
        await build_server(settings, router, tracer_provider=provider).serve_until_signal()
    finally:
        if shuttle is not None:
            shuttle.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await shuttle
        if router is not None and router.shuttle is not None:
            # Moves in flight finish within the server's grace (cut short, a claim lapses).
            await router.shuttle.close(settings.server.grace_seconds)
        if agents is not None:
            await agents.close()
        await client.close()
        await asyncio.to_thread(shutdown_tracing, provider)


def main() -> None:
    settings = RouterSettings()
    configure_logging(settings.telemetry)
    log.info("router.config", **settings.model_dump(mode="json"))  # SecretStr dumps as "**********"
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
