"""The Redis store across a crash of Redis itself: a real redis-server with AOF on (each test its
own directory and port), SIGKILLed (no shutdown save) and started again on the same files, then
read by NEW RedisStores (registry replicas restarting with it).

- `appendfsync always`: Redis writes and fsyncs each write before it answers, so everything
  acknowledged is in the AOF: every retention, claim, fence, node and remembered answer comes back
  exactly as it was, and a late put below a fence is still refused.
- `appendfsync everysec`: Redis still write()s the AOF before it answers, but fsyncs once a second
  (and postpones the write itself, up to 2 s, while a slow fsync is in flight). A SIGKILL does not
  lose what is in the kernel's page cache, so here (after the state had a second to settle) nothing
  is lost either; the loss window (up to ~1-2 s of writes) is a machine crash or power loss, which a
  test cannot stage. `test_a_burst_just_before_the_kill` measures how much of a burst in flight at
  the kill survives (reported, not asserted, for everysec; asserted complete for always).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from tests.support.clock import FakeClock
from tests.support.redis_server import RedisServer
from tests.support.registry_model import POOL, POOL_HOLDER, POOLED, pool_spec, retention, spec

from kvshuttle.core.errors import Aborted, KvshuttleError, NotFound
from kvshuttle.core.nodes import NodeLoad
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.model import ChangeKind, Move, Retention
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.redis.store import RedisStore

pytestmark = [pytest.mark.redis, pytest.mark.slow]

LIMITS = StoreLimits(max_retentions_per_tenant=10_000, fence_ttl=1000)
TENANT = "tenants/acme"
CONVS = [f"{TENANT}/conversations/c{i}" for i in range(8)]
GONE = f"{TENANT}/conversations/gone"  # its retention lapsed: a lingering fence
RELEASED = f"{TENANT}/conversations/released"  # its retention released: a lingering fence
ALL_CONVS = [*CONVS, GONE, RELEASED]
StartAof = Callable[[str], RedisServer]


def aof(fsync: str) -> list[str]:
    return ["--save", "", "--appendonly", "yes", "--appendfsync", fsync]


@pytest.fixture
def servers() -> Iterator[list[RedisServer]]:
    """Every RedisServer a test starts, killed at its end whatever happened."""
    started: list[RedisServer] = []
    yield started
    for server in started:
        server.kill()


@pytest.fixture
def start_aof(servers: list[RedisServer], tmp_path: Path) -> StartAof:
    """Starts a redis-server with AOF under `appendfsync <fsync>`, in its own dir of tmp_path."""

    def start(fsync: str) -> RedisServer:
        directory = tmp_path / f"redis-{fsync}"
        directory.mkdir()
        server = RedisServer(directory, aof(fsync))
        servers.append(server)
        return server.start()

    return start


@pytest.fixture
async def clients() -> AsyncIterator[list[aioredis.Redis]]:
    opened: list[aioredis.Redis] = []
    yield opened
    for client in opened:
        await client.aclose()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def connect(server: RedisServer, clients: list[aioredis.Redis], *, retry: bool = True) -> aioredis.Redis:
    if retry:
        client = aioredis.Redis(host="127.0.0.1", port=server.port, decode_responses=False)
    else:  # a call to a killed server fails at once (redis-py's default retries for seconds)
        client = aioredis.Redis(
            host="127.0.0.1", port=server.port, decode_responses=False, retry=Retry(NoBackoff(), 0)
        )
    clients.append(client)
    return client


def replica(client: aioredis.Redis, clock: FakeClock) -> Registry:
    return Registry(RedisStore(client, LIMITS), clock, BlockIndex(1000), RegistryLimits())


async def _put(registry: Registry, conv: str, generation: int, ttl: float = 60) -> Retention:
    result = await registry.put_retention(
        request_id="", parent=conv, retention=retention(generation), ttl=ttl
    )
    return result.retention


async def populate(registry: Registry, clock: FakeClock) -> dict[str, Any]:
    """Nodes (a decode node and its pool), retentions over several conversations (each put over
    the ones before it: fences above 1), claims (one with a request id), a move onto the pool
    node, and two lingering fences (a lapsed and a released retention)."""
    nodes = [
        await registry.register_node(spec(), ttl=300),
        await registry.register_node(pool_spec(), ttl=300),
    ]
    for i, conv in enumerate(CONVS):
        for generation in range(1, 2 + i % 4):
            await _put(registry, conv, generation, ttl=60 + 10 * i)
    current = {conv: f"{conv}/retentions/{1 + i % 4}" for i, conv in enumerate(CONVS)}
    claim = await registry.claim_retention(
        request_id="claim-1", name=current[CONVS[0]], holder="router/turn-1", claim_ttl=30
    )
    await registry.claim_retention(
        request_id="", name=current[CONVS[1]], holder="router/turn-2", claim_ttl=45
    )
    parked = await registry.claim_retention(
        request_id="", name=current[CONVS[2]], holder="router/park", claim_ttl=30
    )
    assert parked.claim is not None
    moved = await registry.move_retention(
        request_id="move-1",
        move=Move(
            name=parked.name,
            claim_id=parked.claim.claim_id,
            node=POOL,
            kv_transfer_params=POOLED,
            kv_bytes=99 * 1024,
            holder=POOL_HOLDER,
        ),
        ttl=300,
    )
    assert moved.node == POOL
    await _put(registry, GONE, 5, ttl=5)
    await _put(registry, RELEASED, 3)
    await registry.release_retention(f"{RELEASED}/retentions/3", claim_id="", force=False)
    clock.advance(6)
    lapsed = await registry.expire_due()  # GONE's retention lapses; its fence lingers
    assert [c.retention.name for c in lapsed.retentions] == [f"{GONE}/retentions/5"]
    return {"nodes": nodes, "claim": claim, "current": current}


async def snapshot(registry: Registry) -> dict[str, Any]:
    """What a replica serves: every node, retention (with its claim) and conversation (fence)."""
    nodes, _ = await registry.list_nodes(role=None, model="", page_size=0, page_token="")
    retentions, _ = await registry.list_retentions(parent=TENANT, node="", page_size=0, page_token="")
    by_node = {
        n.name: (await registry.list_retentions(parent=TENANT, node=n.name, page_size=0, page_token=""))[0]
        for n in nodes
    }
    conversations = [await registry.get_conversation(c) for c in ALL_CONVS]
    await registry.expire_due()  # refreshes this replica's counts (nothing is due)
    return {
        "nodes": nodes,
        "retentions": retentions,
        "by_node": by_node,
        "conversations": conversations,
        "counts": registry.counts_by_kind(),
    }


async def keyspace(client: aioredis.Redis) -> dict[bytes, tuple[bytes, Any, bool]]:
    """Every key's type, contents and whether it has a TTL: the server's whole state."""
    out: dict[bytes, tuple[bytes, Any, bool]] = {}
    async for key in client.scan_iter(count=1000):
        kind = await client.type(key)
        value: Any
        if kind == b"hash":
            value = await cast("Awaitable[dict[bytes, bytes]]", client.hgetall(key))
        elif kind == b"zset":
            value = await client.zrange(key, 0, -1, withscores=True)
        elif kind == b"set":
            value = await cast("Awaitable[set[bytes]]", client.smembers(key))
        elif kind == b"string":
            value = await client.get(key)
        else:
            value = kind
        out[key] = (kind, value, await client.pttl(key) > 0)
    return out


async def crash_and_restart(server: RedisServer, client: aioredis.Redis) -> None:
    await client.aclose()
    server.kill()  # SIGKILL: no shutdown save, no final fsync
    server.start()  # the same dir: it loads the AOF


@pytest.mark.parametrize("fsync", ["always", "everysec"])
async def test_a_redis_crash_loses_no_retention_claim_fence_or_node(
    fsync: str, start_aof: StartAof, clients: list[aioredis.Redis], clock: FakeClock
) -> None:
    server = start_aof(fsync)
    client = connect(server, clients)
    first = replica(client, clock)
    state = await populate(first, clock)
    before = await snapshot(first)
    raw_before = await keyspace(client)
    assert len(before["retentions"]) == len(CONVS)
    assert before["counts"] == {"node": 2, "retention": len(CONVS) - 2, "claim": 2}
    assert [r.name for r in before["by_node"][POOL]] == [state["current"][CONVS[2]]]
    if fsync == "everysec":
        await asyncio.sleep(1.2)  # past the once-a-second fsync: the state is on disk
    first.close()

    await crash_and_restart(server, client)

    client = connect(server, clients)
    second = replica(client, clock)  # a replica restarting: a new store, nothing cached
    assert await keyspace(client) == raw_before
    assert await snapshot(second) == before
    # The remembered first answer of a request id survives: a retried claim gets the same claim.
    again = await second.claim_retention(
        request_id="claim-1", name=state["current"][CONVS[0]], holder="router/turn-1", claim_ttl=30
    )
    assert again == state["claim"]
    # The fences hold: a late commit of an older turn is refused, on live and lingering fences.
    for conv, generation in [(CONVS[3], 3), (CONVS[3], 1), (CONVS[0], 1), (GONE, 4), (RELEASED, 2)]:
        with pytest.raises(Aborted) as stale:
            await _put(second, conv, generation)
        assert stale.value.reason == "FENCING_GENERATION_STALE", (conv, generation)
    with pytest.raises(NotFound):
        await second.get_retention(f"{GONE}/retentions/5")
    # The nodes' leases are theirs still: heartbeats at their incarnation, a newer put.
    for node in state["nodes"]:
        await second.heartbeat_node(node.name, node.incarnation, 300, NodeLoad())
    newer = await _put(second, CONVS[3], 5)
    assert (await second.get_conversation(CONVS[3])).retention == newer
    assert (await second.register_node(spec("nodes/d1", "engine-d1"), ttl=60)).incarnation > max(
        n.incarnation for n in state["nodes"]
    )


async def test_the_restarted_store_expires_what_is_due_exactly_once(
    start_aof: StartAof, clients: list[aioredis.Redis], clock: FakeClock
) -> None:
    server = start_aof("always")
    client = connect(server, clients)
    first = replica(client, clock)
    await populate(first, clock)
    before = await snapshot(first)
    first.close()
    await crash_and_restart(server, client)

    # Now 91 s after the puts: past both claims (30, 45 s) and c3's lease (90 s); not the others'
    # (c2's, moved: 300 s; c4..c7: 100..130 s).
    clock.advance(85)
    now = clock.now()
    due = sorted(
        r.name
        for r in before["retentions"]
        if r.expire_at <= now or (r.claim is not None and r.claim.expire_at <= now)
    )
    assert due == sorted(f"{c}/retentions/{1 + i % 4}" for i, c in enumerate(CONVS) if i in (0, 1, 3))
    client = connect(server, clients)
    a, b = replica(client, clock), replica(client, clock)
    results = await asyncio.gather(a.expire_due(), b.expire_due(), a.expire_due(), b.expire_due())
    emitted = sorted(c.retention.name for result in results for c in result.retentions)
    assert emitted == due  # each exactly once, across the two replicas
    assert all(c.kind is ChangeKind.EXPIRED for result in results for c in result.retentions)
    assert not any(result.nodes for result in results)
    claims = a.stats.expirations["claim"] + b.stats.expirations["claim"]
    assert claims == sum(1 for r in before["retentions"] if r.name in due and r.claim is not None)
    for registry in (a, b):
        assert not (await registry.expire_due()).changes()
    left, _ = await a.list_retentions(parent=TENANT, node="", page_size=0, page_token="")
    assert sorted(r.name for r in left) == sorted(r.name for r in before["retentions"] if r.name not in due)

    # And once means once across another crash: what was expired stays expired, unemitted.
    await crash_and_restart(server, client)
    client = connect(server, clients)
    third = replica(client, clock)
    assert not (await third.expire_due()).changes()
    for name in due:
        with pytest.raises(NotFound):
            await third.get_retention(name)


@pytest.mark.parametrize("fsync", ["always", "everysec"])
async def test_a_burst_just_before_the_kill(
    fsync: str,
    start_aof: StartAof,
    clients: list[aioredis.Redis],
    clock: FakeClock,
    record_property: Any,
) -> None:
    """16 writers put retentions as fast as they can; Redis is SIGKILLed after the 300th answer,
    with puts still in flight. Every acknowledged put must be back under `always`; under
    `everysec` the count is a measurement (run with -s to see it, or read the JUnit property)."""
    server = start_aof(fsync)
    client = connect(server, clients, retry=False)
    writer = replica(client, clock)
    await writer.register_node(spec(), ttl=300)
    await asyncio.sleep(1.2)  # the node is fsynced under both policies
    acked: list[str] = []
    enough = asyncio.Event()

    async def write(w: int) -> None:
        for k in range(10_000):
            try:
                r = await _put(writer, f"{TENANT}/conversations/burst-{w}-{k}", 1)
            except (KvshuttleError, aioredis.RedisError, OSError):
                return  # the server is gone
            acked.append(r.name)
            if len(acked) >= 300:
                enough.set()

    tasks = [asyncio.create_task(write(w)) for w in range(16)]
    await enough.wait()
    server.kill()  # mid-burst: writes acknowledged a moment ago, others in flight
    at_kill = list(acked)
    await asyncio.gather(*tasks)
    writer.close()
    await client.aclose()
    server.start()

    client = connect(server, clients)
    reader = replica(client, clock)
    await reader.expire_due()  # a sweep over half-done puts must not fail
    present = set()
    for name in at_kill:
        try:
            await reader.get_retention(name)
            present.add(name)
        except NotFound:
            pass
    survived = len(present)
    record_property("acknowledged_before_kill", len(at_kill))
    record_property("acknowledged_survived", survived)
    print(f"\nappendfsync {fsync}: {survived} of {len(at_kill)} acknowledged puts survived the SIGKILL")
    if fsync == "always":
        assert survived == len(at_kill)
