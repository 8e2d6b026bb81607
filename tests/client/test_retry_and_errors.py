"""Retries, deadlines and error parsing, against a real grpc.aio server that misbehaves."""

from __future__ import annotations

import random
import time
from datetime import timedelta

import grpc
import grpc.aio
import pytest
from google.protobuf import any_pb2
from google.protobuf.descriptor import ServiceDescriptor
from google.rpc import error_details_pb2, status_pb2
from tests.client.fake_registry import FakeRegistry, closed_port

from kvshuttle.agent.v1 import agent_service_pb2
from kvshuttle.client import AgentClient, ChannelOptions, KvshuttleRpcError, RegistryClient, RouterClient
from kvshuttle.client._base import ServiceClient
from kvshuttle.client.retry import RETRY_POLICY, Retry, backoff_delay, should_retry
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.router.v1 import router_service_pb2

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
RETENTION = "tenants/a/conversations/b/retentions/3"


def _camel_to_snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


@pytest.mark.parametrize(
    ("client_type", "descriptor"),
    [
        (RegistryClient, pb.DESCRIPTOR.services_by_name["RegistryService"]),
        (RouterClient, router_service_pb2.DESCRIPTOR.services_by_name["RouterService"]),
        (AgentClient, agent_service_pb2.DESCRIPTOR.services_by_name["AgentService"]),
    ],
)
def test_every_rpc_is_classified_and_has_a_method(
    client_type: type[ServiceClient], descriptor: ServiceDescriptor
) -> None:
    service = descriptor.full_name
    rpcs = {m.name for m in descriptor.methods}
    assert service == client_type.SERVICE
    assert set(RETRY_POLICY[service]) == rpcs
    for rpc in rpcs:
        assert callable(getattr(client_type, _camel_to_snake(rpc))), rpc


def test_retry_needs_unavailable_and_an_idempotent_call() -> None:
    with_id = pb.PutRetentionRequest(request_id="r-1")
    without_id = pb.PutRetentionRequest()
    assert should_retry(Retry.ALWAYS, pb.GetNodeRequest(), UNAVAILABLE)
    assert not should_retry(Retry.ALWAYS, pb.GetNodeRequest(), grpc.StatusCode.INTERNAL)
    assert not should_retry(Retry.ALWAYS, pb.GetNodeRequest(), grpc.StatusCode.DEADLINE_EXCEEDED)
    assert should_retry(Retry.WITH_REQUEST_ID, with_id, UNAVAILABLE)
    assert not should_retry(Retry.WITH_REQUEST_ID, without_id, UNAVAILABLE)
    assert not should_retry(Retry.NEVER, with_id, UNAVAILABLE)


def test_backoff_is_jittered_under_an_exponential_cap() -> None:
    options = ChannelOptions("x:1", initial_backoff=0.1, max_backoff=0.5)
    rng = random.Random(7)
    for retry, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (10, 0.5)]:
        delays = [backoff_delay(retry, options, rng) for _ in range(200)]
        assert all(0 <= d <= cap for d in delays)
        assert max(delays) > cap * 0.8  # spread over the range, not pinned to 0


async def test_reads_are_retried_on_unavailable(fake: FakeRegistry, client: RegistryClient) -> None:
    fake.add_node("nodes/d0")
    fake.fail("GetNode", UNAVAILABLE, UNAVAILABLE)
    response = await client.get_node("nodes/d0")
    assert response.node.name == "nodes/d0"
    assert fake.calls["GetNode"] == 3


async def test_retries_stop_after_max_attempts(fake: FakeRegistry, client: RegistryClient) -> None:
    fake.fail("ListNodes", *[UNAVAILABLE] * 5)
    with pytest.raises(KvshuttleRpcError) as caught:
        await client.list_nodes()
    assert caught.value.code == UNAVAILABLE
    assert caught.value.attempts == 3
    assert fake.calls["ListNodes"] == 3


async def test_heartbeats_and_renewals_are_retried(fake: FakeRegistry, client: RegistryClient) -> None:
    fake.add_node("nodes/d0")
    fake.add_retention("tenants/a/conversations/b", 3, "nodes/d0")
    fake.fail("HeartbeatNode", UNAVAILABLE)
    fake.fail("RenewRetention", UNAVAILABLE)
    await client.heartbeat_node("nodes/d0", 1, ttl=5)
    await client.renew_retention(RETENTION, timedelta(seconds=5))
    assert fake.calls["HeartbeatNode"] == 2
    assert fake.calls["RenewRetention"] == 2


async def test_register_node_is_never_retried(fake: FakeRegistry, client: RegistryClient) -> None:
    fake.fail("RegisterNode", UNAVAILABLE)
    with pytest.raises(KvshuttleRpcError) as caught:
        await client.register_node(pb.Node(name="nodes/d0"))
    assert caught.value.code == UNAVAILABLE
    assert caught.value.attempts == 1
    assert fake.calls["RegisterNode"] == 1
    assert "nodes/d0" not in fake.nodes


@pytest.mark.parametrize("method", ["DeregisterNode", "ReleaseRetention"])
async def test_other_writes_without_request_id_are_never_retried(
    fake: FakeRegistry, client: RegistryClient, method: str
) -> None:
    fake.add_node("nodes/d0")
    fake.add_retention("tenants/a/conversations/b", 3, "nodes/d0")
    fake.fail(method, UNAVAILABLE)
    with pytest.raises(KvshuttleRpcError):
        if method == "DeregisterNode":
            await client.deregister_node("nodes/d0")
        else:
            await client.release_retention(RETENTION)
    assert fake.calls[method] == 1


async def test_put_retention_is_retried_under_one_request_id(
    fake: FakeRegistry, client: RegistryClient
) -> None:
    fake.add_node("nodes/d0")
    fake.fail("PutRetention", UNAVAILABLE, UNAVAILABLE)
    response = await client.put_retention(
        "tenants/a/conversations/b", pb.Retention(node="nodes/d0", generation=1), ttl=30
    )
    assert response.retention.name == "tenants/a/conversations/b/retentions/1"
    sent = fake.requests["PutRetention"]
    assert len(sent) == 3
    ids = {r.request_id for r in sent}  # type: ignore[attr-defined]
    assert len(ids) == 1
    assert ids != {""}


async def test_put_retention_without_request_id_is_not_retried(
    fake: FakeRegistry, client: RegistryClient
) -> None:
    fake.add_node("nodes/d0")
    fake.fail("PutRetention", UNAVAILABLE)
    with pytest.raises(KvshuttleRpcError):
        await client.put_retention(
            "tenants/a/conversations/b", pb.Retention(node="nodes/d0", generation=1), request_id=""
        )
    assert fake.calls["PutRetention"] == 1


async def test_claim_retry_returns_the_first_claim(fake: FakeRegistry, client: RegistryClient) -> None:
    fake.add_node("nodes/d0")
    fake.add_retention("tenants/a/conversations/b", 3, "nodes/d0")
    fake.fail("ClaimRetention", UNAVAILABLE)
    response = await client.claim_retention(RETENTION, "turns/t1", 2.0, request_id="claim-1")
    assert response.retention.claim.holder == "turns/t1"
    assert fake.calls["ClaimRetention"] == 2
    again = await client.claim_retention(RETENTION, "turns/t1", 2.0, request_id="claim-1")
    assert again.retention.claim.claim_id == response.retention.claim.claim_id


async def test_other_codes_fail_at_once_even_for_reads(fake: FakeRegistry, client: RegistryClient) -> None:
    fake.fail("GetNode", grpc.StatusCode.RESOURCE_EXHAUSTED)
    with pytest.raises(KvshuttleRpcError) as caught:
        await client.get_node("nodes/d0")
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert fake.calls["GetNode"] == 1


async def test_call_timeout_is_the_deadline(fake: FakeRegistry, client: RegistryClient) -> None:
    fake.add_node("nodes/d0")
    fake.delay["GetNode"] = 2.0
    started = time.monotonic()
    with pytest.raises(KvshuttleRpcError) as caught:
        await client.get_node("nodes/d0", timeout=0.2)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert caught.value.reason is None
    assert time.monotonic() - started < 1.5


async def test_default_timeout_applies(fake: FakeRegistry, fake_address: str) -> None:
    fake.delay["ListNodes"] = 2.0
    async with RegistryClient.connect(fake_address, default_timeout=0.2) as client:
        started = time.monotonic()
        with pytest.raises(KvshuttleRpcError) as caught:
            await client.list_nodes()
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 1.5


async def test_the_deadline_covers_all_retries(fake: FakeRegistry, fake_address: str) -> None:
    fake.fail("GetNode", *[UNAVAILABLE] * 50)
    options = ChannelOptions(fake_address, max_attempts=50, initial_backoff=0.2, max_backoff=0.2)
    async with RegistryClient.connect(options) as client:
        started = time.monotonic()
        with pytest.raises(KvshuttleRpcError) as caught:
            await client.get_node("nodes/d0", timeout=0.5)
    assert time.monotonic() - started < 1.0
    assert caught.value.code in (UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert fake.calls["GetNode"] < 50  # the deadline, not max_attempts, ended it


async def test_error_info_is_parsed(fake: FakeRegistry, client: RegistryClient) -> None:
    with pytest.raises(KvshuttleRpcError) as caught:
        await client.get_retention(RETENTION)
    error = caught.value
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert error.reason == "RETENTION_NOT_FOUND"
    assert error.domain == "registry.kvshuttle"
    assert error.method == "/kvshuttle.registry.v1.RegistryService/GetRetention"
    assert str(error) == f"NOT_FOUND (RETENTION_NOT_FOUND): retention {RETENTION} not found"


async def test_invalid_argument_names_the_field(client: RegistryClient) -> None:
    with pytest.raises(KvshuttleRpcError) as caught:
        await client.register_node(pb.Node(name="d0"))
    error = caught.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.field == "node.name"
    assert str(error) == "INVALID_ARGUMENT: node.name: must look like nodes/{node}"


async def test_unreachable_server_is_unavailable_without_reason() -> None:
    address = f"127.0.0.1:{closed_port()}"
    async with RegistryClient.connect(address, initial_backoff=0.001, max_backoff=0.002) as client:
        with pytest.raises(KvshuttleRpcError) as caught:
            await client.get_node("nodes/d0", timeout=2)
    assert caught.value.code == UNAVAILABLE
    assert caught.value.reason is None
    assert caught.value.attempts == 3


def _aio_error(
    code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str | bytes], ...]
) -> grpc.RpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


def test_from_rpc_error_without_details() -> None:
    error = KvshuttleRpcError.from_rpc_error(_aio_error(UNAVAILABLE, "connection refused\nretry", ()))
    assert (error.code, error.reason, error.domain, error.metadata) == (UNAVAILABLE, None, None, {})
    assert str(error) == "UNAVAILABLE: connection refused retry"


def test_from_rpc_error_ignores_a_broken_trailer() -> None:
    error = KvshuttleRpcError.from_rpc_error(
        _aio_error(grpc.StatusCode.ABORTED, "lost", (("grpc-status-details-bin", b"\xff\x00garbage"),))
    )
    assert (error.code, error.reason, error.message) == (grpc.StatusCode.ABORTED, None, "lost")


def test_from_rpc_error_reads_bad_request_field() -> None:
    detail = any_pb2.Any()
    detail.Pack(
        error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field="ttl", description="negative")
            ]
        )
    )
    status = status_pb2.Status(code=3, message="ttl: negative", details=[detail])
    error = KvshuttleRpcError.from_rpc_error(
        _aio_error(
            grpc.StatusCode.INVALID_ARGUMENT,
            "ttl: negative",
            (("grpc-status-details-bin", status.SerializeToString()),),
        )
    )
    assert error.field == "ttl"
    assert error.reason is None


def test_channel_options_validate() -> None:
    with pytest.raises(ValueError, match="go together"):
        ChannelOptions("x:1", cert_chain="c.pem")
    with pytest.raises(ValueError, match="max_attempts"):
        ChannelOptions("x:1", max_attempts=0)
    assert ChannelOptions("x:1", root_certificates="ca.pem").secure
    assert not ChannelOptions("x:1").secure
    assert ChannelOptions.of("x:1", default_timeout=1.0).default_timeout == 1.0
