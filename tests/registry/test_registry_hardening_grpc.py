"""Hostile and out-of-range input over a real registry gRPC server (issue 9, sections 2 and 5):
KV is read only from nodes the registry knows, and bad input never reaches INTERNAL. Each case
asserts the code, the ErrorInfo reason and field, and that the registry's state did not change."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from tests.support.registry_env import RegistryEnv, start_registry
from tests.support.registry_messages import CONV, error_info, node, register, retention, rpc_error, seconds

from kvshuttle.core import limits
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.registry.v1 import registry_service_pb2 as pb

TENANT_A = "tenants/a/conversations/c1"


async def snapshot(env: RegistryEnv, conversations: tuple[str, ...] = (CONV, TENANT_A)) -> Any:
    """Every record a rejected request must leave alone: nodes, retentions, fences."""
    nodes = (await env.stub.ListNodes(pb.ListNodesRequest())).nodes
    listed: list[bytes] = []
    fences: list[int | None] = []
    for conversation in conversations:
        tenant = "/".join(conversation.split("/")[:2])
        page = await env.stub.ListRetentions(pb.ListRetentionsRequest(parent=tenant))
        listed += [r.SerializeToString(deterministic=True) for r in page.retentions]
        try:
            got = await env.stub.GetConversation(pb.GetConversationRequest(name=conversation))
            fences.append(got.conversation.fence_generation)
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND
            fences.append(None)
    return [n.SerializeToString(deterministic=True) for n in nodes], listed, fences


async def refused(
    env: RegistryEnv, call: Any, code: grpc.StatusCode, reason: str, field: str | None = None
) -> grpc.aio.AioRpcError:
    err = await rpc_error(call)
    assert err.code() == code, err.details()
    info = error_info(err)
    assert (info.reason, info.domain) == (reason, "registry.kvshuttle")
    if field is not None:
        assert info.metadata["field"] == field
    return err


async def put(
    env: RegistryEnv,
    r: pb.Retention,
    *,
    parent: str = CONV,
    request_id: str = "",
    ttl: Duration | None = None,
) -> pb.PutRetentionResponse:
    return await env.stub.PutRetention(
        pb.PutRetentionRequest(parent=parent, retention=r, ttl=ttl or seconds(60), request_id=request_id)
    )


# ---- section 2: KV is read only from nodes the registry knows ------------------------------


def _forged(change: dict[str, Any]) -> pb.Retention:
    r = retention(1)
    for key, value in change.items():
        if value is None:
            r.kv_transfer_params.ClearField(key)  # type: ignore[arg-type]
        else:
            setattr(r.kv_transfer_params, key, value)
    return r


@pytest.mark.parametrize(
    ("change", "field"),
    [
        # An attacker's retention for tenant A's conversation, sending readers to its own host.
        (
            {"remote_engine_id": "attacker", "remote_host": "203.0.113.9", "remote_port": 6666},
            "remote_engine_id",
        ),
        ({"remote_host": "203.0.113.9"}, "remote_host"),
        ({"remote_port": 6666}, "remote_port"),
        ({"remote_engine_id": "engine-p0"}, "remote_engine_id"),  # another registered node's
        ({"remote_engine_id": None, "remote_host": None, "remote_port": None}, "remote_engine_id"),
    ],
    ids=["all-forged", "host", "port", "another-node-engine", "none-named"],
)
async def test_a_forged_retention_is_node_mismatch_and_stores_nothing(
    registry_env: RegistryEnv, change: dict[str, Any], field: str
) -> None:
    await register(registry_env)
    await register(registry_env, node("nodes/p0", "engine-p0", pb.NODE_ROLE_PREFILL))
    before = await snapshot(registry_env)

    await refused(
        registry_env,
        put(registry_env, _forged(change), parent=TENANT_A, request_id="forge-1"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "NODE_MISMATCH",
        f"retention.kv_transfer_params.{field}",
    )

    assert await snapshot(registry_env) == before  # no retention, no fence for tenant A
    assert registry_env.registry.stats.puts == 0
    # The request id was not spent on the refusal: the honest retention goes in under it.
    stored = (await put(registry_env, retention(1), parent=TENANT_A, request_id="forge-1")).retention
    assert stored.kv_transfer_params.remote_host == "127.0.0.1"


@pytest.mark.parametrize(
    ("extra", "what"),
    [({f"k{i}": i for i in range(33)}, "keys"), ({"k": "x" * 5000}, "bytes")],
)
async def test_unknown_params_fields_are_bounded(registry_env: RegistryEnv, extra: Any, what: str) -> None:
    await register(registry_env)
    before = await snapshot(registry_env)
    r = retention(1)
    r.kv_transfer_params.extra.update(extra)
    await refused(
        registry_env,
        put(registry_env, r),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        "retention.kv_transfer_params.extra",
    )
    assert await snapshot(registry_env) == before
    within = retention(1)
    within.kv_transfer_params.extra.update({f"k{i}": i for i in range(32)})
    assert (
        await put(registry_env, within)
    ).retention.kv_transfer_params.extra == within.kv_transfer_params.extra


# ---- section 5: integers that are summed, incremented or echoed ----------------------------


async def test_kv_bytes_beyond_the_bound_are_refused_and_nodes_stay_listable(
    registry_env: RegistryEnv,
) -> None:
    await register(registry_env)
    before = await snapshot(registry_env)
    for kv_bytes in (2**64 - 1, limits.MAX_KV_BYTES + 1):
        r = retention(1)
        r.kv_bytes = kv_bytes
        await refused(
            registry_env,
            put(registry_env, r),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "retention.kv_bytes",
        )
    assert await snapshot(registry_env) == before
    # Two retentions at the bound: the node's sum still fits, and every read of it answers.
    for parent in (CONV, TENANT_A):
        r = retention(1)
        r.kv_bytes = limits.MAX_KV_BYTES
        await put(registry_env, r, parent=parent)
    listed = (await registry_env.stub.ListNodes(pb.ListNodesRequest())).nodes
    got = (await registry_env.stub.GetNode(pb.GetNodeRequest(name="nodes/d0"))).node
    assert [n.retained_bytes for n in listed] == [got.retained_bytes] == [2 * limits.MAX_KV_BYTES]


async def test_kv_bytes_per_token_beyond_the_bound_are_refused(registry_env: RegistryEnv) -> None:
    bad = node("nodes/x", "engine-x")
    bad.kv_bytes_per_token = 2**64 - 1
    await refused(
        registry_env,
        registry_env.stub.RegisterNode(pb.RegisterNodeRequest(node=bad)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        "node.kv_bytes_per_token",
    )
    assert list((await registry_env.stub.ListNodes(pb.ListNodesRequest())).nodes) == []


async def test_a_generation_at_2_63_is_refused_below_it_accepted(registry_env: RegistryEnv) -> None:
    await register(registry_env)
    before = await snapshot(registry_env)
    for generation in (2**64 - 1, 2**63):
        await refused(
            registry_env,
            put(registry_env, retention(generation)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "retention.generation",
        )
    assert await snapshot(registry_env) == before
    top = (await put(registry_env, retention(limits.MAX_GENERATION))).retention
    assert top.name == f"{CONV}/retentions/{2**63 - 1}"
    assert (await registry_env.stub.GetRetention(pb.GetRetentionRequest(name=top.name))).retention == top


async def test_an_event_seq_at_2_63_is_refused_and_applies_nothing(registry_env: RegistryEnv) -> None:
    n = await register(registry_env)
    tokens = list(range(2 * 16))
    stored = pb.BlockEvent(
        stored=pb.BlockStored(block_hashes=[11, 12], token_ids=tokens, block_size=16, medium="GPU")
    )

    def report(*seqs: int) -> Any:
        return registry_env.stub.ReportBlockEvents(
            pb.ReportBlockEventsRequest(
                node="nodes/d0",
                incarnation=n.incarnation,
                batches=[pb.BlockEventBatch(seq=s, events=[stored]) for s in seqs],
            )
        )

    for seqs, field in (((2**64 - 1,), "batches[0].seq"), ((0, 2**63), "batches[1].seq")):
        await refused(
            registry_env, report(*seqs), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", field
        )
        got = (await registry_env.stub.GetNode(pb.GetNodeRequest(name="nodes/d0"))).node
        assert got.indexed_blocks == 0  # nothing of the batch was applied
    # Every later report still answers; the largest seq the bound allows too.
    assert (await report(0)).next_seq == 1
    assert (await report(limits.MAX_EVENT_SEQ)).next_seq == 2**63
    assert (await report(2**63 - 1)).applied_batches == 0  # seen already


# ---- section 5: names, times, durations ---------------------------------------------------


@pytest.mark.parametrize(
    "generation",
    ["\u00b2", "\u0661", "\uff11", "1\u0661", "01", str(2**63), "1e3", "+1", " 1"],
    ids=["superscript-2", "arabic-indic-1", "fullwidth-1", "mixed", "leading-0", "2^63", "1e3", "+1", "sp"],
)
async def test_retention_names_take_ascii_digits_only(registry_env: RegistryEnv, generation: str) -> None:
    await register(registry_env)
    await put(registry_env, retention(1))
    before = await snapshot(registry_env)
    name = f"{CONV}/retentions/{generation}"
    for call in (
        registry_env.stub.GetRetention(pb.GetRetentionRequest(name=name)),
        registry_env.stub.ClaimRetention(pb.ClaimRetentionRequest(name=name, holder="h")),
        registry_env.stub.RenewRetention(pb.RenewRetentionRequest(name=name)),
        registry_env.stub.ReleaseRetention(pb.ReleaseRetentionRequest(name=name, force=True)),
    ):
        await refused(registry_env, call, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "name")
    assert await snapshot(registry_env) == before


def _with_pin(ts: Timestamp) -> pb.Retention:
    r = retention(1)
    r.pin_expire_time.CopyFrom(ts)
    return r


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda env: put(env, _with_pin(Timestamp(seconds=2**62))), "retention.pin_expire_time"),
        (lambda env: put(env, _with_pin(Timestamp(seconds=-(2**62)))), "retention.pin_expire_time"),
        (lambda env: put(env, _with_pin(Timestamp(seconds=253_402_300_800))), "retention.pin_expire_time"),
        (
            lambda env: put(env, _with_pin(Timestamp(seconds=2_000_000_000, nanos=-1))),
            "retention.pin_expire_time",
        ),
        (lambda env: put(env, retention(1), ttl=Duration(seconds=2**62)), "ttl"),
        (lambda env: put(env, retention(1), ttl=Duration(seconds=-(2**62))), "ttl"),
        (lambda env: put(env, retention(1), ttl=Duration(seconds=5, nanos=-1)), "ttl"),
        (
            lambda env: env.stub.ClaimRetention(
                pb.ClaimRetentionRequest(
                    name=f"{CONV}/retentions/1", holder="h", claim_ttl=Duration(seconds=2**62)
                )
            ),
            "claim_ttl",
        ),
        (
            lambda env: env.stub.RenewRetention(
                pb.RenewRetentionRequest(name=f"{CONV}/retentions/1", ttl=Duration(nanos=2**31 - 1))
            ),
            "ttl",
        ),
        (
            lambda env: env.stub.HeartbeatNode(
                pb.HeartbeatNodeRequest(name="nodes/d0", incarnation=1, ttl=Duration(seconds=2**62))
            ),
            "ttl",
        ),
    ],
    ids=[
        "pin-2^62",
        "pin-negative-2^62",
        "pin-year-10000",
        "pin-negative-nanos",
        "ttl-2^62",
        "ttl-negative-2^62",
        "ttl-mixed-signs",
        "claim-ttl-2^62",
        "renew-ttl-nanos",
        "heartbeat-ttl-2^62",
    ],
)
async def test_times_outside_protobufs_range_are_invalid_argument(
    registry_env: RegistryEnv, make: Any, field: str
) -> None:
    await register(registry_env)
    existing = (await put(registry_env, retention(1))).retention
    before = await snapshot(registry_env)
    await refused(
        registry_env, make(registry_env), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", field
    )
    assert await snapshot(registry_env) == before
    assert existing.state == pb.RETENTION_STATE_ACTIVE


# ---- section 5: a request id repeated with another body -----------------------------------


async def test_a_put_request_id_with_another_retention_is_refused(registry_env: RegistryEnv) -> None:
    await register(registry_env)
    first = await put(registry_env, retention(1, tokens=100), request_id="put-1")
    before = await snapshot(registry_env)

    other = retention(2, tokens=100)
    err = await refused(
        registry_env,
        put(registry_env, other, request_id="put-1"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "REQUEST_ID_REUSED",
        "request_id",
    )
    assert "request_id" in (err.details() or "")
    changed = retention(1, tokens=100)
    changed.kv_transfer_params.remote_request_id = "cmpl-other"
    await refused(
        registry_env,
        put(registry_env, changed, request_id="put-1"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "REQUEST_ID_REUSED",
    )
    assert await snapshot(registry_env) == before
    # The same retention again, even with another lease (a retry computes its own): the first
    # response, unchanged.
    registry_env.clock.advance(1)
    again = await put(registry_env, retention(1, tokens=100), request_id="put-1", ttl=seconds(30))
    assert again == first
    assert registry_env.registry.stats.puts == 1


async def test_a_claim_request_id_from_another_holder_gets_no_claim(registry_env: RegistryEnv) -> None:
    await register(registry_env)
    r = (await put(registry_env, retention(1))).retention
    first = await registry_env.stub.ClaimRetention(
        pb.ClaimRetentionRequest(request_id="claim-1", name=r.name, holder="turns/mine", claim_ttl=seconds(5))
    )
    before = await snapshot(registry_env)

    err = await refused(
        registry_env,
        registry_env.stub.ClaimRetention(
            pb.ClaimRetentionRequest(
                request_id="claim-1", name=r.name, holder="turns/thief", claim_ttl=seconds(5)
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "REQUEST_ID_REUSED",
        "request_id",
    )
    assert first.retention.claim.claim_id not in (err.details() or "")
    assert await snapshot(registry_env) == before
    again = await registry_env.stub.ClaimRetention(
        pb.ClaimRetentionRequest(request_id="claim-1", name=r.name, holder="turns/mine", claim_ttl=seconds(5))
    )
    assert again == first
    # Consumed: the claim ended, and so does its idempotent answer.
    await registry_env.stub.ReleaseRetention(
        pb.ReleaseRetentionRequest(name=r.name, claim_id=first.retention.claim.claim_id)
    )
    await refused(
        registry_env,
        registry_env.stub.ClaimRetention(
            pb.ClaimRetentionRequest(
                request_id="claim-1", name=r.name, holder="turns/mine", claim_ttl=seconds(5)
            )
        ),
        grpc.StatusCode.NOT_FOUND,
        "RETENTION_NOT_FOUND",
    )


# ---- section 5: memory bounded by bytes ----------------------------------------------------


@pytest.fixture
async def small_store_env() -> AsyncIterator[tuple[RegistryEnv, InMemoryStore]]:
    store = InMemoryStore(
        StoreLimits(
            max_retentions_per_tenant=1000,
            idempotency_max_bytes=64 * 1024,
            max_lingering_fences=20,
            lingering_fence_max_bytes=8 * 1024,
        )
    )
    env = await start_registry(store)
    yield env, store
    await env.channel.close()
    env.registry.close()
    await env.server.stop()


def _large(generation: int) -> pb.Retention:
    """A retention near the request bounds: 4096 hashes (32 KiB) and ~48 KiB of params."""
    tokens = 4096 * 16
    r = retention(generation, tokens=16)
    r.num_tokens = tokens
    r.block_hashes[:] = list(range(1, 4097))
    r.kv_transfer_params.remote_block_ids[0].block_ids[:] = list(range(1_000_000, 1_012_000))
    r.kv_bytes = tokens * 1024
    return r


async def test_request_ids_and_fences_are_held_to_their_byte_budgets(
    small_store_env: tuple[RegistryEnv, InMemoryStore],
) -> None:
    env, store = small_store_env
    await register(env, ttl=300)
    for i in range(150):
        parent = f"tenants/t/conversations/c{i}"
        r = (await put(env, _large(1), parent=parent, request_id=f"put-{i}")).retention
        claimed = await env.stub.ClaimRetention(
            pb.ClaimRetentionRequest(request_id=f"claim-{i}", name=r.name, holder="h", claim_ttl=seconds(5))
        )
        await env.stub.ReleaseRetention(
            pb.ReleaseRetentionRequest(name=r.name, claim_id=claimed.retention.claim.claim_id)
        )
    counts = store.counts()
    assert counts.retentions == 0
    # Compact answers: a few hundred bytes an entry, not the ~80 KiB retention it answered.
    assert 0 < counts.remembered_request_bytes <= 64 * 1024
    assert counts.remembered_request_bytes / counts.remembered_requests < 1024
    assert counts.lingering_fences <= 20 and counts.lingering_fence_bytes <= 8 * 1024
    assert counts.fenced_conversations == counts.lingering_fences
    assert counts.fences_forgotten_early == 150 - counts.lingering_fences
    # The newest fences are the ones kept: a late commit of an older turn is still refused.
    await refused(
        env,
        put(env, _large(1), parent="tenants/t/conversations/c149"),
        grpc.StatusCode.ABORTED,
        "FENCING_GENERATION_STALE",
    )
    # A repeated put within the budget still gets its first answer, rebuilt from the request.
    again = await put(env, _large(1), parent="tenants/t/conversations/c149", request_id="put-149")
    assert again.retention.name == "tenants/t/conversations/c149/retentions/1"
    assert list(again.retention.block_hashes) == list(range(1, 4097))
