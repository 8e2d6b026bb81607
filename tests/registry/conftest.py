"""The registry's store under test: each domain test that asks for `make_store` runs against the
in-memory store and against the Redis store, the latter on a `redis-server` this session starts
on 127.0.0.1 (a free port, its own temporary directory, no persistence) and always stops.
Every Redis test starts from FLUSHALL. Without a `redis-server` binary the Redis cases skip,
unless KVSHUTTLE_REQUIRE_REDIS is set (CI sets it: there a missing binary fails)."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from tests.support.redis_server import running_redis
from tests.support.registry_model import StoreFactory

from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.memory.store import InMemoryStore
from kvshuttle.registry.store.redis.store import RedisStore


@pytest.fixture(scope="session")
def redis_server() -> Iterator[int]:
    """A redis-server for this test session: its port."""
    with tempfile.TemporaryDirectory(prefix="kvshuttle-redis-") as tmp, running_redis(Path(tmp)) as server:
        yield server.port


@pytest.fixture
async def redis_client(redis_server: int) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(host="127.0.0.1", port=redis_server, decode_responses=False)
    await client.flushall()
    yield client
    await client.aclose()


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(store_kind: str, request: pytest.FixtureRequest) -> StoreFactory:
    """Builds the store under test: make_store(StoreLimits(...)) or make_store()."""
    if store_kind == "memory":
        return lambda limits=None: InMemoryStore(limits)
    client: aioredis.Redis = request.getfixturevalue("redis_client")
    return lambda limits=None: RedisStore(client, limits)


__all__ = ["StoreFactory", "StoreLimits"]
