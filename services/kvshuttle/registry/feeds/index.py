"""The path from ReportBlockEvents (and node removals) to the block index
(kvshuttle.registry.block_index): the facade hands each report and each removal to the index
feed, which applies it to this process's index and, where replicas share a store, to theirs.

Two feeds:

- `LocalIndexFeed` (the in-memory store): applies at once to this process's index.
- `kvshuttle.registry.feeds.redis_index.RedisIndexFeed` (the Redis store): the sequence rule is
  decided once for all replicas on shared per-node sequence state, each accepted report is one
  entry of a Redis Stream, and every replica's index applies the stream in its order, so an
  agent may report to any replica and every replica answers LookupBlocks with the whole index.

Lookups always read this process's index: a placement hint, never a decision about which KV is
served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from kvshuttle.core.kv_events import ApplyResult, EventBatch
from kvshuttle.registry.block_index import BlockIndex

__all__ = ["IndexFeed", "LocalIndexFeed"]


class IndexFeed(Protocol):
    async def report(self, node: str, incarnation: int, batches: Sequence[EventBatch]) -> ApplyResult:
        """Apply a node's batches (already validated, `incarnation` checked current) under the
        sequence rule (`block_index.plan_batches`). Raises FailedPrecondition
        (NODE_INCARNATION_MISMATCH) when the node was removed at or after that incarnation
        meanwhile."""
        ...

    async def drop(self, node: str, floor: int, now: float) -> None:
        """Forget the node's blocks and sequence; reports of incarnations below `floor` are refused
        from now on (a report that passed its incarnation check before the removal)."""
        ...

    async def run(self) -> None:
        """What the feed needs running (a reader), until cancelled."""
        ...


class LocalIndexFeed:
    """This process's index, applied to at once."""

    def __init__(self, index: BlockIndex) -> None:
        self._index = index

    async def report(self, node: str, incarnation: int, batches: Sequence[EventBatch]) -> ApplyResult:
        return self._index.apply(node, batches)

    async def drop(self, node: str, floor: int, now: float) -> None:
        self._index.drop_node(node)

    async def run(self) -> None:
        await asyncio.Event().wait()  # nothing to read: reports are applied as they come
