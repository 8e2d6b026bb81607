"""GrpcServer's lifecycle: health, graceful stop, reflection, the metrics endpoint, TLS, signals."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_reflection.v1alpha import reflection_pb2
from prometheus_client import CollectorRegistry
from tests.serving.echo import DOMAIN, SERVICE, EchoServicer, JsonLog, Request, register, unary
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

from kvshuttle.serving.server import GrpcServer
from kvshuttle.serving.settings import ServerSettings, TelemetrySettings


@dataclass
class Served:
    server: GrpcServer
    servicer: EchoServicer
    channel: grpc.aio.Channel
    log: JsonLog


@pytest.fixture
async def served(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    """A started server; a test may parametrize it indirectly with its grace_seconds."""
    log = JsonLog()
    servicer = EchoServicer()
    grace = getattr(request, "param", 5.0)
    server = build(servicer, ServerSettings(listen="127.0.0.1:0", grace_seconds=grace))
    port = await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield Served(server, servicer, channel, log)
    servicer.release.set()
    await server.stop()
    log.close()


async def test_health_serving_then_not_serving_during_stop(served: Served) -> None:
    assert (await health_check(served.channel)(HealthCheckRequest(service=""))).status == SERVING
    assert (await health_check(served.channel)(HealthCheckRequest(service=SERVICE))).status == SERVING
    watch = health_watch(served.channel)(HealthCheckRequest(service=SERVICE))
    assert await next_status(watch) == SERVING

    stopping = asyncio.create_task(served.server.stop())

    # Watchers (load balancers, client-side health checking) hear it before the listener closes.
    assert await next_status(watch) == NOT_SERVING
    watch.cancel()
    await stopping


@pytest.mark.parametrize("served", [5.0], indirect=True)
async def test_stop_lets_in_flight_rpcs_finish_and_refuses_new_ones(served: Served) -> None:
    slow = asyncio.ensure_future(unary(served.channel, "Slow")(Request()))
    await served.servicer.entered.wait()
    started = time.monotonic()

    stopping = asyncio.create_task(served.server.stop())

    # Refused: CANCELLED for a call that raced the shutdown, UNAVAILABLE once the listener is gone.
    refused = None
    for _ in range(200):
        try:
            await unary(served.channel, "Echo")(Request(), timeout=1)
        except grpc.aio.AioRpcError as err:
            refused = err.code()
            break
        await asyncio.sleep(0.005)
    assert refused in {grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE}
    with pytest.raises(grpc.aio.AioRpcError) as later:
        await unary(served.channel, "Echo")(Request(), timeout=1)
    assert later.value.code() == grpc.StatusCode.UNAVAILABLE
    served.servicer.release.set()
    assert (await slow).serving_data == "finally"
    await stopping
    assert time.monotonic() - started < 2.0  # returned as soon as the RPC finished, not after grace
    assert (await served.log.done_once("Slow"))["code"] == "OK"


@pytest.mark.parametrize("served", [0.2], indirect=True)
async def test_stop_cancels_what_outlives_the_grace(served: Served) -> None:
    slow = asyncio.ensure_future(unary(served.channel, "Slow")(Request()))
    await served.servicer.entered.wait()

    await asyncio.wait_for(served.server.stop(), timeout=2.0)

    with pytest.raises(grpc.aio.AioRpcError):
        await slow
    assert (await served.log.done_once("Slow"))["code"] == "CANCELLED"


async def test_reflection_lists_the_services(served: Served) -> None:
    reflect = served.channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )

    names: set[str] = set()
    async for response in reflect(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
        names |= {service.name for service in response.list_services_response.service}

    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        text: str = response.read().decode()
        return text


async def test_metrics_endpoint_serves_the_rpc_counter_and_stops() -> None:
    log = JsonLog()
    servicer = EchoServicer()
    server = build(servicer, telemetry=TelemetrySettings(metrics_listen="127.0.0.1:0"))
    port = await server.start()
    metrics_port = server.metrics_port
    assert metrics_port is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await unary(channel, "Echo")(Request())

    text = await asyncio.to_thread(scrape, metrics_port)
    await server.stop()

    assert f'kvshuttle_rpc_total{{code="OK",method="Echo",service="{SERVICE}"}} 1.0' in text
    assert "kvshuttle_rpc_duration_seconds_bucket" in text
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(scrape, metrics_port)
    log.close()


@needs_openssl
async def test_mtls_admits_only_clients_with_a_certificate(tmp_path: Path) -> None:
    await asyncio.to_thread(make_certs, tmp_path)
    settings = ServerSettings(
        listen="127.0.0.1:0",
        tls_cert_file=tmp_path / "server.pem",
        tls_key_file=tmp_path / "server.key",
        tls_client_ca_file=tmp_path / "ca.pem",
    )
    log = JsonLog()
    server = build(EchoServicer(), settings)
    target = f"127.0.0.1:{await server.start()}"
    ca = (tmp_path / "ca.pem").read_bytes()
    try:
        with_cert = grpc.ssl_channel_credentials(
            ca, (tmp_path / "client.key").read_bytes(), (tmp_path / "client.pem").read_bytes()
        )
        assert await secure_health(target, with_cert) == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await secure_health(target, grpc.ssl_channel_credentials(ca))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop()
        log.close()


async def test_serve_until_signal_stops_gracefully_on_sigterm() -> None:
    log = JsonLog()
    # No provider passed in: the server makes its own and shuts it down.
    server = GrpcServer(
        ServerSettings(listen="127.0.0.1:0"),
        TelemetrySettings(),
        service_name="kvshuttle-test",
        domain=DOMAIN,
        register=register(EchoServicer()),
        service_names=[SERVICE],
        registry=CollectorRegistry(),
    )
    before = signal.getsignal(signal.SIGTERM)
    serving = asyncio.create_task(server.serve_until_signal())
    for _ in range(200):  # the handler must be in place before the signal is sent
        if signal.getsignal(signal.SIGTERM) != before:
            break
        await asyncio.sleep(0.005)
    else:
        pytest.fail("serve_until_signal installed no SIGTERM handler")

    assert server.port is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        assert (await health_check(channel)(HealthCheckRequest())).status == SERVING

    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(serving, timeout=5)

    assert signal.getsignal(signal.SIGTERM) == before
    events = [e["event"] for e in log.events()]
    assert events[-3:] == ["server.signal", "server.stopping", "server.stopped"]
    log.close()
