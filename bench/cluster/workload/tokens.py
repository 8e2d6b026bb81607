"""Token ids for a trace's blocks, so a replay sends real prompts whose prefix sharing is exactly
the trace's: a block's tokens depend only on its id (and the seed), hence two prompts sharing
their first k ids share their first k * block_size tokens.

And no more than that: a block's first token is `reserved + (id + seed) mod span`, so blocks with
different ids (fewer than `span` apart) already differ at their first token, and a shared prefix
never runs on by chance into the next block. The other tokens are splitmix64 of (seed, id,
position), uniform over [reserved, vocab_size). A prompt whose last block is partial takes the
first tokens of that block's sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

_U64 = np.uint64


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    # uint64 arithmetic wraps, as splitmix64 wants.
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


@dataclass(frozen=True, slots=True)
class TokenMap:
    vocab_size: int
    seed: int = 0
    # Ids below it (a tokenizer's special tokens) are never produced.
    reserved: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.reserved < self.vocab_size:
            raise ValueError(f"reserved {self.reserved} outside a vocabulary of {self.vocab_size}")

    def blocks(self, hash_ids: Sequence[int], block_size: int) -> npt.NDArray[np.int64]:
        """The tokens of each block, shape (len(hash_ids), block_size)."""
        span = _U64(self.vocab_size - self.reserved)
        ids = np.asarray(hash_ids, dtype=np.uint64)[:, None]
        positions = np.arange(block_size, dtype=np.uint64)[None, :]
        seed = _U64(self.seed & ((1 << 64) - 1))
        mixed = _splitmix64(_splitmix64(ids ^ seed) + positions)
        mixed[:, 0] = ids[:, 0] + seed
        return (mixed % span).astype(np.int64) + self.reserved

    def prompt(self, hash_ids: Sequence[int], input_tokens: int, block_size: int) -> npt.NDArray[np.int64]:
        """The prompt's `input_tokens` token ids (hash_ids at `block_size`, the last possibly partial)."""
        if not (len(hash_ids) - 1) * block_size < input_tokens <= len(hash_ids) * block_size:
            raise ValueError(f"{len(hash_ids)} blocks of {block_size} do not hold {input_tokens} tokens")
        return self.blocks(hash_ids, block_size).reshape(-1)[:input_tokens]


__all__ = ["TokenMap"]
