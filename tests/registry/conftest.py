"""The registry's store under test: each domain test that asks for `make_store` runs against the
in-memory store and against the Redis store, the latter on a `redis-server` this session starts
on 127.0.0.1 (a free port, its own temporary directory, no persistence) and always stops.
Every Redis test starts from FLUSHALL. Without a `redis-server` binary the Redis cases skip,
unless KVSHUTTLE_REQUIRE_REDIS is set (CI sets it: there a missing binary fails)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from kvshuttle.registry.memory_store import InMemoryStore, StoreLimits
from kvshuttle.registry.redis_store import RedisStore
from kvshuttle.registry.store import RegistryStore

StoreFactory = Callable[..., RegistryStore]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def redis_server() -> Iterator[int]:
    """A redis-server for this test session: its port."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("KVSHUTTLE_REQUIRE_REDIS"):
            pytest.fail("KVSHUTTLE_REQUIRE_REDIS is set and redis-server is not installed")
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    with tempfile.TemporaryDirectory(prefix="kvshuttle-redis-") as tmp:
        for _ in range(3):
            port = _free_port()
            proc = subprocess.Popen(
                [
                    binary,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    tmp,
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--protected-mode",
                    "yes",
                    "--daemonize",
                    "no",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=Path(tmp),
            )
            client = redis.Redis(host="127.0.0.1", port=port)
            try:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and proc.poll() is None:
                    try:
                        if client.ping():
                            break
                    except redis.ConnectionError:
                        time.sleep(0.05)
                else:
                    proc.kill()
                    proc.wait()
                    continue  # the port was taken meanwhile, or it did not come up: another
                try:
                    yield port
                finally:
                    proc.kill()
                    proc.wait()
                return
            finally:
                client.close()
        pytest.fail("redis-server did not answer PING")


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
