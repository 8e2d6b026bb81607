"""A real registry gRPC server on 127.0.0.1 port 0, on a fake clock, and a stub to it."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry
from tests.support.clock import FakeClock

from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.config import RegistrySettings
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.main import build_server
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc
from kvshuttle.serving.server import GrpcServer
from kvshuttle.serving.settings import ServerSettings


@dataclass
class RegistryEnv:
    clock: FakeClock
    registry: Registry
    server: GrpcServer
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.RegistryServiceAsyncStub
    metrics: CollectorRegistry


async def start_registry(
    store: InMemoryStore | None = None, *, limits: RegistryLimits | None = None
) -> RegistryEnv:
    clock = FakeClock()
    registry = Registry(
        store or InMemoryStore(StoreLimits(max_retentions_per_tenant=50)),
        clock,
        BlockIndex(10_000),
        limits or RegistryLimits(),
    )
    settings = RegistrySettings(server=ServerSettings(listen="127.0.0.1:0", grace_seconds=5))
    metrics = CollectorRegistry()
    server = build_server(settings, registry, metrics)
    port = await server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    return RegistryEnv(
        clock, registry, server, address, channel, pb_grpc.RegistryServiceStub(channel), metrics
    )
