"""The registry's domain rules, driven with a fake clock: no sockets, no sleeps."""

from __future__ import annotations

import asyncio
from array import array

import pytest
from tests.support.clock import FakeClock
from tests.support.registry_model import BLOCK, CONV, StoreFactory, put, retention, spec

from kvshuttle.core.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    KvshuttleError,
    NotFound,
    ResourceExhausted,
)
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.core.kv_events import BlockStored, EventBatch
from kvshuttle.core.nodes import NodeLoad, NodeRole
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.model import ChangeKind, Retention, RetentionState
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock, make_store: StoreFactory) -> Registry:
    return Registry(
        make_store(StoreLimits(max_retentions_per_tenant=3)),
        clock,
        BlockIndex(max_blocks_per_node=1000),
        RegistryLimits(),
    )


async def test_node_lease_renews_and_lapses(registry: Registry, clock: FakeClock) -> None:
    node = await registry.register_node(spec(), ttl=10)
    assert node.expire_at == clock.now() + 10
    clock.advance(8)
    await registry.heartbeat_node("nodes/d0", node.incarnation, 10, NodeLoad(running_requests=2))
    clock.advance(8)
    await registry.expire_due()
    assert (await registry.get_node("nodes/d0")).load.running_requests == 2
    clock.advance(2.5)
    result = await registry.expire_due()
    assert [n.node.name for n in result.nodes] == ["nodes/d0"]
    with pytest.raises(NotFound) as err:
        await registry.get_node("nodes/d0")
    assert err.value.reason == "NODE_NOT_FOUND"
    assert registry.stats.expirations["node"] == 1


async def test_old_incarnation_is_fenced(registry: Registry) -> None:
    first = await registry.register_node(spec(), ttl=10)
    second = await registry.register_node(spec(), ttl=10)
    assert second.incarnation > first.incarnation
    with pytest.raises(FailedPrecondition) as err:
        await registry.heartbeat_node("nodes/d0", first.incarnation, 10, NodeLoad())
    assert err.value.reason == "NODE_INCARNATION_MISMATCH"


async def test_node_death_cascades_to_retentions_and_index(registry: Registry, clock: FakeClock) -> None:
    node = await registry.register_node(spec(), ttl=5)
    await put(registry, 1)
    await put(registry, 1, conv="tenants/acme/conversations/c2")
    tokens = tuple(range(BLOCK))
    await registry.report_block_events(
        "nodes/d0",
        node.incarnation,
        [EventBatch(0, 0.0, (BlockStored((7,), None, tokens, BLOCK, None, "GPU"),))],
    )
    assert registry.indexed_blocks("nodes/d0") == 1
    watch = registry.watch(parent="tenants/acme", node="")
    clock.advance(5)
    result = await registry.expire_due()
    lost = result.changes()
    assert {c.kind for c in lost} == {ChangeKind.NODE_LOST}
    assert len(lost) == 2
    assert registry.indexed_blocks("nodes/d0") == 0
    assert (await registry.list_retentions(parent="tenants/acme", node="", page_size=0, page_token=""))[
        0
    ] == []
    registry.close()
    seen = [c.kind async for c in watch]
    assert seen == [ChangeKind.NODE_LOST, ChangeKind.NODE_LOST]


async def test_engine_change_drops_retentions_but_agent_restart_keeps_them(registry: Registry) -> None:
    await registry.register_node(spec(), ttl=10)
    await put(registry, 1)
    await registry.register_node(spec(), ttl=10)  # same engine: the agent restarted
    assert (await registry.get_node("nodes/d0")).retention_count == 1
    await registry.register_node(spec(engine_id="engine-d0-new"), ttl=10)  # the engine restarted
    node = await registry.get_node("nodes/d0")
    assert node.retention_count == 0
    assert node.retained_bytes == 0
    with pytest.raises(NotFound):
        await registry.get_retention(f"{CONV}/retentions/1")


async def test_put_get_and_pin_caps_ttl(registry: Registry, clock: FakeClock) -> None:
    await registry.register_node(spec(), ttl=10)
    r = await put(registry, 3, ttl=600, pin=clock.now() + 100)
    assert r.name == f"{CONV}/retentions/3"
    assert r.expire_at == clock.now() + 100
    got = await registry.get_retention(r.name)
    assert list(got.block_hashes) == list(r.block_hashes)
    assert got.state is RetentionState.ACTIVE
    node = await registry.get_node("nodes/d0")
    assert (node.retained_bytes, node.retention_count) == (100 * 1024, 1)


async def test_put_is_idempotent_by_request_id(registry: Registry) -> None:
    await registry.register_node(spec(), ttl=10)
    first = await put(registry, 1, request_id="req-1")
    again = await put(registry, 1, request_id="req-1")
    assert again.name == first.name
    assert again.create_time == first.create_time
    assert registry.stats.puts == 1


async def test_fencing_rejects_older_and_newer_replaces(registry: Registry) -> None:
    await registry.register_node(spec(), ttl=10)
    await put(registry, 2)
    for stale in (1, 2):
        with pytest.raises(Aborted) as err:
            await put(registry, stale)
        assert err.value.reason == "FENCING_GENERATION_STALE"
    result = await registry.put_retention(request_id="", parent=CONV, retention=retention(3), ttl=60)
    assert result.replaced == f"{CONV}/retentions/2"
    conversation = await registry.get_conversation(CONV)
    assert conversation.fence_generation == 3
    assert conversation.retention is not None
    assert conversation.retention.generation == 3


async def test_fence_outlives_its_retention(registry: Registry, clock: FakeClock) -> None:
    await registry.register_node(spec(), ttl=300)
    r = await put(registry, 5, ttl=10)
    clock.advance(11)
    await registry.expire_due()
    with pytest.raises(NotFound):
        await registry.get_retention(r.name)
    with pytest.raises(Aborted):  # a late commit of an older turn
        await put(registry, 4)


async def test_two_concurrent_claims_exactly_one_wins(registry: Registry) -> None:
    await registry.register_node(spec(), ttl=10)
    r = await put(registry, 1)
    results = await asyncio.gather(
        *(
            registry.claim_retention(request_id="", name=r.name, holder=f"turn-{i}", claim_ttl=5)
            for i in range(8)
        ),
        return_exceptions=True,
    )
    won = [x for x in results if isinstance(x, Retention)]
    lost = [x for x in results if isinstance(x, KvshuttleError)]
    assert len(won) == 1
    assert len(lost) == 7
    assert all(isinstance(e, Aborted) and e.reason == "RETENTION_ALREADY_CLAIMED" for e in lost)
    assert registry.stats.claims["GRANTED"] == 1
    assert registry.stats.claims["RETENTION_ALREADY_CLAIMED"] == 7


async def test_claim_retried_with_same_request_id_returns_the_same_claim(registry: Registry) -> None:
    await registry.register_node(spec(), ttl=10)
    r = await put(registry, 1)
    a = await registry.claim_retention(request_id="claim-1", name=r.name, holder="t", claim_ttl=5)
    b = await registry.claim_retention(request_id="claim-1", name=r.name, holder="t", claim_ttl=5)
    assert a.claim is not None
    assert b.claim is not None
    assert a.claim.claim_id == b.claim.claim_id


async def test_claim_after_deadline_is_expired_even_before_the_timer_runs(
    registry: Registry, clock: FakeClock
) -> None:
    await registry.register_node(spec(), ttl=100)
    r = await put(registry, 1, ttl=10)
    clock.advance(10)
    with pytest.raises(FailedPrecondition) as err:
        await registry.claim_retention(request_id="", name=r.name, holder="t", claim_ttl=5)
    assert err.value.reason == "RETENTION_EXPIRED"


async def test_claim_pins_until_the_claim_lapses_then_removes(registry: Registry, clock: FakeClock) -> None:
    await registry.register_node(spec(), ttl=300)
    r = await put(registry, 1, ttl=10)
    clock.advance(9)
    claimed = await registry.claim_retention(request_id="", name=r.name, holder="t", claim_ttl=30)
    assert claimed.state is RetentionState.CLAIMED
    clock.advance(20)  # past the retention's own ttl
    await registry.expire_due()
    assert (await registry.get_retention(r.name)).state is RetentionState.CLAIMED
    with pytest.raises(FailedPrecondition) as err:
        await registry.renew_retention(r.name, 60)
    assert err.value.reason == "RETENTION_CLAIMED"
    clock.advance(11)
    await registry.expire_due()
    with pytest.raises(NotFound):
        await registry.get_retention(r.name)
    assert registry.stats.expirations["claim"] == 1


async def test_release_of_a_claimed_retention_needs_its_claim(registry: Registry) -> None:
    await registry.register_node(spec(), ttl=100)
    r = await put(registry, 1)
    claimed = await registry.claim_retention(request_id="", name=r.name, holder="t", claim_ttl=5)
    assert claimed.claim is not None
    with pytest.raises(FailedPrecondition) as err:
        await registry.release_retention(r.name, claim_id="someone-else", force=False)
    assert err.value.reason == "CLAIM_MISMATCH"
    await registry.get_retention(r.name)  # unchanged
    await registry.release_retention(r.name, claim_id=claimed.claim.claim_id, force=False)
    with pytest.raises(NotFound):
        await registry.get_retention(r.name)


async def test_renew_is_capped_by_the_pin(registry: Registry, clock: FakeClock) -> None:
    await registry.register_node(spec(), ttl=300)
    r = await put(registry, 1, ttl=10, pin=clock.now() + 30)
    renewed = await registry.renew_retention(r.name, 600)
    assert renewed.expire_at == clock.now() + 30


async def test_list_pages_and_tokens_are_scoped(registry: Registry) -> None:
    await registry.register_node(spec(), ttl=100)
    for c in ("a", "b", "c"):
        await put(registry, 1, conv=f"tenants/acme/conversations/{c}")
    await put(registry, 1, conv="tenants/other/conversations/z")
    page, token = await registry.list_retentions(parent="tenants/acme", node="", page_size=2, page_token="")
    assert [r.conversation for r in page] == ["tenants/acme/conversations/a", "tenants/acme/conversations/b"]
    rest, end = await registry.list_retentions(parent="tenants/acme", node="", page_size=2, page_token=token)
    assert [r.conversation for r in rest] == ["tenants/acme/conversations/c"]
    assert end == ""
    with pytest.raises(InvalidArgument) as err:
        await registry.list_retentions(parent="tenants/other", node="", page_size=2, page_token=token)
    assert err.value.field == "page_token"
    one, _ = await registry.list_retentions(
        parent="tenants/acme/conversations/b", node="", page_size=0, page_token=""
    )
    assert [r.name for r in one] == ["tenants/acme/conversations/b/retentions/1"]


async def test_capacity_per_tenant(registry: Registry) -> None:
    await registry.register_node(spec(), ttl=100)
    for c in ("a", "b", "c"):
        await put(registry, 1, conv=f"tenants/acme/conversations/{c}")
    with pytest.raises(ResourceExhausted) as err:
        await put(registry, 1, conv="tenants/acme/conversations/d")
    assert err.value.reason == "CAPACITY_EXCEEDED"
    await put(registry, 2, conv="tenants/acme/conversations/a")  # a replacement still fits


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: setattr(r, "node", "node-without-collection"), "retention.node"),
        (lambda r: setattr(r, "generation", 0), "retention.generation"),
        (lambda r: setattr(r, "num_tokens", 0), "retention.num_tokens"),
        (lambda r: setattr(r, "block_hashes", array("Q", [1, 2])), "retention.block_hashes"),
        (lambda r: setattr(r, "kv_transfer_params", b""), "retention.kv_transfer_params"),
        (lambda r: setattr(r, "kv_transfer_params", b"x" * 70_000), "retention.kv_transfer_params"),
        (lambda r: setattr(r, "block_size", 0), "retention.block_size"),
    ],
)
async def test_bad_retention_input_names_the_field_and_changes_nothing(
    registry: Registry, mutate: object, field: str
) -> None:
    await registry.register_node(spec(), ttl=100)
    r = retention(1)
    mutate(r)  # type: ignore[operator]
    with pytest.raises(InvalidArgument) as err:
        await registry.put_retention(request_id="", parent=CONV, retention=r, ttl=60)
    assert err.value.field == field
    with pytest.raises(NotFound):
        await registry.get_conversation(CONV)
    await put(registry, 1)  # generation 1 was not consumed by the rejected request


@pytest.mark.parametrize(
    ("parent", "ttl", "field"),
    [
        ("tenants/acme", 60, "parent"),
        ("tenants/acme/conversations/" + "x" * 200, 60, "parent"),
        ("tenants/ac me/conversations/c", 60, "parent"),
        (CONV, 0.5, "ttl"),
        (CONV, 10_000, "ttl"),
    ],
)
async def test_bad_put_arguments(registry: Registry, parent: str, ttl: float, field: str) -> None:
    await registry.register_node(spec(), ttl=100)
    with pytest.raises(InvalidArgument) as err:
        await registry.put_retention(request_id="", parent=parent, retention=retention(1), ttl=ttl)
    assert err.value.field == field
    assert registry.counts_by_kind()["retention"] == 0


async def test_put_on_unknown_node_or_mismatched_block_size(registry: Registry) -> None:
    with pytest.raises(FailedPrecondition) as err:
        await put(registry, 1)
    assert err.value.reason == "NODE_NOT_FOUND"
    await registry.register_node(spec(), ttl=100)
    r = retention(1)
    r.block_size = 32
    r.block_hashes = array("Q", chain_hashes(list(range(100)), 32))
    with pytest.raises(FailedPrecondition) as err:
        await registry.put_retention(request_id="", parent=CONV, retention=r, ttl=60)
    assert err.value.reason == "NODE_MISMATCH"


async def test_bad_node_registration(registry: Registry) -> None:
    bad = spec()
    bad.http_endpoint = "ftp://x"
    with pytest.raises(InvalidArgument) as err:
        await registry.register_node(bad, ttl=10)
    assert err.value.field == "node.http_endpoint"
    bad = spec()
    bad.labels = {f"k{i}": "v" for i in range(17)}
    with pytest.raises(InvalidArgument) as err:
        await registry.register_node(bad, ttl=10)
    assert err.value.field == "node.labels"
    assert registry.counts_by_kind()["node"] == 0


async def test_events_of_an_old_incarnation_are_rejected(registry: Registry) -> None:
    old = await registry.register_node(spec(), ttl=10)
    await registry.register_node(spec(), ttl=10)
    with pytest.raises(FailedPrecondition):
        await registry.report_block_events("nodes/d0", old.incarnation, [EventBatch(0, 0.0, ())])


async def test_lookup_ranks_nodes_by_prefix_held(registry: Registry) -> None:
    p = await registry.register_node(spec("nodes/p0", "engine-p0", NodeRole.PREFILL), ttl=10)
    d = await registry.register_node(spec(), ttl=10)
    tokens = tuple(range(3 * BLOCK))
    await registry.report_block_events(
        "nodes/p0",
        p.incarnation,
        [EventBatch(0, 0.0, (BlockStored((1, 2, 3), None, tokens, BLOCK, None, "GPU"),))],
    )
    await registry.report_block_events(
        "nodes/d0",
        d.incarnation,
        [EventBatch(0, 0.0, (BlockStored((1,), None, tokens[:BLOCK], BLOCK, None, "GPU"),))],
    )
    chain = chain_hashes(tokens, BLOCK)
    assert await registry.lookup_blocks(chain, model="m", role=None) == [("nodes/p0", 3), ("nodes/d0", 1)]
    assert await registry.lookup_blocks(chain, model="m", role=NodeRole.DECODE) == [("nodes/d0", 1)]


async def test_slow_watcher_is_dropped_not_waited_for(clock: FakeClock, make_store: StoreFactory) -> None:
    registry = Registry(make_store(), clock, BlockIndex(100), RegistryLimits(watch_queue_size=2))
    await registry.register_node(spec(), ttl=100)
    sub = registry.watch(parent="tenants/acme", node="")
    for i in range(1, 5):
        await put(registry, i)
    assert registry.stats.watchers_dropped == 1
    with pytest.raises(ResourceExhausted):
        async for _ in sub:
            pass


async def test_watch_needs_exactly_one_scope(registry: Registry) -> None:
    with pytest.raises(InvalidArgument):
        registry.watch(parent="", node="")
    with pytest.raises(InvalidArgument):
        registry.watch(parent="tenants/a", node="nodes/x")


async def test_fences_are_forgotten_fence_ttl_after_the_last_retention(
    clock: FakeClock, make_store: StoreFactory
) -> None:
    registry = Registry(make_store(StoreLimits(fence_ttl=100)), clock, BlockIndex(100), RegistryLimits())
    await registry.register_node(spec(), ttl=300)
    await put(registry, 1, ttl=10)
    clock.advance(50)  # the retention lapsed at 10 and was swept at 50: the fence starts counting
    await registry.expire_due()
    assert (await registry.get_conversation(CONV)).fence_generation == 1
    clock.advance(99)
    await registry.expire_due()
    await registry.get_conversation(CONV)
    clock.advance(1)
    await registry.expire_due()
    with pytest.raises(NotFound):
        await registry.get_conversation(CONV)
    await put(registry, 1)  # forgotten: generation 1 is accepted again


async def test_request_ids_are_scoped_by_their_target(registry: Registry) -> None:
    """Two callers that happen to pick one request id never get each other's answer."""
    await registry.register_node(spec(), ttl=100)
    a = await put(registry, 1, conv="tenants/a/conversations/c", request_id="same")
    b = await put(registry, 1, conv="tenants/b/conversations/c", request_id="same")
    assert (a.name, b.name) == (
        "tenants/a/conversations/c/retentions/1",
        "tenants/b/conversations/c/retentions/1",
    )
    ca = await registry.claim_retention(request_id="same", name=a.name, holder="x", claim_ttl=5)
    cb = await registry.claim_retention(request_id="same", name=b.name, holder="y", claim_ttl=5)
    assert (ca.name, cb.name) == (a.name, b.name)
