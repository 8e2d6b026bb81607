"""Secure channels: the client library and the CLI against an mTLS grpc.aio server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from tests.client.fake_registry import FakeRegistry
from tests.support.cli_runner import arun_cli
from tests.support.tls import make_certs, needs_openssl

from kvshuttle.client import ChannelOptions, RegistryClient
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc

pytestmark = needs_openssl


@pytest.fixture
async def mtls_registry(tmp_path: Path) -> AsyncIterator[tuple[FakeRegistry, Path]]:
    await asyncio.to_thread(make_certs, tmp_path)
    fake = FakeRegistry()
    server = grpc.aio.server()
    pb_grpc.add_RegistryServiceServicer_to_server(fake, server)
    credentials = grpc.ssl_server_credentials(
        [((tmp_path / "server.key").read_bytes(), (tmp_path / "server.pem").read_bytes())],
        root_certificates=(tmp_path / "ca.pem").read_bytes(),
        require_client_auth=True,
    )
    fake.address = f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', credentials)}"
    await server.start()
    try:
        yield fake, tmp_path
    finally:
        await server.stop(None)


async def test_client_with_mtls(mtls_registry: tuple[FakeRegistry, Path]) -> None:
    fake, certs = mtls_registry
    fake.add_node("nodes/d0")
    options = ChannelOptions(
        fake.address,
        root_certificates=certs / "ca.pem",
        cert_chain=certs / "client.pem",
        private_key=certs / "client.key",
    )
    async with RegistryClient.connect(options) as client:
        assert (await client.get_node("nodes/d0")).node.name == "nodes/d0"


async def test_cli_with_mtls(mtls_registry: tuple[FakeRegistry, Path]) -> None:
    fake, certs = mtls_registry
    fake.add_node("nodes/d0")
    ca, cert, key = (str(certs / f) for f in ("ca.pem", "client.pem", "client.key"))
    tls = ["--ca", ca, "--cert", cert, "--key", key]
    ok = await arun_cli([*tls, "registry", "nodes", "--json"], registry=fake.address)
    assert ok.exit_code == 0, ok.stderr
    assert [n["name"] for n in ok.json()["nodes"]] == ["nodes/d0"]
    without_cert = await arun_cli(["--ca", ca, "registry", "nodes"], registry=fake.address)
    assert without_cert.exit_code == 1
    assert without_cert.stderr == f"error: cannot reach the registry at {fake.address} (UNAVAILABLE)\n"
    plaintext = await arun_cli(["registry", "nodes", "--timeout", "1"], registry=fake.address)
    assert plaintext.exit_code == 1
    assert plaintext.stderr.startswith("error: cannot reach the registry at ")
    missing = await arun_cli(["--ca", str(certs / "nope.pem"), "registry", "nodes"], registry=fake.address)
    assert missing.exit_code == 1
    assert missing.stderr == f"error: No such file or directory: {certs / 'nope.pem'}\n"
