"""gRPC health-check helpers and a test GrpcServer builder, shared by the serving and deploy tests."""

from __future__ import annotations

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry
from tests.serving.echo import DOMAIN, SERVICE, EchoServicer, register

from kvshuttle.serving.server import GrpcServer
from kvshuttle.serving.settings import ServerSettings, TelemetrySettings
from kvshuttle.serving.tracing import configure_tracing

SERVING = health_pb2.HealthCheckResponse.SERVING


NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


HealthCheckRequest = health_pb2.HealthCheckRequest


# The generated stubs of grpc_health and grpc_reflection have no typed methods; these do.
def health_check(
    channel: grpc.aio.Channel,
) -> grpc.aio.UnaryUnaryMultiCallable[HealthCheckRequest, HealthCheckResponse]:
    return channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=HealthCheckRequest.SerializeToString,
        response_deserializer=HealthCheckResponse.FromString,
    )


def health_watch(
    channel: grpc.aio.Channel,
) -> grpc.aio.UnaryStreamMultiCallable[HealthCheckRequest, HealthCheckResponse]:
    return channel.unary_stream(
        "/grpc.health.v1.Health/Watch",
        request_serializer=HealthCheckRequest.SerializeToString,
        response_deserializer=HealthCheckResponse.FromString,
    )


async def next_status(watch: grpc.aio.UnaryStreamCall[HealthCheckRequest, HealthCheckResponse]) -> int:
    response = await watch.read()
    assert isinstance(response, HealthCheckResponse)
    return response.status


def build(
    servicer: EchoServicer,
    settings: ServerSettings | None = None,
    telemetry: TelemetrySettings | None = None,
) -> GrpcServer:
    return GrpcServer(
        settings or ServerSettings(listen="127.0.0.1:0"),
        telemetry or TelemetrySettings(),
        service_name="kvshuttle-test",
        domain=DOMAIN,
        register=register(servicer),
        service_names=[SERVICE],
        registry=CollectorRegistry(),
        tracer_provider=configure_tracing(TelemetrySettings(), "kvshuttle-test"),
    )


async def secure_health(target: str, credentials: grpc.ChannelCredentials) -> int:
    async with grpc.aio.secure_channel(target, credentials) as channel:
        response = await health_check(channel)(HealthCheckRequest(), timeout=5)
        return response.status


HealthCheckResponse = health_pb2.HealthCheckResponse
