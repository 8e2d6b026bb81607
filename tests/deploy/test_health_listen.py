"""SERVER__HEALTH_LISTEN, the setting the manifests' probes rely on, in every gRPC service: each
service's settings read it from that service's environment, and a service's server built as its
main() builds it serves health there."""

from __future__ import annotations

from collections.abc import Callable

import grpc.aio
import pytest
from prometheus_client import CollectorRegistry
from tests.deploy.manifest_checks import REPO
from tests.support.clock import FakeClock
from tests.support.health import SERVING, HealthCheckRequest, health_check

from kvshuttle.agent.config import AgentSettings
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.config import RegistrySettings
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.main import SERVICE, build_server
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.router.config import RouterSettings
from kvshuttle.serving.settings import ServerSettings

# What each service cannot load its settings without, besides the setting under test.
REQUIRED = {
    "REGISTRY": {},
    "ROUTER": {"PROFILES_FILE": str(REPO / "deploy/profiles/qwen3-32b-h200.toml")},
    "AGENT": {
        f"NODE__{name}": value
        for name, value in {
            "NAME": "n",
            "ROLE": "decode",
            "MODEL": "m",
            "ENGINE_ID": "e",
            "BLOCK_SIZE": "16",
            "KV_BYTES_PER_TOKEN": "1",
            "HTTP_ENDPOINT": "http://127.0.0.1:8000",
        }.items()
    },
}


@pytest.mark.parametrize(
    ("prefix", "server_settings"),
    [
        ("REGISTRY", lambda: RegistrySettings().server),
        ("ROUTER", lambda: RouterSettings().server),
        ("AGENT", lambda: AgentSettings().server),  # type: ignore[call-arg]  # node: from the env
    ],
)
def test_each_service_reads_its_health_listen(
    prefix: str, server_settings: Callable[[], ServerSettings], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {**REQUIRED[prefix], "SERVER__HEALTH_LISTEN": "0.0.0.0:8081"}.items():
        monkeypatch.setenv(f"KVSHUTTLE_{prefix}_{name}", value)
    server = server_settings()
    assert server.health_listen == "0.0.0.0:8081"
    assert server.listen.startswith("127.0.0.1:")  # the service's own default survives


async def test_the_registry_serves_health_on_its_health_listen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSHUTTLE_REGISTRY_SERVER__LISTEN", "127.0.0.1:0")
    monkeypatch.setenv("KVSHUTTLE_REGISTRY_SERVER__HEALTH_LISTEN", "127.0.0.1:0")
    registry = Registry(InMemoryStore(StoreLimits()), FakeClock(), BlockIndex(100), RegistryLimits())
    server = build_server(RegistrySettings(), registry, CollectorRegistry())
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
            assert (await health_check(channel)(HealthCheckRequest(service=SERVICE))).status == SERVING
    finally:
        await server.stop()
