"""What the sidecar tests share: a real registry and router over gRPC, stand-in prefill and
decode engines registered as nodes/p0 and nodes/d0, the sidecar of nodes/d0 in front of its
decode, and the EPP's planning half (tests.support.planning_epp) to make the headers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from bench.emulator.http.engine import StandinEngine
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from tests.gateway.helpers import register, standin
from tests.router.helpers import MODEL, RouterEnv, start_router
from tests.support.planning_epp import PlanningEpp
from tests.support.registry_env import RegistryEnv, start_registry

from kvshuttle.client.settings import ServiceConnection
from kvshuttle.gateway.config import ModelSettings, RouterConnection
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.sidecar.config import SidecarSettings
from kvshuttle.sidecar.main import SidecarServer

SALT_KEY = b"sidecar-test-salt-key-0123456789"


@dataclass
class SidecarCluster:
    registry: RegistryEnv
    router: RouterEnv
    prefill: StandinEngine
    decode: StandinEngine
    server: SidecarServer
    url: str
    http: aiohttp.ClientSession
    epp: PlanningEpp
    metrics: CollectorRegistry

    async def post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, bytes, dict[str, str]]:
        """Status, raw body and headers, once the sidecar's background work has landed."""
        async with self.http.post(self.url + path, json=body, headers=headers or {}) as response:
            answer = response.status, await response.read(), dict(response.headers)
        await self.server.sidecar.settle()
        return answer

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.get_sample_value(name, labels) or 0.0

    async def retentions(self) -> list[reg_pb.Retention]:
        request = reg_pb.ListRetentionsRequest(parent="tenants/default", page_size=100)
        return list((await self.registry.stub.ListRetentions(request)).retentions)


def sse_events(raw: bytes) -> list[Any]:
    """Every SSE event's data, JSON-decoded ("[DONE]" as the string)."""
    text = raw.decode()
    assert text.endswith("\n\n"), text[-200:]
    events: list[Any] = []
    for event in text.split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        data = event[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def start_sidecar_cluster(
    model_dir: Path, tokenizer: ChatTokenizer, *, provider: TracerProvider, **overrides: Any
) -> SidecarCluster:
    registry = await start_registry()
    router = await start_router(registry, tracer_provider=provider)
    prefill, decode = standin("prefill", model_dir), standin("decode", model_dir)
    await prefill.start()
    await decode.start()
    await register(registry, "nodes/p0", reg_pb.NODE_ROLE_PREFILL, prefill)
    await register(registry, "nodes/d0", reg_pb.NODE_ROLE_DECODE, decode)
    settings = SidecarSettings(
        listen="127.0.0.1:0",
        node="nodes/d0",
        decode_endpoint=decode.url,
        router=RouterConnection(address=f"127.0.0.1:{router.server.port}", timeout=2.0),
        registry=ServiceConnection(address=registry.address, timeout=2.0),
        models={MODEL: ModelSettings(tokenizer=model_dir)},
        cache_salt_key=SecretStr(SALT_KEY.decode()),
        grace_seconds=2.0,
        **overrides,
    )
    metrics = CollectorRegistry()
    server = SidecarServer(
        settings, tracer_provider=provider, metrics_registry=metrics, tokenizers={MODEL: tokenizer}
    )
    port = await server.start()
    epp = PlanningEpp(router.client, MODEL, MODEL, tokenizer, SALT_KEY)
    return SidecarCluster(
        registry,
        router,
        prefill,
        decode,
        server,
        f"http://127.0.0.1:{port}",
        aiohttp.ClientSession(),
        epp,
        metrics,
    )


async def stop_sidecar_cluster(c: SidecarCluster) -> None:
    await c.http.close()
    await c.server.stop()
    await c.prefill.stop()
    await c.decode.stop()
    await c.router.close()
    await c.registry.channel.close()
    c.registry.registry.close()
    await c.registry.server.stop()
