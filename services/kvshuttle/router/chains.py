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

from kvshuttle.core.hashing import ROOT_HASH, chain_array

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


def _frozen(tokens: Tokens) -> bool:
    """Whether nobody can write the array: read-only, and no other array's view."""
    return not tokens.flags.writeable and bool(tokens.flags.owndata)


def _common_prefix(a: Tokens, b: Tokens) -> int:
    """Leading equal tokens of two arrays. Compared as uint64 pairs first (half the elements;
    both are contiguous from their start), then the pair where they first differ."""
    n = min(len(a), len(b))
    if a.dtype.itemsize != 4 or b.dtype.itemsize != 4:
        differ = np.flatnonzero(a[:n] != b[:n])
        return int(differ[0]) if differ.size else n
    pairs = n // 2
    if pairs:
        x = np.ascontiguousarray(a[: 2 * pairs]).view(np.uint64)
        y = np.ascontiguousarray(b[: 2 * pairs]).view(np.uint64)
        differ = np.flatnonzero(x != y)
        if differ.size:
            i = 2 * int(differ[0])
            return i if a[i] != b[i] else i + 1
    if n % 2 and a[n - 1] != b[n - 1]:
        return n - 1
    return n


class ChainCache:
    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # Lookups that reused a remembered chain, and those that hashed the prompt whole.
        self.hits = 0
        self.misses = 0

    def chain(
        self,
        key: str,
        tokens: Tokens,
        block_size: int,
        *,
        root: int = ROOT_HASH,
        remember: bool = True,
        starts_with: Tokens | None = None,
    ) -> Chain:
        """The chain of `tokens` (uint32 array) from `root`, as uint64s; remembered under `key`
        unless key is empty. `starts_with`: a frozen array `tokens` is known to begin with (a
        commit's planned prompt): when it is the very array remembered, nothing is compared.

        The returned array is shared with the cache: treat it as read-only.
        """
        entry = self._entries.get(key) if key else None
        reused = 0
        if entry is not None and entry.block_size == block_size and entry.root == root:
            if starts_with is not None and starts_with is entry.tokens and _frozen(starts_with):
                same = len(starts_with)
            else:
                same = _common_prefix(tokens, entry.tokens)
            reused = min(same // block_size, len(entry.chain))
        if entry is not None and reused:
            self.hits += 1
            tail = chain_array(tokens[reused * block_size :], block_size, parent=int(entry.chain[reused - 1]))
            chain = np.concatenate([entry.chain[:reused], tail])
        else:
            self.misses += 1
            chain = chain_array(tokens, block_size, parent=root)
        if key and remember:
            # An array nobody can write (the router's own, frozen when checked) is kept as it is.
            self._put(key, _Entry(tokens if _frozen(tokens) else tokens.copy(), chain, block_size, root))
        return chain

    def adopt(self, key: str, tokens: Tokens, chain: Chain, block_size: int, *, root: int) -> None:
        """Remember `chain`, computed for `tokens` before `key` was known, as `key`'s: the next
        chain of `key` then hashes only what follows (a prompt's conversation found by its chain)."""
        self._put(key, _Entry(tokens if _frozen(tokens) else tokens.copy(), chain, block_size, root))

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
