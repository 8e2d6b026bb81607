"""The Redis store's find_retention indexes and transcript bytes: an index entry is a hint its
record overrides (a stale one is never returned, and is deleted when found), the transcript
travels with its record, and the bytes a put reserved are freed by every way its retention goes,
a crashed put's included."""

from __future__ import annotations

from array import array
from collections.abc import Awaitable
from typing import cast

import pytest
import redis.asyncio as aioredis
from tests.support.clock import FakeClock
from tests.support.registry_model import BLOCK, retention, spec

from kvshuttle.core.errors import NotFound
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.model import Found, Transcript
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.redis.codec import end_field, key_field
from kvshuttle.registry.store.redis.store import RedisStore

pytestmark = pytest.mark.redis

ACME = "tenants/acme"
KEY = b"k" * 32


def transcript(key: bytes = KEY, tokens: int = 100) -> Transcript:
    return Transcript(key, array("I", range(tokens)), b"a" * 32, 7)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def setup(client: aioredis.Redis, clock: FakeClock) -> tuple[Registry, RedisStore]:
    store = RedisStore(client)
    registry = Registry(store, clock, BlockIndex(100), RegistryLimits())
    await registry.register_node(spec(), ttl=300)
    return registry, store


async def put(registry: Registry, conv: str, generation: int = 1, key: bytes = KEY) -> str:
    r = retention(generation)
    r.transcript = transcript(key)
    result = await registry.put_retention(request_id="", parent=conv, retention=r, ttl=60)
    return result.retention.name


async def find_chain(store: RedisStore, clock: FakeClock, tenant: str = "acme") -> Found:
    chain = array("Q", chain_hashes(list(range(300)), BLOCK))
    return await store.find_retention(
        tenant=tenant, model="m", block_size=BLOCK, chain=chain, transcript_key=None, now=clock.now()
    )


async def find_key(store: RedisStore, clock: FakeClock, key: bytes = KEY, tenant: str = "acme") -> Found:
    return await store.find_retention(
        tenant=tenant, model="m", block_size=0, chain=None, transcript_key=key, now=clock.now()
    )


async def hget(client: aioredis.Redis, key: str, field: bytes) -> bytes | None:
    return await cast("Awaitable[bytes | None]", client.hget(key, field))  # type: ignore[arg-type]


async def test_a_stale_index_entry_is_never_returned(redis_client: aioredis.Redis, clock: FakeClock) -> None:
    registry, store = await setup(redis_client, clock)
    name = await put(registry, f"{ACME}/conversations/c1")
    assert (await find_key(store, clock)).retention.name == name
    ends, keys = store.keys.lookup("acme")
    end = end_field("m", BLOCK, retention().block_hashes[-1])
    assert await hget(redis_client, ends, end) == name.encode()
    # The record removed behind the indexes (as a replica dying before its retirement leaves it).
    await redis_client.delete(store.keys.conversation(f"{ACME}/conversations/c1"))
    with pytest.raises(NotFound):
        await find_key(store, clock)
    with pytest.raises(NotFound):
        await find_chain(store, clock)
    # Both entries were deleted when found stale.
    assert await hget(redis_client, keys, key_field("m", KEY)) is None
    assert await hget(redis_client, ends, end) is None


async def test_an_entry_its_record_does_not_back_is_never_returned(
    redis_client: aioredis.Redis, clock: FakeClock
) -> None:
    registry, store = await setup(redis_client, clock)
    other = await put(registry, f"{ACME}/conversations/c2", key=b"2" * 32)
    foreign = await put(registry, "tenants/other/conversations/c1")
    ends, keys = store.keys.lookup("acme")
    # Entries naming a live retention that holds another key, and another tenant's retention.
    await redis_client.hset(keys, key_field("m", KEY), other)  # type: ignore[arg-type,misc]
    with pytest.raises(NotFound):
        await find_key(store, clock)
    assert await hget(redis_client, keys, key_field("m", KEY)) is None
    assert (await find_key(store, clock, b"2" * 32)).retention.name == other
    await redis_client.hset(keys, key_field("m", KEY), foreign)  # type: ignore[arg-type,misc]
    with pytest.raises(NotFound):
        await find_key(store, clock)
    assert (await find_key(store, clock, tenant="other")).retention.name == foreign
    # Chain-end entries past the live retention's: one naming a record that does not own it
    # (deleted), and one its record owns whose whole chain is not the prompt's prefix (kept).
    prompt = array("Q", chain_hashes(list(range(300)), BLOCK))
    await redis_client.hset(ends, end_field("m", BLOCK, prompt[9]), other)  # type: ignore[arg-type,misc]
    found = await find_chain(store, clock)
    assert (found.retention.name, found.matched_blocks) == (other, 6)
    assert await hget(redis_client, ends, end_field("m", BLOCK, prompt[9])) is None
    forked = array("Q", [prompt[0] ^ 1, *prompt[1:6]])
    conversation = store.keys.conversation(f"{ACME}/conversations/c2")
    await redis_client.hset(conversation, "bh", forked.tobytes())  # type: ignore[arg-type,misc]
    with pytest.raises(NotFound):
        await find_chain(store, clock)
    assert await hget(redis_client, ends, end_field("m", BLOCK, prompt[5])) == other.encode()


async def test_transcript_bytes_are_freed_by_every_removal_and_a_crashed_put(
    redis_client: aioredis.Redis, clock: FakeClock
) -> None:
    registry, store = await setup(redis_client, clock)
    one = transcript().nbytes
    first = await put(registry, f"{ACME}/conversations/c1", key=b"1" * 32)
    await put(registry, f"{ACME}/conversations/c1", 2, key=b"2" * 32)  # replaces the first
    await put(registry, f"{ACME}/conversations/c2", key=b"3" * 32)
    got = await registry.get_retention(f"{ACME}/conversations/c1/retentions/2")
    assert got.transcript == transcript(b"2" * 32)
    assert (store.counts().transcripts, store.counts().transcript_bytes) == (2, 2 * one)
    assert await redis_client.hget(store.keys.txt, "acme") == str(2 * one).encode()  # type: ignore[misc]
    with pytest.raises(NotFound):
        await find_key(store, clock, b"1" * 32)
    assert first not in await redis_client.hvals(store.keys.lookup("acme")[1])  # type: ignore[misc]
    # A put that reserved its bytes and died before its commit: freed when its deadline is due.
    await store.bounds.reserve_put(f"{ACME}/conversations/crashed/retentions/1", clock.now() + 10, one)
    await registry.expire_due()
    assert (store.counts().transcripts, store.counts().transcript_bytes) == (3, 3 * one)
    await registry.release_retention(f"{ACME}/conversations/c2/retentions/1", claim_id="", force=True)
    clock.advance(61)
    await registry.expire_due()
    assert (store.counts().transcripts, store.counts().transcript_bytes) == (0, 0)
    for key in (store.keys.txsz, store.keys.txt, *store.keys.lookup("acme")):
        assert await redis_client.exists(key) == 0
    assert await redis_client.hget(store.keys.meta, "tb") == b"0"  # type: ignore[misc]
