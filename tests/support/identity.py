"""An in-memory registry, and the registry settings the identity tests (auth, TLS reload) run it with."""

from __future__ import annotations

from pathlib import Path

from tests.support.clock import FakeClock

from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.config import RegistrySettings
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.serving.settings import AuthSettings, ServerSettings


def registry_settings(listen: str, auth: AuthSettings, tls: Path | None = None) -> RegistrySettings:
    server = ServerSettings(listen=listen)
    if tls is not None:
        server = ServerSettings(
            listen=listen,
            tls_cert_file=tls / "server.pem",
            tls_key_file=tls / "server.key",
            tls_client_ca_file=tls / "ca.pem",
        )
    return RegistrySettings(server=server, auth=auth)


def registry() -> Registry:
    return Registry(InMemoryStore(), FakeClock(), BlockIndex(100), RegistryLimits())
