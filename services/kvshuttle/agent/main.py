"""`kvshuttle-agent`: the sidecar of one vLLM worker.

Builds its settings, logs them, connects to the registry, serves AgentService, then starts the
agent's loops (register + heartbeat, engine polling, KV events); with a block pool, only once
the engine passed its NIXL check (an incompatible engine: exit with the reason). On SIGTERM or SIGINT: stop
receiving, forward what is queued (shutdown_flush_timeout), deregister the node, stop the
server (health NOT_SERVING, in-flight RPCs drained).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import structlog
from prometheus_client import REGISTRY, CollectorRegistry

from kvshuttle.agent import authz
from kvshuttle.agent.agent import Agent
from kvshuttle.agent.config import AgentSettings
from kvshuttle.agent.metrics import AgentCollector
from kvshuttle.agent.registry_port import GrpcRegistryPort
from kvshuttle.agent.servicer import AgentServicer, add_to_server
from kvshuttle.agent.v1 import agent_service_pb2
from kvshuttle.client.registry import RegistryClient
from kvshuttle.core.errors import KvshuttleError
from kvshuttle.serving.logging import configure_logging
from kvshuttle.serving.server import GrpcServer, wait_for_signal

if TYPE_CHECKING:
    from kvshuttle.agent.pool.data_plane import DataPlane

SERVICE = agent_service_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name
ERROR_DOMAIN = "agent.kvshuttle"
SERVICE_NAME = "kvshuttle-agent"

log = structlog.get_logger("kvshuttle.agent")


# gRPC waits up to 120 s between reconnection attempts by default, and calls made meanwhile fail
# at once without trying: an agent would take minutes to see its registry back. Cap the wait.
REGISTRY_RECONNECT = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2000))


def connect_registry(settings: AgentSettings) -> RegistryClient:
    options = settings.registry.channel_options()
    return RegistryClient.connect(options, grpc_options=(*options.grpc_options, *REGISTRY_RECONNECT))


def build_server(
    settings: AgentSettings, agent: Agent, prometheus: CollectorRegistry = REGISTRY
) -> GrpcServer:
    def register(server: grpc.aio.Server) -> None:
        add_to_server(AgentServicer(agent.status, agent.moves), server)

    prometheus.register(AgentCollector(agent))
    return GrpcServer(
        settings.server,
        settings.telemetry,
        service_name=SERVICE_NAME,
        domain=ERROR_DOMAIN,
        register=register,
        service_names=[SERVICE],
        registry=prometheus,
        auth=settings.auth,
        policy=authz.policy,
    )


async def serve(settings: AgentSettings, data_plane: DataPlane | None = None) -> None:
    """The agent until a signal; `data_plane`: its pool's (None: NIXL's)."""
    client = connect_registry(settings)
    try:
        agent = Agent(settings, GrpcRegistryPort(client), data_plane=data_plane)
        server = build_server(settings, agent)
        port = await server.start()
        try:
            await agent.start(agent_endpoint=settings.advertised_endpoint(port))
            log.info("agent.signal", signal=(await wait_for_signal()).name)
        finally:
            await agent.shutdown()
            await server.stop()
    finally:
        await client.close()


def main(data_plane: Callable[[AgentSettings], DataPlane] | None = None) -> None:
    """`data_plane`: makes the pool's from the settings (None: NIXL's)."""
    settings = AgentSettings()  # type: ignore[call-arg]  # node comes from the environment
    configure_logging(settings.telemetry)
    log.info("agent.config", **settings.model_dump(mode="json"))
    try:
        asyncio.run(serve(settings, None if data_plane is None else data_plane(settings)))
    except KvshuttleError as exc:  # start refused: the engine check (logged as agent.engine_refused)
        raise SystemExit(f"kvshuttle-agent: refusing to start: {exc.message}") from None


if __name__ == "__main__":
    main()
