"""Block events of salted prompts over the registry's API: the agent sends the salt's SHA-256
(never the salt), the registry refuses anything else and keys the blocks by the salt's root."""

from __future__ import annotations

import pytest

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.hashing import cache_salt_digest, chain_hashes, salted_root
from kvshuttle.core.kv_events import BlockStored
from kvshuttle.registry.api.convert import event_batches_from_pb
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.v1 import registry_service_pb2 as pb

BS = 16
TOKENS = list(range(2 * BS))


def batch(digest: bytes) -> pb.BlockEventBatch:
    stored = pb.BlockStored(block_hashes=[1, 2], token_ids=TOKENS, block_size=BS, cache_salt_sha256=digest)
    return pb.BlockEventBatch(seq=0, events=[pb.BlockEvent(stored=stored)])


def test_a_salted_store_converts_and_is_keyed_by_the_salts_root() -> None:
    digest = cache_salt_digest("tenant-salt")
    (converted,) = event_batches_from_pb([batch(digest)])
    (event,) = converted.events
    assert isinstance(event, BlockStored) and event.cache_salt_sha256 == digest
    assert event_batches_from_pb([batch(b"")])[0].events[0] == BlockStored(
        (1, 2), None, tuple(TOKENS), BS, None, ""
    )
    index = BlockIndex(100)
    index.apply("nodes/p0", [converted])
    assert index.lookup(chain_hashes(TOKENS, BS, parent=salted_root(digest))) == [("nodes/p0", 2)]
    assert index.lookup(chain_hashes(TOKENS, BS)) == []


@pytest.mark.parametrize("digest", [b"tenant-salt", b"\x00" * 31, b"\x00" * 64])
def test_anything_but_a_sha256_is_refused_naming_the_field(digest: bytes) -> None:
    with pytest.raises(InvalidArgument) as err:
        event_batches_from_pb([pb.BlockEventBatch(), batch(digest)])
    assert err.value.field == "batches[1].events[0].cache_salt_sha256"
