"""ChainCache: a remembered chain is reused exactly as far as the tokens are the same, wherever
the first edit falls (odd and even positions, inside or at the edge of a block)."""

from __future__ import annotations

import numpy as np
import pytest

from kvshuttle.core.hashing import ROOT_HASH, chain_array, chain_hashes
from kvshuttle.router.chains import ChainCache

BS = 16


def frozen(tokens: list[int] | np.ndarray) -> np.ndarray:
    arr = np.array(tokens, dtype=np.uint32)
    arr.flags.writeable = False
    return arr


def test_chain_array_is_chain_hashes() -> None:
    tokens = list(range(1000, 1000 + 5 * BS + 3))
    assert chain_array(tokens, BS).tolist() == chain_hashes(tokens, BS)
    assert chain_array(tokens, BS, parent=7).tolist() == chain_hashes(tokens, BS, parent=7)
    assert chain_array(tokens[:3], BS).size == 0


@pytest.mark.parametrize("edit", [0, 1, 15, 16, 17, 31, 32, 63, 64, 79, 80])
@pytest.mark.parametrize("extra", [0, 1, 16, 33])
def test_an_edit_anywhere_rehashes_from_its_block(edit: int, extra: int) -> None:
    rng = np.random.default_rng(edit * 100 + extra)
    first = rng.integers(0, 150_000, 81, dtype=np.uint32)
    second = np.concatenate([first, rng.integers(0, 150_000, extra, dtype=np.uint32)])
    second[edit] ^= 1
    cache = ChainCache(1 << 20)
    cache.chain("c", frozen(first), BS)
    got = cache.chain("c", frozen(second), BS)
    assert got.tolist() == chain_hashes(second.tolist(), BS, ROOT_HASH)
    # Blocks before the edit's came from the cache; the prompt's own blocks always hash anew.
    assert cache.hits == (1 if edit >= BS else 0)


def test_a_writable_prompt_is_copied_a_frozen_one_kept() -> None:
    cache = ChainCache(1 << 20)
    writable = np.arange(64, dtype=np.uint32)
    cache.chain("c", writable, BS)
    writable[3] = 99  # the caller's array changes after the call: the cache must not see it
    assert cache.chain("c", np.arange(64, dtype=np.uint32), BS).tolist() == chain_hashes(list(range(64)), BS)
    assert cache.hits == 1


def test_starts_with_skips_the_comparison_only_for_the_remembered_array() -> None:
    cache = ChainCache(1 << 20)
    prompt = frozen(list(range(70)))
    cache.chain("c", prompt, BS)
    sequence = frozen(list(range(70)) + [5] * 40)
    assert cache.chain("c", sequence, BS, starts_with=prompt).tolist() == chain_hashes(sequence.tolist(), BS)
    # Another array of equal tokens is compared, not trusted: the edit at 3 is found.
    other = frozen(list(range(70)))
    edited = frozen([0, 1, 2, 9, *range(4, 70)] + [5] * 40)
    cache.chain("d", other, BS)
    assert cache.chain("d", edited, BS, starts_with=prompt).tolist() == chain_hashes(edited.tolist(), BS)
