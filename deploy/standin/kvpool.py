"""The stand-in engine's GPU KV pool (deploy/standin/engine.py): `num_blocks` blocks of
`block_size` tokens, each holding the KV content of deploy/standin/kv.py.

The prefix cache is vLLM's: full blocks keyed by vLLM's block hash (deploy/standin/kv.py),
published as BlockStored, evicted least recently used among the unreferenced ones when a block is
needed (BlockRemoved). Blocks held for a remote reader (prefill's for decode, decode's retained for
the next turn's prefill, `decoder_kv_blocks_ttl`) are pinned until read once (the READ and the
reader's notification free them) or expired; when nothing else can make room the oldest holding is
dropped (its reader then fails and recomputes).

A profile-timed engine (deploy/standin/scheduler.py) admits a request only when the pool can give
it blocks: `try_reserve` counts free blocks and unreferenced cached ones (which eviction frees)
less what admitted requests have reserved and not yet placed; a request that does not fit waits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deploy.standin.kv import int64_of

__all__ = ["CacheFull", "Held", "KvBlockPool"]


class CacheFull(Exception):
    """A request needs more blocks than the whole cache has."""


@dataclass(slots=True)
class _Block:
    content: tuple[int, ...]
    vllm_hash: bytes | None  # set while the block is in the prefix cache
    refs: int = 0


@dataclass(slots=True)
class Held:
    """Blocks pinned for one remote reader, in position order."""

    block_ids: list[int]
    expires_at: float


class KvBlockPool:
    """`num_blocks` blocks of `block_size` tokens; events for the publisher accumulate in `events`."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks - 1, -1, -1))
        self._blocks: dict[int, _Block] = {}
        self._cached: OrderedDict[bytes, int] = OrderedDict()  # hash -> block id, LRU first
        self._held: OrderedDict[str, Held] = OrderedDict()  # oldest first
        self.events: list[dict[str, Any]] = []
        self.evicted_blocks = 0
        self._idle = 0  # cached blocks nobody references: eviction frees them
        self.reserved = 0  # blocks admitted requests will place
        self.dropped_holdings = 0

    # -- reading -----------------------------------------------------------------------------

    def local_hit(self, hashes: Sequence[bytes]) -> list[tuple[int, ...]]:
        """Contents of the leading blocks found in the prefix cache (touched as used)."""
        found = []
        for h in hashes if self.prefix_caching else ():
            block_id = self._cached.get(h)
            if block_id is None:
                break
            self._cached.move_to_end(h)
            found.append(self._blocks[block_id].content)
        return found

    def take(
        self, holding: str, block_ids: Sequence[int], *, notify: bool = True
    ) -> list[tuple[int, ...]] | None:
        """A remote reader's READ of `block_ids` of `holding`, then (`notify`) its notification:
        the blocks' contents, the holding released (single use). None when the holding is
        unknown (expired, already read, dropped) or does not hold those blocks."""
        held = self._held.pop(holding, None) if notify else self._held.get(holding)
        if held is None:
            return None
        wanted = set(block_ids)
        contents = [self._blocks[b].content for b in block_ids] if wanted <= set(held.block_ids) else None
        if notify:
            self._release(held.block_ids)
        return contents

    def holdings(self) -> int:
        return len(self._held)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def referenced_blocks(self) -> int:
        """Blocks in use (running requests' and held ones), the prefix cache's idle ones not counted."""
        return self.num_blocks - len(self._free) - self._idle

    def held_blocks(self) -> int:
        """Distinct blocks pinned for remote readers (holdings share their prefix-cached blocks)."""
        return len(set().union(*(held.block_ids for held in self._held.values())))

    def available(self) -> int:
        """Blocks a new request could get without dropping a holding: free or evictable, less
        the reservations."""
        return len(self._free) + self._idle - self.reserved

    # -- admission (a profile-timed engine's scheduler) ---------------------------------------

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

    def place(
        self,
        tokens: Sequence[int],
        content: Sequence[int],
        hashes: Sequence[bytes],
        cache_salt: str | None = None,
        *,
        prompt_tokens: int | None = None,
    ) -> list[int]:
        """Blocks for a sequence of `tokens` whose KV holds `content` (as long as `tokens`),
        `hashes` its vLLM block hashes: leading blocks the prefix cache has are shared, the rest
        allocated (full ones cached and published; `cache_salt` the request's). Tokens past
        `prompt_tokens` (default: none) were generated: vLLM caches each block they fill in its
        own decode step, so each is a BlockStored of its own. Their ids come back pinned: `hold`
        or `release` them. Raises CacheFull."""
        bs = self.block_size
        count = -(-len(tokens) // bs)
        if count > self.num_blocks:
            raise CacheFull(f"{len(tokens)} tokens need {count} blocks; the cache has {self.num_blocks}")
        ids: list[int] = []
        hits = 0
        for i, h in enumerate(hashes if self.prefix_caching else ()):
            block_id = self._cached.get(h)
            if block_id is None or hits != i:
                break
            self._cached.move_to_end(h)
            block = self._blocks[block_id]
            self._idle -= block.refs == 0
            block.refs += 1
            ids.append(block_id)
            hits += 1
        stored: list[int] = []
        for i in range(hits, count):
            block_id = self._allocate()
            full = (i + 1) * bs <= len(tokens)
            self._blocks[block_id] = block = _Block(tuple(content[i * bs : (i + 1) * bs]), None, refs=1)
            ids.append(block_id)
            if full and self.prefix_caching and hashes[i] not in self._cached:
                block.vllm_hash = hashes[i]
                self._cached[hashes[i]] = block_id
                stored.append(i)
        if stored:
            generated = len(tokens) if prompt_tokens is None else prompt_tokens
            self._store_event(tokens, hashes, stored, cache_salt, first_generated=generated // bs)
        return ids

    def hold(self, holding: str, block_ids: list[int], expires_at: float) -> None:
        """Keep pinned blocks (from `place`) for one remote reader until `expires_at`."""
        self._held[holding] = Held(block_ids, expires_at)

    def release(self, block_ids: Sequence[int]) -> None:
        """Unpin blocks from `place` that nobody will read remotely."""
        self._release(block_ids)

    def expire(self, now: float) -> int:
        """Release the holdings due by `now`; how many."""
        due = [name for name, held in self._held.items() if held.expires_at <= now]
        for name in due:
            self._release(self._held.pop(name).block_ids)
        return len(due)

    def clear(self) -> None:
        """vLLM's /reset_prefix_cache: unpinned cached blocks leave the cache (AllBlocksCleared)."""
        for h, block_id in list(self._cached.items()):
            block = self._blocks[block_id]
            block.vllm_hash = None
            del self._cached[h]
            if block.refs == 0:
                del self._blocks[block_id]
                self._free.append(block_id)
        self._idle = 0
        self.events.append({"type": "AllBlocksCleared"})

    # -- internals ---------------------------------------------------------------------------

    def _release(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            block = self._blocks[block_id]
            block.refs -= 1
            if block.refs == 0 and block.vllm_hash is None:  # not cached: free at once
                del self._blocks[block_id]
                self._free.append(block_id)
            elif block.refs == 0:
                self._idle += 1

    def _allocate(self) -> int:
        while not self._free:
            if not self._evict_one():
                if not self._held:
                    raise CacheFull("every block is in use by running requests")
                _, held = self._held.popitem(last=False)  # the oldest holding makes room
                self.dropped_holdings += 1
                self._release(held.block_ids)
        return self._free.pop()

    def _evict_one(self) -> bool:
        for h, block_id in self._cached.items():
            block = self._blocks[block_id]
            if block.refs == 0:
                del self._cached[h]
                del self._blocks[block_id]
                self._free.append(block_id)
                self._idle -= 1
                self.evicted_blocks += 1
                self.events.append({"type": "BlockRemoved", "block_hashes": [int64_of(h)], "medium": "GPU"})
                return True
        return False

    def _store_event(
        self,
        tokens: Sequence[int],
        hashes: Sequence[bytes],
        stored: list[int],
        cache_salt: str | None,
        *,
        first_generated: int,
    ) -> None:
        """One BlockStored per run of consecutive newly cached prompt blocks, and one per block
        from `first_generated` on (filled by decode steps), shaped as vLLM 0.32's."""
        bs = self.block_size
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1 and i < first_generated:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first = run[0]
            # vLLM 0.32 reports the salt (its first block's extra key) untagged.
            extra: list[list[str] | None] = [None] * len(run)
            if first == 0 and cache_salt:
                extra[0] = [cache_salt]
            self.events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [int64_of(hashes[i]) for i in run],
                    "parent_block_hash": None if first == 0 else int64_of(hashes[first - 1]),
                    "token_ids": list(tokens[first * bs : (run[-1] + 1) * bs]),
                    "block_size": bs,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": extra,
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                }
            )
