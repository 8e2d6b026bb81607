"""The prefix-hash chain: a stable format (the registry stores it), equal for every input form."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvshuttle.core.hashing import (
    ROOT_HASH,
    block_hash,
    cache_salt_digest,
    chain_hashes,
    chain_root,
    common_prefix_blocks,
    salted_root,
    token_array,
)
from kvshuttle.router.v1 import router_service_pb2 as pb

# Changing these changes what every stored retention's chain means: never without a migration.
GOLDEN = [10251598853290956434, 14413796365232270483]


def test_golden_vector() -> None:
    assert chain_hashes(list(range(40)), 16) == GOLDEN  # the partial third block has no hash


def test_every_input_form_hashes_alike() -> None:
    tokens = list(range(40))
    container = pb.PlanTurnRequest(prompt_token_ids=tokens).prompt_token_ids
    for form in (tokens, tuple(tokens), np.array(tokens, dtype=np.int64), np.array(tokens, dtype=np.uint32),
                 container):  # fmt: skip
        assert chain_hashes(form, 16) == GOLDEN


def test_chain_composes_block_by_block() -> None:
    tokens = list(range(48))
    chain = chain_hashes(tokens, 16)
    assert block_hash(ROOT_HASH, tokens[:16]) == chain[0]
    assert chain_hashes(tokens[32:], 16, parent=chain[1]) == chain[2:]


def test_common_prefix_stops_at_the_first_edit() -> None:
    a = list(range(64))
    b = a.copy()
    b[40] = 9999  # an edit inside block 2
    assert common_prefix_blocks(chain_hashes(a, 16), chain_hashes(b, 16)) == 2
    b[0] = 9999  # an edit at the start invalidates everything after it
    assert common_prefix_blocks(chain_hashes(a, 16), chain_hashes(b, 16)) == 0


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], [[1, 2]]])
def test_out_of_range_tokens_are_rejected(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        token_array(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        chain_hashes(bad * 16, 16)  # type: ignore[arg-type]


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        chain_hashes([1, 2], 0)


# ---- cache salts ------------------------------------------------------------------------------

# Changing these changes the chains of every salted retention and indexed block: as GOLDEN.
SALTED_ROOT_GOLDEN = 2145356868704012124
SALTED_GOLDEN = [3084259696662267180, 10796282701393797524]


def test_salted_root_golden_vector() -> None:
    digest = cache_salt_digest("tenant-salt")
    assert digest == hashlib.sha256(b"tenant-salt").digest()
    assert salted_root(digest) == SALTED_ROOT_GOLDEN
    assert chain_hashes(list(range(40)), 16, parent=salted_root(digest)) == SALTED_GOLDEN


def test_salted_roots_never_meet_the_plain_root_or_each_other() -> None:
    tokens = list(range(64))
    roots = {salted_root(cache_salt_digest(s)) for s in ("a", "b", "tenant-a", "tenant-b", "a" * 128)}
    assert len(roots) == 5 and ROOT_HASH not in roots
    assert salted_root(b"") == ROOT_HASH == chain_root(None) == chain_root(None, b"")
    chains = [chain_hashes(tokens, 16, parent=r) for r in (ROOT_HASH, *roots)]
    # The same tokens under two salts share no block: no prefix of one verifies for the other.
    for i, a in enumerate(chains):
        for b in chains[i + 1 :]:
            assert common_prefix_blocks(a, b) == 0
            assert not set(a) & set(b)


def test_lora_and_salt_roots_are_distinct() -> None:
    salt = cache_salt_digest("tenant-salt")
    roots = [
        chain_root(None),
        chain_root(None, salt),
        chain_root(5),
        chain_root(5, salt),
        chain_root(6, salt),
    ]
    assert len(set(roots)) == len(roots)
    assert chain_root(5) == 4581589754866342491  # unchanged by salts: indexed LoRA blocks keep their keys


@pytest.mark.parametrize("bad", [b"x", b"\0" * 31, b"\0" * 33])
def test_a_salt_digest_is_32_bytes_or_none(bad: bytes) -> None:
    with pytest.raises(ValueError):
        salted_root(bad)
    with pytest.raises(ValueError):
        chain_root(7, bad)
