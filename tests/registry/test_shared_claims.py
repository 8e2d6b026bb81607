"""Shared claims (ClaimRetentionRequest.shared): the forks of one history reading a pool-held
retention at once. Both stores, a fake clock: who may share, what each claim holds, how each
ends, and that a refused call changes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from tests.support.clock import FakeClock
from tests.support.registry_model import (
    CONV,
    NAME,
    POOL,
    StoreFactory,
    claimed,
    move,
    put,
    state,
    with_pool_node,
)

from kvshuttle.core.errors import Aborted, FailedPrecondition, NotFound
from kvshuttle.core.limits import MAX_SHARED_CLAIMS
from kvshuttle.registry.model import ChangeKind, Retention, RetentionState
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def registry(clock: FakeClock, make_store: StoreFactory) -> Registry:
    return await with_pool_node(make_store(StoreLimits(max_retentions_per_tenant=10)), clock)


async def pooled(registry: Registry, ttl: float = 60) -> Retention:
    """The conversation's retention, moved into the pool node with a lease of `ttl`."""
    taken = await claimed(registry)
    assert taken.claim is not None
    return await registry.move_retention(request_id="", move=move(taken.claim.claim_id), ttl=ttl)


async def share(registry: Registry, holder: str, ttl: float = 10, **kw: Any) -> Retention:
    return await registry.claim_retention(
        request_id=kw.pop("request_id", ""), name=NAME, holder=holder, claim_ttl=ttl, shared=True, **kw
    )


async def test_readers_share_a_pool_held_retention(registry: Registry, clock: FakeClock) -> None:
    moved = await pooled(registry)
    first, second = await share(registry, "child-1"), await share(registry, "child-2")
    assert first.claim is not None and second.claim is not None
    assert first.claim.claim_id != second.claim.claim_id
    assert (first.claim.holder, second.claim.holder) == ("child-1", "child-2")
    # Each reader reads the same KV: the params and the lease are the retention's own.
    assert first.kv_transfer_params == second.kv_transfer_params == moved.kv_transfer_params
    assert first.expire_at == second.expire_at == moved.expire_at
    seen = await registry.get_retention(NAME)
    assert seen.state is RetentionState.CLAIMED and seen.claim is None and len(seen.shared) == 2
    # Neither kind of claim beside them: a single-use reader, an eviction.
    before = await state(registry)
    with pytest.raises(Aborted) as single:
        await registry.claim_retention(request_id="", name=NAME, holder="turn", claim_ttl=5)
    assert single.value.reason == "RETENTION_ALREADY_CLAIMED"
    with pytest.raises(FailedPrecondition) as evict:
        await registry.evict_retention(NAME, node=POOL)
    assert evict.value.reason == "RETENTION_ALREADY_CLAIMED"
    with pytest.raises(FailedPrecondition) as release:
        await registry.release_retention(NAME, claim_id="", force=False)
    assert release.value.reason == "CLAIM_MISMATCH"
    assert await state(registry) == before
    # A release with a shared claim's id ends that claim only; the retention stays.
    await registry.release_retention(NAME, claim_id=first.claim.claim_id, force=False)
    left = await registry.get_retention(NAME)
    assert [c.claim_id for c in left.shared] == [second.claim.claim_id]
    await registry.release_retention(NAME, claim_id=second.claim.claim_id, force=False, keep=True)
    after = await registry.get_retention(NAME)
    assert after.state is RetentionState.ACTIVE and after.shared == ()
    assert after.expire_at == moved.expire_at
    # Live again: a single-use reader may take it now.
    taken = await registry.claim_retention(request_id="", name=NAME, holder="turn", claim_ttl=5)
    assert taken.claim is not None and taken.shared == ()


async def test_only_a_pool_held_unclaimed_retention_is_shared(registry: Registry) -> None:
    await put(registry, 1)  # held by decode: its engine frees the blocks at the first read
    before = await state(registry)
    with pytest.raises(FailedPrecondition) as decode:
        await share(registry, "child-1")
    assert decode.value.reason == "RETENTION_NOT_SHAREABLE"
    assert decode.value.metadata["field"] == "shared"
    assert await state(registry) == before
    taken = await registry.claim_retention(request_id="", name=NAME, holder="router/park", claim_ttl=10)
    assert taken.claim is not None
    await registry.move_retention(request_id="", move=move(taken.claim.claim_id), ttl=60)
    single = await registry.claim_retention(request_id="", name=NAME, holder="turn", claim_ttl=5)
    before = await state(registry)
    with pytest.raises(Aborted) as claimed_once:
        await share(registry, "child-1")
    assert claimed_once.value.reason == "RETENTION_ALREADY_CLAIMED"
    assert await state(registry) == before
    assert single.claim is not None
    with pytest.raises(NotFound):
        await registry.claim_retention(request_id="", name=f"{CONV}/retentions/9", holder="x", claim_ttl=5,
                                       shared=True)  # fmt: skip


async def test_shared_claims_are_bounded(registry: Registry) -> None:
    await pooled(registry)
    for i in range(MAX_SHARED_CLAIMS):
        await share(registry, f"child-{i}")
    before = await state(registry)
    with pytest.raises(Aborted) as full:
        await share(registry, "one-too-many")
    assert full.value.reason == "RETENTION_ALREADY_CLAIMED"
    assert await state(registry) == before


async def test_a_shared_claim_holds_the_retention_past_its_lease(
    registry: Registry, clock: FakeClock
) -> None:
    await pooled(registry, ttl=5)
    reader = await share(registry, "child-1", ttl=20)
    assert reader.claim is not None
    clock.advance(10)  # past the lease, within the claim
    await registry.expire_due()
    kept = await registry.get_retention(NAME)
    assert kept.expire_at < clock.now()  # its lease, as readers must see it
    with pytest.raises(FailedPrecondition) as late:
        await share(registry, "child-2")  # nobody starts a read past the lease
    assert late.value.reason == "RETENTION_EXPIRED"
    # The last reader done: gone, as EXPIRED.
    await registry.release_retention(NAME, claim_id=reader.claim.claim_id, force=False)
    with pytest.raises(NotFound):
        await registry.get_retention(NAME)
    assert (await registry.get_conversation(CONV)).fence_generation == 1


async def test_a_lapsed_shared_claim_lets_the_retention_go(registry: Registry, clock: FakeClock) -> None:
    await pooled(registry, ttl=5)
    await share(registry, "child-1", ttl=8)
    clock.advance(6)
    await registry.expire_due()
    assert len((await registry.get_retention(NAME)).shared) == 1
    clock.advance(3)  # the claim lapsed too
    await registry.expire_due()
    with pytest.raises(NotFound):
        await registry.get_retention(NAME)


async def test_a_lapsed_shared_claim_no_longer_blocks(registry: Registry, clock: FakeClock) -> None:
    await pooled(registry, ttl=60)
    await share(registry, "child-1", ttl=5)
    clock.advance(6)
    taken = await registry.claim_retention(request_id="", name=NAME, holder="turn", claim_ttl=5)
    assert taken.claim is not None and taken.shared == ()


async def test_a_repeated_shared_claim_gets_its_first_answer(registry: Registry) -> None:
    await pooled(registry)
    first = await share(registry, "child-1", request_id="r-1")
    again = await share(registry, "child-1", request_id="r-1")
    assert first.claim is not None and again.claim is not None
    assert again.claim.claim_id == first.claim.claim_id
    assert len((await registry.get_retention(NAME)).shared) == 1
    # The same id asking for a single-use claim is another request.
    with pytest.raises(Exception) as reused:
        await registry.claim_retention(request_id="r-1", name=NAME, holder="child-1", claim_ttl=10)
    assert getattr(reused.value, "reason", "") == "REQUEST_ID_REUSED"
    await registry.release_retention(NAME, claim_id=first.claim.claim_id, force=False)
    with pytest.raises(NotFound):  # the claim ended: its repeat has nothing to answer
        await share(registry, "child-1", request_id="r-1")


async def test_a_put_replaces_a_shared_retention_and_force_removes_one(registry: Registry) -> None:
    await pooled(registry)
    reader = await share(registry, "child-1")
    assert reader.claim is not None
    await put(registry, 2)
    with pytest.raises(NotFound):  # the reader's release finds it gone: nothing to end
        await registry.release_retention(NAME, claim_id=reader.claim.claim_id, force=False)
    # force removes one whatever its readers.
    taken = await registry.claim_retention(
        request_id="", name=f"{CONV}/retentions/2", holder="router/park", claim_ttl=10
    )
    assert taken.claim is not None
    await registry.move_retention(
        request_id="", move=move(taken.claim.claim_id, name=f"{CONV}/retentions/2"), ttl=60
    )
    await registry.claim_retention(
        request_id="", name=f"{CONV}/retentions/2", holder="c", claim_ttl=10, shared=True
    )
    await registry.release_retention(f"{CONV}/retentions/2", claim_id="", force=True)
    with pytest.raises(NotFound):
        await registry.get_retention(f"{CONV}/retentions/2")


async def test_watchers_see_each_shared_claim(registry: Registry) -> None:
    await pooled(registry)
    tenant = registry.watch(parent="tenants/acme", node="")
    reader = await share(registry, "child-1")
    assert reader.claim is not None
    await registry.release_retention(NAME, claim_id=reader.claim.claim_id, force=False)
    registry.close()
    seen = [(c.kind, c.retention.state) async for c in tenant]
    assert seen == [
        (ChangeKind.CLAIMED, RetentionState.CLAIMED),
        (ChangeKind.UNCLAIMED, RetentionState.ACTIVE),
    ]
