"""Verified reuse: how much of a new prompt a retention's KV really covers, and the
kv_transfer_params that make a prefill engine read exactly that much.

vLLM's prefill takes `min(remote_num_tokens, prompt tokens)` minus its local prefix hits from
the remote holder and trims the remote block list from the end: it assumes the prompt extends
the retained tokens and never checks. An edited history (stripped reasoning, compaction, a
re-rendered chat-template tail) would silently read KV of other tokens. So the router compares
hash chains, keeps the full blocks of the longest identical run, and hands prefill params
truncated to exactly those blocks.

Token granular: when every full block of the retention verified and its tail tokens (those of
its partly filled last block) are known, the prompt is compared with them token by token, and
the prefix ends at the last equal token. Prefill then reads that last block whole (its block id
is in the list, `remote_num_tokens` says where the verified tokens end): vLLM's scheduler sets
the request's computed tokens to exactly `remote_num_tokens`, prefill computes from there on and
writes those positions of the block before attention reads them, so the block's unverified
slots are overwritten, never attended (vLLM 0.32 CPU, nixl pull_scheduler / scheduler;
tests/e2e/test_reuse_granularity.py compares outputs).

Where prefill reads from (remote_engine_id, remote_host, remote_port) comes from the node
registry, the holder node as registered, never from the params a retention stored: KV is read
only from nodes the registry knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvshuttle.core.hashing import common_prefix_blocks
from kvshuttle.router.model import Hashes, NodeInfo, RetentionInfo
from kvshuttle.vllm.block_ids import block_groups


@dataclass(frozen=True, slots=True)
class VerifiedPrefix:
    # Full blocks verified, and tokens verified in the block after them (0: none).
    blocks: int
    block_size: int
    tail: int = 0

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size + self.tail

    @property
    def read_blocks(self) -> int:
        """Blocks prefill reads: the full ones, and the partly verified one."""
        return self.blocks + (1 if self.tail else 0)


def verify(
    prompt_chain: Hashes,
    prompt_tokens: int,
    retention: RetentionInfo,
    *,
    prompt: npt.NDArray[np.uint32] | None = None,
) -> VerifiedPrefix:
    """The prefix of the prompt that the retention holds, token for token: full blocks, and with
    `prompt` (its token ids) the tokens of the retention's partly filled last block that equal
    the prompt's.

    Capped by the retention's token count and by the block ids its params carry, and kept
    below the prompt's length: prefill must compute at least one token to produce logits.
    """
    bs = retention.block_size
    blocks = common_prefix_blocks(prompt_chain, retention.block_hashes)
    blocks = min(blocks, retention.num_tokens // bs, (prompt_tokens - 1) // bs if prompt_tokens else 0)
    groups = block_groups(retention.kv_transfer_params)
    blocks = min(blocks, len(groups[0]) if groups else 0)
    if len(groups) > 1 and any(len(g) != len(groups[0]) for g in groups):
        # Groups of other shapes (sliding window, mamba) cannot be cut to a prefix by position:
        # reuse them only whole, and only when the whole retention verified.
        whole = min(len(g) for g in groups)
        blocks = blocks if blocks == whole == retention.num_tokens // bs else 0
    blocks = max(blocks, 0)
    tail = 0
    if prompt is not None and len(groups) == 1 and len(groups[0]) > blocks:
        tail = _tail_match(prompt, prompt_tokens, retention, blocks)
    return VerifiedPrefix(blocks, bs, tail)


def _tail_match(
    prompt: npt.NDArray[np.uint32], prompt_tokens: int, retention: RetentionInfo, blocks: int
) -> int:
    """Leading tokens of the retention's last, partly filled block that the prompt repeats
    (0 unless every full block verified and the tail is known)."""
    bs, tail = retention.block_size, retention.tail_tokens
    start = blocks * bs
    if not tail or blocks != retention.num_tokens // bs or len(tail) != retention.num_tokens - start:
        return 0
    n = max(0, min(len(tail), prompt_tokens - 1 - start, int(prompt.size) - start))
    differ = np.flatnonzero(prompt[start : start + n] != np.asarray(tail[:n], dtype=np.uint32))
    return int(differ[0]) if differ.size else n


def knows_side_channel(node: NodeInfo) -> bool:
    """Whether the router knows where to send a reader of the node's KV."""
    return bool(node.engine_id and node.side_channel_host and 0 < node.side_channel_port < 65536)


def prefill_params(retention: RetentionInfo, prefix: VerifiedPrefix, holder: NodeInfo) -> dict[str, Any]:
    """Decode's params, truncated to the verified prefix, as prefill must receive them: read
    from `holder` (the retention's node, as the registry lists it) at its registered engine id
    and side channel."""
    if holder.name != retention.node or not knows_side_channel(holder):
        raise ValueError(f"{holder.name} cannot serve {retention.name} (held by {retention.node})")
    params = dict(retention.kv_transfer_params)
    params["remote_engine_id"] = holder.engine_id
    params["remote_host"] = holder.side_channel_host
    params["remote_port"] = holder.side_channel_port
    params["remote_block_ids"] = [g[: prefix.read_blocks] for g in block_groups(params)]
    params["remote_num_tokens"] = prefix.tokens
    params["do_remote_decode"] = True
    params["do_remote_prefill"] = False
    return params


def first_turn_params() -> dict[str, Any]:
    """What prefill gets when nothing is reused: compute, then keep the KV for decode to read."""
    return {"do_remote_decode": True, "do_remote_prefill": False}
