"""vLLM's KV-cache events as kvshuttle's domain values, shared by their publisher side (the
agent, which decodes them from the engine's wire format in `kvshuttle.vllm.kv_events`) and
their consumer (the registry's block index). Wire formats and the index live above this."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AllBlocksCleared",
    "ApplyResult",
    "BlockEvent",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """vLLM's BlockStored: full blocks newly cached, parent first."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]  # block_size * len(block_hashes) tokens
    block_size: int
    lora_id: int | None
    medium: str
    # SHA-256 of the cache_salt the sequence's first block was stored under (vLLM reports the
    # salt in that block's `extra_keys`); b"" for none, and for every event whose first block is
    # not a sequence's first (its parent carries the salt down the chain).
    cache_salt_sha256: bytes = b""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """vLLM's BlockRemoved: blocks evicted from the cache (deepest first)."""

    block_hashes: tuple[int, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """vLLM's AllBlocksCleared: the prefix cache was reset."""


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One message of the engine's KV-event publisher."""

    seq: int  # the publisher's sequence number; restarts at 0 with the engine
    engine_time: float  # the engine's timestamp, seconds since the epoch
    events: tuple[BlockEvent, ...]


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What the block index did with a node's batches."""

    applied_batches: int  # batches applied; already-seen ones are skipped
    next_seq: int  # the sequence number the index expects next from the node
    gap_detected: bool  # sequence numbers were missing: the index may lack blocks
    engine_restarted: bool  # the sequence went back to 0: the node's index was cleared
