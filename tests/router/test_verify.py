"""verify() and prefill_params() over both shapes of decode's block ids: one list per KV-cache
group (vLLM today) and one flat list (older vLLM)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvshuttle.core.hashing import chain_hashes
from kvshuttle.core.nodes import NodeRole
from kvshuttle.router.model import NodeInfo, RetentionInfo
from kvshuttle.router.verify import prefill_params, verify

BS = 16
TOKENS = list(range(1, 1 + 10 * BS))


HOLDER = NodeInfo(
    name="nodes/d0",
    role=NodeRole.DECODE,
    engine_id="engine-d0",
    http_endpoint="http://d0:8000",
    model="m",
    block_size=BS,
    kv_bytes_per_token=1,
    healthy=True,
    side_channel_host="10.0.0.7",
    side_channel_port=5601,
)


def retention(block_ids: object, **params: object) -> RetentionInfo:
    return RetentionInfo(
        name="tenants/t/conversations/c/retentions/1",
        node="nodes/d0",
        generation=1,
        model="m",
        block_size=BS,
        num_tokens=len(TOKENS),
        block_hashes=np.array(chain_hashes(TOKENS, BS), dtype=np.uint64),
        kv_transfer_params={"do_remote_decode": True, "remote_block_ids": block_ids, **params},
        expire_at=0.0,
        claimed=False,
    )


@pytest.mark.parametrize("block_ids", [[list(range(10))], list(range(10))], ids=["grouped", "flat"])
def test_prefill_reads_only_the_verified_blocks(block_ids: object) -> None:
    prompt = [*TOKENS[: 6 * BS], 0, *TOKENS[6 * BS + 1 :], 7, 7]  # an edit in block 6
    held = retention(block_ids)
    prefix = verify(chain_hashes(prompt, BS), len(prompt), held)
    assert (prefix.blocks, prefix.tokens) == (6, 6 * BS)
    params = prefill_params(held, prefix, HOLDER)
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


def test_prefill_reads_from_the_holder_as_registered_never_from_the_stored_params() -> None:
    held = retention(
        [list(range(10))], remote_engine_id="attacker", remote_host="203.0.113.9", remote_port=6666
    )
    prefix = verify(chain_hashes([*TOKENS, 1], BS), len(TOKENS) + 1, held)
    params = prefill_params(held, prefix, HOLDER)
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == (
        "engine-d0",
        "10.0.0.7",
        5601,
    )
    assert held.kv_transfer_params["remote_host"] == "203.0.113.9"  # the stored copy untouched


@pytest.mark.parametrize(
    "holder",
    [
        replace(HOLDER, name="nodes/d1"),
        replace(HOLDER, side_channel_host=""),
        replace(HOLDER, side_channel_port=0),
    ],
    ids=["another node", "no host", "no port"],
)
def test_no_params_name_a_holder_the_router_cannot_address(holder: NodeInfo) -> None:
    held = retention([list(range(10))])
    with pytest.raises(ValueError):
        prefill_params(held, verify(chain_hashes([*TOKENS, 1], BS), len(TOKENS) + 1, held), holder)


def known(held: RetentionInfo, num_tokens: int, from_block: int) -> RetentionInfo:
    """`held` cut to `num_tokens`, its tokens known from block `from_block` on."""
    return replace(
        held,
        num_tokens=num_tokens,
        block_hashes=held.block_hashes[: num_tokens // BS],
        known_from_block=from_block,
        known_tokens=np.array(TOKENS[from_block * BS : num_tokens], dtype=np.uint32),
    )


def test_a_known_tail_verifies_token_by_token() -> None:
    held = known(retention([list(range(10))]), 6 * BS + 5, 6)
    prompt = [*TOKENS[: 6 * BS + 3], 9999, *TOKENS[6 * BS + 4 :]]  # differs at the tail's 4th token
    chain = chain_hashes(prompt, BS)
    arr = np.array(prompt, dtype=np.uint32)
    prefix = verify(chain, len(prompt), held, prompt=arr)
    assert (prefix.blocks, prefix.partial, prefix.tokens, prefix.read_blocks) == (6, 3, 6 * BS + 3, 7)
    params = prefill_params(held, prefix, HOLDER)
    assert (params["remote_num_tokens"], params["remote_block_ids"]) == (6 * BS + 3, [list(range(7))])
    # Without the prompt's ids (or the known tokens), only full blocks.
    assert verify(chain, len(prompt), held).tokens == 6 * BS
    unknown = replace(held, known_tokens=np.zeros(0, dtype=np.uint32))
    assert verify(chain, len(prompt), unknown, prompt=arr).tokens == 6 * BS
    # Never the prompt's last token: prefill computes at least one.
    short = arr[: 6 * BS + 2]
    assert verify(chain_hashes(short, BS), len(short), held, prompt=short).tokens == 6 * BS + 1


@pytest.mark.parametrize("at", [4 * BS, 4 * BS + 1, 5 * BS + 7, 6 * BS - 1, 8 * BS + 3])
def test_a_departure_inside_a_known_full_block_is_cut_at_its_last_equal_token(at: int) -> None:
    # Known from block 4 (the block holding the turn's prompt end) to the retention's end.
    held = known(retention([list(range(10))]), 9 * BS + 5, 4)
    prompt = [*TOKENS[:at], 9999, *TOKENS[at + 1 :]]  # e.g. a re-rendered tool call
    arr = np.array(prompt, dtype=np.uint32)
    prefix = verify(chain_hashes(prompt, BS), len(prompt), held, prompt=arr)
    assert (prefix.blocks, prefix.tokens) == (at // BS, at)
    assert prefix.read_blocks == at // BS + (1 if at % BS else 0)
    params = prefill_params(held, prefix, HOLDER)
    assert params["remote_num_tokens"] == at
    assert params["remote_block_ids"] == [list(range(prefix.read_blocks))]


def test_a_departure_before_the_known_blocks_is_cut_at_its_block() -> None:
    held = known(retention([list(range(10))]), 9 * BS + 5, 4)
    prompt = [*TOKENS[: 3 * BS + 5], 9999, *TOKENS[3 * BS + 6 :]]  # in the turn's prompt: unknown
    prefix = verify(chain_hashes(prompt, BS), len(prompt), held, prompt=np.array(prompt, dtype=np.uint32))
    assert (prefix.blocks, prefix.partial) == (3, 0)


def test_the_cut_is_capped_by_the_block_ids_and_the_prompt() -> None:
    held = known(retention([list(range(10))]), 9 * BS + 5, 4)
    prompt = [*TOKENS[: 5 * BS + 7], 9999, *TOKENS[5 * BS + 8 :]]
    arr = np.array(prompt, dtype=np.uint32)
    chain = chain_hashes(prompt, BS)
    # Block 5's id is not in decode's params: nothing of it is read.
    fewer = replace(held, kv_transfer_params={"remote_block_ids": [list(range(5))]})
    assert verify(chain, len(prompt), fewer, prompt=arr).tokens == 5 * BS
    # A prompt ending inside the matching run keeps its last token to compute.
    short = arr[: 5 * BS + 4]
    assert verify(chain_hashes(short, BS), len(short), held, prompt=short).tokens == 5 * BS + 3


def test_several_kv_cache_groups_stay_block_granular() -> None:
    held = known(retention([list(range(10)), list(range(20, 30))]), 9 * BS + 5, 4)
    prompt = [*TOKENS[: 5 * BS + 7], 9999, *TOKENS[5 * BS + 8 :]]
    prefix = verify(chain_hashes(prompt, BS), len(prompt), held, prompt=np.array(prompt, dtype=np.uint32))
    assert (prefix.blocks, prefix.partial) == (5, 0)


def test_known_tokens_are_not_read_past_an_earlier_mismatch() -> None:
    held = known(retention([list(range(10))]), 6 * BS + 5, 6)
    prompt = [*TOKENS[: 2 * BS], 9999, *TOKENS[2 * BS + 1 :]]  # an edit in block 2
    prefix = verify(chain_hashes(prompt, BS), len(prompt), held, prompt=np.array(prompt, dtype=np.uint32))
    assert (prefix.blocks, prefix.partial) == (2, 0)
    # Known tokens of the wrong length (not up to num_tokens) are ignored.
    bad = replace(held, known_tokens=held.known_tokens[:2])
    ok = np.array(TOKENS, dtype=np.uint32)
    assert verify(chain_hashes(TOKENS, BS), len(TOKENS), bad, prompt=ok).partial == 0
