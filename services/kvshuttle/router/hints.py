"""What this router last stored for each conversation: the retention its own CommitTurn put.

A conversation's next turn usually comes back to the router replica that committed the last
one. With that retention at hand, PlanTurn verifies the prompt against it without reading the
registry and goes straight to the claim. A hint is never the truth: only a claim that succeeds
confirms it (the registry refuses a claim on a retention that was replaced, released, claimed
or has lapsed, and a live unclaimed retention is the conversation's newest, so its generation is
the fence). Any other outcome forgets the hint and plans again on what the registry says.
Bounded by bytes, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvshuttle.router.model import RetentionInfo
from kvshuttle.vllm.block_ids import block_groups

# A retention's fields, names and dict beyond its hashes, block ids and known tokens.
_FIXED_BYTES = 1024
# A block id in the params' lists (a Python int and its list slot).
_BLOCK_ID_BYTES = 36


def _nbytes(retention: RetentionInfo) -> int:
    hashes = retention.block_hashes
    hash_bytes = hashes.nbytes if isinstance(hashes, np.ndarray) else 8 * len(hashes)
    ids = sum(len(group) for group in block_groups(retention.kv_transfer_params))
    known = retention.known_tokens.nbytes
    return int(hash_bytes) + int(known) + _BLOCK_ID_BYTES * ids + _FIXED_BYTES


class RetentionHints:
    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[str, tuple[RetentionInfo, int]] = OrderedDict()

    def get(self, conversation: str) -> RetentionInfo | None:
        entry = self._entries.get(conversation)
        if entry is None:
            return None
        self._entries.move_to_end(conversation)
        return entry[0]

    def put(self, conversation: str, retention: RetentionInfo) -> None:
        self.forget(conversation)
        size = _nbytes(retention)
        if size > self._max_bytes:
            return
        self._entries[conversation] = (retention, size)
        self._bytes += size
        while self._bytes > self._max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self._bytes -= evicted

    def forget(self, conversation: str) -> None:
        entry = self._entries.pop(conversation, None)
        if entry is not None:
            self._bytes -= entry[1]

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes
