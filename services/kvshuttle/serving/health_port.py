"""grpc.health.v1 of one service: the servicer both of its listeners answer from, and the second,
plaintext listener that serves health alone (ServerSettings.health_listen) for probes that
cannot speak TLS, such as Kubernetes' native grpc probe."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

HealthContext = grpc.aio.ServicerContext[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]

# HealthCheckRequest and HealthCheckResponse hold a service name and a status: tens of bytes.
MAX_MESSAGE_BYTES = 4 * 1024
# A probe makes one call per connection at a time; a few streams per connection and a few dozen
# calls in all is plenty, and bounds what callers that need no identity can hold.
MAX_STREAMS_PER_CONNECTION = 4
MAX_CONCURRENT_RPCS = 32


class ServiceHealth(health.aio.HealthServicer):
    """The health of the names the server reports on, fixed at construction. A Watch of any other
    name gets SERVICE_UNKNOWN and keeps its stream open, as the protocol says, but leaves no
    entry behind: grpc_health's servicer keeps one per name ever watched, and health needs no
    identity, so any caller could otherwise grow that table without bound."""

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__()
        self._names = frozenset(names)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: HealthContext) -> None:
        if request.service in self._names:
            await super().Watch(request, context)
            return
        await context.write(
            health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        )
        await asyncio.Event().wait()  # until the caller cancels or the server stops


def health_only_server(servicer: ServiceHealth, listen: str) -> tuple[grpc.aio.Server, int]:
    """A plaintext server of grpc.health.v1.Health alone, bound to `listen` (not started), and
    its port. No other service, no reflection, no authentication: health carries no data (a
    caller learns SERVING or NOT_SERVING of names the protos publish, and can change nothing),
    so serving it in the clear beyond loopback exposes nothing that mTLS on the main port
    protects."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            # As on the main port: a port in use fails the bind instead of being shared.
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return server, server.add_insecure_port(listen)
