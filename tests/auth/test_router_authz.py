"""RouterService with authentication on, over a registry with authentication on: a gateway plans,
commits and aborts only for the tenants it is bound to, and lists the ready decode nodes; other
roles plan nothing; the router reaches the registry with its own token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from tests.auth.helpers import ROLES, auth_settings, bearer, denial, token
from tests.router.helpers import BS, KEY, MODEL, PROFILES, Tokens, node, seconds
from tests.support.clock import FakeClock

from kvshuttle.client import RegistryClient
from kvshuttle.client.settings import ServiceConnection
from kvshuttle.core.auth import Role
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.config import RegistrySettings
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.main import build_server as build_registry_server
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as reg_grpc
from kvshuttle.router.config import RouterSettings
from kvshuttle.router.grpc.registry_port import GrpcRegistryPort
from kvshuttle.router.main import build_router, build_server
from kvshuttle.router.policy import RouterPolicy
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.router.v1 import router_service_pb2_grpc as pb_grpc
from kvshuttle.serving.settings import Grant, ServerSettings

ACME = "tenants/acme/conversations/c1"
GLOBEX = "tenants/globex/conversations/c1"
EXTRA = {"gateway-globex": (Grant(role=Role.GATEWAY, tenants=["globex"]), "tok-gateway-globex-0123456789")}
TOKENS = {"gateway-globex": EXTRA["gateway-globex"][1]}


@dataclass
class Env:
    router: pb_grpc.RouterServiceAsyncStub
    registry: reg_grpc.RegistryServiceAsyncStub


def metadata(identity: str) -> tuple[tuple[str, str], ...]:
    if identity in TOKENS:
        return (("authorization", f"Bearer {TOKENS[identity]}"),)
    return bearer(identity)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    clock = FakeClock()
    registry = Registry(InMemoryStore(), clock, BlockIndex(10_000), RegistryLimits())
    reg_server = build_registry_server(
        RegistrySettings(server=ServerSettings(listen="127.0.0.1:0"), auth=auth_settings(EXTRA)),
        registry,
        CollectorRegistry(),
    )
    reg_port = await reg_server.start()
    config = RouterSettings(
        server=ServerSettings(listen="127.0.0.1:0", grace_seconds=1),
        registry=ServiceConnection(address=f"127.0.0.1:{reg_port}", token=SecretStr(token("router"))),
        profiles_file=PROFILES,
        turn_signing_key=SecretStr(KEY),
        policy=RouterPolicy(node_max_age_s=0.0),
        auth=auth_settings(EXTRA),
    )
    registry_client = RegistryClient.connect(config.registry.channel_options())
    metrics = CollectorRegistry()
    router = build_router(config, GrpcRegistryPort(registry_client), clock, metrics)
    server = build_server(config, router, metrics)
    port = await server.start()
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{reg_port}") as reg_channel,
    ):
        e = Env(pb_grpc.RouterServiceStub(channel), reg_grpc.RegistryServiceStub(reg_channel))
        for name, role in (("nodes/p0", reg_pb.NODE_ROLE_PREFILL), ("nodes/d0", reg_pb.NODE_ROLE_DECODE)):
            registered = await e.registry.RegisterNode(
                reg_pb.RegisterNodeRequest(node=node(name, role), ttl=seconds(300)), metadata=bearer("admin")
            )
            await e.registry.HeartbeatNode(
                reg_pb.HeartbeatNodeRequest(
                    name=name,
                    incarnation=registered.node.incarnation,
                    ttl=seconds(300),
                    load=reg_pb.NodeLoad(engine_healthy=True),
                ),
                metadata=bearer("admin"),
            )
        yield e
    await server.stop()
    await registry_client.close()
    registry.close()
    await reg_server.stop()


def plan_request(conversation: str) -> pb.PlanTurnRequest:
    return pb.PlanTurnRequest(
        model=MODEL, prompt_token_ids=list(range(1, 4 * BS + 1)), conversation=conversation
    )


async def plan(env: Env, conversation: str, identity: str | None) -> tuple[str, str] | pb.PlanTurnResponse:
    try:
        return await env.router.PlanTurn(
            plan_request(conversation), metadata=metadata(identity) if identity else ()
        )
    except grpc.aio.AioRpcError as err:
        return denial(err)


async def test_only_gateways_and_admins_plan_and_a_gateway_only_for_its_tenants(env: Env) -> None:
    for identity in ROLES:
        got = await plan(env, ACME, identity)
        if identity in ("gateway-acme", "admin"):
            assert isinstance(got, pb.PlanTurnResponse), (identity, got)
        else:
            assert got == ("PERMISSION_DENIED", "PERMISSION_MISSING"), identity
    assert await plan(env, GLOBEX, "gateway-acme") == ("PERMISSION_DENIED", "TENANT_NOT_IN_SCOPE")
    assert isinstance(await plan(env, GLOBEX, "gateway-globex"), pb.PlanTurnResponse)
    assert await plan(env, ACME, None) == ("UNAUTHENTICATED", "UNAUTHENTICATED")


async def test_a_gateway_cannot_commit_or_abort_another_tenant_s_turn(env: Env) -> None:
    planned = await env.router.PlanTurn(plan_request(ACME), metadata=metadata("gateway-acme"))
    for rpc, request in (
        ("AbortTurn", pb.AbortTurnRequest(turn=planned.turn, reason="test")),
        ("CommitTurn", pb.CommitTurnRequest(turn=planned.turn, token_ids=list(range(1, 4 * BS + 9)))),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await getattr(env.router, rpc)(request, metadata=metadata("gateway-globex"))
        assert denial(err.value) == ("PERMISSION_DENIED", "TENANT_NOT_IN_SCOPE"), rpc
    # The turn is untouched: its own gateway still aborts it.
    await env.router.AbortTurn(
        pb.AbortTurnRequest(turn=planned.turn, reason="done"), metadata=metadata("gateway-acme")
    )


async def test_only_callers_that_plan_turns_list_the_ready_decodes_for_no_tenant_in_particular(
    env: Env,
) -> None:
    request = pb.ListReadyDecodesRequest(model=MODEL)
    for identity in (*ROLES, "gateway-globex", None):
        try:
            got: object = await env.router.ListReadyDecodes(
                request, metadata=metadata(identity) if identity else ()
            )
        except grpc.aio.AioRpcError as err:
            got = denial(err)
        if identity in ("gateway-acme", "gateway-globex", "admin"):
            assert isinstance(got, pb.ListReadyDecodesResponse), (identity, got)
            assert [d.node for d in got.decodes] == ["nodes/d0"]
        elif identity is None:
            assert got == ("UNAUTHENTICATED", "UNAUTHENTICATED")
        else:
            assert got == ("PERMISSION_DENIED", "PERMISSION_MISSING"), identity


async def test_the_router_reaches_the_registry_only_as_itself(env: Env) -> None:
    # The gateway's token is no registry identity with retention rights.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await env.registry.GetConversation(
            reg_pb.GetConversationRequest(name=ACME), metadata=metadata("gateway-acme")
        )
    assert denial(err.value) == ("PERMISSION_DENIED", "PERMISSION_MISSING")


async def test_no_gateway_finds_another_tenants_conversation_or_transcript(env: Env) -> None:
    """A gateway of globex tries every way to learn of acme's retained KV by what it holds: the
    tenant it names is checked against its scope, and within its own tenant nothing of acme's is
    found (the router finds conversations and transcripts per tenant only)."""
    prompt = list(range(1, 4 * BS + 1))
    planned = await env.router.PlanTurn(
        pb.PlanTurnRequest(model=MODEL, prompt_token_ids=prompt, tenant="tenants/acme"),
        metadata=metadata("gateway-acme"),
    )
    assert planned.conversation.startswith("tenants/acme/conversations/anon-")
    key = b"k" * 32
    await env.router.CommitTurn(
        pb.CommitTurnRequest(
            turn=planned.turn,
            token_ids=[*prompt, 7, 8],
            decode_kv_transfer_params=Tokens().decode_params(planned, len(prompt) + 2),
            transcript=pb.TranscriptSpec(lookup_key=key, num_tokens=len(prompt) + 2, answer_sha256=b"a" * 32),
        ),
        metadata=metadata("gateway-acme"),
    )
    for rpc, request in (
        ("PlanTurn", pb.PlanTurnRequest(model=MODEL, prompt_token_ids=[*prompt, 9], tenant="tenants/acme")),
        ("FindTranscript", pb.FindTranscriptRequest(tenant="tenants/acme", model=MODEL, lookup_key=key)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await getattr(env.router, rpc)(request, metadata=metadata("gateway-globex"))
        assert denial(err.value) == ("PERMISSION_DENIED", "TENANT_NOT_IN_SCOPE"), rpc
    # In its own tenant: the same prompt starts a conversation of globex's, the key finds nothing.
    theirs = await env.router.PlanTurn(
        pb.PlanTurnRequest(model=MODEL, prompt_token_ids=[*prompt, 9], tenant="tenants/globex"),
        metadata=metadata("gateway-globex"),
    )
    assert theirs.conversation.startswith("tenants/globex/") and theirs.reusable_tokens == 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await env.router.FindTranscript(
            pb.FindTranscriptRequest(tenant="tenants/globex", model=MODEL, lookup_key=key),
            metadata=metadata("gateway-globex"),
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # Acme's own gateway finds both.
    found = await env.router.FindTranscript(
        pb.FindTranscriptRequest(tenant="tenants/acme", model=MODEL, lookup_key=key),
        metadata=metadata("gateway-acme"),
    )
    assert found.conversation == planned.conversation and list(found.token_ids) == [*prompt, 7, 8]
