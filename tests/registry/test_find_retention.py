"""Retentions found by what they hold (FindRetention), over each store: by the prompt's chain
(the longest prefix a whole retention covers) and by a transcript's key; never another
tenant's, never a lapsed or removed one; transcripts bounded by bytes per tenant and in all."""

from __future__ import annotations

from array import array

import pytest
from tests.support.clock import FakeClock
from tests.support.registry_model import BLOCK, StoreFactory, retention, spec

from kvshuttle.core.errors import InvalidArgument, NotFound
from kvshuttle.core.hashing import chain_hashes
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.model import TRANSCRIPT_OVERHEAD, Found, Retention, Transcript
from kvshuttle.registry.service.registry import Registry
from kvshuttle.registry.store.contract import StoreLimits

ACME = "tenants/acme"
KEY = b"k" * 32


def transcript(key: bytes = KEY, tokens: int = 100) -> Transcript:
    return Transcript(key, array("I", range(tokens)), b"a" * 32, 7)


def with_transcript(r: Retention, t: Transcript | None) -> Retention:
    r.transcript = t
    return r


async def make(make_store: StoreFactory, clock: FakeClock, limits: StoreLimits | None = None) -> Registry:
    registry = Registry(make_store(limits), clock, BlockIndex(max_blocks_per_node=100), RegistryLimits())
    await registry.register_node(spec(), ttl=300)
    return registry


async def put(
    registry: Registry, conv: str, gen: int = 1, tokens: int = 100, t: Transcript | None = None
) -> None:
    await registry.put_retention(
        request_id="", parent=conv, retention=with_transcript(retention(gen, tokens=tokens), t), ttl=60
    )


def prompt_chain(tokens: int) -> array[int]:
    return array("Q", chain_hashes(list(range(tokens)), BLOCK))


async def find_chain(registry: Registry, chain: array[int], parent: str = ACME, model: str = "m") -> Found:
    return await registry.find_retention(
        parent=parent, model=model, block_size=BLOCK, block_hashes=chain, transcript_key=b""
    )


async def find_key(registry: Registry, key: bytes = KEY, parent: str = ACME) -> Found:
    return await registry.find_retention(
        parent=parent, model="m", block_size=0, block_hashes=array("Q"), transcript_key=key
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def test_longest_covered_prefix_wins(make_store: StoreFactory, clock: FakeClock) -> None:
    registry = await make(make_store, clock)
    await put(registry, f"{ACME}/conversations/short", tokens=40)  # 2 blocks
    await put(registry, f"{ACME}/conversations/long", tokens=100)  # 6 blocks
    found = await find_chain(registry, prompt_chain(300))
    assert found.retention.conversation == f"{ACME}/conversations/long"
    assert found.matched_blocks == 6
    found = await find_chain(registry, prompt_chain(90))  # the long one is not a prefix of it
    assert found.retention.conversation == f"{ACME}/conversations/short"
    assert found.matched_blocks == 2
    # A chain that departs inside the first block matches nothing.
    with pytest.raises(NotFound) as err:
        await find_chain(registry, array("Q", chain_hashes([9, *range(1, 100)], BLOCK)))
    assert err.value.reason == "RETENTION_NOT_FOUND"


async def test_no_tenant_finds_another_tenants_retention(make_store: StoreFactory, clock: FakeClock) -> None:
    registry = await make(make_store, clock)
    await put(registry, f"{ACME}/conversations/c1", t=transcript())
    for find in (
        find_chain(registry, prompt_chain(300), parent="tenants/other"),
        find_key(registry, parent="tenants/other"),
    ):
        with pytest.raises(NotFound):
            await find
    with pytest.raises(NotFound):  # nor another model's
        await find_chain(registry, prompt_chain(300), model="m2")
    assert (await find_key(registry)).retention.conversation == f"{ACME}/conversations/c1"


async def test_removed_replaced_and_lapsed_are_not_found(make_store: StoreFactory, clock: FakeClock) -> None:
    registry = await make(make_store, clock)
    conv = f"{ACME}/conversations/c1"
    await put(registry, conv, 1, tokens=40, t=transcript(b"1" * 32))
    await put(registry, conv, 2, tokens=100, t=transcript(b"2" * 32))  # replaces generation 1
    with pytest.raises(NotFound):
        await find_key(registry, b"1" * 32)
    found = await find_chain(registry, prompt_chain(300))
    assert found.retention.generation == 2
    assert found.retention.transcript is not None
    assert list(found.retention.transcript.token_ids) == list(range(100))
    await registry.release_retention(f"{conv}/retentions/2", claim_id="", force=True)
    with pytest.raises(NotFound):
        await find_chain(registry, prompt_chain(300))
    with pytest.raises(NotFound):
        await find_key(registry, b"2" * 32)
    await put(registry, conv, 3, t=transcript(b"3" * 32))
    clock.advance(61)  # lapsed, not yet swept
    with pytest.raises(NotFound):
        await find_key(registry, b"3" * 32)
    await registry.expire_due()
    assert registry.store.counts().transcripts == 0
    assert registry.store.counts().transcript_bytes == 0


async def test_a_shared_key_belongs_to_the_latest_put(make_store: StoreFactory, clock: FakeClock) -> None:
    registry = await make(make_store, clock)
    await put(registry, f"{ACME}/conversations/a", t=transcript())
    await put(registry, f"{ACME}/conversations/b", t=transcript())
    assert (await find_key(registry)).retention.conversation == f"{ACME}/conversations/b"
    # The first's removal leaves the key with the second.
    await registry.release_retention(f"{ACME}/conversations/a/retentions/1", claim_id="", force=True)
    assert (await find_key(registry)).retention.conversation == f"{ACME}/conversations/b"


async def test_transcripts_are_bounded_per_tenant_by_bytes(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    one = transcript().nbytes
    assert one == 4 * 100 + 32 + TRANSCRIPT_OVERHEAD
    registry = await make(make_store, clock, StoreLimits(transcript_max_bytes_per_tenant=2 * one))
    for i in range(3):
        await put(registry, f"{ACME}/conversations/c{i}", t=transcript(bytes([i]) * 32))
    # The third retention is kept, without its transcript.
    assert (await find_chain(registry, prompt_chain(300))).retention.conversation.startswith(ACME)
    with pytest.raises(NotFound):
        await find_key(registry, bytes([2]) * 32)
    got = await registry.get_retention(f"{ACME}/conversations/c2/retentions/1")
    assert got.transcript is None
    counts = registry.store.counts()
    assert (counts.transcripts, counts.transcript_bytes) == (2, 2 * one)
    # Another tenant has its own budget; the store's total bounds them all.
    await put(registry, "tenants/other/conversations/c0", t=transcript())
    assert (await find_key(registry, parent="tenants/other")).retention.tenant == "other"
    # Room freed by a removal is room again.
    await registry.release_retention(f"{ACME}/conversations/c0/retentions/1", claim_id="", force=True)
    await put(registry, f"{ACME}/conversations/c2", 2, t=transcript(bytes([2]) * 32))
    assert (await find_key(registry, bytes([2]) * 32)).retention.generation == 2


async def test_the_store_total_bounds_every_tenant(make_store: StoreFactory, clock: FakeClock) -> None:
    one = transcript().nbytes
    registry = await make(make_store, clock, StoreLimits(transcript_max_bytes=one))
    await put(registry, f"{ACME}/conversations/c0", t=transcript())
    await put(registry, "tenants/other/conversations/c0", t=transcript())
    with pytest.raises(NotFound):
        await find_key(registry, parent="tenants/other")


async def test_bad_lookups_name_their_field(make_store: StoreFactory, clock: FakeClock) -> None:
    registry = await make(make_store, clock)
    cases = [
        (dict(parent="acme", block_hashes=prompt_chain(32), transcript_key=b""), "parent"),
        (dict(parent=ACME, block_hashes=array("Q"), transcript_key=b""), "block_hashes"),
        (dict(parent=ACME, block_hashes=prompt_chain(32), transcript_key=KEY), "block_hashes"),
        (dict(parent=ACME, block_hashes=array("Q"), transcript_key=b"short"), "transcript_key"),
    ]
    for kwargs, field in cases:
        with pytest.raises(InvalidArgument) as err:
            await registry.find_retention(model="m", block_size=BLOCK, **kwargs)  # type: ignore[arg-type]
        assert err.value.field == field
    with pytest.raises(InvalidArgument) as err:
        await put(registry, f"{ACME}/conversations/c1", t=Transcript(KEY, array("I"), b"a" * 32, 0))
    assert err.value.field == "retention.transcript.token_ids"


async def test_a_prompt_that_repeats_only_the_previous_prompt_finds_it_by_its_prompt_blocks(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    """A chat re-tokenized from text repeats the previous prompt but not decode's answer: the
    retention is found by its prompt's last full block too, and answers how far it matches."""
    registry = await make(make_store, clock)
    conv = f"{ACME}/conversations/c1"
    r = retention(1, tokens=100)  # 6 blocks: a prompt of 70 tokens (4 blocks before its last token)
    r.prompt_blocks = 4
    await registry.put_retention(request_id="", parent=conv, retention=r, ttl=60)
    departs = array("Q", chain_hashes([*range(70), *range(500, 600)], BLOCK))
    found = await find_chain(registry, departs)
    assert (found.retention.conversation, found.matched_blocks, found.retention.prompt_blocks) == (conv, 4, 4)
    assert (await find_chain(registry, prompt_chain(300))).matched_blocks == 6  # the whole chain first
    with pytest.raises(NotFound):  # departing inside the prompt's blocks: nothing
        await find_chain(registry, array("Q", chain_hashes([*range(40), *range(500, 600)], BLOCK)))
    await registry.release_retention(f"{conv}/retentions/1", claim_id="", force=True)
    with pytest.raises(NotFound):
        await find_chain(registry, departs)
    bad = retention(2, tokens=100)
    bad.prompt_blocks = 7
    with pytest.raises(InvalidArgument) as err:
        await registry.put_retention(request_id="", parent=conv, retention=bad, ttl=60)
    assert err.value.field == "retention.prompt_blocks"
