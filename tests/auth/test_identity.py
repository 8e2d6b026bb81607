"""Identities from client certificates (mTLS, SPIFFE-style URI SANs, then DNS SANs), the
agent's service with authentication on, and servers that refuse to listen beyond loopback
without protection."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from tests.agent.helpers import agent_settings
from tests.auth.helpers import auth_settings, bearer, denial, token
from tests.support.identity import registry, registry_settings
from tests.support.tls import make_certs, needs_openssl

from kvshuttle.agent.agent import Agent
from kvshuttle.agent.main import build_server as build_agent_server
from kvshuttle.agent.main import connect_registry
from kvshuttle.agent.registry_port import GrpcRegistryPort
from kvshuttle.agent.v1 import agent_service_pb2 as apb
from kvshuttle.agent.v1 import agent_service_pb2_grpc as apb_grpc
from kvshuttle.core.auth import Permission, Role
from kvshuttle.core.errors import Unauthenticated
from kvshuttle.registry.main import build_server
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc
from kvshuttle.serving.auth import Authorizer, Requirement
from kvshuttle.serving.settings import AuthSettings, Grant

# Client certificates: `router` (URI and DNS SANs), `dns-viewer` (a DNS SAN only), `stranger`
# (a SAN no grant names).
CLIENTS = {
    "router": "URI:spiffe://kvshuttle/router,DNS:router.kvshuttle.svc",
    "dns-viewer": "DNS:viewer.kvshuttle.svc",
    "stranger": "URI:spiffe://elsewhere/intruder",
}


@needs_openssl
async def test_client_certificates_name_the_caller(tmp_path: Path) -> None:
    make_certs(tmp_path, CLIENTS)
    auth = AuthSettings(
        identities={
            "spiffe://kvshuttle/router": Grant(role=Role.ROUTER),
            "viewer.kvshuttle.svc": Grant(role=Role.VIEWER),
        }
    )
    server = build_server(registry_settings("127.0.0.1:0", auth, tmp_path), registry(), CollectorRegistry())
    port = await server.start()

    def channel(name: str) -> grpc.aio.Channel:
        credentials = grpc.ssl_channel_credentials(
            (tmp_path / "ca.pem").read_bytes(),
            (tmp_path / f"{name}.key").read_bytes(),
            (tmp_path / f"{name}.pem").read_bytes(),
        )
        return grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials)

    conversation = pb.GetConversationRequest(name="tenants/acme/conversations/c1")
    try:
        async with channel("router") as router:  # the URI SAN: a router reads conversations
            stub = pb_grpc.RegistryServiceStub(router)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetConversation(conversation)
            assert denial(err.value) == ("NOT_FOUND", "CONVERSATION_NOT_FOUND")  # past authorization
        async with channel("dns-viewer") as viewer:  # a DNS SAN: a viewer lists, never writes
            stub = pb_grpc.RegistryServiceStub(viewer)
            await stub.ListNodes(pb.ListNodesRequest())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ReleaseRetention(
                    pb.ReleaseRetentionRequest(name="tenants/a/conversations/c/retentions/1")
                )
            assert denial(err.value) == ("PERMISSION_DENIED", "PERMISSION_MISSING")
        async with channel("stranger") as stranger:  # a valid certificate of no configured identity
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.RegistryServiceStub(stranger).ListNodes(pb.ListNodesRequest())
            assert denial(err.value) == ("UNAUTHENTICATED", "UNAUTHENTICATED")
    finally:
        await server.stop()


async def test_without_protection_only_loopback_is_served() -> None:
    with pytest.raises(ValueError, match="refusing to listen"):
        await build_server(
            registry_settings("0.0.0.0:0", AuthSettings()), registry(), CollectorRegistry()
        ).start()
    # Tokens travel in clear without TLS: identities alone do not make a wildcard address safe.
    with pytest.raises(ValueError, match="refusing to listen"):
        await build_server(
            registry_settings("0.0.0.0:0", auth_settings()), registry(), CollectorRegistry()
        ).start()
    explicit = AuthSettings(insecure=True)
    server = build_server(registry_settings("0.0.0.0:0", explicit), registry(), CollectorRegistry())
    assert await server.start() > 0  # said so (server.insecure), and served
    await server.stop()


async def test_the_agent_serves_status_to_its_watchers_only() -> None:
    settings = agent_settings("127.0.0.1:1", "http://127.0.0.1:1").model_copy(
        update={"auth": auth_settings()}
    )
    agent = Agent(settings, GrpcRegistryPort(connect_registry(settings)))  # never started: status only
    server = build_agent_server(settings, agent, CollectorRegistry())
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = apb_grpc.AgentServiceStub(channel)
            for identity in ("router", "admin", "viewer"):
                await stub.GetStatus(apb.GetStatusRequest(), metadata=bearer(identity))
            for identity in ("gateway-acme", "agent-d0"):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.GetStatus(apb.GetStatusRequest(), metadata=bearer(identity))
                assert denial(err.value) == ("PERMISSION_DENIED", "PERMISSION_MISSING")
            with pytest.raises(grpc.aio.AioRpcError) as err:  # the NIXL moves: the router's to order
                await stub.ParkRetention(apb.ParkRetentionRequest(), metadata=bearer("viewer"))
            assert denial(err.value) == ("PERMISSION_DENIED", "PERMISSION_MISSING")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ParkRetention(apb.ParkRetentionRequest(), metadata=bearer("router"))
            # Authorized: this agent has no pool, which the move itself refuses.
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await server.stop()


def test_a_remembered_token_is_still_only_that_token() -> None:
    # The Authorizer remembers a token once it authenticated; a near miss must still be refused.
    authorizer = Authorizer(auth_settings(), lambda method, request: Requirement(Permission.NODES_READ))
    for _ in range(2):
        caller = authorizer.authenticate(bearer("router"), {})
        assert (caller.identity, caller.role) == ("router", Role.ROUTER)
    near = token("router")[:-1] + ("x" if token("router")[-1] != "x" else "y")
    for presented in (near, token("router") + "x", token("viewer")[:-1]):
        with pytest.raises(Unauthenticated):
            authorizer.authenticate((("authorization", f"Bearer {presented}"),), {})
    assert authorizer.authenticate(bearer("viewer"), {}).identity == "viewer"
