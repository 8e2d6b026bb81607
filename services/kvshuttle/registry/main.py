"""`kvshuttle-registry`: the registry service process."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import redis.asyncio as aioredis
import redis.exceptions
import structlog
from prometheus_client import REGISTRY, CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvshuttle.core.clock import Clock, SystemClock
from kvshuttle.registry.api import authz
from kvshuttle.registry.api.metrics import register_metrics
from kvshuttle.registry.api.servicer import RegistryServicer
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.config import RedisSettings, RegistrySettings
from kvshuttle.registry.feeds.change import ChangeFeed
from kvshuttle.registry.feeds.index import IndexFeed
from kvshuttle.registry.feeds.redis_change import RedisFeed
from kvshuttle.registry.feeds.redis_index import RedisIndexFeed
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import RegistryStore
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.registry.store.redis.cluster_client import ReseedingRedisCluster
from kvshuttle.registry.store.redis.store import RedisClient, RedisStore
from kvshuttle.registry.v1 import registry_service_pb2, registry_service_pb2_grpc
from kvshuttle.serving.logging import configure_logging
from kvshuttle.serving.server import GrpcServer

SERVICE = registry_service_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name
ERROR_DOMAIN = "registry.kvshuttle"


def redis_client(settings: RedisSettings) -> RedisClient:
    """The client for settings.mode (bytes in and out: decode_responses=False).

    redis-py never sends a command again after a connection error: the script may have run and
    only its reply been lost, and run twice a put would meet its own fence (ABORTED for a put that
    was stored). The store answers UNAVAILABLE instead and the caller retries under its request
    id, which replays the first answer. Tried again are only refusals that ran nothing: a
    standalone client's READONLY (its address now reaches a replica, after a failover behind a
    DNS name or a virtual IP: on a new connection, the name resolved again), a Cluster's MOVED and
    ASK. Sentinel connections meeting READONLY drop and ask the Sentinels again on the next call.
    A Cluster client maps the cluster again from any node it knows (ReseedingRedisCluster)."""
    once = Retry(NoBackoff(), 0)
    timeout, connect_timeout = settings.socket_timeout_s, settings.socket_connect_timeout_s
    if settings.mode == "sentinel":
        sentinel = aioredis.Sentinel(  # type: ignore[no-untyped-call]
            [settings.sentinel_address(a) for a in settings.sentinels],
            sentinel_kwargs={"socket_timeout": timeout, "socket_connect_timeout": connect_timeout},
        )
        master: aioredis.Redis = sentinel.master_for(
            settings.service_name,
            decode_responses=False,
            db=settings.db,
            password=settings.password.get_secret_value() if settings.password else None,
            retry=once,
            socket_timeout=timeout,
            socket_connect_timeout=connect_timeout,
        )
        return master
    if settings.mode == "cluster":
        cluster: aioredis.RedisCluster = ReseedingRedisCluster.from_url(
            settings.url,
            decode_responses=False,
            retry=once,
            socket_timeout=timeout,
            socket_connect_timeout=connect_timeout,
        )
        return cluster
    readonly_again = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ReadOnlyError,))
    standalone: aioredis.Redis = aioredis.Redis.from_url(
        settings.url,
        decode_responses=False,
        retry=readonly_again,
        socket_timeout=timeout,
        socket_connect_timeout=connect_timeout,
    )
    return standalone


def build_registry(settings: RegistrySettings, clock: Clock) -> Registry:
    # Incarnations keep growing across registry restarts: agents of the previous process
    # then re-register instead of colliding with a reused number.
    base = int(clock.now() * 1000)
    store: RegistryStore
    index = BlockIndex(settings.max_indexed_blocks_per_node)
    feed: ChangeFeed | None = None  # the in-memory feed
    index_feed: IndexFeed | None = None  # this process's index alone
    if settings.store == "redis":
        client = redis_client(settings.redis)
        store = RedisStore(
            client, settings.store_limits, prefix=settings.redis.key_prefix, incarnation_base=base
        )
        # Every replica's watchers see every replica's changes, from one stream.
        feed = RedisFeed(client, prefix=settings.redis.key_prefix, maxlen=settings.redis.change_stream_maxlen)
        # Every replica's index applies every replica's event reports, from one stream.
        index_feed = RedisIndexFeed(
            client, index, prefix=settings.redis.key_prefix, maxlen=settings.redis.block_stream_maxlen
        )
    else:
        store = InMemoryStore(settings.store_limits, incarnation_base=base)
    return Registry(store, clock, index, settings.limits, feed, index_feed)


def build_server(
    settings: RegistrySettings, registry: Registry, prometheus: CollectorRegistry = REGISTRY
) -> GrpcServer:
    def register(server: grpc.aio.Server) -> None:
        registry_service_pb2_grpc.add_RegistryServiceServicer_to_server(RegistryServicer(registry), server)

    register_metrics(registry, prometheus)
    return GrpcServer(
        settings.server,
        settings.telemetry,
        service_name="kvshuttle-registry",
        domain=ERROR_DOMAIN,
        register=register,
        service_names=[SERVICE],
        registry=prometheus,
        on_stopping=registry.close,
        auth=settings.auth,
        policy=authz.policy,
    )


async def serve(settings: RegistrySettings) -> None:
    registry = build_registry(settings, SystemClock())
    server = build_server(settings, registry)
    expiry = asyncio.create_task(registry.run_expiry(max_sleep=settings.expiry_max_sleep))
    feed = asyncio.create_task(registry.run_feed())
    try:
        await server.serve_until_signal()
    finally:
        for task in (expiry, feed):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def main() -> None:
    settings = RegistrySettings()
    configure_logging(settings.telemetry)
    structlog.get_logger("kvshuttle.registry").info("registry.config", **settings.model_dump(mode="json"))
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
