"""Pool nodes, MoveRetention and EvictRetention in the registry's domain (the in-memory store
behind the facade), with a fake clock: every rule, and that a refused call changes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from tests.support.clock import FakeClock
from tests.support.registry_model import (
    CONV,
    NAME,
    POOL,
    POOL_HOLDER,
    POOLED,
    StoreFactory,
    claimed,
    move,
    pool_spec,
    put,
    spec,
    state,
    with_pool_node,
)

from kvshuttle.core.errors import Aborted, FailedPrecondition, InvalidArgument, KvshuttleError, NotFound
from kvshuttle.core.nodes import (
    POOL_CAPACITY_LABEL,
    POOL_OF_LABEL,
    NodeLoad,
    NodeRole,
    NodeSpec,
    pool_node_name,
)
from kvshuttle.registry.model import ChangeKind, Holder, Move, RetentionState
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def registry(clock: FakeClock, make_store: StoreFactory) -> Registry:
    return await with_pool_node(make_store(StoreLimits(max_retentions_per_tenant=10)), clock)


# ---- pool nodes -----------------------------------------------------------------------------


async def test_pool_nodes_are_listed_only_as_pool(registry: Registry) -> None:
    await registry.register_node(spec("nodes/b0", "engine-b0", NodeRole.BOTH), ttl=60)

    async def names(role: NodeRole | None) -> list[str]:
        nodes, _ = await registry.list_nodes(role=role, model="", page_size=0, page_token="")
        return [n.name for n in nodes]

    assert await names(None) == ["nodes/b0", "nodes/d0", POOL]
    assert await names(NodeRole.DECODE) == ["nodes/b0", "nodes/d0"]
    assert await names(NodeRole.PREFILL) == ["nodes/b0"]
    assert await names(NodeRole.BOTH) == ["nodes/b0"]
    assert await names(NodeRole.POOL) == [POOL]
    node = await registry.get_node(POOL)
    assert node.spec.role is NodeRole.POOL
    assert node.spec.labels[POOL_OF_LABEL] == "nodes/d0"


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (pool_spec(name="nodes/d0"), "node.name"),  # a pool node is nodes/{node}-pool
        (pool_spec(name="nodes/d0-pool-pool"), "node.name"),  # no pool of a pool
        (pool_spec(labels={}), "node.labels"),
        (pool_spec(labels={POOL_OF_LABEL: "nodes/d1"}), "node.labels"),
        (pool_spec(labels={POOL_OF_LABEL: "nodes/d0", POOL_CAPACITY_LABEL: "1 GiB"}), "node.labels"),
        (spec("nodes/x-pool", "engine-x"), "node.name"),  # reserved for pool nodes
    ],
)
async def test_bad_pool_node_registration(registry: Registry, bad: NodeSpec, field: str) -> None:
    before = await state(registry)
    with pytest.raises(InvalidArgument) as err:
        await registry.register_node(bad, ttl=60)
    assert err.value.field == field
    assert await state(registry) == before


def test_pool_node_name_leaves_room_or_refuses() -> None:
    assert pool_node_name("nodes/x") == "nodes/x-pool"
    longest = "n" * (128 - len("-pool"))
    assert pool_node_name(f"nodes/{longest}") == f"nodes/{longest}-pool"
    for bad in (f"nodes/{longest}n", "nodes/x-pool", "x", "nodes/"):
        with pytest.raises(InvalidArgument):
            pool_node_name(bad)
    assert not NodeRole.POOL.serves(NodeRole.PREFILL)
    assert not NodeRole.POOL.serves(NodeRole.DECODE)
    assert not NodeRole.POOL.serves(NodeRole.BOTH)
    assert NodeRole.POOL.serves(None)
    assert NodeRole.POOL.serves(NodeRole.POOL)
    assert not NodeRole.BOTH.serves(NodeRole.POOL)


# ---- MoveRetention --------------------------------------------------------------------------


async def test_move_hands_the_claimed_retention_to_the_pool_node(
    registry: Registry, clock: FakeClock
) -> None:
    before = await claimed(registry, pin=clock.now() + 100)
    assert before.claim is not None
    clock.advance(2)
    moved = await registry.move_retention(request_id="m-1", move=move(before.claim.claim_id), ttl=500)
    assert (moved.node, moved.holder, moved.kv_transfer_params, moved.kv_bytes) == (
        POOL,
        POOL_HOLDER,
        POOLED,
        99 * 1024,
    )
    assert moved.claim is None and moved.state is RetentionState.ACTIVE
    assert moved.pin_expire_at is None  # the pool node's lease keeps it now, not the engine's pin
    assert moved.expire_at == clock.now() + 500  # past the old pin: the pool holds it
    # What it is stays: name, generation, chain, tokens, creation.
    assert (moved.name, moved.generation, moved.num_tokens, moved.create_time) == (
        before.name,
        before.generation,
        before.num_tokens,
        before.create_time,
    )
    assert list(moved.block_hashes) == list(before.block_hashes)
    assert await registry.get_retention(NAME) == moved
    assert (await registry.get_conversation(CONV)).fence_generation == 1
    decode, pool = await registry.get_node("nodes/d0"), await registry.get_node(POOL)
    assert (decode.retained_bytes, decode.retention_count) == (0, 0)
    assert (pool.retained_bytes, pool.retention_count) == (99 * 1024, 1)
    assert registry.counts_by_kind() == {"node": 2, "retention": 1, "claim": 0}
    assert registry.stats.moves == 1
    listed, _ = await registry.list_retentions(parent="tenants/acme", node=POOL, page_size=0, page_token="")
    assert [r.name for r in listed] == [NAME]
    # Claimable again, by the next turn's reader; and the fence still refuses an older commit.
    again = await registry.claim_retention(request_id="", name=NAME, holder="turn-2", claim_ttl=5)
    assert again.node == POOL
    with pytest.raises(Aborted):
        await put(registry, 1)


async def test_a_moved_retention_lapses_at_its_ttl_or_with_its_pool_node(
    registry: Registry, clock: FakeClock
) -> None:
    first = await claimed(registry)
    assert first.claim is not None
    await registry.move_retention(request_id="", move=move(first.claim.claim_id), ttl=30)
    clock.advance(29)
    await registry.heartbeat_node(
        POOL, (await registry.get_node(POOL)).incarnation, 60, NodeLoad(engine_healthy=True)
    )
    await registry.heartbeat_node(
        "nodes/d0", (await registry.get_node("nodes/d0")).incarnation, 60, NodeLoad(engine_healthy=True)
    )
    await registry.expire_due()
    await registry.get_retention(NAME)
    clock.advance(1)
    result = await registry.expire_due()
    assert [(c.kind, c.retention.name) for c in result.retentions] == [(ChangeKind.EXPIRED, NAME)]
    assert (await registry.get_node(POOL)).retention_count == 0
    # The pool node's lease is the heartbeat that keeps it: its lapse takes the retention along.
    second = await claimed(registry, 2)
    assert second.claim is not None
    await registry.move_retention(
        request_id="", move=move(second.claim.claim_id, name=f"{CONV}/retentions/2"), ttl=600
    )
    await registry.deregister_node(POOL, 0)
    with pytest.raises(NotFound):
        await registry.get_retention(f"{CONV}/retentions/2")
    assert (await registry.get_node("nodes/d0")).retention_count == 0


async def test_renewing_a_moved_retention_is_capped_only_by_the_max_ttl(
    registry: Registry, clock: FakeClock
) -> None:
    first = await claimed(registry, pin=clock.now() + 50)
    assert first.claim is not None
    await registry.move_retention(request_id="", move=move(first.claim.claim_id), ttl=10)
    maximum = registry.limits.retention_ttl.maximum
    renewed = await registry.renew_retention(NAME, maximum)
    assert renewed.expire_at == clock.now() + maximum  # no pin any more
    with pytest.raises(InvalidArgument) as err:
        await registry.renew_retention(NAME, maximum + 1)
    assert err.value.field == "ttl"


async def test_move_error_cases_change_nothing(registry: Registry, clock: FakeClock) -> None:
    await registry.register_node(pool_spec("nodes/d1", model="other"), ttl=60)
    await registry.register_node(pool_spec("nodes/d2", block_size=32), ttl=60)
    await put(registry, 1)
    # Not claimed at all.
    await _refused(registry, move("nope"), FailedPrecondition, "CLAIM_MISMATCH")
    retention = await registry.claim_retention(request_id="", name=NAME, holder="park", claim_ttl=10)
    assert retention.claim is not None
    claim = retention.claim.claim_id
    cases: list[tuple[Move, type[KvshuttleError], str, str | None]] = [
        (move(claim, name=f"{CONV}/retentions/7"), NotFound, "RETENTION_NOT_FOUND", None),
        (move("another-claim"), FailedPrecondition, "CLAIM_MISMATCH", "claim_id"),
        (move(claim, node="nodes/gone-pool"), NotFound, "NODE_NOT_FOUND", None),
        (
            move(claim, node="nodes/d1-pool", holder=Holder("pool-d1", "127.0.0.1", 5700)),
            FailedPrecondition,
            "NODE_MISMATCH",
            "node",
        ),
        (
            move(claim, node="nodes/d2-pool", holder=Holder("pool-d2", "127.0.0.1", 5700)),
            FailedPrecondition,
            "NODE_MISMATCH",
            "node",
        ),
        (
            move(claim, holder=None),
            FailedPrecondition,
            "NODE_MISMATCH",
            "kv_transfer_params.remote_engine_id",
        ),
        (
            move(claim, holder=Holder("engine-d0", "127.0.0.1", 5601)),
            FailedPrecondition,
            "NODE_MISMATCH",
            "kv_transfer_params.remote_engine_id",
        ),
        (
            move(claim, holder=Holder("pool-d0", "10.0.0.9", 5700)),
            FailedPrecondition,
            "NODE_MISMATCH",
            "kv_transfer_params.remote_host",
        ),
        (
            move(claim, holder=Holder("pool-d0", "127.0.0.1", 5701)),
            FailedPrecondition,
            "NODE_MISMATCH",
            "kv_transfer_params.remote_port",
        ),
    ]
    for bad, error, reason, field in cases:
        info = await _refused(registry, bad, error, reason)
        if field is not None:
            assert info.get("field") == field, (bad, info)
    # The claim lapsed (before the timer ran): the retention is consumed, never moved.
    clock.advance(10)
    await _refused(registry, move(claim), FailedPrecondition, "RETENTION_EXPIRED")


async def _refused(registry: Registry, bad: Move, error: type[KvshuttleError], reason: str) -> dict[str, str]:
    before = await state(registry)
    with pytest.raises(error) as err:
        await registry.move_retention(request_id="m-x", move=bad, ttl=60)
    assert err.value.reason == reason, bad
    assert await state(registry) == before, bad
    assert registry.stats.moves == 0
    return dict(err.value.metadata)


@pytest.mark.parametrize(
    ("kw", "ttl", "request_id", "field"),
    [
        ({"name": "tenants/acme/conversations/c1"}, 60, "", "name"),
        ({"claim_id": ""}, 60, "", "claim_id"),
        ({"claim_id": "c" * 300}, 60, "", "claim_id"),
        ({"node": "d0-pool"}, 60, "", "node"),
        ({"kv_transfer_params": b""}, 60, "", "kv_transfer_params"),
        ({"kv_transfer_params": b"x" * (64 * 1024 + 1)}, 60, "", "kv_transfer_params"),
        ({"kv_bytes": 2**47}, 60, "", "kv_bytes"),
        ({}, 10**6, "", "ttl"),
        ({}, -1, "", "ttl"),
        ({}, 60, "bad id!", "request_id"),
    ],
)
async def test_bad_move_arguments_name_the_field(
    registry: Registry, kw: dict[str, Any], ttl: float, request_id: str, field: str
) -> None:
    retention = await claimed(registry)
    assert retention.claim is not None
    before = await state(registry)
    with pytest.raises(InvalidArgument) as err:
        await registry.move_retention(
            request_id=request_id, move=move(**{"claim_id": retention.claim.claim_id, **kw}), ttl=ttl
        )
    assert err.value.field == field
    assert await state(registry) == before


async def test_move_is_idempotent_by_request_id(registry: Registry, clock: FakeClock) -> None:
    retention = await claimed(registry)
    assert retention.claim is not None
    claim = retention.claim.claim_id
    first = await registry.move_retention(request_id="m-1", move=move(claim), ttl=60)
    clock.advance(5)
    again = await registry.move_retention(request_id="m-1", move=move(claim), ttl=90)  # ttl not compared
    assert again == first
    assert registry.stats.moves == 1
    assert (await registry.get_node(POOL)).retention_count == 1
    # Same id, another move: refused, nothing changes.
    before = await state(registry)
    with pytest.raises(InvalidArgument) as err:
        await registry.move_retention(request_id="m-1", move=move(claim, kv_bytes=1), ttl=60)
    assert err.value.reason == "REQUEST_ID_REUSED"
    assert await state(registry) == before
    # Without the id, a resend meets the claim it ended.
    with pytest.raises(FailedPrecondition) as refused:
        await registry.move_retention(request_id="", move=move(claim), ttl=60)
    assert refused.value.reason == "CLAIM_MISMATCH"
    # Once the retention is gone, the move has ended.
    await registry.evict_retention(NAME, node=POOL)
    with pytest.raises(NotFound) as gone:
        await registry.move_retention(request_id="m-1", move=move(claim), ttl=60)
    assert gone.value.reason == "RETENTION_NOT_FOUND"


async def test_watchers_see_moves_on_both_nodes_and_evictions(registry: Registry) -> None:
    tenant = registry.watch(parent="tenants/acme", node="")
    decode = registry.watch(parent="", node="nodes/d0")
    pool = registry.watch(parent="", node=POOL)
    retention = await claimed(registry)
    assert retention.claim is not None
    await registry.move_retention(request_id="", move=move(retention.claim.claim_id), ttl=60)
    await registry.evict_retention(NAME, node=POOL)
    registry.close()
    seen = [(c.kind, c.retention.node, c.previous_node) async for c in tenant]
    assert seen == [
        (ChangeKind.PUT, "nodes/d0", ""),
        (ChangeKind.CLAIMED, "nodes/d0", ""),
        (ChangeKind.MOVED, POOL, "nodes/d0"),
        (ChangeKind.EVICTED, POOL, ""),
    ]
    assert [c.kind async for c in decode] == [ChangeKind.PUT, ChangeKind.CLAIMED, ChangeKind.MOVED]
    assert [c.kind async for c in pool] == [ChangeKind.MOVED, ChangeKind.EVICTED]


# ---- EvictRetention -------------------------------------------------------------------------


async def test_evict_removes_it_and_keeps_the_fence(registry: Registry) -> None:
    retention = await claimed(registry)
    assert retention.claim is not None
    await registry.move_retention(request_id="", move=move(retention.claim.claim_id), ttl=60)
    await registry.evict_retention(NAME, node=POOL)
    with pytest.raises(NotFound):
        await registry.get_retention(NAME)
    assert (await registry.get_node(POOL)).retention_count == 0
    assert (await registry.get_node(POOL)).retained_bytes == 0
    assert (await registry.get_conversation(CONV)).fence_generation == 1
    with pytest.raises(Aborted) as stale:
        await put(registry, 1)
    assert stale.value.reason == "FENCING_GENERATION_STALE"
    assert registry.stats.evictions == 1
    # Gone: NOT_FOUND, which the evicting agent reads as done.
    with pytest.raises(NotFound) as gone:
        await registry.evict_retention(NAME, node=POOL)
    assert gone.value.reason == "RETENTION_NOT_FOUND"


async def test_evict_refuses_another_node_s_or_a_claimed_retention(registry: Registry) -> None:
    await put(registry, 1)
    before = await state(registry)
    with pytest.raises(FailedPrecondition) as other:
        await registry.evict_retention(NAME, node=POOL)  # decode holds it
    assert other.value.reason == "NODE_MISMATCH"
    assert await state(registry) == before
    await registry.claim_retention(request_id="", name=NAME, holder="reader", claim_ttl=5)
    before = await state(registry)
    with pytest.raises(FailedPrecondition) as held:
        await registry.evict_retention(NAME, node="nodes/d0")
    assert held.value.reason == "RETENTION_ALREADY_CLAIMED"
    assert await state(registry) == before
    assert registry.stats.evictions == 0


@pytest.mark.parametrize(
    ("name", "node", "field"),
    [(CONV, POOL, "name"), (NAME, "", "node"), (NAME, "d0-pool", "node")],
)
async def test_bad_evict_arguments_name_the_field(
    registry: Registry, name: str, node: str, field: str
) -> None:
    with pytest.raises(InvalidArgument) as err:
        await registry.evict_retention(name, node=node)
    assert err.value.field == field


# ---- a claim given back unread (ReleaseRetention keep) --------------------------------------


async def test_a_claim_given_back_unread_leaves_the_retention_as_it_was(
    registry: Registry, clock: FakeClock
) -> None:
    before = await put(registry, ttl=60)
    taken = await registry.claim_retention(request_id="", name=NAME, holder="router/park", claim_ttl=10)
    assert taken.claim is not None
    with pytest.raises(FailedPrecondition) as err:  # only with its own claim id
        await registry.release_retention(NAME, claim_id="someone-else", force=False, keep=True)
    assert err.value.reason == "CLAIM_MISMATCH"
    with pytest.raises(InvalidArgument) as bad:
        await registry.release_retention(NAME, claim_id=taken.claim.claim_id, force=True, keep=True)
    assert bad.value.field == "keep"
    clock.advance(5)
    await registry.release_retention(NAME, claim_id=taken.claim.claim_id, force=False, keep=True)
    kept = await registry.get_retention(NAME)
    assert kept.claim is None and kept.state is RetentionState.ACTIVE
    assert (kept.node, kept.expire_at, kept.generation) == (before.node, before.expire_at, 1)
    assert registry.counts_by_kind()["claim"] == 0
    # Claimable again, by the next reader; and it still lapses at its own lease.
    again = await registry.claim_retention(request_id="", name=NAME, holder="router/plan", claim_ttl=10)
    assert again.claim is not None
    await registry.release_retention(NAME, claim_id=again.claim.claim_id, force=False, keep=True)
    clock.advance(before.expire_at - clock.now())
    await registry.expire_due()
    with pytest.raises(NotFound):
        await registry.get_retention(NAME)


async def test_a_claim_given_back_after_its_lease_passed_expires_it(
    registry: Registry, clock: FakeClock
) -> None:
    await put(registry, ttl=5)
    taken = await registry.claim_retention(request_id="", name=NAME, holder="router/park", claim_ttl=30)
    assert taken.claim is not None
    clock.advance(10)  # past the retention's own lease, inside the claim's
    await registry.release_retention(NAME, claim_id=taken.claim.claim_id, force=False, keep=True)
    with pytest.raises(NotFound):
        await registry.get_retention(NAME)
    with pytest.raises(FailedPrecondition):  # not claimed (nor there): nothing to give back
        await put(registry, 2, ttl=60)
        await registry.release_retention(f"{CONV}/retentions/2", claim_id="x", force=False, keep=True)
