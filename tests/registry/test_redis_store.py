"""The Redis store with several registry replicas (RedisStore instances) on one redis-server:
each expiry is emitted once across replicas sweeping together, exactly one claim wins a race
between replicas, and a restarted replica sees every retention and fence."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from tests.support.clock import FakeClock
from tests.support.registry_model import CONV, retention, spec

from kvshuttle.core.errors import Aborted, FailedPrecondition, KvshuttleError, NotFound
from kvshuttle.core.nodes import NodeLoad
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.config import RedisSettings, RegistrySettings
from kvshuttle.registry.feeds.index import LocalIndexFeed
from kvshuttle.registry.feeds.redis_index import RedisIndexFeed
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.main import build_registry
from kvshuttle.registry.model import ChangeKind, Retention
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.registry.store.redis.store import RedisStore

pytestmark = pytest.mark.redis

LIMITS = StoreLimits(max_retentions_per_tenant=1000, fence_ttl=100)


def replica(client: aioredis.Redis, clock: FakeClock) -> Registry:
    return Registry(RedisStore(client, LIMITS), clock, BlockIndex(1000), RegistryLimits())


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def _put(registry: Registry, conv: str, generation: int = 1, ttl: float = 60) -> Retention:
    result = await registry.put_retention(
        request_id="", parent=conv, retention=retention(generation), ttl=ttl
    )
    return result.retention


async def test_each_expiry_is_emitted_once_across_replicas(
    redis_client: aioredis.Redis, clock: FakeClock
) -> None:
    a, b = replica(redis_client, clock), replica(redis_client, clock)
    await a.register_node(spec(), ttl=300)
    names = [(await _put(a if i % 2 else b, f"{CONV}-{i}", ttl=10 + i % 5)).name for i in range(60)]
    # Some claimed (their claim is what lapses), one given back, and node d1 lapsing whole.
    for name in names[:10]:
        await b.claim_retention(request_id="", name=name, holder="h", claim_ttl=3)
    await b.register_node(spec("nodes/d1", "engine-d1"), ttl=12)
    on_d1 = [
        (
            await b.put_retention(
                request_id="", parent=f"{CONV}-d1-{i}", retention=retention(1, node="nodes/d1"), ttl=60
            )
        ).retention.name
        for i in range(5)
    ]
    emitted: list[str] = []
    lost: list[str] = []
    for _ in range(20):
        clock.advance(1)
        results = await asyncio.gather(a.expire_due(), b.expire_due(), a.expire_due(), b.expire_due())
        for result in results:
            for change in result.changes():
                # A sweeper that finds the node already removed by another finishes its cascade
                # with it: each NODE_LOST is still emitted once, by the replica that removed it.
                (lost if change.kind is ChangeKind.NODE_LOST else emitted).append(change.retention.name)
            for node in result.nodes:
                assert node.node.name == "nodes/d1"
    assert sorted(emitted) == sorted(names)  # each exactly once
    assert sorted(lost) == sorted(on_d1)
    assert a.stats.expirations["node"] + b.stats.expirations["node"] == 1
    claims = a.stats.expirations["claim"] + b.stats.expirations["claim"]
    assert claims == 10
    listed, _ = await a.list_retentions(parent="tenants/acme", node="", page_size=0, page_token="")
    assert listed == []
    d0 = await a.get_node("nodes/d0")
    assert (d0.retention_count, d0.retained_bytes) == (0, 0)


async def test_exactly_one_claim_wins_across_replicas(redis_client: aioredis.Redis, clock: FakeClock) -> None:
    replicas = [replica(redis_client, clock) for _ in range(3)]
    await replicas[0].register_node(spec(), ttl=300)
    for round_ in range(40):
        r = await _put(replicas[round_ % 3], CONV, round_ + 1)
        results = await asyncio.gather(
            *(
                replicas[i % 3].claim_retention(request_id="", name=r.name, holder=f"turn-{i}", claim_ttl=5)
                for i in range(9)
            ),
            return_exceptions=True,
        )
        won = [x for x in results if isinstance(x, Retention)]
        refused = [x for x in results if isinstance(x, KvshuttleError)]
        assert len(won) == 1, results
        assert len(refused) == 8
        assert all(isinstance(e, Aborted) and e.reason == "RETENTION_ALREADY_CLAIMED" for e in refused)
        assert won[0].claim is not None
        got = await replicas[(round_ + 1) % 3].get_retention(r.name)
        assert got.claim is not None and got.claim.claim_id == won[0].claim.claim_id


async def test_concurrent_puts_across_replicas_respect_the_fence(
    redis_client: aioredis.Redis, clock: FakeClock
) -> None:
    a, b = replica(redis_client, clock), replica(redis_client, clock)
    await a.register_node(spec(), ttl=300)
    results = await asyncio.gather(
        *(
            (a if g % 2 else b).put_retention(request_id="", parent=CONV, retention=retention(g), ttl=60)
            for g in range(1, 21)
        ),
        return_exceptions=True,
    )
    assert all(not isinstance(x, Exception) or isinstance(x, Aborted) for x in results)
    conversation = await b.get_conversation(CONV)
    assert conversation.retention is not None
    # The newest generation that got in is the one held, and the fence never went back.
    assert conversation.fence_generation == conversation.retention.generation
    assert conversation.fence_generation == max(
        x.retention.generation for x in results if not isinstance(x, BaseException)
    )
    node = await a.get_node("nodes/d0")
    assert node.retention_count == 1


async def test_a_restarted_replica_sees_every_retention_and_fence(
    redis_client: aioredis.Redis, clock: FakeClock
) -> None:
    first = replica(redis_client, clock)
    node = await first.register_node(spec(), ttl=300)
    kept = [await _put(first, f"tenants/acme/conversations/c{i}", 3) for i in range(7)]
    claimed = await first.claim_retention(request_id="claim-1", name=kept[0].name, holder="h", claim_ttl=30)
    gone = await _put(first, "tenants/acme/conversations/gone", 5, ttl=5)
    clock.advance(6)
    await first.expire_due()  # `gone` lapses; its fence lingers
    first.close()

    second = replica(redis_client, clock)  # the restart: a new process, the same Redis
    await second.expire_due()  # refreshes its counts
    assert second.counts_by_kind() == {"node": 1, "retention": 6, "claim": 1}
    listed, _ = await second.list_retentions(parent="tenants/acme", node="", page_size=0, page_token="")
    assert [r.name for r in listed] == sorted(r.name for r in kept)
    for r in kept[1:]:
        assert await second.get_retention(r.name) == r
    again = await second.claim_retention(request_id="claim-1", name=kept[0].name, holder="h", claim_ttl=30)
    assert again == claimed  # its remembered first answer
    with pytest.raises(Aborted) as stale:  # a late commit of an older turn, after the restart
        await _put(second, "tenants/acme/conversations/c3", 2)
    assert stale.value.reason == "FENCING_GENERATION_STALE"
    with pytest.raises(Aborted):
        await _put(second, "tenants/acme/conversations/gone", 4)
    assert (await second.get_conversation("tenants/acme/conversations/gone")).fence_generation == 5
    assert (await second.get_node("nodes/d0")).incarnation == node.incarnation
    await second.heartbeat_node("nodes/d0", node.incarnation, 100, NodeLoad())
    with pytest.raises(NotFound):
        await second.get_retention(gone.name)
    # A new replica's incarnations never collide with the first one's.
    assert (await second.register_node(spec("nodes/d1", "engine-d1"), ttl=10)).incarnation > node.incarnation


async def test_a_cascade_left_undone_is_finished_by_the_next_sweep(
    redis_client: aioredis.Redis, clock: FakeClock
) -> None:
    """A replica that died mid-cascade: the node's `lost` set still names retentions."""
    registry = replica(redis_client, clock)
    store = RedisStore(redis_client, LIMITS)
    await registry.register_node(spec(), ttl=10)
    names = [(await _put(registry, f"{CONV}-{i}", ttl=600)).name for i in range(3)]
    # What the node script does, without the cascade after it.
    out = await store.scripts["remove_node"](
        keys=store.keys.node("nodes/d0"), args=["", repr(clock.now()), "deregister"]
    )
    assert out[0] == b"removed"
    clock.advance(10)
    result = await registry.expire_due()
    assert sorted(c.retention.name for c in result.retentions) == names
    assert {c.kind for c in result.retentions} == {ChangeKind.NODE_LOST}
    assert (await registry.list_nodes(role=None, model="", page_size=0, page_token=""))[0] == []
    for name in names:
        with pytest.raises(NotFound):
            await registry.get_retention(name)
    with pytest.raises(FailedPrecondition):  # the node is gone: nothing is put on it
        await _put(registry, CONV)


async def test_the_registry_runs_on_redis_by_configuration(
    redis_client: aioredis.Redis, redis_server: int, clock: FakeClock
) -> None:
    settings = RegistrySettings(
        store="redis", redis=RedisSettings(url=f"redis://127.0.0.1:{redis_server}/0", key_prefix="cfg")
    )
    registry = build_registry(settings, clock)
    await registry.register_node(spec(), ttl=30)
    assert await redis_client.zrange("{cfg}:nodes", 0, -1) == [b"nodes/d0"]
    # The block index follows the store: replicas share it through the prefix's block stream.
    assert isinstance(registry.index_feed, RedisIndexFeed)
    assert registry.index_feed.key == "{cfg}:blocks"
    memory = build_registry(RegistrySettings(), clock)
    assert isinstance(memory.store, InMemoryStore)
    assert isinstance(memory.index_feed, LocalIndexFeed)
