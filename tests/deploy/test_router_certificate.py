"""The production overlay's gateway -> router mTLS, for real: a router server (the router's own
build_server, its TLS and its grants as rendered) serving a certificate with exactly the SANs of
the rendered cert-manager Certificate, and the gateway's channel to each router replica as the
rendered gateway settings make it (RouterConnection.replica_options). Each channel must check
the certificate against the name it dials and get the router's answer; a certificate without
one pod's name refuses that pod's channel. Names are not resolved here (no cluster DNS): each
channel connects to 127.0.0.1 and checks the name it would dial (tls_server_name, as gRPC's
target name override), which is the check a channel to that name makes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from deploy.kubernetes import check
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from tests.deploy import manifests as m
from tests.deploy.manifest_checks import service_workload
from tests.router.helpers import PROFILES
from tests.support.tls import issue, make_certs, needs_openssl

from kvshuttle.client import KvshuttleRpcError, RegistryClient, RouterClient
from kvshuttle.client.settings import ServiceConnection
from kvshuttle.core.clock import SystemClock
from kvshuttle.gateway.config import RouterConnection
from kvshuttle.router.config import RouterSettings
from kvshuttle.router.grpc.registry_port import GrpcRegistryPort
from kvshuttle.router.main import build_router, build_server
from kvshuttle.serving.server import GrpcServer
from kvshuttle.serving.settings import AuthSettings, ServerSettings

pytestmark = [needs_openssl, pytest.mark.k8s]

PRODUCTION = check.render("production")
MOUNT = "/run/tls"  # where every production pod mounts its certificate (mtls.yaml)


def certificate(name: str) -> dict[str, Any]:
    spec: dict[str, Any] = m.one(PRODUCTION, "Certificate", name)["spec"]
    return spec


def issue_as(certs: Path, name: str, spec: dict[str, Any], *, dns_names: list[str] | None = None) -> None:
    """A certificate `name`.pem as cert-manager issues it from the Certificate `spec`."""
    sans = [f"URI:{u}" for u in spec["uris"]]
    sans += [f"DNS:{d}" for d in (spec.get("dnsNames", []) if dns_names is None else dns_names)]
    usages = {"server auth": "serverAuth", "client auth": "clientAuth"}
    (certs / f"{name}.ext").write_text(
        f"extendedKeyUsage={','.join(usages[u] for u in spec['usages'] if u in usages)}\n"
        f"subjectAltName={','.join(sans)}\n"
    )
    issue(certs, name)


def mounted(env: dict[str, str], directory: Path) -> dict[str, str]:
    """`env` with its certificate files at `directory` instead of the pod's mount."""
    return {k: v.replace(MOUNT, str(directory)) for k, v in env.items()}


def volume_of(certs: Path, name: str) -> Path:
    """A directory laid out as the pod's certificate volume: tls.crt, tls.key, ca.crt."""
    volume = certs / f"{name}-volume"
    volume.mkdir()
    for published, source in {"tls.crt": f"{name}.pem", "tls.key": f"{name}.key", "ca.crt": "ca.pem"}.items():
        (volume / published).write_bytes((certs / source).read_bytes())
    return volume


async def start_router(volume: Path) -> tuple[GrpcServer, RegistryClient, int]:
    """A router server with the rendered router's TLS files (at `volume`) and grants."""
    env = mounted(m.env(service_workload(PRODUCTION, "router").container("router"), PRODUCTION), volume)
    server = ServerSettings(
        listen="127.0.0.1:0",
        grace_seconds=1,
        tls_cert_file=Path(env["KVSHUTTLE_ROUTER_SERVER__TLS_CERT_FILE"]),
        tls_key_file=Path(env["KVSHUTTLE_ROUTER_SERVER__TLS_KEY_FILE"]),
        tls_client_ca_file=Path(env["KVSHUTTLE_ROUTER_SERVER__TLS_CLIENT_CA_FILE"]),
    )
    settings = RouterSettings(
        server=server,
        auth=AuthSettings(identities=json.loads(env["KVSHUTTLE_ROUTER_AUTH__IDENTITIES"])),
        registry=ServiceConnection(address="127.0.0.1:1"),  # never called: the plan is refused first
        profiles_file=PROFILES,
        turn_signing_key=SecretStr("shared-turn-key-" * 2),
    )
    registry = RegistryClient.connect(settings.registry.channel_options())
    metrics = CollectorRegistry()
    router = build_router(settings, GrpcRegistryPort(registry), SystemClock(), metrics)
    grpc_server = build_server(settings, router, metrics)
    return grpc_server, registry, await grpc_server.start()


def gateway_connection(volume: Path) -> RouterConnection:
    """The gateway's RouterConnection as the rendered gateway environment configures it."""
    env = mounted(m.env(service_workload(PRODUCTION, "gateway").container("gateway"), PRODUCTION), volume)
    prefix = "KVSHUTTLE_GATEWAY_ROUTER__"
    return RouterConnection.model_validate(
        {k.removeprefix(prefix).lower(): v for k, v in env.items() if k.startswith(prefix)}
    )


async def answers(connection: RouterConnection, address: str, port: int) -> str:
    """The status of a PlanTurn the router refuses by its content (an empty prompt) on the
    gateway's channel to replica `address`, connected to 127.0.0.1:`port` instead."""
    options = connection.replica_options(address)
    checked = options.tls_server_name or m.host_of_address(address)
    local = dataclasses.replace(options, target=f"127.0.0.1:{port}", tls_server_name=checked)
    async with RouterClient.connect(local) as client:
        try:
            await client.plan_turn("Qwen/Qwen3-32B", [], conversation="tenants/t/conversations/c", timeout=10)
        except KvshuttleRpcError as err:
            return f"{err.code_name} {err.reason}"
    raise AssertionError("an empty prompt was planned")


@pytest.mark.parametrize("dropped", [None, "kvshuttle-router-1.kvshuttle-router"])
async def test_the_gateway_verifies_each_router_pod_by_the_name_it_dials(
    tmp_path: Path, dropped: str | None
) -> None:
    make_certs(tmp_path)
    router_spec = certificate("kvshuttle-router")
    names = [d for d in router_spec["dnsNames"] if d != dropped]
    issue_as(tmp_path, "router", router_spec, dns_names=names)
    issue_as(tmp_path, "gateway", certificate("kvshuttle-gateway"))
    server, registry, port = await start_router(volume_of(tmp_path, "router"))
    try:
        connection = gateway_connection(volume_of(tmp_path, "gateway"))
        replicas = connection.replicas()
        assert replicas == m.addresses(connection.address) and len(replicas) == 2
        got = {address: await answers(connection, address, port) for address in replicas}
    finally:
        await server.stop()
        await registry.close()
    # Past TLS both ways and the router's grant of the gateway's identity: the router's own
    # refusal of the request. A name the certificate lacks: the handshake fails, no answer.
    want = {a: "INVALID_ARGUMENT INVALID_ARGUMENT" for a in replicas}
    if dropped is not None:
        want[f"{dropped}:50061"] = "UNAVAILABLE None"
    assert got == want
