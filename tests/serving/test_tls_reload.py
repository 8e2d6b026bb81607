"""Certificates renewed while running, with real certificates and a real registry over mTLS:
the server's files swapped as a Kubernetes secret volume swaps them (one link renamed). New
connections get the new certificate (read from the handshake by a TLS client), connections
already up keep working; a client whose own certificate is renewed makes a new channel and
keeps working, as the identity its new certificate names."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from tests.agent.helpers import eventually
from tests.support.identity import registry
from tests.support.tls import issue, make_certs, needs_openssl, publish

from kvshuttle.client import KvshuttleRpcError, RegistryClient
from kvshuttle.client.channel import ChannelOptions
from kvshuttle.core.auth import Role
from kvshuttle.registry.config import RegistrySettings
from kvshuttle.registry.main import build_server
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc
from kvshuttle.serving.server import GrpcServer
from kvshuttle.serving.settings import AuthSettings, Grant, ServerSettings

pytestmark = needs_openssl

SERVER_FILES = {"tls.crt": "server.pem", "tls.key": "server.key", "ca.crt": "ca.pem"}


def start_registry(live: Path, auth: AuthSettings | None = None) -> GrpcServer:
    server = ServerSettings(
        listen="127.0.0.1:0",
        tls_cert_file=live / "tls.crt",
        tls_key_file=live / "tls.key",
        tls_client_ca_file=live / "ca.crt",
    )
    return build_server(
        RegistrySettings(server=server, auth=auth or AuthSettings()), registry(), CollectorRegistry()
    )


def served_certificate(port: int, certs: Path, client: str = "client") -> bytes:
    """The DER certificate the server presents to a new TLS connection (ALPN h2, as gRPC)."""
    context = ssl.create_default_context(cafile=certs / "ca.pem")
    context.load_cert_chain(certs / f"{client}.pem", certs / f"{client}.key")
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def der_of(pem: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.read_text())


def channel_to(port: int, certs: Path) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(
        (certs / "ca.pem").read_bytes(),
        (certs / "client.key").read_bytes(),
        (certs / "client.pem").read_bytes(),
    )
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials)


async def test_a_renewed_server_certificate_is_served_to_new_connections(tmp_path: Path) -> None:
    certs, live = tmp_path / "certs", tmp_path / "live"
    certs.mkdir()
    make_certs(certs)
    publish(certs, live, SERVER_FILES)
    first = der_of(certs / "server.pem")
    server = start_registry(live)
    port = await server.start()
    try:
        async with channel_to(port, certs) as before:
            stub = pb_grpc.RegistryServiceStub(before)
            await stub.ListNodes(pb.ListNodesRequest())
            assert await asyncio.to_thread(served_certificate, port, certs) == first

            issue(certs, "server", days=2)  # same CA, next serial, later expiry
            publish(certs, live, SERVER_FILES)
            renewed = der_of(certs / "server.pem")
            assert renewed != first

            assert await asyncio.to_thread(served_certificate, port, certs) == renewed
            await stub.ListNodes(pb.ListNodesRequest())  # the connection made before still serves
            async with channel_to(port, certs) as after:  # and gRPC clients connect anew
                await pb_grpc.RegistryServiceStub(after).ListNodes(pb.ListNodesRequest())
        assert server.tls_files is not None and server.tls_files.reloads == 1
    finally:
        await server.stop()


async def test_files_that_do_not_load_keep_the_served_certificate(tmp_path: Path) -> None:
    certs, live = tmp_path / "certs", tmp_path / "live"
    certs.mkdir()
    make_certs(certs)
    publish(certs, live, SERVER_FILES)
    server = start_registry(live)
    port = await server.start()
    try:
        publish(certs, live, {"tls.crt": "server.pem", "ca.crt": "ca.pem"})  # the key missing
        assert await asyncio.to_thread(served_certificate, port, certs) == der_of(certs / "server.pem")
        assert server.tls_files is not None and server.tls_files.reloads == 0
    finally:
        await server.stop()


async def test_a_client_follows_its_renewed_certificate(tmp_path: Path) -> None:
    certs, live = tmp_path / "certs", tmp_path / "client"
    certs.mkdir()
    make_certs(certs, {"viewer": "URI:spiffe://kvshuttle/viewer"})
    publish(certs, tmp_path / "server", SERVER_FILES)
    client_files = {"tls.crt": "viewer.pem", "tls.key": "viewer.key", "ca.crt": "ca.pem"}
    publish(certs, live, client_files)
    auth = AuthSettings(
        identities={
            "spiffe://kvshuttle/viewer": Grant(role=Role.VIEWER),
            "spiffe://kvshuttle/router": Grant(role=Role.ROUTER),
        }
    )
    server = start_registry(tmp_path / "server", auth)
    port = await server.start()
    options = ChannelOptions(
        f"127.0.0.1:{port}",
        root_certificates=live / "ca.crt",
        cert_chain=live / "tls.crt",
        private_key=live / "tls.key",
        tls_reload_interval=0.05,
    )
    claim = "tenants/acme/conversations/c/retentions/1"
    client = RegistryClient.connect(options)
    try:
        await client.list_nodes()
        with pytest.raises(KvshuttleRpcError) as err:  # a viewer claims nothing
            await client.claim_retention(claim, "decode-0")
        assert (err.value.code, err.value.reason) == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_MISSING")
        first_channel = client.channel

        # Renewed, here as another identity so the server shows which certificate it saw.
        issue(certs, "viewer", days=2, san="URI:spiffe://kvshuttle/router")
        publish(certs, live, client_files)

        async def claimed_as_router() -> bool:
            try:
                await client.claim_retention(claim, "decode-0")
            except KvshuttleRpcError as exc:
                if exc.reason == "PERMISSION_MISSING":
                    return False
                assert exc.code == grpc.StatusCode.NOT_FOUND  # past authorization: no such retention
            return True

        await eventually(claimed_as_router, within=30, what="a call made with the renewed certificate")
        assert client.channel is not first_channel
        await client.list_nodes()
    finally:
        await client.close()
        await server.stop()


def test_reload_interval_is_positive() -> None:
    with pytest.raises(ValueError, match="tls_reload_interval"):
        ChannelOptions("127.0.0.1:1", tls_reload_interval=0)
