"""An emulated engine's KV memory, block by block: the GPU pool (HBM) with vLLM's prefix cache and
the blocks held for remote readers, and the host tier (CPU DRAM) of vLLM's OffloadingConnector.

No tensors: a block is its **key** (what the prefix cache finds it by: vLLM's block hash over
HTTP, kvshuttle's chain hash in the fleet simulator; equal keys at position i mean equal tokens in
blocks 0..i) and its **content** (what KV it actually holds: the tokens it was computed from over
HTTP, the key it was computed for in the simulator). Computing a block gives it its own content; a
prefix-cache hit or a remote read copies the content found, so a reader handed the wrong blocks
holds content that differs from a clean recompute's and answers differently
(bench/emulator/http/kv.py, bench/emulator/fleet/engine.py).

`BlockPool` follows vLLM 0.32's KVCacheManager: full blocks cached by key, the least recently used
unreferenced block evicted first when one is needed; a sequence's blocks freed tail first, so that
its head is evicted last; holdings (prefill's blocks for decode, decode's retained for the next
turn's reader, `decoder_kv_blocks_ttl`) pinned until read once or expired, the oldest dropped when
nothing else makes room (its reader then fails and recomputes); admission reserves blocks
(`try_reserve`, the step scheduler's BlockBudget). Newly cached blocks go to `on_stored`, evicted
ones to `on_removed`, a reset to `on_cleared` (the engine's KV events).

`HostTier`: vLLM's OffloadingConnector CPU backend: a capacity LRU of blocks by key. What is
offloaded, and when, is the engine's call (bench/emulator/core/engine.py); a lookup touches what it
finds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["BlockPool", "CacheFull", "HostTier"]

K = TypeVar("K", bound=Hashable)
C = TypeVar("C")


class CacheFull(Exception):
    """A request needs more blocks than the whole pool has, or every block is in use."""


@dataclass(slots=True)
class _Block(Generic[K, C]):
    content: C
    key: K | None  # set while the block is in the prefix cache
    refs: int = 0


@dataclass(slots=True)
class _Held:
    block_ids: list[int]
    expires_at: float


def _nothing(*_: Any) -> None:
    return None


class BlockPool(Generic[K, C]):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        prefix_caching: bool = True,
        on_stored: Callable[[list[int], Any], None] = _nothing,
        on_removed: Callable[[list[K]], None] = _nothing,
        on_cleared: Callable[[], None] = _nothing,
    ) -> None:
        """`on_stored(indices, sequence)`: blocks `indices` of `place`'s `sequence` newly cached;
        `on_removed(keys)`: cached blocks evicted; `on_cleared()`: the cache reset."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._on_stored = on_stored
        self._on_removed = on_removed
        self._on_cleared = on_cleared
        self._free = list(range(num_blocks - 1, -1, -1))
        self._blocks: dict[int, _Block[K, C]] = {}
        self._cached: dict[K, int] = {}  # key -> block id
        # Cached blocks nobody references, least recently used first: eviction's candidates.
        self._idle: OrderedDict[K, None] = OrderedDict()
        self._held: OrderedDict[str, _Held] = OrderedDict()  # oldest first
        self.reserved = 0
        self.evicted_blocks = 0
        self.dropped_holdings = 0
        self.expired_holdings = 0

    # -- reading -----------------------------------------------------------------------------

    def hits(self, keys: Sequence[K]) -> list[C]:
        """Contents of the leading blocks of `keys` in the prefix cache (touched as used)."""
        found: list[C] = []
        if not self.prefix_caching:
            return found
        cached, blocks = self._cached, self._blocks
        for key in keys:
            block_id = cached.get(key)
            if block_id is None:
                break
            found.append(blocks[block_id].content)
        idle = self._idle
        for key in reversed(keys[: len(found)]):  # the head most recent: the tail goes first
            if key in idle:
                idle.move_to_end(key)
        return found

    def take(self, holding: str, block_ids: Sequence[int], *, notify: bool = True) -> list[C] | None:
        """A remote reader's READ of `block_ids` of `holding`, then (`notify`) its notification:
        the blocks' contents, the holding released (single use). None when the holding is gone
        (read, expired, dropped) or does not hold those blocks."""
        held = self._held.pop(holding, None) if notify else self._held.get(holding)
        if held is None:
            return None
        contents = (
            [self._blocks[b].content for b in block_ids] if set(block_ids) <= set(held.block_ids) else None
        )
        if notify:
            self._release(held.block_ids)
        return contents

    def take_leading(self, holding: str, upto_blocks: int) -> list[C] | None:
        """`take` of the holding's first `upto_blocks` blocks; None as `take`, or when it holds fewer."""
        held = self._held.get(holding)
        if held is None or upto_blocks > len(held.block_ids):
            if held is not None:
                self._release(self._held.pop(holding).block_ids)
            return None
        return self.take(holding, held.block_ids[:upto_blocks])

    def holdings(self) -> int:
        return len(self._held)

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: blocks not free (the prefix cache's idle ones included)."""
        return 1.0 - len(self._free) / self.num_blocks

    def used_blocks(self) -> int:
        """Blocks in use (running requests' and held ones); the prefix cache's idle ones not."""
        return self.num_blocks - len(self._free) - len(self._idle)

    def held_blocks(self) -> int:
        """Distinct blocks pinned for remote readers (holdings share their prefix-cached blocks)."""
        return len(set().union(*(held.block_ids for held in self._held.values())))

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
        """Blocks a new request could get without dropping a holding: free or evictable, less
        the reservations."""
        return len(self._free) + len(self._idle) - self.reserved

    # -- admission (the step scheduler's BlockBudget) ----------------------------------------

    def try_reserve(self, blocks: int) -> bool:
        """Set `blocks` aside for an admitted request if `available()` has them."""
        if blocks > self.available():
            return False
        self.reserved += blocks
        return True

    def unreserve(self, blocks: int) -> None:
        """The request placed its blocks (or ended without)."""
        self.reserved -= blocks

    # -- writing -----------------------------------------------------------------------------

    def place(self, keys: Sequence[K], contents: Sequence[C], sequence: Any = None) -> list[int]:
        """Blocks for a sequence of `len(contents)` blocks holding `contents`, its full ones keyed
        by `keys` (a trailing partial block has no key and is not cached): leading blocks the
        cache has are shared, the rest allocated and the full ones cached (`on_stored` gets their
        indices and `sequence`). Ids come back pinned: `hold` or `release` them. Raises
        CacheFull."""
        total = len(contents)
        if total > self.num_blocks:
            raise CacheFull(f"{total} blocks needed; the pool has {self.num_blocks}")
        ids: list[int] = []
        cached, blocks, idle = self._cached, self._blocks, self._idle
        caching = self.prefix_caching
        hits = 0
        for hit in keys if caching else ():
            block_id = cached.get(hit)
            if block_id is None:
                break
            block = blocks[block_id]
            if block.refs == 0:
                del idle[hit]
            block.refs += 1
            ids.append(block_id)
            hits += 1
        stored: list[int] = []
        # Blocks evicted to make room, reported as one removal (vLLM's events of one step).
        removed: list[K] = []
        free, keyed = self._free, len(keys) if caching else 0
        try:
            for i in range(hits, total):
                block_id = free.pop() if free else self._allocate(removed)
                key: K | None = keys[i] if i < keyed else None
                if key is not None and key in cached:  # cached meanwhile under this key: not twice
                    key = None
                blocks[block_id] = _Block(contents[i], key, refs=1)
                if key is not None:
                    cached[key] = block_id
                    stored.append(i)
                ids.append(block_id)
        finally:
            if removed:
                self._on_removed(removed)
        if stored:
            self._on_stored(stored, sequence)
        return ids

    def hold(self, holding: str, block_ids: list[int], expires_at: float) -> None:
        """Keep pinned blocks (from `place`) for one remote reader until `expires_at`."""
        self._held[holding] = _Held(block_ids, expires_at)

    def release(self, block_ids: Sequence[int]) -> None:
        """Unpin blocks from `place` that nobody will read remotely."""
        self._release(block_ids)

    def expire(self, now: float) -> int:
        """Release the holdings due by `now`; how many."""
        due = [name for name, held in self._held.items() if held.expires_at <= now]
        for name in due:
            self._release(self._held.pop(name).block_ids)
        self.expired_holdings += len(due)
        return len(due)

    def next_expiry(self) -> float | None:
        return min((h.expires_at for h in self._held.values()), default=None)

    def clear(self) -> None:
        """vLLM's /reset_prefix_cache: unpinned cached blocks leave the cache (`on_cleared`)."""
        for key, block_id in list(self._cached.items()):
            block = self._blocks[block_id]
            block.key = None
            del self._cached[key]
            if block.refs == 0:
                del self._blocks[block_id]
                self._free.append(block_id)
        self._idle.clear()
        self._on_cleared()

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

    def _allocate(self, removed: list[K]) -> int:
        while not self._free:
            if not self._evict_one(removed):
                if not self._held:
                    raise CacheFull("every block is in use by running requests")
                _, held = self._held.popitem(last=False)  # the oldest holding makes room
                self.dropped_holdings += 1
                self._release(held.block_ids)
        return self._free.pop()

    def _evict_one(self, removed: list[K]) -> bool:
        if not self._idle:
            return False
        key, _ = self._idle.popitem(last=False)
        block_id = self._cached.pop(key)
        del self._blocks[block_id]
        self._free.append(block_id)
        self.evicted_blocks += 1
        removed.append(key)
        return True


class HostTier(Generic[K, C]):
    """`capacity_blocks` blocks of host memory, LRU by key; each entry holds its content."""

    def __init__(self, capacity_blocks: int, *, on_removed: Callable[[list[K]], None] = _nothing) -> None:
        self.capacity_blocks = capacity_blocks
        self._on_removed = on_removed
        self._blocks: OrderedDict[K, C] = OrderedDict()  # key -> content, LRU first
        self.stored_blocks = 0
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def hits(self, keys: Sequence[K], start: int = 0) -> list[C]:
        """Contents of the run of `keys` from `start` found here (touched as used)."""
        found: list[C] = []
        blocks = self._blocks
        key_list = keys[start:]
        for key in key_list:
            if key not in blocks:
                break
            found.append(blocks[key])
        for key in reversed(key_list[: len(found)]):
            blocks.move_to_end(key)
        return found

    def leading(self, keys: Sequence[K]) -> int:
        """How many leading blocks of `keys` are here (not touched: a router's look)."""
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            n += 1
        return n

    def store(self, keys: Sequence[K], contents: Sequence[C]) -> list[K]:
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
            gone = [blocks.popitem(last=False)[0] for _ in range(over)]
            self.evicted_blocks += over
            self._on_removed(gone)
        return new
