"""RegistryService over a real gRPC server on 127.0.0.1: codes, ErrorInfo, and that rejected
requests change nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from tests.support.registry_env import RegistryEnv, start_registry
from tests.support.registry_messages import (
    BLOCK,
    CONV,
    error_info,
    put,
    register,
    retention,
    rpc_error,
    seconds,
)

from kvshuttle.core.hashing import chain_hashes
from kvshuttle.registry.model import Retention
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.registry.v1 import registry_service_pb2 as pb


async def test_put_get_round_trip(registry_env: RegistryEnv) -> None:
    await register(registry_env)
    r = await put(registry_env, 1, ttl=30)
    assert r.name == f"{CONV}/retentions/1"
    assert r.state == pb.RETENTION_STATE_ACTIVE
    assert r.expire_time.ToNanoseconds() == int((registry_env.clock.now() + 30) * 1e9)
    got = (await registry_env.stub.GetRetention(pb.GetRetentionRequest(name=r.name))).retention
    assert got == r
    assert got.kv_transfer_params.remote_block_ids[0].block_ids == [1, 2, 3]


async def test_expiry_on_the_registry_timer(registry_env: RegistryEnv) -> None:
    await register(registry_env, ttl=100)
    r = await put(registry_env, 1, ttl=5)
    registry_env.clock.advance(5)
    await registry_env.registry.expire_due()
    err = await rpc_error(registry_env.stub.GetRetention(pb.GetRetentionRequest(name=r.name)))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    info = error_info(err)
    assert (info.reason, info.domain) == ("RETENTION_NOT_FOUND", "registry.kvshuttle")


async def test_concurrent_claims_over_grpc_exactly_one_wins(registry_env: RegistryEnv) -> None:
    await register(registry_env)
    r = await put(registry_env)

    async def claim(i: int) -> pb.ClaimRetentionResponse | grpc.aio.AioRpcError:
        try:
            return await registry_env.stub.ClaimRetention(
                pb.ClaimRetentionRequest(name=r.name, holder=f"turns/{i}", claim_ttl=seconds(5))
            )
        except grpc.aio.AioRpcError as err:
            return err

    results = await asyncio.gather(*(claim(i) for i in range(10)))
    won = [x for x in results if isinstance(x, pb.ClaimRetentionResponse)]
    lost = [x for x in results if isinstance(x, grpc.aio.AioRpcError)]
    assert len(won) == 1
    assert won[0].retention.state == pb.RETENTION_STATE_CLAIMED
    assert won[0].retention.kv_transfer_params.remote_engine_id == "engine-d0"
    assert {e.code() for e in lost} == {grpc.StatusCode.ABORTED}
    assert {error_info(e).reason for e in lost} == {"RETENTION_ALREADY_CLAIMED"}


async def test_older_fencing_generation_is_aborted(registry_env: RegistryEnv) -> None:
    await register(registry_env)
    await put(registry_env, 5)
    err = await rpc_error(put(registry_env, 4))
    assert err.code() == grpc.StatusCode.ABORTED
    info = error_info(err)
    assert info.reason == "FENCING_GENERATION_STALE"
    assert info.metadata["fence_generation"] == "5"
    conversation = (
        await registry_env.stub.GetConversation(pb.GetConversationRequest(name=CONV))
    ).conversation
    assert conversation.retention.generation == 5


async def test_node_death_cascades(registry_env: RegistryEnv) -> None:
    await register(registry_env, ttl=3)
    r = await put(registry_env)
    registry_env.clock.advance(3)
    await registry_env.registry.expire_due()
    for call in (
        registry_env.stub.GetRetention(pb.GetRetentionRequest(name=r.name)),
        registry_env.stub.GetNode(pb.GetNodeRequest(name="nodes/d0")),
    ):
        assert (await rpc_error(call)).code() == grpc.StatusCode.NOT_FOUND


async def test_block_index_through_an_engine_restart(registry_env: RegistryEnv) -> None:
    n = await register(registry_env)
    tokens = list(range(2 * BLOCK))

    def stored(seq: int) -> pb.BlockEventBatch:
        return pb.BlockEventBatch(
            seq=seq,
            events=[
                pb.BlockEvent(
                    stored=pb.BlockStored(
                        block_hashes=[11, 12], token_ids=tokens, block_size=BLOCK, medium="GPU"
                    )
                )
            ],
        )

    chain = chain_hashes(tokens, BLOCK)
    report = await registry_env.stub.ReportBlockEvents(
        pb.ReportBlockEventsRequest(
            node="nodes/d0", incarnation=n.incarnation, batches=[stored(0), pb.BlockEventBatch(seq=1)]
        )
    )
    assert (report.applied_batches, report.next_seq) == (2, 2)
    found = await registry_env.stub.LookupBlocks(pb.LookupBlocksRequest(block_hashes=chain))
    assert [(m.node, m.matched_blocks) for m in found.matches] == [("nodes/d0", 2)]
    gap = await registry_env.stub.ReportBlockEvents(
        pb.ReportBlockEventsRequest(
            node="nodes/d0", incarnation=n.incarnation, batches=[pb.BlockEventBatch(seq=5)]
        )
    )
    assert gap.gap_detected
    # The engine restarted: its sequence starts again at 0 and its cache is empty.
    restart = await registry_env.stub.ReportBlockEvents(
        pb.ReportBlockEventsRequest(
            node="nodes/d0", incarnation=n.incarnation, batches=[pb.BlockEventBatch(seq=0)]
        )
    )
    assert restart.engine_restarted
    found = await registry_env.stub.LookupBlocks(pb.LookupBlocksRequest(block_hashes=chain))
    assert list(found.matches) == []
    got = (await registry_env.stub.GetNode(pb.GetNodeRequest(name="nodes/d0"))).node
    assert got.indexed_blocks == 0


async def test_watch_streams_changes(registry_env: RegistryEnv) -> None:
    await register(registry_env, ttl=100)
    stream = registry_env.stub.WatchRetentions(pb.WatchRetentionsRequest(parent="tenants/acme"))
    await asyncio.sleep(0.05)  # let the subscription open before the changes
    r = await put(registry_env, 1, ttl=5)
    await registry_env.stub.ClaimRetention(
        pb.ClaimRetentionRequest(name=r.name, holder="t", claim_ttl=seconds(1))
    )
    registry_env.clock.advance(2)
    await registry_env.registry.expire_due()
    changes = []
    async for change in stream:
        changes.append(change.change)
        if len(changes) == 3:
            break
    stream.cancel()
    assert changes == [pb.RETENTION_CHANGE_PUT, pb.RETENTION_CHANGE_CLAIMED, pb.RETENTION_CHANGE_EXPIRED]


def _bad_requests() -> list[tuple[str, str, Any, str]]:
    too_many_hashes = retention(1)
    too_many_hashes.block_hashes.extend([1] * 70_000)
    no_params = retention(1)
    no_params.ClearField("kv_transfer_params")
    return [
        ("PutRetention", "missing parent", pb.PutRetentionRequest(retention=retention(1)), "parent"),
        (
            "PutRetention",
            "no tenant",
            pb.PutRetentionRequest(parent="conversations/c1", retention=retention(1)),
            "parent",
        ),
        (
            "PutRetention",
            "negative ttl",
            pb.PutRetentionRequest(parent=CONV, retention=retention(1), ttl=seconds(-1)),
            "ttl",
        ),
        (
            "PutRetention",
            "ttl too long",
            pb.PutRetentionRequest(parent=CONV, retention=retention(1), ttl=seconds(86_400)),
            "ttl",
        ),
        (
            "PutRetention",
            "too many hashes",
            pb.PutRetentionRequest(parent=CONV, retention=too_many_hashes),
            "retention.block_hashes",
        ),
        (
            "PutRetention",
            "no params",
            pb.PutRetentionRequest(parent=CONV, retention=no_params),
            "retention.kv_transfer_params",
        ),
        (
            "PutRetention",
            "huge request id",
            pb.PutRetentionRequest(request_id="r" * 500, parent=CONV, retention=retention(1)),
            "request_id",
        ),
        (
            "ClaimRetention",
            "bad name",
            pb.ClaimRetentionRequest(name="tenants/acme/retentions/1", holder="h"),
            "name",
        ),
        (
            "ClaimRetention",
            "generation zero",
            pb.ClaimRetentionRequest(name=f"{CONV}/retentions/0", holder="h"),
            "name",
        ),
        ("ClaimRetention", "no holder", pb.ClaimRetentionRequest(name=f"{CONV}/retentions/1"), "holder"),
        (
            "ListRetentions",
            "negative page",
            pb.ListRetentionsRequest(parent="tenants/acme", page_size=-1),
            "page_size",
        ),
        (
            "ListRetentions",
            "forged token",
            pb.ListRetentionsRequest(parent="tenants/acme", page_token="!!"),
            "page_token",
        ),
        ("RegisterNode", "no role", pb.RegisterNodeRequest(node=pb.Node(name="nodes/x")), "node.role"),
        (
            "RegisterNode",
            "bad port",
            pb.RegisterNodeRequest(
                node=pb.Node(
                    name="nodes/x",
                    role=pb.NODE_ROLE_DECODE,
                    engine_id="e",
                    http_endpoint="http://h:1",
                    side_channel_host="h",
                    side_channel_port=70000,
                    model="m",
                    block_size=16,
                    kv_bytes_per_token=1,
                )
            ),
            "node.side_channel_port",
        ),
        ("HeartbeatNode", "no incarnation", pb.HeartbeatNodeRequest(name="nodes/d0"), "incarnation"),
        (
            "ReportBlockEvents",
            "empty event",
            pb.ReportBlockEventsRequest(
                node="nodes/d0", incarnation=1, batches=[pb.BlockEventBatch(events=[pb.BlockEvent()])]
            ),
            "batches[0].events[0]",
        ),
        (
            "ReportBlockEvents",
            "salt digest not sha-256",
            pb.ReportBlockEventsRequest(
                node="nodes/d0",
                incarnation=1,
                batches=[
                    pb.BlockEventBatch(
                        events=[
                            pb.BlockEvent(
                                stored=pb.BlockStored(
                                    block_hashes=[1],
                                    token_ids=list(range(16)),
                                    block_size=16,
                                    cache_salt_sha256=b"tenant-salt",  # the salt, not its digest
                                )
                            )
                        ]
                    )
                ],
            ),
            "batches[0].events[0].cache_salt_sha256",
        ),
        (
            "LookupBlocks",
            "too many hashes",
            pb.LookupBlocksRequest(block_hashes=[1] * 70_000),
            "block_hashes",
        ),
        ("WatchRetentions", "no scope", pb.WatchRetentionsRequest(), "parent"),
    ]


@pytest.mark.parametrize(
    ("method", "case", "request_msg", "field"),
    _bad_requests(),
    ids=[f"{m}-{c}" for m, c, _, _ in _bad_requests()],
)
async def test_bad_input_is_invalid_argument_and_changes_nothing(
    registry_env: RegistryEnv, method: str, case: str, request_msg: Any, field: str
) -> None:
    await register(registry_env)
    await put(registry_env, 1, parent="tenants/acme/conversations/existing")
    before = registry_env.registry.counts_by_kind()
    call = getattr(registry_env.stub, method)(request_msg)
    if method == "WatchRetentions":
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
        err = caught.value
    else:
        err = await rpc_error(call)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, case
    info = error_info(err)
    assert info.reason == "INVALID_ARGUMENT"
    assert info.metadata["field"] == field
    assert field in (err.details() or "")
    assert registry_env.registry.counts_by_kind() == before
    assert registry_env.registry.stats.puts == 1


async def test_unknown_and_expired_and_claimed_codes(registry_env: RegistryEnv) -> None:
    await register(registry_env, ttl=100)
    missing = await rpc_error(
        registry_env.stub.ClaimRetention(pb.ClaimRetentionRequest(name=f"{CONV}/retentions/9", holder="h"))
    )
    assert (missing.code(), error_info(missing).reason) == (grpc.StatusCode.NOT_FOUND, "RETENTION_NOT_FOUND")
    r = await put(registry_env, 1, ttl=5)
    registry_env.clock.advance(5)  # past its deadline; the timer has not run yet
    expired = await rpc_error(
        registry_env.stub.ClaimRetention(pb.ClaimRetentionRequest(name=r.name, holder="h"))
    )
    assert (expired.code(), error_info(expired).reason) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "RETENTION_EXPIRED",
    )
    r2 = await put(registry_env, 2, ttl=60)
    await registry_env.stub.ClaimRetention(pb.ClaimRetentionRequest(name=r2.name, holder="h"))
    renew = await rpc_error(
        registry_env.stub.RenewRetention(pb.RenewRetentionRequest(name=r2.name, ttl=seconds(30)))
    )
    assert (renew.code(), error_info(renew).reason) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "RETENTION_CLAIMED",
    )


class _GatedStore(InMemoryStore):
    """Holds PutRetention until the test opens the gate: an RPC that is in flight on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def put_retention(self, retention: Retention, ttl: float, now: float, *, request_id: str) -> Any:
        self.entered.set()
        await self.gate.wait()
        return await super().put_retention(retention, ttl, now, request_id=request_id)


async def test_shutdown_drains_in_flight_rpcs() -> None:
    store = _GatedStore()
    env = await start_registry(store)
    try:
        await register(env, ttl=100)
        in_flight = asyncio.create_task(put(env, 1))
        await store.entered.wait()
        stopping = asyncio.create_task(env.server.stop())
        await asyncio.sleep(0.2)
        late = await rpc_error(env.stub.GetNode(pb.GetNodeRequest(name="nodes/d0"), timeout=2))
        assert late.code() == grpc.StatusCode.UNAVAILABLE
        store.gate.set()
        r = await in_flight
        assert r.name == f"{CONV}/retentions/1"
        await stopping
    finally:
        await env.channel.close()
        env.registry.close()
        await env.server.stop()


async def test_claim_metrics_by_outcome(registry_env: RegistryEnv) -> None:
    await register(registry_env)
    r = await put(registry_env)
    await registry_env.stub.ClaimRetention(pb.ClaimRetentionRequest(name=r.name, holder="a"))
    await rpc_error(registry_env.stub.ClaimRetention(pb.ClaimRetentionRequest(name=r.name, holder="b")))
    m = registry_env.metrics
    assert m.get_sample_value("kvshuttle_registry_claims_total", {"outcome": "GRANTED"}) == 1
    assert (
        m.get_sample_value("kvshuttle_registry_claims_total", {"outcome": "RETENTION_ALREADY_CLAIMED"}) == 1
    )
    assert m.get_sample_value("kvshuttle_registry_live_leases", {"kind": "claim"}) == 1


async def test_shutdown_ends_watch_streams_instead_of_waiting_out_the_grace() -> None:
    env = await start_registry()
    try:
        stream = env.stub.WatchRetentions(pb.WatchRetentionsRequest(parent="tenants/acme"))
        await asyncio.sleep(0.05)
        await env.server.stop()
        # Cancelled after the grace period, the stream would raise CANCELLED instead.
        assert [c async for c in stream] == []
        assert await stream.code() == grpc.StatusCode.OK
    finally:
        await env.channel.close()
        env.registry.close()


async def test_rejections_are_counted_by_reason(registry_env: RegistryEnv) -> None:
    await register(registry_env)
    await put(registry_env, 2)
    await rpc_error(put(registry_env, 1))
    await rpc_error(registry_env.stub.GetRetention(pb.GetRetentionRequest(name="bad")))
    m = registry_env.metrics
    labels = {"service": "kvshuttle.registry.v1.RegistryService", "method": "PutRetention"}
    assert (
        m.get_sample_value("kvshuttle_rpc_rejections_total", labels | {"reason": "FENCING_GENERATION_STALE"})
        == 1
    )
    assert (
        m.get_sample_value(
            "kvshuttle_rpc_rejections_total",
            {
                "service": "kvshuttle.registry.v1.RegistryService",
                "method": "GetRetention",
                "reason": "INVALID_ARGUMENT",
            },
        )
        == 1
    )
