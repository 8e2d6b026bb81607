"""verify() and prefill_params() over both shapes of decode's block ids: one list per KV-cache
group (vLLM today) and one flat list (older vLLM)."""

from __future__ import annotations

import numpy as np
import pytest

from kvshuttle.core.hashing import chain_hashes
from kvshuttle.router.model import RetentionInfo
from kvshuttle.router.verify import prefill_params, verify

BS = 16
TOKENS = list(range(1, 1 + 10 * BS))


def retention(block_ids: object) -> RetentionInfo:
    return RetentionInfo(
        name="tenants/t/conversations/c/retentions/1",
        node="nodes/d0",
        generation=1,
        model="m",
        block_size=BS,
        num_tokens=len(TOKENS),
        block_hashes=np.array(chain_hashes(TOKENS, BS), dtype=np.uint64),
        kv_transfer_params={"do_remote_decode": True, "remote_block_ids": block_ids},
        expire_at=0.0,
        claimed=False,
    )


@pytest.mark.parametrize("block_ids", [[list(range(10))], list(range(10))], ids=["grouped", "flat"])
def test_prefill_reads_only_the_verified_blocks(block_ids: object) -> None:
    prompt = [*TOKENS[: 6 * BS], 0, *TOKENS[6 * BS + 1 :], 7, 7]  # an edit in block 6
    held = retention(block_ids)
    prefix = verify(chain_hashes(prompt, BS), len(prompt), held)
    assert (prefix.blocks, prefix.tokens) == (6, 6 * BS)
    params = prefill_params(held, prefix)
    assert params["remote_block_ids"] == [list(range(6))]
    assert (params["remote_num_tokens"], params["do_remote_decode"], params["do_remote_prefill"]) == (
        6 * BS,
        True,
        False,
    )
    assert held.kv_transfer_params["remote_block_ids"] == block_ids  # decode's own copy untouched


def test_groups_of_other_lengths_are_reused_only_whole() -> None:
    # Groups of other shapes (sliding window, mamba) cannot be cut to a prefix by position.
    held = retention([list(range(10)), list(range(20, 31))])
    extended = [*TOKENS, 1]
    assert verify(chain_hashes(extended, BS), len(extended), held).blocks == 10
    edited = [*TOKENS[: 6 * BS], 0, *TOKENS[6 * BS + 1 :], 1]
    assert verify(chain_hashes(edited, BS), len(edited), held).blocks == 0
    shorter = retention([list(range(10)), [20, 21]])  # does not cover the whole retention
    assert verify(chain_hashes(extended, BS), len(extended), shorter).blocks == 0
