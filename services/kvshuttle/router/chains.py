"""Prefix-hash chains of prompts, computed incrementally per conversation.

A conversation's next prompt almost always starts with the last one (plus the answer): the
cache keeps each conversation's last token ids and chain, finds where the new tokens first
differ (one vectorised comparison), reuses the chain up to that block and hashes only the rest.
A miss (another router replica served the last turn) hashes everything: same result, slower.
A chain is remembered with its root (the prompt's cache salt's): a prompt under another root
shares no hash with it, so it is hashed whole. Bounded by bytes, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvshuttle.core.hashing import ROOT_HASH, chain_hashes

Tokens = npt.NDArray[np.uint32]
Chain = npt.NDArray[np.uint64]
# The chain of what needed none (a plain request with nothing to look up).
NO_CHAIN: Chain = np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True, slots=True)
class _Entry:
    tokens: Tokens
    chain: Chain
    block_size: int
    root: int

    @property
    def nbytes(self) -> int:
        return int(self.tokens.nbytes) + int(self.chain.nbytes) + 200


class ChainCache:
    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # Lookups that reused a remembered chain, and those that hashed the prompt whole.
        self.hits = 0
        self.misses = 0

    def chain(
        self, key: str, tokens: Tokens, block_size: int, *, root: int = ROOT_HASH, remember: bool = True
    ) -> Chain:
        """The chain of `tokens` (uint32 array) from `root`, as uint64s; remembered under `key`
        unless key is empty.

        The returned array is shared with the cache: treat it as read-only.
        """
        entry = self._entries.get(key) if key else None
        reused = 0
        if entry is not None and entry.block_size == block_size and entry.root == root:
            n = min(len(tokens), len(entry.tokens))
            differ = np.flatnonzero(tokens[:n] != entry.tokens[:n])
            same = int(differ[0]) if differ.size else n
            reused = min(same // block_size, len(entry.chain))
        if entry is not None and reused:
            self.hits += 1
            tail = chain_hashes(
                tokens[reused * block_size :], block_size, parent=int(entry.chain[reused - 1])
            )
            chain = np.concatenate([entry.chain[:reused], np.array(tail, dtype=np.uint64)])
        else:
            self.misses += 1
            chain = np.array(chain_hashes(tokens, block_size, parent=root), dtype=np.uint64)
        if key and remember:
            self._put(key, _Entry(tokens.copy(), chain, block_size, root))
        return chain

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _put(self, key: str, entry: _Entry) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        if entry.nbytes > self._max_bytes:
            return
        self._entries[key] = entry
        self._bytes += entry.nbytes
        while self._bytes > self._max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
