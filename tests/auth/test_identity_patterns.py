"""Agent identities by pattern ("spiffe://kvshuttle/agent/{node}" -> nodes/{node}): the settings
that may say so, what one identity may act for (its node and that node's pool node, never
another), and the registry refusing and granting real client certificates over mTLS."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from prometheus_client import CollectorRegistry
from pydantic import SecretStr, ValidationError
from tests.auth.helpers import denial
from tests.support.identity import registry, registry_settings
from tests.support.tls import make_certs, needs_openssl

from kvshuttle.core.auth import Role
from kvshuttle.core.errors import Unauthenticated
from kvshuttle.registry.main import build_server
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc
from kvshuttle.serving.auth import Authorizer
from kvshuttle.serving.identities import Identities, pattern_node
from kvshuttle.serving.settings import AuthSettings, Grant

PATTERN = "spiffe://kvshuttle/agent/{node}"
AGENT_OF = Grant(role=Role.AGENT, node="nodes/{node}")
GRANTS = {
    PATTERN: AGENT_OF,
    "spiffe://kvshuttle/router": Grant(role=Role.ROUTER),
    "router.kvshuttle.svc": Grant(role=Role.VIEWER),
}


def test_a_pattern_names_the_node_of_its_identity_and_nothing_else() -> None:
    prefix = "spiffe://kvshuttle/agent/"
    assert pattern_node(prefix, prefix + "decode-0") == "nodes/decode-0"
    assert pattern_node(prefix, prefix + "kvshuttle-vllm-prefill-12") == "nodes/kvshuttle-vllm-prefill-12"
    for identity in (
        prefix,  # no node
        prefix + "decode-0-pool",  # the pool node of decode-0: its agent's alone
        prefix + "*",
        prefix + "a/b",
        prefix + "../router",
        prefix + "decode 0",
        "spiffe://kvshuttle/agents/decode-0",
        "spiffe://kvshuttle/router",
    ):
        assert pattern_node(prefix, identity) is None, identity


def test_an_agent_by_pattern_acts_for_its_node_and_its_pool_node_only() -> None:
    identities = Identities(GRANTS)
    caller = identities.of_certificate(["spiffe://kvshuttle/agent/d0"], [])
    assert caller is not None
    assert (caller.identity, caller.role, caller.node) == (
        "spiffe://kvshuttle/agent/d0",
        Role.AGENT,
        "nodes/d0",
    )
    assert caller.acts_for_node("nodes/d0") and caller.acts_for_node("nodes/d0-pool")
    for other in ("nodes/d1", "nodes/d0x", "nodes/d", "nodes/d0-pool-pool", "nodes/*", "d0"):
        assert not caller.acts_for_node(other), other
    # Patterns are for certificates: a token's identity is granted by name only.
    assert identities.named("spiffe://kvshuttle/agent/d0") is None
    assert identities.named(PATTERN) is None
    assert identities.names == {"spiffe://kvshuttle/router", "router.kvshuttle.svc"}


def test_a_certificate_naming_several_identities_is_refused() -> None:
    identities = Identities(GRANTS)
    for uris, dns in (
        (["spiffe://kvshuttle/agent/d0", "spiffe://kvshuttle/agent/d1"], []),
        (["spiffe://kvshuttle/agent/d0", "spiffe://kvshuttle/router"], []),
        (["spiffe://kvshuttle/router"], ["router.kvshuttle.svc"]),
    ):
        with pytest.raises(Unauthenticated, match="names several identities"):
            identities.of_certificate(uris, dns)
    # SANs that name nothing configured beside the one that does are no ambiguity.
    caller = identities.of_certificate(["spiffe://elsewhere/x", "spiffe://kvshuttle/agent/d0"], ["d0.svc"])
    assert caller is not None and caller.node == "nodes/d0"
    assert identities.of_certificate(["spiffe://kvshuttle/agent/d0-pool"], []) is None


@pytest.mark.parametrize(
    ("identities", "message"),
    [
        ({"spiffe://kvshuttle/agent/{node}": Grant(role=Role.ROUTER)}, "for an agent"),
        ({"{node}": AGENT_OF}, "one {node} at the end"),
        ({"spiffe://{node}/agent/{node}": AGENT_OF}, "one {node} at the end"),
        ({"spiffe://kvshuttle/agent/{node}/x": AGENT_OF}, "one {node} at the end"),
        ({PATTERN: Grant(role=Role.AGENT, node="nodes/d0")}, "must be 'nodes/{node}'"),
        ({"spiffe://kvshuttle/agent/d0": AGENT_OF}, "one {node} at the end"),
        ({PATTERN: AGENT_OF, "spiffe://kvshuttle/{node}": AGENT_OF}, "also covers"),
        ({PATTERN: AGENT_OF, "spiffe://kvshuttle/agent/d0": Grant(role=Role.ADMIN)}, "also covers"),
    ],
)
def test_settings_refuse_patterns_that_could_grant_more(identities: dict[str, Grant], message: str) -> None:
    with pytest.raises(ValidationError) as err:
        AuthSettings(identities=identities)
    assert message in str(err.value)


def test_tokens_need_a_grant_of_their_own() -> None:
    settings = AuthSettings(
        identities={PATTERN: AGENT_OF},
        tokens={"spiffe://kvshuttle/agent/d0": SecretStr("tok-agent-d0-0123456789ab")},
    )
    with pytest.raises(ValueError, match="no grant of their own"):
        Authorizer(settings, lambda method, request: pytest.fail("never called"))


def seconds(value: float) -> Duration:
    duration = Duration()
    duration.FromSeconds(int(value))
    return duration


def node(name: str) -> pb.Node:
    return pb.Node(
        name=name,
        role=pb.NODE_ROLE_DECODE,
        engine_id=f"engine-{name.removeprefix('nodes/')}",
        http_endpoint="http://127.0.0.1:8000",
        side_channel_host="127.0.0.1",
        side_channel_port=5600,
        model="m",
        block_size=16,
        kv_bytes_per_token=1024,
    )


@needs_openssl
async def test_per_pod_certificates_over_mtls(tmp_path: Path) -> None:
    make_certs(
        tmp_path,
        {
            "d0": "URI:spiffe://kvshuttle/agent/d0,DNS:kvshuttle-agent",
            "d1": "URI:spiffe://kvshuttle/agent/d1",
            "pool-name": "URI:spiffe://kvshuttle/agent/d0-pool",
            "two-nodes": "URI:spiffe://kvshuttle/agent/d0,URI:spiffe://kvshuttle/agent/d1",
            "wildcard": "URI:spiffe://kvshuttle/agent/*",
        },
    )
    auth = AuthSettings(identities={PATTERN: AGENT_OF, "spiffe://kvshuttle/router": Grant(role=Role.ROUTER)})
    server = build_server(registry_settings("127.0.0.1:0", auth, tmp_path), registry(), CollectorRegistry())
    port = await server.start()

    def channel(name: str) -> grpc.aio.Channel:
        credentials = grpc.ssl_channel_credentials(
            (tmp_path / "ca.pem").read_bytes(),
            (tmp_path / f"{name}.key").read_bytes(),
            (tmp_path / f"{name}.pem").read_bytes(),
        )
        return grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials)

    try:
        async with channel("d0") as d0, channel("d1") as d1:
            agent0, agent1 = pb_grpc.RegistryServiceStub(d0), pb_grpc.RegistryServiceStub(d1)
            await agent0.RegisterNode(pb.RegisterNodeRequest(node=node("nodes/d0"), ttl=seconds(30)))
            await agent1.RegisterNode(pb.RegisterNodeRequest(node=node("nodes/d1"), ttl=seconds(30)))
            # Its pool node is in scope (authorized: the registry answers it is not registered).
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await agent0.DeregisterNode(pb.DeregisterNodeRequest(name="nodes/d0-pool", incarnation=1))
            assert denial(err.value) == ("NOT_FOUND", "NODE_NOT_FOUND")
            # Another node, by any call an agent may make: refused before the registry runs.
            for call in (
                agent0.RegisterNode(pb.RegisterNodeRequest(node=node("nodes/d1"), ttl=seconds(30))),
                agent0.HeartbeatNode(
                    pb.HeartbeatNodeRequest(name="nodes/d1", incarnation=2, ttl=seconds(30))
                ),
                agent0.DeregisterNode(pb.DeregisterNodeRequest(name="nodes/d1", incarnation=2)),
                agent0.ReportBlockEvents(pb.ReportBlockEventsRequest(node="nodes/d1", incarnation=2)),
                agent1.DeregisterNode(pb.DeregisterNodeRequest(name="nodes/d0-pool", incarnation=1)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert denial(err.value) == ("PERMISSION_DENIED", "NODE_NOT_IN_SCOPE")
        for name in ("pool-name", "two-nodes", "wildcard"):
            async with channel(name) as other:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pb_grpc.RegistryServiceStub(other).RegisterNode(
                        pb.RegisterNodeRequest(node=node("nodes/d0"), ttl=seconds(30))
                    )
                assert denial(err.value) == ("UNAUTHENTICATED", "UNAUTHENTICATED"), name
    finally:
        await server.stop()
