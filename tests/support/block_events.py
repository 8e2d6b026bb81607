"""vLLM KV-event batches of stored and removed blocks, for the block index and its feed."""

from __future__ import annotations

from kvshuttle.core.kv_events import BlockEvent, BlockRemoved, BlockStored, EventBatch

BS = 4


def toks(n_blocks: int, start: int = 0, block_size: int = BS) -> tuple[int, ...]:
    return tuple(range(start, start + n_blocks * block_size))


def stored(
    hashes: tuple[int, ...],
    tokens: tuple[int, ...],
    parent: int | None = None,
    *,
    block_size: int = BS,
    lora_id: int | None = None,
    medium: str = "GPU",
    salt: bytes = b"",
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=lora_id,
        medium=medium,
        cache_salt_sha256=salt,
    )


def removed(*hashes: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium)


def batch(seq: int, *events: BlockEvent) -> EventBatch:
    return EventBatch(seq=seq, engine_time=1.0e9 + seq, events=events)
