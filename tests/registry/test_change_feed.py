"""The change feed behind WatchRetentions (kvshuttle.registry.feeds.change and .redis_change):
with the Redis store, two replicas over one redis-server, each replica's watchers see the changes
of both, in one order, each once; a watcher resumes with its last token and gets exactly what it
missed; a token the stream no longer covers is refused; a cancelled reader ends. The in-memory
feed resumes within its process. And WatchRetentions with resume_token over a real gRPC server
on Redis."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace

import grpc
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from tests.support.clock import FakeClock
from tests.support.registry_env import RegistryEnv
from tests.support.registry_messages import error_info, register, rpc_error
from tests.support.registry_messages import put as grpc_put
from tests.support.registry_model import CONV, NAME, POOL, move, pool_spec, put, retention, spec

from kvshuttle.core.errors import FailedPrecondition, InvalidArgument
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.config import RedisSettings, RegistrySettings
from kvshuttle.registry.feeds.redis_change import RedisFeed
from kvshuttle.registry.feeds.watchers import Subscription
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.main import build_server
from kvshuttle.registry.main import redis_client as registry_client
from kvshuttle.registry.model import ChangeKind, RetentionChange
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.registry.store.redis.store import RedisStore
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc
from kvshuttle.serving.settings import ServerSettings

LIMITS = StoreLimits(max_retentions_per_tenant=1000, fence_ttl=100)
C1, C2, C3 = f"{CONV}-1", f"{CONV}-2", f"{CONV}-3"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def replicas(
    redis_client: aioredis.Redis, clock: FakeClock
) -> AsyncIterator[tuple[Registry, Registry]]:
    """Two registry replicas (A, B) over one Redis, each with its feed reader running."""
    made: list[tuple[Registry, asyncio.Task[None]]] = []
    for _ in range(2):
        feed = RedisFeed(redis_client, block_ms=50)
        registry = Registry(RedisStore(redis_client, LIMITS), clock, BlockIndex(1000), RegistryLimits(), feed)
        made.append((registry, asyncio.create_task(registry.run_feed())))
        await asyncio.wait_for(feed.started.wait(), 5)
    yield made[0][0], made[1][0]
    for registry, task in made:
        registry.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def take(
    sub: Subscription, n: int
) -> tuple[list[RetentionChange], AsyncGenerator[RetentionChange, None]]:
    it = sub.__aiter__()
    return [await asyncio.wait_for(anext(it), 5) for _ in range(n)], it


async def nothing_more(it: AsyncGenerator[RetentionChange, None]) -> None:
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(it), 0.3)


def kinds(changes: list[RetentionChange]) -> list[tuple[ChangeKind, str]]:
    return [(c.kind, c.retention.conversation) for c in changes]


def tokens_ascend(changes: list[RetentionChange]) -> bool:
    positions = [tuple(int(p) for p in c.token.split("-")) for c in changes]
    return positions == sorted(set(positions))


async def test_a_watcher_on_one_replica_sees_every_replicas_changes_once_in_order(
    replicas: tuple[Registry, Registry], clock: FakeClock
) -> None:
    a, b = replicas
    on_b = b.watch(parent="tenants/acme", node="")
    pool_on_b = b.watch(parent="", node=POOL)
    on_a = a.watch(parent="tenants/acme", node="")
    await a.register_node(spec(), ttl=300)
    await a.register_node(pool_spec(), ttl=300)
    first = await put(a, conv=C1)
    claimed = await a.claim_retention(request_id="", name=f"{C1}/retentions/1", holder="r", claim_ttl=10)
    assert claimed.claim is not None
    await a.move_retention(
        request_id="", move=move(claimed.claim.claim_id, name=f"{C1}/retentions/1"), ttl=60
    )
    await put(b, conv=C2, ttl=5)  # B's own change: through the stream too
    clock.advance(10)
    # Both replicas sweep at once: the expiry is emitted once, by whichever removed it.
    results = await asyncio.gather(a.expire_due(), b.expire_due(), a.expire_due(), b.expire_due())
    assert sum(len(r.changes()) for r in results) == 1
    expected = [
        (ChangeKind.PUT, C1),
        (ChangeKind.CLAIMED, C1),
        (ChangeKind.MOVED, C1),
        (ChangeKind.PUT, C2),
        (ChangeKind.EXPIRED, C2),
    ]
    seen_b, it_b = await take(on_b, 5)
    seen_a, it_a = await take(on_a, 5)
    assert kinds(seen_b) == expected
    assert [c.token for c in seen_a] == [c.token for c in seen_b]  # one order, everywhere
    assert tokens_ascend(seen_b)
    moved = seen_b[2]
    assert (moved.retention.node, moved.previous_node) == (POOL, "nodes/d0")
    assert moved.retention.claim is None
    assert seen_b[1].retention.claim is not None and seen_b[1].retention.claim.holder == "r"
    put_seen = seen_b[0].retention
    assert (put_seen.name, put_seen.node, put_seen.kv_transfer_params) == (
        first.name,
        first.node,
        first.kv_transfer_params,
    )
    assert put_seen.block_hashes == first.block_hashes
    assert (put_seen.create_time, put_seen.expire_at) == (first.create_time, first.expire_at)
    pool_seen, it_pool = await take(pool_on_b, 1)
    assert kinds(pool_seen) == [(ChangeKind.MOVED, C1)]
    await nothing_more(it_b)
    await nothing_more(it_a)
    await nothing_more(it_pool)


async def test_a_watcher_that_resumes_gets_exactly_what_it_missed_expiry_included(
    replicas: tuple[Registry, Registry], clock: FakeClock
) -> None:
    a, b = replicas
    await a.register_node(spec(), ttl=300)
    watch = b.watch(parent="tenants/acme", node="")
    await put(a, conv=C1)
    (seen, it) = await take(watch, 1)
    await it.aclose()  # the watcher goes away
    b.unwatch(watch)
    token = seen[0].token
    await a.claim_retention(request_id="", name=f"{C1}/retentions/1", holder="r", claim_ttl=10)
    await put(a, conv=C2, ttl=5)
    clock.advance(6)
    assert len((await b.expire_due()).changes()) == 1  # swept by B while nobody watched
    # Back, on the other replica, with its last token: the replay, then live changes, each once.
    resumed = a.watch(parent="tenants/acme", node="", resume_token=token)
    missed, it = await take(resumed, 3)
    assert kinds(missed) == [(ChangeKind.CLAIMED, C1), (ChangeKind.PUT, C2), (ChangeKind.EXPIRED, C2)]
    await put(b, conv=C3)
    live = [await asyncio.wait_for(anext(it), 5)]
    assert kinds(live) == [(ChangeKind.PUT, C3)]
    await nothing_more(it)
    # Resuming from the newest token: nothing to replay, the live ones only.
    newest = b.watch(parent="tenants/acme", node="", resume_token=live[0].token)
    newest_it = aiter(newest)
    await nothing_more(newest_it)


async def test_a_token_the_stream_no_longer_holds_is_refused(
    replicas: tuple[Registry, Registry], redis_client: aioredis.Redis
) -> None:
    a, b = replicas
    await a.register_node(spec(), ttl=300)
    watch = b.watch(parent="tenants/acme", node="")
    for conv in (C1, C2, C3):
        await put(a, conv=conv)
    seen, it = await take(watch, 3)
    await it.aclose()
    await redis_client.xtrim("{kvshuttle}:changes", maxlen=2, approximate=False)  # C1's trimmed

    async def resume(token: str) -> list[RetentionChange]:
        _, it = await take(b.watch(parent="tenants/acme", node="", resume_token=token), 0)
        out = []
        with contextlib.suppress(TimeoutError):
            while True:
                out.append(await asyncio.wait_for(anext(it), 0.3))
        return out

    with pytest.raises(FailedPrecondition) as expired:
        await resume(seen[0].token)  # its own change left the stream: what followed may have too
    assert expired.value.reason == "WATCH_RESUME_EXPIRED"
    # C2's change is still in the stream, so all after it is: it resumes (with C3's change).
    assert kinds(await resume(seen[1].token)) == [(ChangeKind.PUT, C3)]
    # A token the stream never issued (another stream, or one that was lost): refused too.
    with pytest.raises(FailedPrecondition):
        await resume("99999999999999-0")
    for bad in ("abc", "1-", "-1", "1.5", "1-2-3", f"{2**64}-0"):
        with pytest.raises(InvalidArgument) as malformed:
            b.watch(parent="tenants/acme", node="", resume_token=bad)
        assert malformed.value.field == "resume_token"


async def test_the_stream_is_bounded(redis_client: aioredis.Redis, clock: FakeClock) -> None:
    feed = RedisFeed(redis_client, maxlen=10)
    registry = Registry(RedisStore(redis_client, LIMITS), clock, BlockIndex(1000), RegistryLimits(), feed)
    await registry.register_node(spec(), ttl=300)
    for i in range(1, 400):
        await put(registry, i, conv=C1)  # each a PUT and a REPLACED
    # MAXLEN ~ trims whole stream nodes (stream-node-max-entries, 100 by default).
    assert await redis_client.xlen(feed.key) <= 10 + 100


async def test_the_in_memory_feed_resumes_within_its_process(clock: FakeClock) -> None:
    registry = Registry(InMemoryStore(LIMITS), clock, BlockIndex(100), RegistryLimits(watch_history=3))
    await registry.register_node(spec(), ttl=300)
    watch = registry.watch(parent="tenants/acme", node="")
    await put(registry, conv=C1)
    seen, it = await take(watch, 1)
    await it.aclose()
    registry.unwatch(watch)
    await put(registry, conv=C2)
    await put(registry, conv=C3)
    resumed, _ = await take(registry.watch(parent="tenants/acme", node="", resume_token=seen[0].token), 2)
    assert kinds(resumed) == [(ChangeKind.PUT, C2), (ChangeKind.PUT, C3)]
    for i in range(4, 7):
        await put(registry, conv=f"{CONV}-{i}")  # the history (3) no longer reaches back to C1
    with pytest.raises(FailedPrecondition) as expired:
        await take(registry.watch(parent="tenants/acme", node="", resume_token=seen[0].token), 1)
    assert expired.value.reason == "WATCH_RESUME_EXPIRED"
    other = Registry(InMemoryStore(LIMITS), clock, BlockIndex(100), RegistryLimits())
    with pytest.raises(FailedPrecondition):  # another process's token
        await take(other.watch(parent="tenants/acme", node="", resume_token=resumed[-1].token), 1)
    with pytest.raises(InvalidArgument):
        registry.watch(parent="tenants/acme", node="", resume_token="1-0")


async def test_watch_resumes_over_grpc_on_redis(redis_client: aioredis.Redis) -> None:
    clock = FakeClock()
    feed = RedisFeed(redis_client, block_ms=50)
    registry = Registry(RedisStore(redis_client, LIMITS), clock, BlockIndex(1000), RegistryLimits(), feed)
    reader = asyncio.create_task(registry.run_feed())
    await asyncio.wait_for(feed.started.wait(), 5)
    settings = RegistrySettings(server=ServerSettings(listen="127.0.0.1:0", grace_seconds=1))
    metrics = CollectorRegistry()
    server = build_server(settings, registry, metrics)
    address = f"127.0.0.1:{await server.start()}"
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.RegistryServiceStub(channel)
    env = RegistryEnv(clock, registry, server, address, channel, stub, metrics)
    try:
        await register(env, ttl=100)
        stream = stub.WatchRetentions(pb.WatchRetentionsRequest(parent="tenants/acme"))
        await asyncio.sleep(0.1)
        await grpc_put(env, 1)
        first = await asyncio.wait_for(stream.read(), 5)
        assert isinstance(first, pb.WatchRetentionsResponse)
        assert first.change == pb.RETENTION_CHANGE_PUT and first.resume_token
        stream.cancel()
        await grpc_put(env, 2)  # a PUT and a REPLACED, while nobody watches
        resumed = stub.WatchRetentions(
            pb.WatchRetentionsRequest(parent="tenants/acme", resume_token=first.resume_token)
        )
        got = [await asyncio.wait_for(resumed.read(), 5) for _ in range(2)]
        assert sorted(g.change for g in got if isinstance(g, pb.WatchRetentionsResponse)) == sorted(
            [pb.RETENTION_CHANGE_PUT, pb.RETENTION_CHANGE_REPLACED]
        )
        resumed.cancel()
        bad = stub.WatchRetentions(pb.WatchRetentionsRequest(parent="tenants/acme", resume_token="x"))
        err = await rpc_error(bad.read())
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(err).metadata["field"] == "resume_token"
        gone = stub.WatchRetentions(
            pb.WatchRetentionsRequest(parent="tenants/acme", resume_token="99999999999999-0")
        )
        err = await rpc_error(gone.read())
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(err).reason == "WATCH_RESUME_EXPIRED"
    finally:
        await channel.close()
        registry.close()
        await server.stop()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def test_a_reader_cancelled_as_it_hands_over_a_change_stops(redis_server: int) -> None:
    """Cancelled in the step it delivers a change, the reader is sending its next XREAD: with the
    registry's client (a socket timeout: redis-py sends under asyncio.wait_for) Python 3.11's
    wait_for swallows that cancel (kvshuttle.core.cancellation); the reader ends all the same."""
    client = registry_client(RedisSettings(url=f"redis://127.0.0.1:{redis_server}/0"))
    feed = RedisFeed(client)
    delivered = asyncio.Event()
    feed.bind(lambda changes: delivered.set(), lambda error: None)
    reader = asyncio.create_task(feed.run())
    try:
        await asyncio.wait_for(feed.started.wait(), 5)
        await feed.publish([RetentionChange(ChangeKind.PUT, replace(retention(), name=NAME), at=1.0)])
        await delivered.wait()  # plain: this task wakes in the reader's step, before its send ends
        reader.cancel()
        await asyncio.wait({reader}, timeout=5)
        assert reader.cancelled()
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await client.aclose()
