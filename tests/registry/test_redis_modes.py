"""The registry on Redis Sentinel and on Redis Cluster (RedisSettings.mode), each on real local
servers this module starts (own ports and temporary directories, always killed): through Sentinel
discovery a store round trip works; on a 3-master Cluster every store operation and the change
feed work, so each script touches one hash slot (a Cluster refuses others with CROSSSLOT). Without
a `redis-server` binary these skip, unless KVSHUTTLE_REQUIRE_REDIS is set (as in conftest)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from pydantic import ValidationError
from tests.support.clock import FakeClock
from tests.support.redis_server import (
    NO_PERSISTENCE,
    RedisServer,
    free_port,
    redis_binary,
    redis_cli,
    running_redis,
)
from tests.support.registry_model import POOL, POOL_HOLDER, POOLED, pool_spec, retention, spec

from kvshuttle.core.errors import NotFound, ResourceExhausted
from kvshuttle.core.nodes import NodeLoad
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.config import RedisSettings, RegistrySettings
from kvshuttle.registry.feeds.redis_change import RedisFeed
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.main import build_registry, redis_client
from kvshuttle.registry.model import ChangeKind, Move, PutResult
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.redis.cluster_client import ReseedingRedisCluster
from kvshuttle.registry.store.redis.store import RedisStore

pytestmark = pytest.mark.redis

SERVICE = "kvmaster"


def _wait(what: str, check: object, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError, OSError):
            if check() if callable(check) else check:
                return
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


@contextlib.contextmanager
def _process(args: list[str], cwd: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


# ---- configuration ------------------------------------------------------------------------------


def test_sentinel_mode_needs_sentinels_and_a_service_name() -> None:
    with pytest.raises(ValueError, match=r"needs redis\.sentinels"):
        RedisSettings(mode="sentinel", service_name=SERVICE)
    with pytest.raises(ValueError, match=r"needs redis\.service_name"):
        RedisSettings(mode="sentinel", sentinels=["127.0.0.1:26379"])
    with pytest.raises(ValueError, match="not host:port"):
        RedisSettings(mode="sentinel", sentinels=["127.0.0.1"], service_name=SERVICE)
    with pytest.raises(ValueError, match="are for mode sentinel"):
        RedisSettings(mode="cluster", sentinels=["127.0.0.1:26379"])
    with pytest.raises(ValidationError):
        RedisSettings(mode="replicated")  # type: ignore[arg-type]
    assert RedisSettings().mode == "standalone"


def test_modes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSHUTTLE_REGISTRY_STORE", "redis")
    monkeypatch.setenv("KVSHUTTLE_REGISTRY_REDIS__MODE", "sentinel")
    monkeypatch.setenv("KVSHUTTLE_REGISTRY_REDIS__SENTINELS", '["10.0.0.1:26379", "10.0.0.2:26379"]')
    monkeypatch.setenv("KVSHUTTLE_REGISTRY_REDIS__SERVICE_NAME", SERVICE)
    monkeypatch.setenv("KVSHUTTLE_REGISTRY_REDIS__DB", "2")
    settings = RegistrySettings().redis
    assert (settings.mode, settings.sentinels, settings.service_name, settings.db) == (
        "sentinel",
        ["10.0.0.1:26379", "10.0.0.2:26379"],
        SERVICE,
        2,
    )
    monkeypatch.delenv("KVSHUTTLE_REGISTRY_REDIS__SERVICE_NAME")
    with pytest.raises(ValueError, match=r"needs redis\.service_name"):
        RegistrySettings()


# ---- Sentinel -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentinel_port() -> Iterator[int]:
    """One master (no persistence) and one Sentinel monitoring it as SERVICE, quorum 1."""
    binary = redis_binary()
    with (
        tempfile.TemporaryDirectory(prefix="kvshuttle-sentinel-") as tmp,
        running_redis(Path(tmp)) as master,
    ):
        port = free_port()
        conf = Path(tmp) / "sentinel.conf"  # Sentinel rewrites its config: a file of its own
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {tmp}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 5000\n"
        )
        with _process([binary, str(conf), "--sentinel"], Path(tmp)):
            client = redis.Redis(host="127.0.0.1", port=port)
            try:
                ask = ("SENTINEL", "get-master-addr-by-name", SERVICE)
                want = [b"127.0.0.1", str(master.port).encode()]
                _wait("the Sentinel to name the master", lambda: client.execute_command(*ask) == want)  # type: ignore[no-untyped-call]
            finally:
                client.close()
            yield port


async def test_a_store_round_trip_through_sentinel_discovery(sentinel_port: int) -> None:
    clock = FakeClock()
    settings = RegistrySettings(
        store="redis",
        redis=RedisSettings(
            mode="sentinel", sentinels=[f"127.0.0.1:{sentinel_port}"], service_name=SERVICE, key_prefix="sen"
        ),
    )
    registry = build_registry(settings, clock)
    store = registry.store
    assert isinstance(store, RedisStore)
    client = store.client
    assert isinstance(client, aioredis.Redis)
    await client.flushall()
    try:
        await registry.register_node(spec(), ttl=60)
        conv = "tenants/acme/conversations/s1"
        put = await registry.put_retention(request_id="", parent=conv, retention=retention(1), ttl=60)
        claimed = await registry.claim_retention(
            request_id="", name=put.retention.name, holder="h", claim_ttl=10
        )
        assert claimed.claim is not None
        got = await registry.get_retention(put.retention.name)
        assert got.claim is not None and got.claim.claim_id == claimed.claim.claim_id
        assert (await registry.get_conversation(conv)).fence_generation == 1
        # It went where the Sentinel said: the master's keyspace.
        assert await client.zrange("{sen}:nodes", 0, -1) == [b"nodes/d0"]
    finally:
        registry.close()
        await client.aclose()


# ---- Cluster ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_port() -> Iterator[int]:
    """Three masters, no replicas, slots spread by `redis-cli --cluster create`: a seed's port."""
    cli = redis_cli()
    with contextlib.ExitStack() as stack:
        servers: list[RedisServer] = []
        for i in range(3):
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"kvshuttle-cluster{i}-")))
            options = (*NO_PERSISTENCE, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
            servers.append(stack.enter_context(running_redis(tmp, options)))
        addresses = [f"127.0.0.1:{s.port}" for s in servers]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )
        clients = [redis.Redis(host="127.0.0.1", port=s.port) for s in servers]
        try:
            for c in clients:
                _wait("cluster_state:ok", lambda c=c: c.cluster("info")["cluster_state"] == "ok")
        finally:
            for c in clients:
                c.close()
        yield servers[0].port


async def test_the_store_and_its_feed_run_on_a_cluster(cluster_port: int) -> None:
    """Every operation across several conversations and nodes: a script whose keys spanned slots
    would fail with CROSSSLOT."""
    clock = FakeClock()
    settings = RegistrySettings(
        store="redis", redis=RedisSettings(mode="cluster", url=f"redis://127.0.0.1:{cluster_port}/0")
    )
    registry = build_registry(settings, clock)
    store, feed = registry.store, registry.feed
    assert isinstance(store, RedisStore) and isinstance(feed, RedisFeed)
    client = store.client
    assert isinstance(client, aioredis.RedisCluster)
    await client.flushall()
    reader = asyncio.create_task(registry.run_feed())
    try:
        await asyncio.wait_for(feed.started.wait(), 10)
        watch = registry.watch(parent="tenants/acme", node="")
        it = watch.__aiter__()

        await registry.register_node(spec(), ttl=300)
        await registry.register_node(pool_spec(), ttl=300)
        await registry.register_node(spec("nodes/d1", "engine-d1"), ttl=5)
        convs = [f"tenants/acme/conversations/k{i}" for i in range(8)]
        names = []
        for i, conv in enumerate(convs):
            node = "nodes/d1" if i == 7 else "nodes/d0"
            put = await registry.put_retention(
                request_id=f"put-{i}", parent=conv, retention=retention(1, node=node), ttl=60 if i != 6 else 3
            )
            names.append(put.retention.name)
        # The change feed (`{kvshuttle}:changes`, one slot): the first put's change read back.
        first = await asyncio.wait_for(anext(it), 5)
        assert (first.kind, first.retention.name) == (ChangeKind.PUT, names[0])
        # The keys really are spread: conversations and nodes on more than one master.
        keys = [store.keys.conversation(c) for c in convs] + store.keys.node("nodes/d0") + [store.keys.nodes]
        assert len({getattr(client.get_node_from_key(k), "port", None) for k in keys}) == 3
        # What a script over several slots gets (redis-py refuses it before the server's CROSSSLOT).
        with pytest.raises((redis.RedisError, redis.exceptions.RedisClusterException), match="same key slot"):
            await client.eval("return 1", 2, keys[0], keys[-1])  # type: ignore[misc]

        # Replayed put (remembered answer), a newer generation replacing one.
        again = await registry.put_retention(
            request_id="put-0", parent=convs[0], retention=retention(1), ttl=60
        )
        assert again.retention.name == names[0]
        newer = await registry.put_retention(request_id="", parent=convs[1], retention=retention(2), ttl=60)
        names[1] = newer.retention.name
        # Claim, then give it back (release keep).
        c0 = await registry.claim_retention(request_id="c0", name=names[0], holder="h", claim_ttl=10)
        assert c0.claim is not None
        await registry.release_retention(names[0], claim_id=c0.claim.claim_id, force=False, keep=True)
        assert (await registry.get_retention(names[0])).claim is None
        # Claim and consume (release without keep).
        c2 = await registry.claim_retention(request_id="", name=names[2], holder="h", claim_ttl=10)
        assert c2.claim is not None
        await registry.release_retention(names[2], claim_id=c2.claim.claim_id, force=False)
        # Move to the pool node.
        c3 = await registry.claim_retention(request_id="", name=names[3], holder="router/park", claim_ttl=10)
        assert c3.claim is not None
        move = Move(
            name=names[3],
            claim_id=c3.claim.claim_id,
            node=POOL,
            kv_transfer_params=POOLED,
            kv_bytes=99 * 1024,
            holder=POOL_HOLDER,
        )
        moved = await registry.move_retention(request_id="m3", move=move, ttl=60)
        assert moved.node == POOL
        # Evict, renew.
        await registry.evict_retention(names[4], node="nodes/d0")
        await registry.renew_retention(names[5], ttl=120)
        # Expiry: k6's retention lapses; node d1's lease lapses, taking k7's (NODE_LOST cascade).
        clock.advance(6)
        await registry.heartbeat_node(
            "nodes/d0", (await registry.get_node("nodes/d0")).incarnation, 300, NodeLoad()
        )
        result = await registry.expire_due()
        expired = {(c.kind, c.retention.name) for c in result.changes()}
        assert (ChangeKind.EXPIRED, names[6]) in expired
        assert (ChangeKind.NODE_LOST, names[7]) in expired
        assert [n.node.name for n in result.nodes] == ["nodes/d1"]

        listed, _ = await registry.list_retentions(parent="tenants/acme", node="", page_size=0, page_token="")
        assert [r.name for r in listed] == sorted([names[0], names[1], names[3], names[5]])
        on_pool, _ = await registry.list_retentions(
            parent="tenants/acme", node=POOL, page_size=0, page_token=""
        )
        assert [r.name for r in on_pool] == [names[3]]
        for i in (2, 4, 6, 7):
            with pytest.raises(NotFound):
                await registry.get_retention(names[i])
        assert (await registry.get_conversation(convs[1])).fence_generation == 2
        assert (await registry.get_conversation(convs[6])).fence_generation == 1  # the fence lingers
        d0 = await registry.get_node("nodes/d0")
        assert d0.retention_count == 3
        await registry.deregister_node("nodes/d0", d0.incarnation)
        assert registry.counts_by_kind()["retention"] == 1  # the pool's
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        registry.close()
        await client.aclose()


async def test_capacity_and_remembered_answers_are_bounded_on_a_cluster(cluster_port: int) -> None:
    """The reservation (global slot) and the commit (the conversation's) on different masters,
    two replicas racing: exactly the free places are taken, and no CROSSSLOT."""
    clock = FakeClock()
    limits = StoreLimits(max_retentions_per_tenant=5, idempotency_max_entries=4)
    clients = [aioredis.RedisCluster(host="127.0.0.1", port=cluster_port) for _ in range(2)]
    try:
        await clients[0].flushall()
        stores = [RedisStore(c, limits) for c in clients]
        registries = [Registry(s, clock, BlockIndex(100), RegistryLimits()) for s in stores]
        await registries[0].register_node(spec(), ttl=300)

        async def put(i: int, parent: str, rid: str = "", generation: int = 1) -> PutResult:
            return await registries[i % 2].put_retention(
                request_id=rid, parent=parent, retention=retention(generation), ttl=60
            )

        for i in range(2):
            await put(i, f"tenants/acme/conversations/old{i}")
        results = await asyncio.gather(
            *(put(i, f"tenants/acme/conversations/r{i}") for i in range(12)), return_exceptions=True
        )
        won = [r for r in results if isinstance(r, PutResult)]
        assert len(won) == 3
        assert all(
            isinstance(r, ResourceExhausted) and r.reason == "CAPACITY_EXCEEDED"
            for r in results
            if r not in won
        )
        assert await clients[1].hget("{kvshuttle}:rcount", "acme") == b"5"  # type: ignore[misc]
        await registries[1].release_retention(won[0].retention.name, claim_id="", force=False)
        await stores[0].bounds.reserve("tenants/acme/conversations/crashed/retentions/1", clock.now() + 10)
        clock.advance(10)
        await registries[1].expire_due()  # the crashed reservation is reconciled
        assert await clients[0].hget("{kvshuttle}:rcount", "acme") == b"4"  # type: ignore[misc]
        # A flood of request ids: 4 remembered, the newest; a replay of one gets its first answer.
        for i in range(12):
            await put(i, "tenants/acme/conversations/hot", rid=f"put-{i}", generation=i + 1)
        assert await clients[0].zcard("{kvshuttle}:idem") == 4
        again = await put(1, "tenants/acme/conversations/hot", rid="put-11", generation=12)
        assert again.retention.name == "tenants/acme/conversations/hot/retentions/12"
        gone = stores[0].keys.idempotency(
            "tenants/acme/conversations/hot", "put", "tenants/acme/conversations/hot", "put-0"
        )
        assert await clients[0].exists(gone) == 0
    finally:
        for c in clients:
            await c.aclose()


async def test_the_cluster_client_maps_the_cluster_again_after_every_node_was_dropped(
    cluster_port: int,
) -> None:
    """A failover under load left the registry's writes failing for good: redis-py drops each
    node a call met a connection error or a timeout on from the nodes it maps the cluster from,
    then closes every connection, failing the calls in flight on the healthy masters too, which
    drop theirs. Once none is left, no mapping can succeed ("Redis Cluster cannot be connected
    ... None") and nothing adds one back. The registry's client keeps the seed and every node it
    has seen to map from."""
    settings = RedisSettings(mode="cluster", url=f"redis://127.0.0.1:{cluster_port}/0")
    plain = aioredis.RedisCluster.from_url(settings.url)
    client = redis_client(settings)
    assert isinstance(client, ReseedingRedisCluster)
    try:
        clients: tuple[aioredis.RedisCluster, ...] = (plain, client)
        for c in clients:
            await c.set(b"{t}:k", b"v")
            # What the cascade leaves: no node to map from, every connection closed.
            c.nodes_manager.startup_nodes.clear()
            await c.aclose()
        with pytest.raises(redis.exceptions.RedisClusterException, match="cannot be connected"):
            await plain.get(b"{t}:k")  # redis-py's own client never recovers from it
        assert await client.get(b"{t}:k") == b"v"
        assert len(client.known_nodes) == 3  # the seed and the two other masters it mapped
    finally:
        await plain.aclose()
        await client.aclose()
