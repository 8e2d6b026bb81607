"""block_groups over both shapes of decode's block ids: one list per KV-cache group (vLLM
today) and one flat list (older vLLM)."""

from __future__ import annotations

from kvshuttle.vllm.block_ids import block_groups


def test_block_groups_reads_both_shapes_and_copies_nothing() -> None:
    grouped = {"remote_block_ids": [[1, 2], [3, 4]]}
    assert block_groups(grouped) == [[1, 2], [3, 4]]
    assert block_groups(grouped)[0] is grouped["remote_block_ids"][0]
    assert block_groups({"remote_block_ids": [1, 2, 3]}) == [[1, 2, 3]]
    assert block_groups({"remote_block_ids": None}) == [[]]
    assert block_groups({}) == [[]]
