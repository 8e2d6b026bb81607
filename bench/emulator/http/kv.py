"""The stand-in engine's KV content (bench/emulator/http/engine.py): no tensors, only which tokens'
KV each block holds, so that reading the wrong blocks changes the output; and vLLM's block hashes.
The blocks themselves, the prefix cache and the holdings are bench/emulator/core/pool.py's; what
their KV events look like on vLLM's wire is `stored_events` / `removed_event`.

A block holds `content`: the tokens whose KV it stands for. A request's KV is computed from its
prompt (content = the prompt's tokens), found in the local prefix cache (content = what the cached
block held), or read from another engine's held blocks (content = what those blocks held). The
output tokens are a deterministic function of the content (`output_tokens`), so an engine that was
handed KV of other tokens answers differently from a clean recompute of the same prompt, which is
exactly `output_tokens(prompt, n)`.

Block hashes are vLLM's: SHA-256 of the pickled `(parent hash, block tokens, extra keys)`, from
NONE_HASH; the request's `cache_salt` is the first block's extra key; KV events carry the hash's
low 64 bits (`int64_of`), as `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` does.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any, Final

__all__ = [
    "NONE_HASH",
    "content_digest",
    "int64_of",
    "output_tokens",
    "removed_event",
    "stored_events",
    "vllm_block_hashes",
]

_U64: Final = (1 << 64) - 1


def _sha256_pickle(value: Any) -> bytes:
    """vLLM's default prefix-caching hash (`--prefix-caching-hash-algo sha256`)."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


NONE_HASH: Final = _sha256_pickle("vllm-none-hash")  # vLLM's DEFAULT_NONE_HASH_SEED


def vllm_block_hashes(tokens: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """vLLM's block hashes of every full block of `tokens` (as bytes; events carry `int64_of`)."""
    hashes: list[bytes] = []
    parent = NONE_HASH
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        parent = _sha256_pickle((parent, tuple(tokens[start : start + block_size]), extra))
        hashes.append(parent)
    return hashes


def int64_of(block_hash: bytes) -> int:
    """The int form KV events carry: the hash's low 64 bits, read big-endian."""
    return int.from_bytes(block_hash, "big") & _U64


def content_digest(content: Sequence[int]) -> bytes:
    """What the output depends on: every token whose KV the engine attends over, in order."""
    return hashlib.blake2b(b"".join(t.to_bytes(4, "little") for t in content), digest_size=16).digest()


def output_tokens(content: Sequence[int], count: int, vocabulary: Sequence[int]) -> list[int]:
    """The `count` greedy output tokens of an engine whose KV holds `content`, drawn from
    `vocabulary` (ids that decode to plain text)."""
    digest = content_digest(content)
    out = []
    for i in range(count):
        h = hashlib.blake2b(digest + i.to_bytes(4, "little"), digest_size=8).digest()
        out.append(vocabulary[int.from_bytes(h, "little") % len(vocabulary)])
    return out


def stored_events(
    tokens: Sequence[int],
    hashes: Sequence[bytes],
    stored: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    *,
    first_generated: int,
    medium: str = "GPU",
) -> list[dict[str, Any]]:
    """vLLM 0.32's BlockStored events for blocks `stored` (ascending) of the sequence `tokens`:
    one per run of consecutive prompt blocks, and one per block from `first_generated` on (decode
    steps fill those one at a time)."""
    runs: list[list[int]] = []
    for i in stored:
        if runs and runs[-1][-1] == i - 1 and i < first_generated:
            runs[-1].append(i)
        else:
            runs.append([i])
    events = []
    for run in runs:
        first = run[0]
        # vLLM 0.32 reports the salt (its first block's extra key) untagged.
        extra: list[list[str] | None] = [None] * len(run)
        if first == 0 and cache_salt:
            extra[0] = [cache_salt]
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": [int64_of(hashes[i]) for i in run],
                "parent_block_hash": None if first == 0 else int64_of(hashes[first - 1]),
                "token_ids": list(tokens[first * block_size : (run[-1] + 1) * block_size]),
                "block_size": block_size,
                "lora_id": None,
                "medium": medium,
                "lora_name": None,
                "extra_keys": extra,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        )
    return events


def removed_event(hashes: Sequence[bytes], medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [int64_of(h) for h in hashes], "medium": medium}
