"""The prefix-hash chain: a stable format (the registry stores it), equal for every input form."""

from __future__ import annotations

import numpy as np
import pytest

from kvshuttle.core.hashing import ROOT_HASH, block_hash, chain_hashes, common_prefix_blocks, token_array
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
