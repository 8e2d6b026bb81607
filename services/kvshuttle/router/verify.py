"""Verified reuse: how much of a new prompt a retention's KV really covers, and the
kv_transfer_params that make a prefill engine read exactly that much.

vLLM's prefill takes `min(remote_num_tokens, prompt tokens)` minus its local prefix hits from
the remote holder and trims the remote block list from the end: it assumes the prompt extends
the retained tokens and never checks. An edited history (stripped reasoning, compaction, a
re-rendered chat-template tail) would silently read KV of other tokens. So the router compares
hash chains, keeps the full blocks of the longest identical run, and hands prefill params
truncated to exactly those blocks.

Token granular: the tokens of a retention's answer blocks (from the block holding its turn's
prompt end to its end, at most committer.MAX_KNOWN_BLOCKS, kept on the committing replica's
hint) are known. When the chain verifies the full blocks before block b and b is one of those,
the prompt is compared with the known tokens from b's start, and the prefix ends at the last
equal token: an answer re-rendered from a tool call or a reasoning parser departs a token or two
after the previous prompt, often inside a full block. Prefill then reads block b whole (its
block id is in the list, `remote_num_tokens` says where the verified tokens end), although its
slots from the departure on hold KV of the retention's own tokens, or none: vLLM's scheduler
sets the request's computed tokens to exactly `remote_num_tokens` and caches only the blocks
full below it, prefill computes from there on and writes those positions of the block, in every
layer, before attention reads them, so the unverified slots are overwritten, never attended, and
the block enters prefill's prefix cache only when a step computes its last slots, under the
prompt's own hash (vLLM 0.32 CPU, nixl pull_scheduler, scheduler._update_waiting_for_remote_kv,
cache_blocks; tests/e2e/test_reuse_granularity.py compares outputs). Retentions of several
KV-cache groups (hybrid models) stay block granular.

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
    partial: int = 0

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size + self.partial

    @property
    def read_blocks(self) -> int:
        """Blocks prefill reads: the full ones, and the partly verified one."""
        return self.blocks + (1 if self.partial else 0)


def verify(
    prompt_chain: Hashes,
    prompt_tokens: int,
    retention: RetentionInfo,
    *,
    prompt: npt.NDArray[np.uint32] | None = None,
) -> VerifiedPrefix:
    """The prefix of the prompt that the retention holds, token for token: full blocks, and with
    `prompt` (its token ids) the leading tokens of the next block that equal the retention's
    known tokens.

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
    partial = 0
    if prompt is not None and len(groups) == 1 and len(groups[0]) > blocks:
        partial = _known_match(prompt, prompt_tokens, retention, blocks)
    return VerifiedPrefix(blocks, bs, partial)


def _known_match(
    prompt: npt.NDArray[np.uint32], prompt_tokens: int, retention: RetentionInfo, blocks: int
) -> int:
    """Leading tokens of block `blocks` that the prompt and the retention's known tokens share
    (0 unless that block's tokens are known)."""
    bs, known = retention.block_size, retention.known_tokens
    offset = (blocks - retention.known_from_block) * bs
    if offset < 0 or len(known) != retention.num_tokens - retention.known_from_block * bs:
        return 0
    start = blocks * bs
    n = max(0, min(bs, len(known) - offset, prompt_tokens - 1 - start, int(prompt.size) - start))
    differ = np.flatnonzero(prompt[start : start + n] != known[offset : offset + n])
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


def whole_params(retention: RetentionInfo, holder: NodeInfo) -> dict[str, Any]:
    """The whole retention's params as a reader of all its blocks needs them (an agent moving
    it into its pool): addressed to `holder` as registered, like prefill_params. One KV-cache
    group is cut to the blocks its tokens fill; several stay whole."""
    groups = block_groups(retention.kv_transfer_params)
    bs, n = retention.block_size, retention.num_tokens
    if len(groups) == 1:
        return prefill_params(retention, VerifiedPrefix(n // bs, bs, n % bs), holder)
    whole = min((len(g) for g in groups), default=0)
    return prefill_params(retention, VerifiedPrefix(whole, bs), holder) | {
        "remote_block_ids": [list(g) for g in groups],
        "remote_num_tokens": n,
    }


def release_params(retention: RetentionInfo, holder: NodeInfo) -> dict[str, Any]:
    """The retention's params addressed to `holder` as a prefill that reads none of it gets
    them: remote_num_tokens 0, so vLLM's pull scheduler matches no external token, and with
    remote_block_ids set it still notifies the holder (as for a full local prefix hit), which
    frees the blocks. Nothing is read: no KV of the retention can reach this turn."""
    return whole_params(retention, holder) | {"remote_num_tokens": 0}


def first_turn_params() -> dict[str, Any]:
    """What prefill gets when nothing is reused: compute, then keep the KV for decode to read."""
    return {"do_remote_decode": True, "do_remote_prefill": False}


def extend_params() -> dict[str, Any]:
    """What the holder's request gets on extend: nothing to read remotely (its own prefix cache
    serves the history), and, being params at all, the blocks kept for the next turn as a
    decode request's are (vLLM's NixlConnector keeps a decode-side request's blocks when it
    came with params and bidirectional transfer is on)."""
    return {"do_remote_decode": False, "do_remote_prefill": False}
