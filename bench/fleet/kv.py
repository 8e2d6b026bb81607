"""A simulated engine's KV memory, block by block: the GPU pool (HBM) with vLLM's prefix cache and
the blocks held for remote readers, and the host tier (CPU DRAM) of vLLM's OffloadingConnector.

No tensors and no tokens: a block is its **key** (the kvshuttle chain hash of the tokens it is
for, kvshuttle.core.hashing, at the engine's block size: equal keys at position i mean equal
tokens in blocks 0..i) and its **content** (the key of the KV it actually holds). Computing a
block gives it its own key as content; a prefix-cache hit or a remote read copies the content
found, so a reader handed the wrong blocks ends up with content != key, and the simulated answer
(bench/fleet/engine.py) differs from a clean recompute's, as the stand-in's does
(deploy/standin/kv.py).

`BlockPool` follows deploy/standin/kvpool.py (which follows vLLM 0.32's KVCacheManager): full
blocks cached by key, least recently used unreferenced block evicted first when one is needed;
holdings (prefill's blocks for decode, decode's retained for the next turn's reader,
`decoder_kv_blocks_ttl`) pinned until read once or expired, the oldest dropped when nothing else
makes room; admission reserves blocks (`try_reserve`, the step scheduler's BlockBudget). Stored
and removed keys go to `on_stored` / `on_removed` (the engine's KV events).

`HostTier`: vLLM's OffloadingConnector CPU backend: a byte-capacity LRU of blocks by key. What is
offloaded, and when, is the engine's call (bench/fleet/engine.py); a lookup touches what it finds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["BlockPool", "CacheFull", "HostTier", "Keys"]

Keys = npt.NDArray[np.uint64]


class CacheFull(Exception):
    """A request needs more blocks than the whole pool has, or every block is in use."""


@dataclass(slots=True)
class _Block:
    content: int
    key: int | None  # set while the block is in the prefix cache
    refs: int = 0


@dataclass(slots=True)
class _Held:
    block_ids: list[int]
    expires_at: float


def _nothing(keys: list[int]) -> None:
    return None


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        on_stored: Callable[[list[int], int, Any], None] | None = None,
        on_removed: Callable[[list[int]], None] = _nothing,
    ) -> None:
        """`on_stored(keys, first, (tokens, parent))`: blocks `first`.. of the sequence of
        `tokens` newly cached with `keys`, `parent` the key before them (None from the first);
        `on_removed(keys)`: cached blocks evicted."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._on_stored = on_stored
        self._on_removed = on_removed
        self._free = list(range(num_blocks - 1, -1, -1))
        self._blocks: dict[int, _Block] = {}
        self._cached: dict[int, int] = {}  # key -> block id
        # Cached blocks nobody references, least recently used first: eviction's candidates.
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._held: OrderedDict[str, _Held] = OrderedDict()  # oldest first
        self.reserved = 0
        self.evicted_blocks = 0
        self.dropped_holdings = 0
        self.expired_holdings = 0

    # -- reading -----------------------------------------------------------------------------

    def hits(self, keys: Sequence[int]) -> list[int]:
        """Contents of the leading blocks of `keys` in the prefix cache (touched as used)."""
        found: list[int] = []
        cached, blocks = self._cached, self._blocks
        key_list = keys
        for key in key_list:
            block_id = cached.get(key)
            if block_id is None:
                break
            found.append(blocks[block_id].content)
        idle = self._idle
        for key in reversed(key_list[: len(found)]):  # the head most recent: the tail goes first
            if key in idle:
                idle.move_to_end(key)
        return found

    def take(self, holding: str, upto_blocks: int) -> list[int] | None:
        """A remote reader's READ of the first `upto_blocks` blocks of `holding`, and its
        notification: their contents, the holding released (single use). None when the holding
        is gone (read, expired, dropped) or shorter."""
        held = self._held.pop(holding, None)
        if held is None:
            return None
        contents = (
            [self._blocks[b].content for b in held.block_ids[:upto_blocks]]
            if upto_blocks <= len(held.block_ids)
            else None
        )
        self._release(held.block_ids)
        return contents

    def used_blocks(self) -> int:
        """Blocks in use (running requests' and held ones); the prefix cache's idle ones not."""
        return self.num_blocks - len(self._free) - len(self._idle)

    def audit(self) -> dict[str, int]:
        """What a quiescent pool (no request running) must show: `lost` blocks neither free nor
        allocated, `unheld` blocks referenced by no holding, `reserved` blocks still set aside;
        all 0 when no block leaked."""
        held = set().union(*(h.block_ids for h in self._held.values())) if self._held else set()
        referenced = {b for b, block in self._blocks.items() if block.refs > 0}
        return {
            "lost": self.num_blocks - len(self._free) - len(self._blocks),
            "unheld": len(referenced - held),
            "reserved": self.reserved,
        }

    def available(self) -> int:
        return len(self._free) + len(self._idle) - self.reserved

    # -- admission (the step scheduler's BlockBudget) ----------------------------------------

    def try_reserve(self, blocks: int) -> bool:
        if blocks > self.available():
            return False
        self.reserved += blocks
        return True

    def unreserve(self, blocks: int) -> None:
        self.reserved -= blocks

    # -- writing -----------------------------------------------------------------------------

    def place(
        self,
        keys: Sequence[int],
        contents: Sequence[int],
        total_blocks: int,
        prompt_blocks: int,
        tokens: Any = None,
    ) -> list[int]:
        """Blocks for a sequence of `total_blocks` (its full ones keyed by `keys`, holding
        `contents`, as long as `keys`; a trailing partial block is not cached): leading blocks
        the cache has are shared, the rest allocated and the full ones cached. Full blocks past
        `prompt_blocks` were filled by decode steps (vLLM reports each on its own). Ids come
        back pinned: `hold` or `release` them. Raises CacheFull."""
        if total_blocks > self.num_blocks:
            raise CacheFull(f"{total_blocks} blocks needed; the pool has {self.num_blocks}")
        ids: list[int] = []
        key_list = keys
        cached, blocks = self._cached, self._blocks
        hits = 0
        for key in key_list:
            block_id = cached.get(key)
            if block_id is None:
                break
            block = blocks[block_id]
            if block.refs == 0:
                del self._idle[key]
            block.refs += 1
            ids.append(block_id)
            hits += 1
        first_new = -1
        for i in range(hits, total_blocks):
            block_id = self._allocate()
            full = i < len(key_list)
            new_key = key_list[i] if full else None
            if new_key is not None and new_key in cached:  # cached meanwhile under this key: not twice
                new_key = None
            blocks[block_id] = _Block(contents[i] if full else -1, new_key, refs=1)
            if new_key is not None:
                cached[new_key] = block_id
                if first_new < 0:
                    first_new = i
            ids.append(block_id)
        if first_new >= 0 and self._on_stored is not None:
            parent = key_list[first_new - 1] if first_new else None
            self._on_stored(list(key_list[first_new:]), first_new, (tokens, parent))
        return ids

    def hold(self, holding: str, block_ids: list[int], expires_at: float) -> None:
        self._held[holding] = _Held(block_ids, expires_at)

    def release(self, block_ids: Sequence[int]) -> None:
        self._release(block_ids)

    def expire(self, now: float) -> int:
        due = [name for name, held in self._held.items() if held.expires_at <= now]
        for name in due:
            self._release(self._held.pop(name).block_ids)
        self.expired_holdings += len(due)
        return len(due)

    def next_expiry(self) -> float | None:
        return min((h.expires_at for h in self._held.values()), default=None)

    # -- internals ---------------------------------------------------------------------------

    def _release(self, block_ids: Sequence[int]) -> None:
        """vLLM frees a sequence's blocks tail first, so that its head is evicted last: a
        cached prefix stays whole while it ages."""
        blocks, idle = self._blocks, self._idle
        for block_id in reversed(block_ids):
            block = blocks[block_id]
            block.refs -= 1
            if block.refs == 0:
                if block.key is None:
                    del blocks[block_id]
                    self._free.append(block_id)
                else:
                    idle[block.key] = None

    def _allocate(self) -> int:
        while not self._free:
            if not self._evict_one():
                if not self._held:
                    raise CacheFull("every block is in use by running requests")
                _, held = self._held.popitem(last=False)
                self.dropped_holdings += 1
                self._release(held.block_ids)
        return self._free.pop()

    def _evict_one(self) -> bool:
        if not self._idle:
            return False
        key, _ = self._idle.popitem(last=False)
        block_id = self._cached.pop(key)
        del self._blocks[block_id]
        self._free.append(block_id)
        self.evicted_blocks += 1
        self._on_removed([key])
        return True


class HostTier:
    """`capacity_blocks` blocks of host memory, LRU by key; each entry holds its content."""

    def __init__(self, capacity_blocks: int, *, on_removed: Callable[[list[int]], None] = _nothing) -> None:
        self.capacity_blocks = capacity_blocks
        self._on_removed = on_removed
        self._blocks: OrderedDict[int, int] = OrderedDict()  # key -> content, LRU first
        self.stored_blocks = 0
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def hits(self, keys: Sequence[int], start: int = 0) -> list[int]:
        """Contents of the run of `keys` from `start` found here (touched as used)."""
        found: list[int] = []
        blocks = self._blocks
        key_list = keys[start:]
        for key in key_list:
            content = blocks.get(key)
            if content is None:
                break
            found.append(content)
        for key in reversed(key_list[: len(found)]):
            blocks.move_to_end(key)
        return found

    def leading(self, keys: Sequence[int]) -> int:
        """How many leading blocks of `keys` are here (not touched: a router's look)."""
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            n += 1
        return n

    def store(self, keys: Sequence[int], contents: Sequence[int]) -> list[int]:
        """Offload blocks (already here: touched); the keys newly stored."""
        if self.capacity_blocks <= 0:
            return []
        blocks, new = self._blocks, []
        for key, content in zip(reversed(keys), reversed(contents), strict=True):  # head last
            if key in blocks:
                blocks.move_to_end(key)
                continue
            blocks[key] = content
            new.append(key)
        self.stored_blocks += len(new)
        over = len(blocks) - self.capacity_blocks
        if over > 0:
            gone = []
            for _ in range(over):
                key, _ = blocks.popitem(last=False)
                gone.append(key)
            self.evicted_blocks += over
            self._on_removed(gone)
        return new
