"""The plaintext health-only listener (ServerSettings.health_listen): health from the main
server's state, nothing else on it, plaintext beside mTLS, started and stopped with the server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from pydantic import ValidationError
from tests.serving.echo import SERVICE, EchoServicer, JsonLog, Request, unary
from tests.support.health import (
    NOT_SERVING,
    SERVING,
    HealthCheckRequest,
    build,
    health_check,
    health_watch,
    next_status,
    secure_health,
)
from tests.support.tls import make_certs, needs_openssl

from kvshuttle.serving.health_port import MAX_STREAMS_PER_CONNECTION
from kvshuttle.serving.server import GrpcServer
from kvshuttle.serving.settings import ServerSettings

SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def with_health_port(servicer: EchoServicer, **settings: object) -> GrpcServer:
    return build(
        servicer,
        ServerSettings.model_validate({"listen": "127.0.0.1:0", "health_listen": "127.0.0.1:0", **settings}),
    )


def health_target(server: GrpcServer) -> str:
    assert server.health_port is not None and server.health_port != server.port
    return f"127.0.0.1:{server.health_port}"


async def test_the_health_port_reports_the_servers_health_and_not_serving_while_it_stops() -> None:
    log = JsonLog()
    servicer = EchoServicer()
    server = with_health_port(servicer, grace_seconds=30)
    port = await server.start()
    main = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    probe = grpc.aio.insecure_channel(health_target(server))
    try:
        for name in ("", SERVICE):
            assert (await health_check(probe)(HealthCheckRequest(service=name))).status == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health_check(probe)(HealthCheckRequest(service="kvshuttle.testing.v1.Nope"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health_watch(probe)(HealthCheckRequest(service=SERVICE))
        assert await next_status(watch) == SERVING
        (started,) = [e for e in log.events() if e["event"] == "server.started"]
        assert started["health_listen"] == "127.0.0.1:0" and started["health_port"] == server.health_port

        # An RPC in flight holds the grace period open: the health port answers all along.
        slow = asyncio.ensure_future(unary(main, "Slow")(Request()))
        await servicer.entered.wait()
        stopping = asyncio.create_task(server.stop())
        assert await next_status(watch) == NOT_SERVING
        watch.cancel()
        for name in ("", SERVICE):
            assert (await health_check(probe)(HealthCheckRequest(service=name))).status == NOT_SERVING

        servicer.release.set()
        assert (await slow).serving_data == "finally"
        await stopping
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await health_check(probe)(HealthCheckRequest(), timeout=2)
        assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        servicer.release.set()
        await server.stop()
        await main.close()
        await probe.close()
        log.close()


async def test_the_health_port_serves_health_alone_and_the_main_port_everything() -> None:
    server = with_health_port(EchoServicer())
    port = await server.start()
    try:
        for target, open_ in ((health_target(server), False), (f"127.0.0.1:{port}", True)):
            async with grpc.aio.insecure_channel(target) as channel:
                assert (await health_check(channel)(HealthCheckRequest())).status == SERVING
                calls = {
                    "echo": unary(channel, "Echo")(Request(serving_data="hi")),
                    "reflection": list_services(channel),
                }
                for what, call in calls.items():
                    if open_:
                        await call
                        continue
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call
                    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED, what
    finally:
        await server.stop()


async def list_services(channel: grpc.aio.Channel) -> set[str]:
    reflect = channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    names: set[str] = set()
    async for response in reflect(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
        names |= {service.name for service in response.list_services_response.service}
    return names


@needs_openssl
async def test_the_health_port_speaks_plaintext_beside_mtls(tmp_path: Path) -> None:
    await asyncio.to_thread(make_certs, tmp_path)
    server = with_health_port(
        EchoServicer(),
        tls_cert_file=tmp_path / "server.pem",
        tls_key_file=tmp_path / "server.key",
        tls_client_ca_file=tmp_path / "ca.pem",
    )
    main = f"127.0.0.1:{await server.start()}"
    try:
        async with grpc.aio.insecure_channel(health_target(server)) as probe:
            assert (await health_check(probe)(HealthCheckRequest(service=SERVICE))).status == SERVING
        # The main port still admits only clients with a certificate of the CA.
        async with grpc.aio.insecure_channel(main) as plaintext:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_check(plaintext)(HealthCheckRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        certificate = grpc.ssl_channel_credentials(
            (tmp_path / "ca.pem").read_bytes(),
            (tmp_path / "client.key").read_bytes(),
            (tmp_path / "client.pem").read_bytes(),
        )
        assert await secure_health(main, certificate) == SERVING
    finally:
        await server.stop()


async def test_a_watch_of_an_unknown_name_answers_service_unknown_and_leaves_nothing_behind() -> None:
    server = with_health_port(EchoServicer())
    port = await server.start()
    try:
        for target in (health_target(server), f"127.0.0.1:{port}"):
            async with grpc.aio.insecure_channel(target) as channel:
                # Fewer than the health port's streams per connection (health_port.py).
                names = [f"kvshuttle.testing.v1.Nope{i}" for i in range(MAX_STREAMS_PER_CONNECTION)]
                watches = [health_watch(channel)(HealthCheckRequest(service=name)) for name in names]
                assert [await next_status(w) for w in watches] == [SERVICE_UNKNOWN] * len(names)
                for watch in watches:
                    watch.cancel()
        # grpc_health's servicer keeps a condition per name ever watched; the guard keeps
        # unknown names out of it (its private table: nothing public shows its size).
        assert set(getattr(server._health, "_server_watchers")) <= {"", SERVICE}  # noqa: B009
    finally:
        await server.stop()


async def test_a_health_port_in_use_fails_the_start() -> None:
    first = build(EchoServicer())
    taken = await first.start()
    second = with_health_port(EchoServicer(), health_listen=f"127.0.0.1:{taken}")
    try:
        with pytest.raises(RuntimeError):
            await second.start()
        assert second.health_port is None and second.port is None
    finally:
        await second.stop()
        await first.stop()


@pytest.mark.parametrize(
    ("listen", "health_listen", "error"),
    [
        ("0.0.0.0:50051", "0.0.0.0:50051", "uses the port of listen"),
        ("0.0.0.0:50051", "[::]:50051", "uses the port of listen"),
        ("0.0.0.0:50051", "8081", "is not host:port"),
    ],
)
def test_a_health_listen_on_the_main_port_or_without_a_port_is_refused(
    listen: str, health_listen: str, error: str
) -> None:
    with pytest.raises(ValidationError, match=error):
        ServerSettings(listen=listen, health_listen=health_listen)


def test_health_listen_is_off_by_default_and_port_zero_twice_is_two_ports() -> None:
    assert ServerSettings().health_listen is None
    assert ServerSettings(listen="127.0.0.1:0", health_listen="127.0.0.1:0").health_listen == "127.0.0.1:0"
