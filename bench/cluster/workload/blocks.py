"""Block ids: fresh prefix-chained ids for generated prompts, and a prompt's ids at an engine's
block size when it differs from the trace's (re-blocking).

Why re-blocking needs no tokens: trace ids are prefix-chained, so id h at block t names the whole
prompt up to the end of block t. An engine block's content is therefore named by the trace id of
the block holding its last token and that token's offset in it: two prompts have the same engine
block exactly when they agree on (id, offset), which maps to one integer, id * trace_block + offset.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


class BlockIds:
    """Hands out fresh ids, counting up from `first`: a generator's new content."""

    def __init__(self, first: int = 0) -> None:
        self._next = first

    def fresh(self, count: int) -> tuple[int, ...]:
        ids = tuple(range(self._next, self._next + count))
        self._next += count
        return ids

    def extend(
        self, prefix_ids: Sequence[int], prefix_tokens: int, total_tokens: int, block_size: int
    ) -> tuple[int, ...]:
        """Ids of a prompt of `total_tokens` whose first `prefix_tokens` are the prompt that
        `prefix_ids` describe: the prefix's full blocks keep their ids, every later block (the
        prefix's partial last block included, which the new tokens fill differently) is fresh."""
        if total_tokens < prefix_tokens:
            raise ValueError(f"a prompt of {total_tokens} tokens cannot extend one of {prefix_tokens}")
        if total_tokens == prefix_tokens:
            return tuple(prefix_ids)
        kept = tuple(prefix_ids[: prefix_tokens // block_size])
        return kept + self.fresh(math.ceil(total_tokens / block_size) - len(kept))


def engine_block_ids(
    hash_ids: Sequence[int], input_tokens: int, trace_block: int, engine_block: int
) -> npt.NDArray[np.int64]:
    """Ids of the prompt's full engine blocks (an engine caches full blocks only), prefix-chained
    like the trace's: equal ids mean equal prefixes. Works for an engine block smaller or larger
    than the trace's, dividing it or not."""
    count = input_tokens // engine_block
    last = np.arange(1, count + 1, dtype=np.int64) * engine_block - 1
    ids = np.asarray(hash_ids, dtype=np.int64)
    return ids[last // trace_block] * trace_block + last % trace_block


_MASK = (1 << 64) - 1
# Ids a context cut makes live above every trace's (bit 62 set), so they never meet one.
DERIVED_ID_BASE = 1 << 62


def chain_id(previous: int, original: int) -> int:
    """A new prefix-chained id for block `original` placed after the block named `previous`
    (splitmix64 of the pair): the ids of a prompt whose blocks moved (workload/context.py)."""
    x = (previous * 0x9E3779B97F4A7C15 + original + 0x632BE59BD9B4E019) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return DERIVED_ID_BASE | ((x ^ (x >> 31)) & (DERIVED_ID_BASE - 1))


__all__ = ["DERIVED_ID_BASE", "BlockIds", "chain_id", "engine_block_ids"]
