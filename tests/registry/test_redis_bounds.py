"""The Redis store's bounds under concurrency, on a real redis-server with two replicas (two
RedisStore instances on their own connections): capacity limits hold however many puts race for
the last places, every removal path gives its place back, a reservation a crashed replica left is
reconciled by the sweeper; remembered request answers stay within their count and byte bounds,
and a replay within them still gets its first answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from tests.support.clock import FakeClock
from tests.support.registry_model import retention, spec

from kvshuttle.core.errors import Aborted, ResourceExhausted
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.model import PutResult
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.redis.store import RedisStore

pytestmark = pytest.mark.redis

TENANT_LIMIT = 10


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def second_client(redis_server: int, redis_client: aioredis.Redis) -> AsyncIterator[aioredis.Redis]:
    """Another replica's own connections (redis_client has flushed the server)."""
    client = aioredis.Redis(host="127.0.0.1", port=redis_server, decode_responses=False)
    yield client
    await client.aclose()


def replicas(
    clients: list[aioredis.Redis], clock: FakeClock, limits: StoreLimits
) -> tuple[list[Registry], list[RedisStore]]:
    stores = [RedisStore(c, limits) for c in clients]
    return [Registry(s, clock, BlockIndex(1000), RegistryLimits()) for s in stores], stores


def conv(i: int | str, tenant: str = "acme") -> str:
    return f"tenants/{tenant}/conversations/k{i}"


async def put(
    registry: Registry, parent: str, generation: int = 1, ttl: float = 60, rid: str = ""
) -> PutResult:
    return await registry.put_retention(
        request_id=rid, parent=parent, retention=retention(generation), ttl=ttl
    )


async def held(client: aioredis.Redis, tenant: str = "acme") -> tuple[int, int]:
    """(what capacity counts for the tenant, the tenant's members of the deadline set)."""
    count = await client.hget("{kvshuttle}:rcount", tenant)  # type: ignore[misc]
    members = [
        m
        for m in await client.zrange("{kvshuttle}:rdl", 0, -1)
        if m.startswith(f"tenants/{tenant}/".encode())
    ]
    return int(count or 0), len(members)


async def live(registry: Registry, tenant: str = "acme") -> int:
    listed, _ = await registry.list_retentions(
        parent=f"tenants/{tenant}", node="", page_size=0, page_token=""
    )
    return len(listed)


async def race(registries: list[Registry], parents: list[str]) -> tuple[list[PutResult], list[BaseException]]:
    results = await asyncio.gather(
        *(put(registries[i % len(registries)], p) for i, p in enumerate(parents)), return_exceptions=True
    )
    won = [r for r in results if isinstance(r, PutResult)]
    lost = [r for r in results if isinstance(r, BaseException)]
    return won, lost


def _capacity_refusal(err: BaseException, limit: str) -> bool:
    return (
        isinstance(err, ResourceExhausted)
        and err.reason == "CAPACITY_EXCEEDED"
        and err.metadata == {"limit": limit}
    )


async def test_concurrent_puts_into_a_nearly_full_tenant_let_exactly_the_free_places_in(
    redis_client: aioredis.Redis, second_client: aioredis.Redis, clock: FakeClock
) -> None:
    registries, _ = replicas(
        [redis_client, second_client], clock, StoreLimits(max_retentions_per_tenant=TENANT_LIMIT)
    )
    await registries[0].register_node(spec(), ttl=300)
    free = 3
    for i in range(TENANT_LIMIT - free):
        await put(registries[i % 2], conv(f"old{i}"))
    for round_ in range(3):
        won, lost = await race(registries, [conv(f"r{round_}-{i}") for i in range(24)])
        assert len(won) == free, lost
        assert len(lost) == 24 - free
        assert all(_capacity_refusal(e, "max_retentions_per_tenant") for e in lost), lost
        assert await held(redis_client) == (TENANT_LIMIT, TENANT_LIMIT)
        assert await live(registries[1]) == TENANT_LIMIT
        # Another tenant is not held to this one's count.
        await put(registries[round_ % 2], conv(round_, tenant="other"))
        # Free the places again: release, expiry and eviction each give theirs back.
        a, b, c = won
        await registries[0].release_retention(a.retention.name, claim_id="", force=False)
        await registries[1].evict_retention(b.retention.name, node="nodes/d0")
        await registries[0].renew_retention(c.retention.name, ttl=60)
        claimed = await registries[1].claim_retention(
            request_id="", name=c.retention.name, holder="h", claim_ttl=1
        )
        assert claimed.claim is not None
        clock.advance(2)
        await asyncio.gather(registries[0].expire_due(), registries[1].expire_due())
        assert await held(redis_client) == (TENANT_LIMIT - free, TENANT_LIMIT - free)
    assert await held(redis_client, "other") == (3, 3)


async def test_the_global_limit_holds_across_tenants(
    redis_client: aioredis.Redis, second_client: aioredis.Redis, clock: FakeClock
) -> None:
    registries, stores = replicas([redis_client, second_client], clock, StoreLimits(max_retentions=8))
    await registries[0].register_node(spec(), ttl=300)
    for i in range(5):
        await put(registries[0], conv(i, tenant=f"t{i}"))
    won, lost = await race(registries, [conv(i, tenant=f"u{i % 4}") for i in range(20)])
    assert len(won) == 3
    assert all(_capacity_refusal(e, "max_retentions") for e in lost), lost
    assert await redis_client.zcard("{kvshuttle}:rdl") == 8
    await stores[1].expire_due(clock.now())
    assert stores[1].counts().retentions == 8
    # A replacement takes no new place, even at the limit.
    again = await put(registries[1], won[0].retention.conversation, generation=2)
    assert again.replaced == won[0].retention.name
    assert await redis_client.zcard("{kvshuttle}:rdl") == 8


async def test_refused_and_replayed_puts_give_their_reservation_back(
    redis_client: aioredis.Redis, second_client: aioredis.Redis, clock: FakeClock
) -> None:
    """Puts of one conversation racing (stale generations, replays of one request id), with the
    tenant one place short of full: the one that got in holds the place, the others none.
    Racing puts of one conversation count each other's reservations until these are given
    back, so at the limit all of them may be refused for capacity (conservative: the next put of
    the conversation, unraced, gets in); never one past the limit, never a count gone wrong."""
    registries, _ = replicas(
        [redis_client, second_client], clock, StoreLimits(max_retentions_per_tenant=TENANT_LIMIT)
    )
    await registries[0].register_node(spec(), ttl=300)
    for i in range(TENANT_LIMIT - 1):
        await put(registries[0], conv(i))
    target = conv("hot")
    results = await asyncio.gather(
        *(put(registries[g % 2], target, generation=1 + g % 3, rid=f"rid-{g % 3}") for g in range(18)),
        return_exceptions=True,
    )
    assert [r for r in results if not isinstance(r, PutResult | Aborted | ResourceExhausted)] == []
    stored = any(isinstance(r, PutResult) for r in results)
    expected = TENANT_LIMIT if stored else TENANT_LIMIT - 1
    assert await held(redis_client) == (expected, expected)
    assert await live(registries[0]) == expected
    if not stored:
        await put(registries[1], target, generation=4)  # unraced, it gets the place
    assert await held(redis_client) == (TENANT_LIMIT, TENANT_LIMIT)
    with pytest.raises(ResourceExhausted):
        await put(registries[1], conv("one-more"))


async def test_a_node_cascade_gives_its_retentions_places_back(
    redis_client: aioredis.Redis, second_client: aioredis.Redis, clock: FakeClock
) -> None:
    registries, _ = replicas(
        [redis_client, second_client], clock, StoreLimits(max_retentions_per_tenant=TENANT_LIMIT)
    )
    node = await registries[0].register_node(spec(), ttl=300)
    won, _ = await race(registries, [conv(i) for i in range(TENANT_LIMIT + 5)])
    assert len(won) == TENANT_LIMIT
    await registries[1].deregister_node("nodes/d0", node.incarnation)
    assert await held(redis_client) == (0, 0)
    await registries[0].register_node(spec(), ttl=300)
    won, _ = await race(registries, [conv(f"again{i}") for i in range(TENANT_LIMIT + 5)])
    assert len(won) == TENANT_LIMIT


async def test_a_reservation_left_by_a_crashed_replica_is_reconciled_by_the_sweeper(
    redis_client: aioredis.Redis, second_client: aioredis.Redis, clock: FakeClock
) -> None:
    registries, stores = replicas(
        [redis_client, second_client], clock, StoreLimits(max_retentions_per_tenant=TENANT_LIMIT)
    )
    await registries[0].register_node(spec(), ttl=300)
    for i in range(TENANT_LIMIT - 2):
        await put(registries[0], conv(i))
    # The replica reserved two places (the first step of a put) and died before its commits.
    for i in range(2):
        added, _, limit = await stores[0].bounds.reserve(
            f"{conv(f'crashed{i}')}/retentions/1", clock.now() + 30
        )
        assert (added, limit) == (True, "")
    with pytest.raises(ResourceExhausted):
        await put(registries[1], conv("refused"))  # held, never overshot
    clock.advance(29)
    await registries[1].expire_due()
    assert await held(redis_client) == (TENANT_LIMIT, TENANT_LIMIT)
    clock.advance(1)
    await registries[1].expire_due()  # due: the names are gone, their places come back
    assert await held(redis_client) == (TENANT_LIMIT - 2, TENANT_LIMIT - 2)
    won, _ = await race(registries, [conv(f"after{i}") for i in range(6)])
    assert len(won) == 2


# ---- remembered request answers ----------------------------------------------------------------


async def _remembered_keys(client: aioredis.Redis) -> list[bytes]:
    return [k async for k in client.scan_iter(match="kvshuttle:*:i:*")]


async def test_remembered_answers_stay_within_their_count_and_replays_within_it_get_the_first_answer(
    redis_client: aioredis.Redis, second_client: aioredis.Redis, clock: FakeClock
) -> None:
    bound = 40
    registries, stores = replicas(
        [redis_client, second_client], clock, StoreLimits(idempotency_max_entries=bound)
    )
    await registries[0].register_node(spec(), ttl=300)
    baseline = (await redis_client.info("memory"))["used_memory"]
    firsts: dict[str, PutResult] = {}
    for i in range(600):  # a flood of request ids, over both replicas
        parent = conv(i % 30)
        rid = f"put-{i}"
        firsts[rid] = await put(registries[i % 2], parent, generation=1 + i // 30, rid=rid)
        if i % 3 == 0:
            r = firsts[rid].retention
            await registries[(i + 1) % 2].claim_retention(
                request_id=f"claim-{i}", name=r.name, holder="h", claim_ttl=5
            )
    keys = await _remembered_keys(redis_client)
    assert len(keys) == bound
    assert await redis_client.zcard("{kvshuttle}:idem") == bound
    grown = (await redis_client.info("memory"))["used_memory"] - baseline
    # 30 retentions and their fences, plus `bound` answers: far below what 800 answers took.
    assert grown < 400 * 1024, grown
    await stores[0].expire_due(clock.now())
    counts = stores[0].counts()
    assert counts.remembered_requests == bound
    # The estimate bounds what Redis holds for them (the answer's key and hash, its index entries).
    measured: list[bytes | str] = [*keys, "{kvshuttle}:idem", "{kvshuttle}:isz"]
    usage = 0
    for k in measured:
        usage += int(await redis_client.memory_usage(k) or 0)
    assert usage < counts.remembered_request_bytes
    # The newest puts are remembered: a replay gets the first answer, on either replica.
    for i in range(580, 600):
        rid = f"put-{i}"
        again = await put(registries[(i + 1) % 2], conv(i % 30), generation=1 + i // 30, rid=rid)
        assert again.retention.name == firsts[rid].retention.name
        assert again.retention.create_time == firsts[rid].retention.create_time
    # The oldest are forgotten: the same request again is a new put, refused by the fence.
    with pytest.raises(Aborted):
        await put(registries[0], conv(0), generation=1, rid="put-0")


async def test_remembered_answers_stay_within_their_bytes_and_age(
    redis_client: aioredis.Redis, clock: FakeClock
) -> None:
    budget = 16 * 1024
    store = RedisStore(redis_client, StoreLimits(idempotency_max_bytes=budget, idempotency_ttl=100))
    registry = Registry(store, clock, BlockIndex(1000), RegistryLimits())
    await registry.register_node(spec(), ttl=300)
    for i in range(300):
        await put(registry, conv(i % 10), generation=1 + i // 10, rid=f"a-much-longer-request-id-{i:06d}")
    await store.expire_due(clock.now())
    counts = store.counts()
    assert 0 < counts.remembered_request_bytes <= budget
    assert len(await _remembered_keys(redis_client)) == counts.remembered_requests < 300
    clock.advance(100)
    await store.expire_due(clock.now())  # aged out: dropped from the index and deleted
    assert store.counts().remembered_requests == 0
    assert await _remembered_keys(redis_client) == []
    assert await redis_client.hget("{kvshuttle}:meta", "ib") == b"0"  # type: ignore[misc]
